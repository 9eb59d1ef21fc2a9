"""What a JSON schema costs under speculation, side by side in one run (issue 57).

The prompts are held-out chat questions, each asking for the schema's JSON in words as a user of JSON
mode does (--no-ask-json: the questions alone, the schema then forcing JSON the model did not mean to
write). Arms, each prompt through all of them in turn, the first arm rotating:
  free          the request as it is, speculative (γ, pipeline)
  schema        the same under a JSON schema: the verifier masks every position, the draft proposes masked
  free-alone    the target alone (a thin session of no drafting), unconstrained
  schema-alone  the target alone under the schema

Reports tokens/s, acceptance (of the draft model's tokens: those the schema forced, sent with no draft
step, are counted apart), tokens per round, the speedup of each speculative arm over the target
alone with the same constraint, and what the verifier's masks cost a round: each schema reply replayed
through a verifier-side matcher (transformers' tokenizer), the masks of every round of γ draft tokens
timed, against the verifier's own forward time per round.

    python -m tools.bench.structured --out docs/runs/bench/structured   (about 5 minutes on 2 cores)
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import time
from pathlib import Path

from draftwire import wire
from draftwire.contract import Constraint, ConstraintKind, Drafting, SamplingParams
from draftwire.grammar import compile_constraint
from draftwire_cli.models import smollm2
from draftwire_cli.models.prompts import chat_turns
from draftwire_cli.models.smollm2_card import CARD_PROMPTS
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import ServerProcess

SCHEMA = {
    "type": "object",
    "properties": {
        "title": {"type": "string", "maxLength": 60},
        "points": {"type": "array", "items": {"type": "string", "maxLength": 100}, "maxItems": 4},
        "confidence": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["title", "points", "confidence"],
    "additionalProperties": False,
}
CONSTRAINT = Constraint(ConstraintKind.JSON_SCHEMA, json.dumps(SCHEMA))
# What a user of JSON mode writes beside the schema (OpenAI's JSON mode requires the conversation to ask
# for JSON): appended to each question unless --no-ask-json, in every arm, so that the arms share prompts.
ASK_JSON = (
    ' Answer with a JSON object only: a "title", up to four short "points", and your "confidence" '
    "from 0 to 10."
)
ARMS = ("free", "schema", "free-alone", "schema-alone")


def request_for(arm: str, prompt, args) -> GenerationRequest:
    return GenerationRequest(
        tuple(prompt),
        SamplingParams(),
        args.new_tokens,
        args.gamma,
        pipeline=args.pipeline,
        drafting=Drafting.NONE if arm.endswith("alone") else Drafting.EDGE,
        constraint=CONSTRAINT if arm.startswith("schema") else None,
    )


async def run_all(args, log=print) -> dict:
    target = args.target or args.pair / smollm2.TARGET
    prompts = chat_turns(
        target, [q + (ASK_JSON if args.ask_json else "") for q in CARD_PROMPTS[: args.prompts]]
    )
    os.sched_setaffinity(0, args.edge_cpus)
    drafter = LlamaDrafter(DrafterConfig(args.draft or smollm2.draft_path(args.pair), n_threads=1))
    flags = ["--max-gamma", "8", "--threads", str(len(args.verifier_cpus)), "--prefix-cache-mb", "0"]
    flags += ["--dtype", args.dtype]
    zero = dict.fromkeys(["tokens", "decode_tokens", "rounds", "drafted", "accepted", "forced"], 0)
    zero |= dict.fromkeys(["wall_s", "decode_s", "verify_s", "draft_s"], 0.0)
    totals = {arm: dict(zero) for arm in ARMS}
    outputs: dict[str, list] = {arm: [] for arm in ARMS}
    with ServerProcess(target, *flags, cpus=args.verifier_cpus) as server:
        async with wire.insecure_channel(server.address) as channel:
            session = EdgeSession(channel, drafter)
            await session.run(request_for("schema", prompts[0], args))  # warm both sides, and the matchers
            for i, prompt in enumerate(prompts):
                log(f"prompt {i + 1}/{len(prompts)}")
                turn = i % len(ARMS)
                for arm in ARMS[turn:] + ARMS[:turn]:
                    ids, stats = await session.run(request_for(arm, prompt, args))
                    t = totals[arm]
                    t["tokens"] += len(ids)
                    t["wall_s"] += stats.wall_s
                    # After the first verdict: the rounds, without the prompt's prefill, which the arms
                    # share and which weighs more on the schema's shorter replies.
                    later, seconds = stats.after_first_verdict
                    t["decode_tokens"] += later
                    t["decode_s"] += seconds
                    t["draft_s"] += stats.draft_s
                    t["rounds"] += stats.rounds
                    t["drafted"] += stats.draft_tokens
                    t["accepted"] += stats.accepted_tokens
                    t["forced"] += stats.forced_tokens
                    t["verify_s"] += stats.verify_s
                    outputs[arm].append(ids)
    mask_ms = _mask_ms_per_round(target, outputs["schema"], args.gamma)
    rows = []
    for arm, t in totals.items():
        alone = totals[("schema" if arm.startswith("schema") else "free") + "-alone"]
        rate = t["tokens"] / t["wall_s"]
        decode = t["decode_tokens"] / t["decode_s"]
        rows.append(
            {
                "arm": arm,
                "tokens": t["tokens"],
                "tokens_per_s": rate,
                "vs_alone": rate / (alone["tokens"] / alone["wall_s"]),
                "decode_tokens_per_s": decode,
                "decode_vs_alone": decode / (alone["decode_tokens"] / alone["decode_s"]),
                "acceptance": t["accepted"] / t["drafted"] if t["drafted"] else None,
                "forced_tokens": t["forced"],
                "tokens_per_round": t["tokens"] / t["rounds"] if t["rounds"] else None,
                "verify_ms_per_round": 1000 * t["verify_s"] / t["rounds"] if t["rounds"] else None,
                "draft_ms_per_round": 1000 * t["draft_s"] / t["rounds"] if t["rounds"] else None,
            }
        )
    verify_ms = next(r["verify_ms_per_round"] for r in rows if r["arm"] == "schema")
    exact = {
        "schema = schema-alone": outputs["schema"] == outputs["schema-alone"],
        "free = free-alone": outputs["free"] == outputs["free-alone"],
    }
    parsed = sum(_parses(drafter, ids) for ids in outputs["schema"])
    return {
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items() if k != "out"},
        "rows": rows,
        "mask_ms_per_round": mask_ms,
        "mask_share_of_round": mask_ms / verify_ms if verify_ms else None,
        "exact": exact,
        "schema_replies_parsed": f"{parsed}/{len(outputs['schema'])}",
    }


def _mask_ms_per_round(target: Path, replies: list[list[int]], gamma: int) -> float:
    """The verifier's mask work for a round of γ draft tokens (masks at γ + 1 positions, then the γ + 1
    committed tokens followed), along the schema replies, in ms."""
    from transformers import AutoTokenizer

    from verifier_service.constraints import hf_grammar_tokenizer

    hf = AutoTokenizer.from_pretrained(target)
    tokenizer = hf_grammar_tokenizer(hf, None, [hf.eos_token_id])  # the verifier's
    spent, rounds = 0.0, 0
    for ids in replies:
        matcher = compile_constraint(CONSTRAINT, tokenizer)
        for start in range(0, len(ids), gamma + 1):
            began = time.perf_counter()
            matcher.masks(ids[start : start + gamma])
            matcher.follow(ids[: start + gamma + 1])
            spent += time.perf_counter() - began
            rounds += 1
    return 1000 * spent / rounds


def _parses(drafter, ids: list[int]) -> bool:
    try:
        json.loads(drafter.detokenize(ids).decode())  # an end-of-sequence token detokenizes to nothing
        return True
    except ValueError:
        return False


def markdown(report: dict) -> str:
    c = report["config"]
    asked = " asking for the JSON" if c.get("ask_json") else ""
    lines = [
        f"{c['prompts']} chat prompts{asked}, up to {c['new_tokens']} tokens each, greedy, γ {c['gamma']}, "
        f"pipeline {c['pipeline']}; verifier on cores {c['verifier_cpus']}, edge and draft on "
        f"{c['edge_cpus']}; target {c['target'] or 'SmolLM2 (the --pair)'}. The schema: an object of a "
        "title, up to 4 points and a confidence (tools/bench/structured.py).",
        "",
        "| arm | tokens | tokens/s | vs the target alone, same constraint | acceptance | forced tokens "
        "| tokens/round | verify ms/round | draft ms/round | after the first verdict: tokens/s "
        "| vs the target alone |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in report["rows"]:
        acc = f"{r['acceptance']:.3f}" if r["acceptance"] is not None else "-"
        per = f"{r['tokens_per_round']:.2f}" if r["tokens_per_round"] else "-"
        ver = f"{r['verify_ms_per_round']:.1f}" if r["verify_ms_per_round"] else "-"
        drf = f"{r['draft_ms_per_round']:.1f}" if r["draft_ms_per_round"] else "-"
        decode = f"{r['decode_tokens_per_s']:.1f} | {r['decode_vs_alone']:.2f}"
        rate = f"{r['tokens_per_s']:.1f} | {r['vs_alone']:.2f}"
        forced = r["forced_tokens"]
        cells = [r["arm"], r["tokens"], rate, acc, forced, per, ver, drf, decode]
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    share = report["mask_share_of_round"]
    lines += [
        "",
        f"Masks: {report['mask_ms_per_round']:.2f} ms a round (γ + 1 masks and the round's tokens followed), "
        f"{100 * share:.1f} % of the schema arm's verify time per round."
        if share is not None
        else "",
        "Same tokens: " + ", ".join(f"{k}: {'yes' if v else 'NO'}" for k, v in report["exact"].items()),
        f"Schema replies that parse as JSON: {report['schema_replies_parsed']} (a reply cut by the length "
        "would not).",
    ]
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pair", type=Path, default=smollm2.default_dir(), help="the SmolLM2 pair's directory")
    ap.add_argument("--target", type=Path, default=None, help="another pair's target (default: the --pair's)")
    ap.add_argument("--draft", type=Path, default=None, help="another pair's GGUF draft (with --target)")
    ap.add_argument("--dtype", default="float32", help="the verifier's --dtype")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--new-tokens", type=int, default=96)
    ap.add_argument(
        "--ask-json",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="each question asks for the schema's JSON (ASK_JSON), in every arm",
    )
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--pipeline", type=int, default=1)
    ap.add_argument("--edge-cpus", type=lambda s: tuple(map(int, s.split(","))), default=(0,))
    ap.add_argument("--verifier-cpus", type=lambda s: tuple(map(int, s.split(","))), default=(1,))
    ap.add_argument("--out", type=Path, default=None, help="write structured.json and structured.md here")
    args = ap.parse_args(argv)
    report = asyncio.run(run_all(args))
    text = markdown(report)
    print(text)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "structured.json").write_text(json.dumps(report, indent=1) + "\n")
        (args.out / "structured.md").write_text(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
