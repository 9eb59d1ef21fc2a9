"""`python -m tools.testkit.tuner_clock`: the adaptive tuner's learning cost over one bench point, on the
virtual clock (tools/testkit/timeline.py: the real planner and tuner, given costs, no machine noise).

A point of `tools.bench.adaptive` is three generations of 48 tokens through one tuner, started fresh. For
each condition this plays it with a tuner told nothing and with one told the verifier's forward times
(SessionOpened.forward_seconds, here the condition's own costs), against every fixed (γ, depth), each
the median over `--seeds` seeds, and prints each over the best fixed setting, with the share of rounds
the told tuner played below the γ it ended at.
"""

from __future__ import annotations

import argparse
import statistics

from edge_client.adaptive import Tuner, TunerConfig, path_rounds
from tools.testkit import timeline

MS = 1e-3
# (name, costs, acceptance, largest γ): the Qwen pair's costs on the two-core rig (a forward that hardly
# grows with its positions, 15 % dearer beside the drafter), at 0 and 30 ms; the SmolLM2 pair's.
QWEN = timeline.Costs(27 * MS, 40 * MS, 330 * MS, 5 * MS, 10 * MS, jitter=0.2, beside=1.15)
QWEN_30 = timeline.Costs(27 * MS, 40 * MS, 330 * MS, 5 * MS, 40 * MS, jitter=0.2, beside=1.15)
SMOLLM2 = timeline.Costs(4 * MS, 12 * MS, 12 * MS, 4 * MS, 2 * MS, jitter=0.2, beside=1.1)
CONDITIONS = [
    ("qwen, 0 ms", QWEN, 0.87, 4),
    ("qwen, 0 ms", QWEN, 0.87, 6),
    ("qwen, 30 ms", QWEN_30, 0.87, 6),
    ("qwen, 0 ms", QWEN, 0.6, 4),
    ("qwen, 0 ms", QWEN, 0.95, 8),
    ("smollm2", SMOLLM2, 0.9, 8),
]
GENERATIONS, TOKENS = 3, 48


def point(costs, acceptance, top, seed, told=False, fixed=(None, None)) -> tuple[float, Tuner]:
    """Tokens per virtual second over one point, and the tuner after it."""
    tuner = Tuner(TunerConfig(max_gamma=top))
    if told:
        tuner.observe_server_costs(
            {n: costs.verify_fixed + costs.verify_position * n for n in range(1, top + 2)}
        )
    seconds = sum(
        TOKENS / timeline.tokens_per_second(costs, acceptance, *fixed, TOKENS, 10 * seed + g, tuner)
        for g in range(GENERATIONS)
    )
    return GENERATIONS * TOKENS / seconds, tuner


def below_end(tuner: Tuner) -> float:
    """The share of the tuner's rounds played at a γ under the one it ended at."""
    low = sum(n for g, _, n in path_rounds(tuner.path, tuner.rounds) if g < tuner.choice[0])
    return low / tuner.rounds if tuner.rounds else 0.0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--seeds", type=int, default=16)
    args = ap.parse_args(argv)
    seeds = range(args.seeds)
    print("| condition | acceptance | γ up to | best fixed (γ, depth) | tok/s | told nothing | told |")
    print("|---|---|---|---|---|---|---|")
    for name, costs, alpha, top in CONDITIONS:
        grid = [(g, d) for g in range(1, top + 1) for d in (0, 1, 2)]
        fixed = {s: statistics.median(point(costs, alpha, top, k, fixed=s)[0] for k in seeds) for s in grid}
        best = max(fixed, key=fixed.get)
        untold = statistics.median(point(costs, alpha, top, k)[0] for k in seeds)
        told = [point(costs, alpha, top, k, told=True) for k in seeds]
        rate = statistics.median(r for r, _ in told)
        low = statistics.fmean(below_end(t) for _, t in told)
        print(
            f"| {name} | {alpha} | {top} | {best} | {fixed[best]:.2f} | {untold / fixed[best]:.3f} "
            f"| {rate / fixed[best]:.3f} ({low:.0%} of rounds below its last γ) |"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
