"""`python -m tools.bench.adaptive`: adaptive speculation (the default of generate, chat, demo and the edge
app) against every fixed (γ, depth) of a grid, at each RTT and sampling mode, in one run.

It reuses `draftwire bench`'s machinery (tools/bench/speed.py): the same prompts, the verifier as a
`draftwire serve` child, the delaying proxy for the RTT, the two-device pinning, and the target alone
(arm a, in a child on the verifier's cores) as the reference every output must equal. A point is one
(RTT, mode); its rows take turns prompt by prompt (tools.bench.speed.RowRun). At each, the adaptive row
(one tuner learning across the point's prompts, as in a chat) is compared with the best fixed setting
there, and over the whole set with every fixed setting (the sum of tokens/s and their geometric mean).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import sys
from dataclasses import asdict
from pathlib import Path

import grpc

from edge_client.adaptive import Tuner
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.bench.arms import BenchConfig, Row, add_pair_flags, params_for, route
from tools.bench.speed import RowRun, add_bound
from tools.rig import devices

WITHIN = 0.05  # adaptive is "within" at a point when it reaches (1 - WITHIN) of the best fixed setting


async def run_all(config: BenchConfig, log=print) -> dict:
    """Every point: the adaptive row, then each fixed (γ in config.gammas, depth in config.pipelines)."""
    from tools.bench import target_arms

    reference = {r.mode: r for r in target_arms.in_child(config, log) if r.arm == "a"}
    flags = ["--max-gamma", str(max(config.gammas)), "--dtype", config.dtype]
    flags += [] if config.invariant else ["--no-bit-exact"]
    server = devices.verifier(config.target_dir, *flags, **config.devices)
    drafter = LlamaDrafter(DrafterConfig(config.draft_gguf, n_threads=config.draft_threads))
    rows: list[Row] = []
    settings = [(None, None)] + [(g, d) for g in config.gammas for d in config.pipelines]
    with server:
        host, port = server.address.rsplit(":", 1)
        for rtt in config.rtts_ms:
            async with route(host, int(port), rtt) as address:
                for mode in reference:
                    log(f"{rtt:g} ms RTT, {mode}: adaptive and {len(settings) - 1} fixed settings")
                    rows += await interleaved(config, drafter, address, server.address, mode, rtt, settings)
    return summarize(config, reference, rows)


async def interleaved(config, drafter, address, upstream, mode, rtt, settings, tuners=None) -> list[Row]:
    """One point's rows, taking turns prompt by prompt: each setting keeps its own edge session (the
    adaptive one its tuner) across the prompts, and the order rotates from prompt to prompt, so a burst
    of load falls on every setting alike and none always runs first.

    Before a prompt's turn, an untimed one-token generation prefills it in the drafter's KV cache and in
    the verifier's kept caches, so that no row pays a prefill and the rows compare decoding alone, as
    in a conversation's later turns. Without it the turn's first row paid the drafter's prefill (about
    200 ms of llama.cpp on one core for a 40-token chat prompt) and every later row reused it. The
    verifier keeps an anonymous caller's caches per connection, so the rows and the warm-up share one
    channel; the rows' `reused_positions` show it.

    `tuners`: a TunerConfig per setting (None: the default tuner's)."""
    async with contextlib.AsyncExitStack() as stack:
        channel = await stack.enter_async_context(grpc.aio.insecure_channel(address))
        runs = [
            await stack.enter_async_context(
                RowRun(config, drafter, address, upstream, mode, g, rtt, d, channel=channel)
            )
            for g, d in settings
        ]
        for run, tuner in zip(runs, tuners or [None] * len(runs), strict=True):
            if tuner is not None:
                run.session.tuner = Tuner(tuner)
        warm = EdgeSession(channel, drafter)
        for i in range(len(config.prompts)):
            prefill = GenerationRequest(config.prompts[i], params_for(mode, config, i), 1, 1, pipeline=0)
            await warm.run(prefill)
            turn = i % len(runs)
            for run in runs[turn:] + runs[:turn]:
                await run.prompt(i)
        rows = [run.row() for run in runs]
    for row, (_, depth) in zip(rows, settings, strict=True):
        row.pipeline = -1 if depth is None else depth  # -1: the adaptive row
        add_bound(row)
    return rows


def summarize(config: BenchConfig, reference: dict[str, Row], rows: list[Row]) -> dict:
    """Per point the adaptive and the best fixed tokens/s; over the set, adaptive against each fixed."""
    points, fixed_rates = [], {}
    for rtt in config.rtts_ms:
        for mode in reference:
            here = [r for r in rows if r.rtt_ms == rtt and r.mode == mode]
            adaptive = next(r for r in here if r.pipeline == -1)
            fixed = [r for r in here if r.pipeline != -1]
            best = max(fixed, key=lambda r: r.tokens_per_s)
            for r in fixed:
                fixed_rates.setdefault((r.gamma, r.pipeline), []).append(r.tokens_per_s)
            points.append(
                {
                    "rtt_ms": rtt,
                    "mode": mode,
                    "adaptive_tokens_per_s": adaptive.tokens_per_s,
                    "adaptive_label": adaptive.label,
                    "adaptive_acceptance": adaptive.acceptance,
                    "adaptive_of_bound": adaptive.share_of_bound,
                    "best_fixed": [best.gamma, best.pipeline],
                    "best_fixed_tokens_per_s": best.tokens_per_s,
                    "of_best": adaptive.tokens_per_s / best.tokens_per_s,
                    "within": adaptive.tokens_per_s >= (1 - WITHIN) * best.tokens_per_s,
                    "rank": 1 + sum(r.tokens_per_s > adaptive.tokens_per_s for r in fixed),
                    "fixed_settings": len(fixed),
                }
            )
    adaptive_rates = [p["adaptive_tokens_per_s"] for p in points]
    overall = {
        "adaptive": {"sum": sum(adaptive_rates), "geomean": _geomean(adaptive_rates)},
        "fixed": {f"{g},{d}": {"sum": sum(v), "geomean": _geomean(v)} for (g, d), v in fixed_rates.items()},
    }
    best_sum = max(overall["fixed"].items(), key=lambda kv: kv[1]["sum"])
    best_geo = max(overall["fixed"].items(), key=lambda kv: kv[1]["geomean"])
    overall["best_fixed_by_sum"] = best_sum[0]
    overall["best_fixed_by_geomean"] = best_geo[0]
    overall["beats_every_fixed_by_sum"] = overall["adaptive"]["sum"] > best_sum[1]["sum"]
    overall["beats_every_fixed_by_geomean"] = overall["adaptive"]["geomean"] > best_geo[1]["geomean"]
    overall["within_at_every_point"] = all(p["within"] for p in points)
    exact = {
        f"{r.mode}/rtt{r.rtt_ms:g}/" + ("adaptive" if r.pipeline == -1 else f"g{r.gamma}/p{r.pipeline}"): (
            r.outputs == reference[r.mode].outputs
        )
        for r in rows
    }
    return {
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items() if k != "prompts"
        },
        "prompts": len(config.prompts),
        "target_alone_tokens_per_s": {m: r.tokens_per_s for m, r in reference.items()},
        "points": points,
        "overall": overall,
        "rows": [
            {**{k: v for k, v in asdict(r).items() if k != "outputs"}, "tokens_per_s": r.tokens_per_s}
            for r in rows
        ],
        "exact": exact,
    }


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values and min(values) > 0 else 0.0


