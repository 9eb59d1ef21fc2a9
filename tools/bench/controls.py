"""What logprobs and penalties cost under speculation, side by side in one run (issue 30).

Arms, each prompt through all of them in turn (so drift hits every arm alike), on the real pair and the
two-device rig (the verifier pinned to its cores, this process and its draft to others):
  plain          the request as it is
  logprobs-0     the same, each token's logprob carried back (top_logprobs=0)
  logprobs-5     and the five likeliest alternatives
  penalties      frequency 0.5, presence 0.3, repetition 1.1: the verifier applies them, the draft too
  penalties-blind  the same request, the draft not told (it proposes what the unpenalised draft would)
  penalties-tiny   penalties of 1e-6: the same work on both sides, the plain arm's text (so its cost is
                 the penalties' computation alone, where the penalties arm also writes another text)

The logprob arms must give the plain arm's tokens, and the two penalty arms each other's (the output is
the target's whatever the draft proposes). Reports tokens/s and its ratio to the plain arm, acceptance,
tokens per round, and the bytes per round on the wire.

    python -m tools.bench.controls --out docs/runs/bench/controls   (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path

from draftwire import wire
from draftwire.contract import SamplingParams
from draftwire_cli.models import smollm2
from draftwire_cli.models.prompts import chat_prompts
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import ServerProcess

PENALTIES = dict(frequency_penalty=0.5, presence_penalty=0.3, repetition_penalty=1.1)
TINY = dict(frequency_penalty=1e-6, presence_penalty=1e-6, repetition_penalty=1.000001)
ARMS = ("plain", "logprobs-0", "logprobs-5", "penalties", "penalties-blind", "penalties-tiny")


@dataclass(frozen=True)
class ControlsConfig:
    pair_dir: Path
    prompts: int = 12
    new_tokens: int = 96
    gamma: int = 4
    pipeline: int = 1
    repeats: int = 2  # passes over the prompts (prompts x repeats a multiple of 6: each arm first as often)
    temperature: float = 0.0  # 0: greedy; else seeded sampling
    dtype: str = "auto"
    edge_cpus: tuple[int, ...] = (0,)
    verifier_cpus: tuple[int, ...] = (1,)


class BlindDrafter:
    """A drafter told nothing of the session's penalties and bias: the arm that shows what they buy."""

    def __init__(self, inner: LlamaDrafter):
        self.inner, self.vocabulary, self.executor = inner, inner.vocabulary, inner.executor

    def propose(self, sequence, gamma, params, stop_token_ids=(), prompt_length=0):
        plain = dataclasses.replace(
            params, logit_bias=(), repetition_penalty=1.0, frequency_penalty=0.0, presence_penalty=0.0
        )
        return self.inner.propose(sequence, gamma, plain, stop_token_ids, prompt_length)


def request_for(arm: str, prompt, config: ControlsConfig, seed: int) -> GenerationRequest:
    extra = TINY if arm == "penalties-tiny" else PENALTIES if arm.startswith("penalties") else {}
    params = SamplingParams(config.temperature, seed=seed if config.temperature else 0, **extra)
    top = {"logprobs-0": 0, "logprobs-5": 5}.get(arm)
    return GenerationRequest(
        prompt,
        params,
        config.new_tokens,
        config.gamma,
        pipeline=config.pipeline,
        ignore_eos=True,
        top_logprobs=top,
    )


