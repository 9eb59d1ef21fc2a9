"""`python -m tools.bench.fallback`: speculation that knows when it does not pay, on real parts. The
default (adaptive γ, which turns speculation off where it loses, handing the session to the verifier
between probes: edge_client.adaptive) against the same with plain steps instead of hand-offs, without
the fallback, and against fixed settings, with the pair's own draft and with a draft wrong on purpose,
side by side in one run, at each round-trip time asked for (a delaying proxy).

The wrong draft is the pair's llama.cpp draft at its real cost, each of its tokens shifted to the next
id: it never agrees with the target, the case of an unrelated draft or of a prompt class where
agreement collapses. Rows take turns prompt by prompt (tools.bench.adaptive), the verifier a `serve`
child on its own cores, and every output must equal the target alone's (arm a, a child on the
verifier's cores). Prints the tokens/s of each row, its ratio to the target alone and to the default,
and what the tuner did (plain steps, times off, probes, its last reason).

    python -m tools.bench.fallback --target DIR --draft GGUF [--two-device 0:1] [--prompts 3] [--rtts 0,30]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path

from draftwire_cli.cliargs import id_list
from edge_client.adaptive import TunerConfig
from edge_client.drafter import DrafterConfig, LlamaDrafter
from tools.bench.adaptive import interleaved
from tools.bench.arms import BenchConfig, add_pair_flags, route
from tools.rig import devices
from tools.rig.wrongdraft import WrongDrafter

SETTINGS = [(None, None), (None, None), (None, None), (1, 0), (4, 0), (4, 2)]
TUNERS = [None, TunerConfig(hand_off=False), TunerConfig(plain=False), None, None, None]
LABELS = [
    "default (fallback)",
    "fallback in plain steps",
    "adaptive, no fallback",
    "fixed γ 1",
    "fixed γ 4",
    "fixed γ 4, depth 2",
]


async def run_all(config: BenchConfig, log=print) -> dict:
    from tools.bench import target_arms

    reference = {r.mode: r for r in target_arms.in_child(config, log) if r.arm == "a"}
    flags = ["--dtype", config.dtype] + ([] if config.invariant else ["--no-bit-exact"])
    server = devices.verifier(config.target_dir, *flags, **config.devices)
    right = LlamaDrafter(DrafterConfig(config.draft_gguf, n_threads=config.draft_threads))
    drafts = {"right": right, "wrong": WrongDrafter(right, right.n_vocab)}
    report = {"target_alone_tokens_per_s": {m: r.tokens_per_s for m, r in reference.items()}, "rows": []}
    with server:
        host, port = server.address.rsplit(":", 1)
        for rtt in config.rtts_ms:
            async with route(host, int(port), rtt) as address:
                for kind, drafter in drafts.items():
                    for mode, alone in reference.items():
                        log(f"{rtt:g} ms RTT, {kind} draft, {mode}: {len(SETTINGS)} rows")
                        turns = [(g, d, rtt) for g, d in SETTINGS]
                        rows = await interleaved(
                            config, drafter, {rtt: address}, server.address, mode, turns, TUNERS
                        )
                        report["rows"] += [
                            _row(rtt, kind, mode, label, row, alone)
                            for label, row in zip(LABELS, rows, strict=True)
                        ]
    return report


def _row(rtt: float, kind: str, mode: str, label: str, row, alone) -> dict:
    return {
        "rtt_ms": rtt,
        "draft": kind,
        "mode": mode,
        "row": label,
        "tokens_per_s": row.tokens_per_s,
        "of_target_alone": row.tokens_per_s / alone.tokens_per_s,
        "acceptance": row.acceptance,
        "tokens_per_round": row.tokens_per_round,
        "exact": row.outputs == alone.outputs,
        "plain_steps": row.plain_steps,
        "server_tokens": row.server_tokens,
        "offs": row.speculation_offs,
        "probes": row.probes,
        "reason": row.speculation_reason if label in LABELS[:2] else "",
    }


def markdown(report: dict) -> str:
    lines = [
        "| RTT ms | draft | mode | row | tok/s | × target alone | of default | acceptance | plain steps | "
        "verifier alone | offs | probes | exact |",
        "|" + "---|" * 13,
    ]
    rows = report["rows"]
    point = ("rtt_ms", "draft", "mode")
    for r in rows:
        default = next(x for x in rows if all(x[k] == r[k] for k in point) and x["row"] == LABELS[0])
        lines.append(
            f"| {r['rtt_ms']:g} | {r['draft']} | {r['mode']} | {r['row']} | {r['tokens_per_s']:.1f} "
            f"| {r['of_target_alone']:.2f} | {r['tokens_per_s'] / default['tokens_per_s']:.2f} "
            f"| {r['acceptance'] or 0:.2f} | {r['plain_steps']} | {r['server_tokens']} | {r['offs']} "
            f"| {r['probes']} | {'yes' if r['exact'] else 'NO'} |"
        )
    reasons = [
        f"- {r['rtt_ms']:g} ms, {r['draft']}, {r['mode']}, {r['row']}: {r['reason']}"
        for r in rows
        if r["reason"]
    ]
    return "\n".join(lines + ["", "Last reasons of the fallback rows' tuners:", *reasons])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m tools.bench.fallback", description=__doc__.split("\n")[0])
    add_pair_flags(p, temperature=0.8)
    p.add_argument("--rtts", type=id_list, default=(0,), help="round-trip times in ms (0: loopback)")
    p.add_argument("--out", type=Path, default=Path("runs/fallback"), help="fallback.json, fallback.md")
    args = p.parse_args(argv)
    args.gammas = (4,)
    config = BenchConfig.from_args(args)
    report = asyncio.run(run_all(config, log=lambda m: print(m, file=sys.stderr, flush=True)))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "fallback.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "fallback.md").write_text(table + "\n")
    print(table)
    return 0 if all(r["exact"] for r in report["rows"]) else 1


if __name__ == "__main__":
    sys.exit(main())