def markdown(report: dict) -> str:
    lines = [
        "| RTT ms | mode | adaptive tok/s | where it ended | best fixed (γ, depth) | best tok/s | of best "
        "| within 5 % | rank |",
        "|" + "---|" * 9,
    ]
    for p in report["points"]:
        ended = p["adaptive_label"].split("adaptive ")[-1].strip("()")
        lines.append(
            f"| {p['rtt_ms']:g} | {p['mode']} | {p['adaptive_tokens_per_s']:.1f} | {ended} "
            f"| {tuple(p['best_fixed'])} | {p['best_fixed_tokens_per_s']:.1f} | {p['of_best']:.2f} "
            f"| {'yes' if p['within'] else 'no'} | {p['rank']} of {p['fixed_settings'] + 1} |"
        )
    o = report["overall"]
    fixed = sorted(o["fixed"].items(), key=lambda kv: -kv[1]["geomean"])
    lines += [
        "",
        "| setting | sum tok/s | geomean tok/s |",
        "|---|---|---|",
        f"| **adaptive** | {o['adaptive']['sum']:.1f} | {o['adaptive']['geomean']:.2f} |",
        *(
            f"| fixed γ {k.replace(',', ', depth ')} | {v['sum']:.1f} | {v['geomean']:.2f} |"
            for k, v in fixed
        ),
        "",
        f"within 5 % of the best fixed setting at every point: {_yes(o['within_at_every_point'])}",
        f"beats every fixed setting over the set: by sum {'yes' if o['beats_every_fixed_by_sum'] else 'no'}"
        f" (best fixed {o['best_fixed_by_sum']}), by geometric mean "
        f"{'yes' if o['beats_every_fixed_by_geomean'] else 'no'} (best fixed {o['best_fixed_by_geomean']})",
    ]
    lines += ["", *ratio_table(report["rows"], "model_tokens_per_s", MODEL_CHECK)]
    lines += ["", *ratio_table(report["rows"], "bound_tokens_per_s", BOUND_CHECK)]
    reused = [r.get("reused_positions", 0) for r in report["rows"]]
    lines.append(
        f"prompt positions a row took from the verifier's kept caches: {min(reused)} to {max(reused)}"
    )
    bad = [k for k, ok in report["exact"].items() if not ok]
    lines.append("every output equals the target alone's" if not bad else f"outputs differing: {bad}")
    return "\n".join(lines)