async def run_all(config: ControlsConfig, log=print) -> dict:
    target = config.pair_dir / smollm2.TARGET
    prompts = chat_prompts(target, config.prompts)
    if config.edge_cpus:
        os.sched_setaffinity(0, config.edge_cpus)  # before llama.cpp starts its threads, which inherit it
    drafter = LlamaDrafter(DrafterConfig(smollm2.draft_path(config.pair_dir), n_threads=1))
    blind = BlindDrafter(drafter)
    # No kept caches: each run prefills its prompt (otherwise the arms after the first of a prompt would
    # start from the first's cache).
    flags = ["--max-gamma", "8", "--threads", str(len(config.verifier_cpus) or 1), "--dtype", config.dtype]
    flags += ["--prefix-cache-mb", "0"]
    totals = {
        arm: dict(tokens=0, wall_s=0.0, decode_tokens=0, decode_s=0.0, rounds=0, drafted=0, accepted=0)
        | dict(wire_bytes=0, draft_s=0.0, verify_s=0.0)
        for arm in ARMS
    }
    outputs: dict[str, list] = {arm: [] for arm in ARMS}
    with ServerProcess(target, *flags, cpus=config.verifier_cpus) as server:
        async with wire.insecure_channel(server.address) as channel:
            sessions = {"blind": EdgeSession(channel, blind), "draft": EdgeSession(channel, drafter)}
            await sessions["draft"].run(request_for("plain", prompts[0], config, 0))  # warm both sides
            for repeat in range(config.repeats):
                for i, prompt in enumerate(prompts):
                    log(f"pass {repeat + 1}, prompt {i + 1}/{len(prompts)}")
                    turn = (repeat * len(prompts) + i) % len(ARMS)  # each arm goes first in turn
                    for arm in ARMS[turn:] + ARMS[:turn]:
                        session = sessions["blind" if arm == "penalties-blind" else "draft"]
                        ids, stats = await session.run(request_for(arm, prompt, config, 1000 + i))
                        t = totals[arm]
                        t["tokens"] += len(ids)
                        t["wall_s"] += stats.wall_s
                        # After the first verdict: the rounds, without either side's prefill.
                        later, seconds = stats.after_first_verdict
                        t["decode_tokens"] += later
                        t["decode_s"] += seconds
                        t["rounds"] += stats.rounds
                        t["drafted"] += stats.draft_tokens
                        t["accepted"] += stats.accepted_tokens
                        t["wire_bytes"] += stats.wire_bytes
                        t["draft_s"] += stats.draft_s  # the edge's drafting, rules included
                        t["verify_s"] += stats.verify_s  # the verifier's forward passes, as it reports
                        if repeat == 0:
                            outputs[arm].append(ids)
    rows = []
    plain = totals["plain"]
    plain_rate, plain_decode = plain["tokens"] / plain["wall_s"], plain["decode_tokens"] / plain["decode_s"]
    for arm, t in totals.items():
        rate, decode = t["tokens"] / t["wall_s"], t["decode_tokens"] / t["decode_s"]
        rows.append(
            {
                "arm": arm,
                "tokens": t["tokens"],
                "tokens_per_s": rate,
                "vs_plain": rate / plain_rate,
                "decode_tokens_per_s": decode,
                "decode_vs_plain": decode / plain_decode,
                "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else 0.0,
                "tokens_per_round": t["tokens"] / t["rounds"],
                "wire_bytes_per_round": t["wire_bytes"] / t["rounds"],
                "wire_bytes_per_token": t["wire_bytes"] / t["tokens"],
                "draft_ms_per_draft_token": 1000 * t["draft_s"] / t["drafted"] if t["drafted"] else 0.0,
                "verify_ms_per_round": 1000 * t["verify_s"] / t["rounds"],
            }
        )
    exact = {
        "logprobs-0 = plain": outputs["logprobs-0"] == outputs["plain"],
        "logprobs-5 = plain": outputs["logprobs-5"] == outputs["plain"],
        "penalties-blind = penalties": outputs["penalties-blind"] == outputs["penalties"],
    }
    # Not a requirement (a penalty of 1e-6 may flip a near-tie), but the arm's premise.
    same_text = {"penalties-tiny = plain": outputs["penalties-tiny"] == outputs["plain"]}
    config_json = {k: str(v) if isinstance(v, Path) else v for k, v in dataclasses.asdict(config).items()}
    return {"config": config_json, "cpu": _cpu(), "rows": rows, "exact": exact, "same_text": same_text}


def _cpu() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return "unknown"


def markdown(report: dict) -> str:
    c = report["config"]
    mode = "greedy" if not c["temperature"] else f"seeded sampling at temperature {c['temperature']}"
    lines = [
        f"{c['prompts']} chat prompts × {c['repeats']} passes, {c['new_tokens']} tokens each, {mode}, "
        f"γ {c['gamma']}, pipeline {c['pipeline']}; verifier on cores {c['verifier_cpus']} "
        f"(dtype {c['dtype']}), edge and draft on {c['edge_cpus']}; {report['cpu']}.",
        "",
        "Tokens/s over the whole reply (both sides' prefill included, no kept cache), and after the first",
        "verdict (decode: the rounds alone); each prompt runs every arm, the first arm rotating.",
        "",
        "| arm | tokens/s | vs plain | decode tokens/s | vs plain | acceptance | tokens/round "
        "| wire bytes/round | wire bytes/token | draft ms/draft token | verify ms/round |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        lines.append(
            f"| {r['arm']} | {r['tokens_per_s']:.1f} | {r['vs_plain']:.3f} | {r['decode_tokens_per_s']:.1f} "
            f"| {r['decode_vs_plain']:.3f} | {r['acceptance']:.3f} "
            f"| {r['tokens_per_round']:.2f} | {r['wire_bytes_per_round']:.1f} "
            f"| {r['wire_bytes_per_token']:.1f} | {r['draft_ms_per_draft_token']:.2f} "
            f"| {r['verify_ms_per_round']:.1f} |"
        )
    same = {**report["exact"], **report.get("same_text", {})}
    lines += ["", "Same tokens: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in same.items())]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", type=Path, default=smollm2.default_dir(), help="the SmolLM2 pair's directory")
    ap.add_argument("--prompts", type=int, default=12)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--temperature", type=float, default=0.0)
    ap.add_argument("--dtype", default="auto")
    ap.add_argument("--out", type=Path, help="write controls.json and controls.md here")
    args = ap.parse_args(argv)
    config = ControlsConfig(
        args.pair,
        args.prompts,
        args.new_tokens,
        repeats=args.repeats,
        temperature=args.temperature,
        dtype=args.dtype,
    )
    report = asyncio.run(run_all(config))
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        suffix = "" if not config.temperature else "-sampled"
        (args.out / f"controls{suffix}.json").write_text(json.dumps(report, indent=1))
        (args.out / f"controls{suffix}.md").write_text(text)
    return 0 if all(report["exact"].values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())
