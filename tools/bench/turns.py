"""A five-turn conversation through the edge app, with the verifier's conversation cache on and off: per
turn, the prompt, the positions the verifier computed for it, the positions it took from its kept cache,
and the time to the first token.

    python -m tools.bench.turns [--models DIR] [--out docs/runs/edge-turns]

The edge app (its llama.cpp draft) runs on core 0 and the verifier on core 1, standing for a device and a
server; the questions are the SmolLM2 card's held-out chat prompts, greedy, 64 tokens a reply.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import urllib.request
from pathlib import Path

from draftwire_cli.models.find import find_pair
from draftwire_cli.models.smollm2_card import CARD_PROMPTS
from tools.rig.serverproc import EdgeProcess, ServerProcess

TURNS = 5


def _post(url: str, body: dict) -> dict:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=600) as response:
        return json.loads(response.read())


def conversation(target: Path, draft: Path, cache_mb: int, max_tokens: int) -> list[dict]:
    with tempfile.TemporaryDirectory() as tmp:
        extra = ("--prefix-cache-mb", str(cache_mb))
        with (
            ServerProcess(target, *extra, cpus=(1,)) as verifier,
            EdgeProcess(
                verifier.address, draft, "--threads", "1", db=Path(tmp) / "e.sqlite3", cpus=(0,)
            ) as edge,
        ):
            settings = {"temperature": 0, "max_tokens": max_tokens}
            cid = _post(edge.url + "api/conversations", {"settings": settings})["id"]
            rows = []
            for i, question in enumerate(CARD_PROMPTS[:TURNS]):
                reply = _post(
                    edge.url + f"api/conversations/{cid}/messages", {"content": question, "stream": False}
                )
                t = reply["timings"]
                rows.append(
                    {
                        "turn": i + 1,
                        "prompt_tokens": reply["usage"]["prompt_tokens"],
                        "new_tokens": reply["usage"]["prompt_tokens"] - (rows[-1]["context"] if rows else 0),
                        "prefill_computed": max(
                            t["prompt_n"] - 1, 0
                        ),  # the last prompt token runs in round 1
                        "prefill_reused": t["cache_n"],
                        "ttft_ms": t["time_to_first_token_ms"],
                        "tokens_per_s": t["predicted_per_second"],
                        "completion_tokens": reply["usage"]["completion_tokens"],
                        "context": reply["usage"]["total_tokens"],
                        "text": reply["choices"][0]["message"]["content"],
                    }
                )
            return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", type=Path, default=None, help="pair directory (default: the SmolLM2 pair)")
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=Path("runs/edge-turns"))
    args = ap.parse_args(argv)
    target, draft = find_pair(args.models)
    arms = {
        "kept cache": conversation(target, draft, 1024, args.max_tokens),
        "no kept cache": conversation(target, draft, 0, args.max_tokens),
    }
    same = [a["text"] == b["text"] for a, b in zip(*arms.values(), strict=True)]
    args.out.mkdir(parents=True, exist_ok=True)
    report = {"target": str(target), "draft": draft.name, "arms": arms, "same_replies": same}
    (args.out / "turns.json").write_text(json.dumps(report, indent=1))
    lines = [
        f"Five-turn conversation, {target.parent.name} ({draft.name} draft on core 0, verifier on "
        f"core 1), greedy, {args.max_tokens} tokens a reply; replies identical with and without the "
        f"cache: {all(same)}",
        "",
        "| arm | turn | prompt tokens | new tokens | prefill computed | prefill reused | TTFT ms "
        "| tokens/s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for name, rows in arms.items():
        for r in rows:
            lines.append(
                f"| {name} | {r['turn']} | {r['prompt_tokens']} | {r['new_tokens']} | "
                f"{r['prefill_computed']} | {r['prefill_reused']} | {r['ttft_ms']:.0f} | "
                f"{r['tokens_per_s']:.1f} |"
            )
    (args.out / "turns.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0 if all(same) else 1


if __name__ == "__main__":
    raise SystemExit(main())