MODEL_CHECK = "Model check: measured tokens/s over the tuner's prediction for the row's (last) setting"
BOUND_CHECK = (
    "Bound check: measured tokens/s over the zero-overhead bound of the row's own measured drafting, "
    "verification and restarts (tools.bench.speed.zero_overhead_bound)"
)


def ratio_table(rows: list[dict], key: str, title: str) -> list[str]:
    """Measured tokens/s over each row's figure `key` (the tuner's prediction for its setting, the tuner
    learning from fixed rows too; or its bound), a column per setting: where the figure is off, and
    whether it is off alike everywhere."""
    rows = [r for r in rows if r.get(key)]
    if not rows:
        return []
    settings = sorted({(r["gamma"], r["pipeline"]) for r in rows if r["pipeline"] >= 0})
    head = ["RTT ms", "mode", "adaptive", *(f"{g},{d}" for g, d in settings)]
    lines = [f"{title} (γ,depth columns).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for rtt, mode in dict.fromkeys((r["rtt_ms"], r["mode"]) for r in rows):
        here = {
            (r["gamma"], r["pipeline"]) if r["pipeline"] >= 0 else "a": r
            for r in rows
            if r["rtt_ms"] == rtt and r["mode"] == mode
        }
        cells = [
            f"{here[k]['tokens_per_s'] / here[k][key]:.2f}" if k in here else "" for k in ["a", *settings]
        ]
        lines.append(f"| {rtt:g} | {mode} | " + " | ".join(cells) + " |")
    return lines


def parser() -> argparse.ArgumentParser:
    from tools.cliargs import id_list

    p = argparse.ArgumentParser(prog="python -m tools.bench.adaptive", description=__doc__)
    add_pair_flags(p, temperature=0.7)
    p.add_argument("--gammas", type=id_list, default=(1, 2, 3, 4, 6, 8), help="the fixed grid's γ")
    p.add_argument("--depths", type=id_list, default=(0, 1, 2), help="the fixed grid's pipeline depths")
    p.add_argument(
        "--rtts", type=id_list, default=(0, 10, 30, 80), help="round-trip times in ms (0: loopback)"
    )
    p.add_argument("--out", type=Path, default=Path("runs/adaptive"), help="adaptive.json, adaptive.md")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    config = BenchConfig.from_args(args, pipelines=args.depths)
    report = asyncio.run(run_all(config, log=lambda m: print(m, file=sys.stderr, flush=True)))
    flags = argv if argv is not None else sys.argv[1:]
    report["command"] = " ".join(["python -m tools.bench.adaptive", *flags])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptive.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "adaptive.md").write_text(table + "\n")
    print(table)
    return 0 if all(report["exact"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
