"""`python -m tools.bench.adaptive`: adaptive speculation (the default of generate, chat, demo and the edge
app) against every fixed (γ, depth) of a grid, at each RTT and sampling mode, in one run.

It reuses `draftwire bench`'s machinery (tools/bench/speed.py): the same prompts, the verifier as a
`draftwire serve` child, the delaying proxy for the RTT, the two-device pinning, and the target alone
(arm a, in a child on the verifier's cores) as the reference every output must equal. A point is one
(RTT, mode); its rows take turns prompt by prompt (tools.bench.speed.RowRun). At each, the adaptive row
(one tuner learning across the point's prompts, as in a chat) is compared with the best fixed setting
there, and over the whole set with every fixed setting (the sum of tokens/s and their geometric mean).

Where the rig's noise is wider than the 5 % margins read here, `--repeats N` plays each point's
interleaved pass N times, a fresh session (and tuner) each time: a setting's figure at a point is then
its median over the passes, and the tables give the spread, the adaptive row over the best fixed one
pass by pass, and the fixed rows' own spread (max - min over median). With `--rtts-together` a pass
holds every RTT's rows too, taking turns with the rest, so that a longer RTT's figures over loopback's
are free of the machine's drift between points.

`python -m tools.bench.adaptive across RUN_DIR... [--out DIR]` reads several runs (a prompt class each)
and compares them as one set: the one default has to serve every class, where the best fixed setting
differs from class to class, so the fixed settings are those measured at every point of every run.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import re
import statistics
import sys
from dataclasses import asdict
from pathlib import Path

import grpc

from edge_client.adaptive import Tuner, TunerConfig
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.bench.arms import BenchConfig, Row, add_pair_flags, params_for, route
from tools.bench.speed import RowRun, add_bound, model_at_own_acceptance
from tools.rig import devices

WITHIN = 0.05  # adaptive is "within" at a point when it reaches (1 - WITHIN) of the best fixed setting


async def run_all(
    config: BenchConfig, log=print, repeats: int = 1, rtts_together: bool = False, rules=("model",)
) -> dict:
    """Every point: the adaptive row, then each fixed (γ in config.gammas, depth in config.pipelines),
    `repeats` interleaved passes each. `rtts_together`: a pass holds every RTT's rows, taking turns as
    the settings do, so that the machine's drift between points (15-20 minutes apart on the Qwen pair)
    falls on each RTT alike and the longer RTT's figures over loopback's compare like with like.
    `rules`: an adaptive row for each (TunerConfig.rule), taking turns with the rest."""
    from tools.bench import target_arms

    reference = {r.mode: r for r in target_arms.in_child(config, log, transformers=False)}
    # The verifier takes the adaptive rows' largest γ too, not only the fixed grid's: capped at the grid,
    # a step rule that climbs past it could not.
    flags = ["--max-gamma", str(max(*config.gammas, TunerConfig().max_gamma)), "--dtype", config.dtype]
    flags += [] if config.invariant else ["--no-bit-exact"]
    server = devices.verifier(config.target_dir, *flags, **config.devices)
    drafter = LlamaDrafter(DrafterConfig(config.draft_gguf, n_threads=config.draft_threads))
    rows: list[Row] = []
    settings = [(None, None)] * len(rules) + [(g, d) for g in config.gammas for d in config.pipelines]
    tuners = [TunerConfig(rule=rule) for rule in rules] + [None] * (len(settings) - len(rules))
    groups = [tuple(config.rtts_ms)] if rtts_together else [(rtt,) for rtt in config.rtts_ms]
    with server:
        host, port = server.address.rsplit(":", 1)
        async with contextlib.AsyncExitStack() as stack:
            addresses = {
                rtt: await stack.enter_async_context(route(host, int(port), rtt)) for rtt in config.rtts_ms
            }
            for group in groups:
                for mode in reference:
                    for repeat in range(repeats):
                        at = " and ".join(f"{rtt:g}" for rtt in group)
                        log(
                            f"{at} ms RTT, {mode}: {'/'.join(rules)} and {len(settings) - len(rules)} fixed"
                            + (f", pass {repeat + 1} of {repeats}" if repeats > 1 else "")
                        )
                        # Each pass starts the rotation elsewhere, so no setting always runs first.
                        turns = [(g, d, rtt) for rtt in group for g, d in settings]
                        configs = tuners * len(group)
                        order = turns[repeat:] + turns[:repeat]
                        here = await interleaved(
                            config,
                            drafter,
                            addresses,
                            server.address,
                            mode,
                            order,
                            configs[repeat:] + configs[:repeat],
                        )
                        for row in here:
                            row.repeat = repeat
                        rows += here
    return summarize(config, reference, rows, rtts_together)


async def interleaved(config, drafter, addresses, upstream, mode, settings, tuners=None) -> list[Row]:
    """One pass's rows, taking turns prompt by prompt: each setting (γ, depth, RTT) keeps its own edge
    session (the adaptive one its tuner) across the prompts, and the order rotates from prompt to
    prompt, so a burst of load falls on every setting alike and none always runs first. `addresses`:
    the verifier's address (a delaying proxy) for each RTT.

    Before a prompt's turn, an untimed one-token generation prefills it in the drafter's KV cache and in
    the verifier's kept caches, so that no row pays a prefill and the rows compare decoding alone, as
    in a conversation's later turns. Without it the turn's first row paid the drafter's prefill (about
    200 ms of llama.cpp on one core for a 40-token chat prompt) and every later row reused it. The
    verifier keeps an anonymous caller's caches per connection, so the rows of an RTT and its warm-up
    share one channel; the rows' `reused_positions` show it.

    `tuners`: a TunerConfig per setting (None: the default tuner's)."""
    async with contextlib.AsyncExitStack() as stack:
        channels = {
            rtt: await stack.enter_async_context(grpc.aio.insecure_channel(addresses[rtt]))
            for rtt in dict.fromkeys(rtt for _, _, rtt in settings)
        }
        runs = [
            await stack.enter_async_context(
                RowRun(config, drafter, addresses[rtt], upstream, mode, g, rtt, d, channel=channels[rtt])
            )
            for g, d, rtt in settings
        ]
        for run, tuner in zip(runs, tuners or [None] * len(runs), strict=True):
            if tuner is not None:
                run.session.tuner = Tuner(tuner)
        warm = [EdgeSession(channel, drafter) for channel in channels.values()]
        for i in range(len(config.prompts)):
            prefill = GenerationRequest(config.prompts[i], params_for(mode, config, i), 1, 1, pipeline=0)
            for session in warm:
                await session.run(prefill)
            turn = i % len(runs)
            for run in runs[turn:] + runs[:turn]:
                await run.prompt(i)
        rows = [run.row() for run in runs]
    for row, (_, depth, _), tuner in zip(rows, settings, tuners or [None] * len(rows), strict=True):
        if depth is None:  # an adaptive row: -1 the model's rule, -2 the step rule's
            depth = -2 if tuner is not None and tuner.rule == "step" else -1
        row.pipeline = depth
        add_bound(row)
    return rows


ADAPTIVE = "adaptive"
STEP = "step rule"  # the adaptive row of TunerConfig(rule="step"), where a run has one


def _key(gamma: int, pipeline: int) -> str | tuple[int, int]:
    return {-1: ADAPTIVE, -2: STEP}.get(pipeline, (gamma, pipeline))


def _setting(row: Row) -> str | tuple[int, int]:
    return _key(row.gamma, row.pipeline)


def summarize(
    config: BenchConfig, reference: dict[str, Row], rows: list[Row], rtts_together: bool = False
) -> dict:
    """Per point the adaptive and the best fixed tokens/s, each a setting's median over the point's
    passes (its one figure when there is one pass), with the adaptive row over the best fixed one pass
    by pass and the fixed rows' spread; over the set, adaptive against each fixed setting."""
    points, fixed_rates = [], {}
    for rtt in config.rtts_ms:
        for mode in reference:
            here: dict[str | tuple[int, int], list[Row]] = {}
            for r in rows:
                if r.rtt_ms == rtt and r.mode == mode:
                    here.setdefault(_setting(r), []).append(r)
            rates = {k: [r.tokens_per_s for r in v] for k, v in here.items()}
            median = {k: statistics.median(v) for k, v in rates.items()}
            fixed = [k for k in here if k not in (ADAPTIVE, STEP)]
            best = max(fixed, key=median.__getitem__)
            for k in fixed:
                fixed_rates.setdefault(k, []).append(median[k])
            adaptive = here[ADAPTIVE]
            best_by_pass = {r.repeat: r.tokens_per_s for r in here[best]}
            spreads = [(max(rates[k]) - min(rates[k])) / median[k] for k in fixed]
            points.append(
                {
                    "rtt_ms": rtt,
                    "mode": mode,
                    "passes": len(adaptive),
                    "adaptive_tokens_per_s": median[ADAPTIVE],
                    "adaptive_label": adaptive[0].label,
                    "adaptive_ended": [r.label.split("adaptive ")[-1].strip("()") for r in adaptive],
                    "adaptive_paths": [r.tuner_path for r in adaptive],
                    "adaptive_acceptance": statistics.median(r.acceptance or 0.0 for r in adaptive),
                    "adaptive_of_bound": statistics.median(r.share_of_bound or 0.0 for r in adaptive),
                    "best_fixed": list(best),
                    "best_fixed_tokens_per_s": median[best],
                    "of_best": median[ADAPTIVE] / median[best],
                    "of_best_by_pass": [r.tokens_per_s / best_by_pass[r.repeat] for r in adaptive],
                    "fixed_spread": statistics.median(spreads),  # a fixed row's (max - min) / median
                    "within": median[ADAPTIVE] >= (1 - WITHIN) * median[best],
                    "rank": 1 + sum(median[k] > median[ADAPTIVE] for k in fixed),
                    "fixed_settings": len(fixed),
                }
            )
            if STEP in median:
                points[-1]["step_tokens_per_s"] = median[STEP]
    step = [p["step_tokens_per_s"] for p in points if "step_tokens_per_s" in p]
    overall = over_the_set([p["adaptive_tokens_per_s"] for p in points], fixed_rates, step)
    overall["within_at_every_point"] = all(p["within"] for p in points)
    passes = max(r.repeat for r in rows) + 1
    exact = {
        f"{r.mode}/rtt{r.rtt_ms:g}/"
        + {-1: "adaptive", -2: "step"}.get(r.pipeline, f"g{r.gamma}/p{r.pipeline}")
        + (f"/pass{r.repeat + 1}" if passes > 1 else ""): (r.outputs == reference[r.mode].outputs)
        for r in rows
    }
    serialized = [
        {**{k: v for k, v in asdict(r).items() if k != "outputs"}, "tokens_per_s": r.tokens_per_s}
        for r in rows
    ]
    return {
        "config": {
            k: str(v) if isinstance(v, Path) else v for k, v in asdict(config).items() if k != "prompts"
        },
        "prompts": len(config.prompts),
        "passes": passes,
        "target_alone_tokens_per_s": {m: r.tokens_per_s for m, r in reference.items()},
        "points": points,
        "overall": overall,
        "rows": serialized,
        "exact": exact,
        "rtts_together": rtts_together,
        "far_of_near": rtt_ratios(serialized),
    }


def rtt_ratios(rows: list[dict]) -> list[dict]:
    """A run's far_of_near (issue 29: 30 ms at least 0.9 of loopback): each point's settings' medians over
    the passes, and the defaults' ratio pass by pass too (the same pass's rows at both RTTs; with
    --rtts-together they took turns, so the machine's drift falls on both alike)."""
    points = []
    for (rtt, mode), rates in _by_point(rows, lambda r: r["tokens_per_s"]).items():
        medians = {k: statistics.median(v) for k, v in rates.items()}
        adaptive = medians.pop(ADAPTIVE)
        medians.pop(STEP, None)
        points.append(
            {
                "mode": mode,
                "rtt_ms": rtt,
                "adaptive_tokens_per_s": adaptive,
                "adaptive_by_pass": rates[ADAPTIVE],  # one a pass, in pass order (_by_point)
                "fixed_tokens_per_s": medians,
            }
        )
    return far_of_near(points)


def over_the_set(
    adaptive_rates: list[float], fixed_rates: dict[tuple[int, int], list[float]], step_rates=()
) -> dict:
    """The adaptive row against each fixed setting over a set of points: each one's tokens/s (a median
    over passes) summed, and their geometric mean (every point weighing alike, whatever its speed).
    `step_rates`: the step rule's adaptive row at the same points, where the run has one."""
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
    if step_rates and len(step_rates) == len(adaptive_rates):
        overall["step"] = {"sum": sum(step_rates), "geomean": _geomean(list(step_rates))}
        overall["step_of_model"] = {
            k: overall["step"][k] / overall["adaptive"][k] for k in ("sum", "geomean")
        }
    return overall


def across(reports: dict[str, dict]) -> dict:
    """Several runs (a prompt class each, by name) as one set: every point of every run, the adaptive
    row against each fixed setting measured at all of them (the one default has to serve every class,
    where the best fixed setting differs by class). A setting's figure at a point is its median over
    the run's passes."""
    points, medians = [], []
    for name, report in reports.items():
        here = _by_point(report["rows"], lambda r: r["tokens_per_s"])
        alone = report.get("target_alone_tokens_per_s", {})
        for p in report["points"]:
            keep = ("rtt_ms", "mode", "of_best", "within", "adaptive_tokens_per_s")
            points.append({"class": name, **{k: p[k] for k in keep}})
            if alone.get(p["mode"]):
                points[-1]["of_alone"] = p["adaptive_tokens_per_s"] / alone[p["mode"]]
            medians.append({k: statistics.median(v) for k, v in here[(p["rtt_ms"], p["mode"])].items()})
    common = set.intersection(*(set(m) for m in medians)) - {ADAPTIVE, STEP}
    if not common:
        raise ValueError("the runs share no fixed (γ, depth) measured at every point: nothing to compare")
    fixed = {k: [m[k] for m in medians] for k in sorted(common)}
    for p, m in zip(points, medians, strict=True):
        p["fixed_tokens_per_s"] = {f"{g},{d}": m[(g, d)] for g, d in sorted(common)}
    return {
        "classes": list(reports),
        "commands": {name: r.get("command", "") for name, r in reports.items()},
        "points": points,
        "overall": {
            **over_the_set([m[ADAPTIVE] for m in medians], fixed, [m[STEP] for m in medians if STEP in m]),
            "within_at_every_point": all(p["within"] for p in points),
        },
        "far_of_near": far_of_near(points),
    }


def far_of_near(points: list[dict]) -> list[dict]:
    """The defaults' tokens/s at each class and mode's longest RTT over its shortest (issue 29's goal:
    30 ms at least 0.9 of loopback), beside the median of the fixed settings' same ratio: a run that
    plays its RTTs one after the other (without --rtts-together) lets a machine that got slower or
    faster in between move every row alike, where a cost of the RTT the defaults fail to hide moves
    theirs only. Points that carry the defaults' figures pass by pass (`adaptive_by_pass`, a run's own)
    give the ratio pass by pass too."""
    out = []
    for key in dict.fromkeys((p.get("class"), p["mode"]) for p in points):
        here = [p for p in points if (p.get("class"), p["mode"]) == key]
        here.sort(key=lambda p: p["rtt_ms"])
        near, far = here[0], here[-1]
        if far["rtt_ms"] > near["rtt_ms"]:
            ratio = {
                "class": key[0],
                "mode": key[1],
                "rtts_ms": [near["rtt_ms"], far["rtt_ms"]],
                "ratio": far["adaptive_tokens_per_s"] / near["adaptive_tokens_per_s"],
                "fixed_ratio": _fixed_ratio(near, far),
            }
            if "adaptive_by_pass" in near and "adaptive_by_pass" in far:
                pairs = zip(near["adaptive_by_pass"], far["adaptive_by_pass"], strict=False)
                ratio["by_pass"] = [f / n for n, f in pairs]
            out.append(ratio)
    return out


def across_markdown(report: dict) -> str:
    o = report["overall"]
    n = len(report["points"])
    lines = [
        f"{n} points: " + ", ".join(report["classes"]) + ", each at its RTTs and modes; fixed settings "
        "measured at every point.",
        "",
        *_set_table(o),
        "",
        "| class | RTT ms | mode | adaptive of best fixed | within 5 % | adaptive of the target alone |",
        "|---|---|---|---|---|---|",
        *(
            f"| {p['class']} | {p['rtt_ms']:g} | {p['mode']} | {p['of_best']:.2f} | {_yes(p['within'])} | "
            + (f"{p['of_alone']:.2f}× |" if "of_alone" in p else " |")
            for p in report["points"]
        ),
        "",
        *_verdict(o),
        *_far_table(report.get("far_of_near", [])),
    ]
    return "\n".join(lines)


def _fixed_ratio(near: dict, far: dict) -> float | None:
    both = [k for k in near.get("fixed_tokens_per_s", {}) if k in far.get("fixed_tokens_per_s", {})]
    if not both:
        return None
    return statistics.median(far["fixed_tokens_per_s"][k] / near["fixed_tokens_per_s"][k] for k in both)


def _far_table(rows: list[dict]) -> list[str]:
    """far_of_near's rows: a class column where they have classes (across runs), the defaults' ratio
    pass by pass where they have it (a run's own)."""
    if not rows:
        return []
    classes, passes = any(r.get("class") for r in rows), any(r.get("by_pass") for r in rows)
    head = ["class"] * classes + ["mode", "RTT ms", "defaults: longer RTT's tok/s over shorter's"]
    head += ["pass by pass"] * passes + ["fixed settings', median"]
    lines = ["", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["class"]] * classes + [r["mode"], f"{r['rtts_ms'][1]:g} of {r['rtts_ms'][0]:g}"]
        cells += [f"{r['ratio']:.2f}"] + [", ".join(f"{x:.2f}" for x in r.get("by_pass", []))] * passes
        cells.append(f"{r['fixed_ratio']:.2f}" if r.get("fixed_ratio") else "")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _set_table(o: dict) -> list[str]:
    fixed = sorted(o["fixed"].items(), key=lambda kv: -kv[1]["geomean"])
    return [
        "| setting | sum tok/s | geomean tok/s |",
        "|---|---|---|",
        f"| **adaptive** | {o['adaptive']['sum']:.1f} | {o['adaptive']['geomean']:.2f} |",
        *(
            [f"| adaptive, step rule | {o['step']['sum']:.1f} | {o['step']['geomean']:.2f} |"]
            if "step" in o
            else []
        ),
        *(
            f"| fixed γ {k.replace(',', ', depth ')} | {v['sum']:.1f} | {v['geomean']:.2f} |"
            for k, v in fixed
        ),
    ]


def _verdict(o: dict) -> list[str]:
    return [
        f"within 5 % of the best fixed setting at every point: {_yes(o['within_at_every_point'])}",
        f"beats every fixed setting over the set: by sum {_yes(o['beats_every_fixed_by_sum'])}"
        f" (best fixed {o['best_fixed_by_sum']}), by geometric mean "
        f"{_yes(o['beats_every_fixed_by_geomean'])} (best fixed {o['best_fixed_by_geomean']})",
        *(
            [
                "the step rule (+2/-1 on γ, fixed depth) over the model's: "
                f"{o['step_of_model']['sum']:.3f} by sum, "
                f"{o['step_of_model']['geomean']:.3f} by geometric mean"
            ]
            if "step_of_model" in o
            else []
        ),
    ]


def _ended(ends: list[str]) -> str:
    """Where the adaptive row ended: its label's words for one pass, (γ, depth) a pass for several."""
    if len(ends) == 1:
        return ends[0]
    settings = [re.search(r"γ (\d+), depth (\d+)", e) for e in ends]
    return ", ".join(f"({m[1]}, {m[2]})" if m else e for m, e in zip(settings, ends, strict=True))


def _paths(points: list[dict]) -> list[str]:
    """The adaptive row's path at each point, pass by pass: (γ, depth)×rounds played there, in order."""
    rows = [p for p in points if any(p.get("adaptive_paths") or ())]
    if not rows:
        return []
    lines = ["The adaptive row's path: (γ, depth)×verified rounds at it, in order, a line per pass.", ""]
    lines += ["| RTT ms | mode | path |", "|---|---|---|"]
    for p in rows:
        for path in p["adaptive_paths"]:
            steps = " → ".join(f"({g}, {d})×{n}" for g, d, n in path or ())
            lines.append(f"| {p['rtt_ms']:g} | {p['mode']} | {steps} |")
    return lines


def _yes(flag: bool) -> str:
    return "yes" if flag else "no"


def _geomean(values: list[float]) -> float:
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values and min(values) > 0 else 0.0


def markdown(report: dict) -> str:
    passes = report.get("passes", 1)
    spread = passes > 1  # the pass-by-pass columns
    head = "| RTT ms | mode | adaptive tok/s | where it ended | best fixed (γ, depth) | best tok/s | of best "
    head += "| of best, pass by pass | fixed rows' spread " if spread else ""
    lines = [
        (f"Each figure the median of {passes} interleaved passes.\n\n" if spread else "")
        + head
        + "| within 5 % | rank |",
        "|" + "---|" * (11 if spread else 9),
    ]
    for p in report["points"]:
        cells = [
            f"{p['rtt_ms']:g}",
            p["mode"],
            f"{p['adaptive_tokens_per_s']:.2f}",
            _ended(p["adaptive_ended"]),
            f"{tuple(p['best_fixed'])}",
            f"{p['best_fixed_tokens_per_s']:.2f}",
            f"{p['of_best']:.2f}",
        ]
        if spread:
            cells += [", ".join(f"{x:.2f}" for x in p["of_best_by_pass"]), f"{p['fixed_spread']:.2f}"]
        cells += ["yes" if p["within"] else "no", f"{p['rank']} of {p['fixed_settings'] + 1}"]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", *_set_table(report["overall"]), "", *_verdict(report["overall"])]
    if report.get("far_of_near"):
        how = "took turns in each pass" if report.get("rtts_together") else "ran one after the other"
        lines += ["", f"The RTTs' rows {how}.", *_far_table(report["far_of_near"])]
    lines += ["", *_paths(report["points"])]
    lines += ["", *ratio_table(report["rows"], "model_tokens_per_s", MODEL_CHECK)]
    own = [{**r, "model_own_tokens_per_s": model_at_own_acceptance(r)} for r in report["rows"]]
    lines += ["", *ratio_table(own, "model_own_tokens_per_s", MODEL_OWN_CHECK)]
    lines += ["", *ratio_table(report["rows"], "bound_tokens_per_s", BOUND_CHECK)]
    reused = [r.get("reused_positions", 0) for r in report["rows"]]
    lines.append(
        f"prompt positions a row took from the verifier's kept caches: {min(reused)} to {max(reused)}"
    )
    bad = [k for k, ok in report["exact"].items() if not ok]
    lines.append("every output equals the target alone's" if not bad else f"outputs differing: {bad}")
    return "\n".join(lines)


MODEL_CHECK = "Model check: measured tokens/s over the tuner's prediction for the row's (last) setting"
MODEL_OWN_CHECK = (
    "The same at the row's own acceptance (the tuner's costs as it ended, the row's acceptance over all "
    "its rounds as one rate at every position: tools.bench.speed.model_at_own_acceptance)"
)
BOUND_CHECK = (
    "Bound check: measured tokens/s over the zero-overhead bound of the row's own measured drafting, "
    "verification and restarts (tools.bench.speed.zero_overhead_bound)"
)


def ratio_table(rows: list[dict], key: str, title: str) -> list[str]:
    """Measured tokens/s over each row's figure `key` (the tuner's prediction for its setting, the tuner
    learning from fixed rows too; or its bound), a column per setting (the median over passes): where
    the figure is off, and whether it is off alike everywhere."""
    rows = [r for r in rows if r.get(key)]
    if not rows:
        return []
    settings = sorted({(r["gamma"], r["pipeline"]) for r in rows if r["pipeline"] >= 0})
    head = ["RTT ms", "mode", "adaptive", *(f"{g},{d}" for g, d in settings)]
    lines = [f"{title} (γ,depth columns).", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for (rtt, mode), here in _by_point(rows, lambda r: r["tokens_per_s"] / r[key]).items():
        cells = [f"{statistics.median(here[k]):.2f}" if k in here else "" for k in [ADAPTIVE, *settings]]
        lines.append(f"| {rtt:g} | {mode} | " + " | ".join(cells) + " |")
    return lines


def _by_point(rows: list[dict], value) -> dict[tuple[float, str], dict]:
    """A report's rows grouped by point ((RTT, mode), in the rows' order) and setting: `value` of each
    row, one a pass."""
    grouped: dict[tuple[float, str], dict] = {}
    for r in rows:
        setting = _key(r["gamma"], r["pipeline"])
        grouped.setdefault((r["rtt_ms"], r["mode"]), {}).setdefault(setting, []).append(value(r))
    return grouped


def parser() -> argparse.ArgumentParser:
    from draftwire_cli.cliargs import id_list

    p = argparse.ArgumentParser(prog="python -m tools.bench.adaptive", description=__doc__)
    add_pair_flags(p, temperature=0.7)
    p.add_argument("--gammas", type=id_list, default=(1, 2, 3, 4, 6, 8), help="the fixed grid's γ")
    p.add_argument("--depths", type=id_list, default=(0, 1, 2), help="the fixed grid's pipeline depths")
    p.add_argument(
        "--rtts", type=id_list, default=(0, 10, 30, 80), help="round-trip times in ms (0: loopback)"
    )
    p.add_argument(
        "--repeats",
        type=int,
        default=1,
        help="interleaved passes of each point, a fresh session each; figures are medians over them",
    )
    p.add_argument(
        "--rtts-together",
        action="store_true",
        help="each pass holds every RTT's rows, taking turns: the RTTs then compare free of the "
        "machine's drift between points",
    )
    p.add_argument(
        "--rules",
        type=lambda v: tuple(v.split(",")),
        default=("model",),
        help="an adaptive row for each of these rules (model, step: edge_client.adaptive.Rule)",
    )
    p.add_argument("--out", type=Path, default=Path("runs/adaptive"), help="adaptive.json, adaptive.md")
    return p


def across_main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(
        prog="python -m tools.bench.adaptive across",
        description="Several runs' adaptive.json (a prompt class each) compared as one set of points.",
    )
    p.add_argument("runs", type=Path, nargs="+", help="run directories (each a --out)")
    p.add_argument("--out", type=Path, help="where to write across.json and across.md")
    args = p.parse_args(argv)
    reports = {}
    for run in args.runs:
        path = run / "adaptive.json"
        if not path.is_file():
            p.error(f"no {path}")
        reports[run.name] = json.loads(path.read_text())
    try:
        report = across(reports)
    except ValueError as e:
        p.error(str(e))
    table = across_markdown(report)
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "across.json").write_text(json.dumps(report, indent=2) + "\n")
        (args.out / "across.md").write_text(table + "\n")
    print(table)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["across"]:
        return across_main(argv[1:])
    args = parser().parse_args(argv)
    config = BenchConfig.from_args(args, pipelines=args.depths)
    if args.repeats < 1:
        raise SystemExit("draftwire: --repeats must be at least 1")
    report = asyncio.run(
        run_all(
            config,
            log=lambda m: print(m, file=sys.stderr, flush=True),
            repeats=args.repeats,
            rtts_together=args.rtts_together,
            rules=args.rules,
        )
    )
    report["command"] = " ".join(["python -m tools.bench.adaptive", *argv])
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "adaptive.json").write_text(json.dumps(report, indent=2) + "\n")
    table = markdown(report)
    (args.out / "adaptive.md").write_text(table + "\n")
    print(table)
    return 0 if all(report["exact"].values()) else 1


if __name__ == "__main__":
    sys.exit(main())
