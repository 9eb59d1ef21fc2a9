"""Where a JSON schema costs the draft its acceptance (issue 57): how often the draft's greedy choice is the
target's, position by position along the target's own greedy reply, unconstrained and under the schema of
tools/bench/structured.py, by where each token sits in the JSON.

The target's replies come from the verifier's engine alone (`reference`, float32 by default, whose greedy
tokens equal transformers' `generate`: tests/exact), under its mask for the schema. At each position the
draft (llama.cpp) is given the target's prefix and chooses as the edge's drafter does, under its own
matcher of the schema in the schema's arm. A position the schema forces (one token allowed) is counted
apart, as the acceptance counts it. The classes:
  string   inside a JSON string value
  json     the rest of the object: keys, quotes, braces, commas, numbers
  outside  before the object opens or after it closes (a fenced block's fence, prose)

    python -m tools.bench.structured_agreement --pair ~/.local/share/draftwire/models/qwen2.5-coder \
        --prompts 6 --new-tokens 64 --out docs/runs/bench/structured-agreement
"""

from __future__ import annotations

import argparse
import json
from collections import Counter
from pathlib import Path

from draftwire.contract import SamplingParams
from draftwire_cli.models.prompts import chat_turns
from draftwire_cli.models.smollm2_card import CARD_PROMPTS
from tools.bench.structured import ASK_JSON, CONSTRAINT

CLASSES = ("string", "json", "outside", "forced")


def json_classes(pieces: list[str]) -> list[str]:
    """Each token's class (string, json or outside) from its decoded text, by a JSON lexer over the reply:
    a token holding any character of a string value is `string`; any other character of the object,
    `json`; else `outside`."""
    classes = []
    stack: list[str] = []
    in_string = is_key = escaped = started = done = False
    key_next = True
    for piece in pieces:
        kinds = set()
        for ch in piece:
            if done or (not started and ch != "{"):
                kinds.add("outside")
                continue
            started = True
            if in_string:
                kinds.add("json" if is_key else "string")
                if escaped:
                    escaped = False
                elif ch == "\\":
                    escaped = True
                elif ch == '"':
                    in_string = False
                continue
            kinds.add("json")
            if ch == '"':
                in_string, is_key = True, bool(stack) and stack[-1] == "{" and key_next
            elif ch in "{[":
                stack.append(ch)
                key_next = True
            elif ch in "}]":
                stack.pop()
                done = not stack
            elif ch in ":,":
                key_next = ch == ","
        classes.append("string" if "string" in kinds else "json" if "json" in kinds else "outside")
    return classes


def agreement(drafter, tokenizer, prompts, replies, matcher) -> Counter:
    """Counts (class, "n") and (class, "agree") over every position of `replies`."""
    tally: Counter = Counter()
    for prompt, reply in zip(prompts, replies, strict=True):
        classes = json_classes([tokenizer.decode([t]) for t in reply])
        for i, token in enumerate(reply):
            extra = {"matcher": matcher, "most": 1} if matcher is not None else {}
            draft = drafter.propose([*prompt, *reply[:i]], 1, SamplingParams(), (), len(prompt), **extra)
            kind = "forced" if 0 in getattr(draft, "forced", ()) else classes[i]
            tally[kind, "n"] += 1
            tally[kind, "agree"] += int(bool(draft) and draft[0] == token)
    return tally


def table(results: dict[str, Counter]) -> str:
    lines = [
        "| arm | drafted positions | agreement | "
        + " | ".join(f"{c}: positions, agreement" for c in CLASSES)
        + " |",
        "|---|---|---|" + "---|" * len(CLASSES),
    ]
    for arm, tally in results.items():
        n = sum(tally[c, "n"] for c in CLASSES if c != "forced")
        agree = sum(tally[c, "agree"] for c in CLASSES if c != "forced")
        cells = [
            f"{tally[c, 'n']}, {tally[c, 'agree'] / tally[c, 'n']:.3f}" if tally[c, "n"] else "-"
            for c in CLASSES
        ]
        lines.append(f"| {arm} | {n} | {agree / n:.3f} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv=None) -> int:
    from draftwire.contract import SessionSpec
    from edge_client.drafter import DrafterConfig, LlamaDrafter
    from verifier_service.engine import TargetEngine
    from verifier_service.session import reference_decode

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", type=Path, required=True, help="a pair's directory (target/, a .gguf draft)")
    ap.add_argument("--draft", type=Path, default=None, help="the GGUF draft (default: the pair's one)")
    ap.add_argument("--prompts", type=int, default=6)
    ap.add_argument("--new-tokens", type=int, default=64)
    ap.add_argument("--dtype", default="float32", help="the target's dtype (float32: transformers' tokens)")
    ap.add_argument("--out", type=Path, default=None, help="write agreement.json and agreement.md here")
    args = ap.parse_args(argv)
    target = args.pair / "target"
    draft = args.draft or min(args.pair.glob("*.gguf"))
    prompts = chat_turns(target, [q + ASK_JSON for q in CARD_PROMPTS[: args.prompts]])
    engine = TargetEngine.load(target, dtype=args.dtype)
    replies = {
        arm: [
            reference_decode(
                engine, SessionSpec(tuple(p), max_new_tokens=args.new_tokens, constraint=constraint)
            )
            for p in prompts
        ]
        for arm, constraint in (("unconstrained", None), ("JSON schema", CONSTRAINT))
    }
    # The draft's matcher ends at the target's end-of-sequence ids, as an edge's does (from GetModelInfo).
    tokenizer, eos = engine.tokenizer, engine.info.eos_token_ids
    del engine
    drafter = LlamaDrafter(DrafterConfig(draft, n_threads=0))
    matchers = {"unconstrained": None, "JSON schema": drafter.constraint_matcher(CONSTRAINT, eos)}
    results = {arm: agreement(drafter, tokenizer, prompts, replies[arm], matchers[arm]) for arm in replies}
    head = (
        f"{args.prompts} chat prompts asking for the JSON, up to {args.new_tokens} tokens each, greedy; "
        f"target {target} ({args.dtype}, alone), draft {draft.name} (llama.cpp)."
    )
    report = f"{head}\n\n{table(results)}\n"
    print(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        counts = {arm: {f"{c}/{k}": v for (c, k), v in t.items()} for arm, t in results.items()}
        (args.out / "agreement.json").write_text(
            json.dumps(
                {
                    "args": vars(args) | {"pair": str(args.pair), "draft": str(draft), "out": str(args.out)},
                    "counts": counts,
                },
                indent=1,
            )
        )
        (args.out / "agreement.md").write_text(report)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
