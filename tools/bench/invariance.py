"""Benchmark: what bit-exact (invariant) verification costs. The target's forward with the invariant
kernels against the plain ones, float32 and bfloat16, side by side in one run: one session's round of
1, 5, 9 and 17 positions over a cached prefix, a batch of 16 sessions x 5 positions, and a prefill.

    python -m tools.bench.invariance --target DIR [--threads 1] [--held 250] [--prefill 1024]

The four engines take turns within each repeat (median of the repeats), so a load that comes and goes
touches them alike. Prints a markdown table; --json writes the figures.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from collections.abc import Callable
from pathlib import Path

import torch

from verifier_service.engine import Forward, TargetEngine

MODES = (("float32", False), ("float32", True), ("bfloat16", False), ("bfloat16", True))
SESSIONS = 16  # of the batch case


def label(dtype: str, invariant: bool) -> str:
    return f"{dtype} {'invariant' if invariant else 'plain'}"


def cases(held: int, prefill: int, vocab: int) -> dict[str, Callable[[TargetEngine], object]]:
    """Each case: what one timed call does to an engine whose sessions s0..s15 hold `held` positions."""
    rng = random.Random(0)
    new = [rng.randrange(100, vocab) for _ in range(17)]
    long_prompt = tuple(rng.randrange(100, vocab) for _ in range(prefill))

    def round_of(n: int):
        return lambda engine: engine.forward("s0", held, new[:n])

    def batch(engine: TargetEngine):
        engine.forward_many([Forward(f"s{s}", held, tuple(new[s % 5 : s % 5 + 5])) for s in range(SESSIONS)])

    def prefill_one(engine: TargetEngine):
        engine.forward("p", 0, list(long_prompt), wants_logits=False)

    out = {f"{n} position{'s' * (n > 1)}": round_of(n) for n in (1, 5, 9, 17)}
    out[f"{SESSIONS} sessions x 5 positions"] = batch
    if prefill:
        out[f"prefill of {prefill} positions"] = prefill_one
    return out


def measure(target: Path, held: int, prefill: int, repeats: int) -> dict[str, dict[str, float]]:
    """Median milliseconds per case and mode."""
    engines = {label(d, i): TargetEngine.load(target, dtype=d, invariant=i) for d, i in MODES}
    vocab = next(iter(engines.values())).info.vocabulary.size
    context = [random.Random(1).randrange(100, vocab) for _ in range(held)]
    for engine in engines.values():
        engine.forward_many(
            [Forward(f"s{s}", 0, tuple(context), wants_logits=False) for s in range(SESSIONS)]
        )
    results = {}
    for name, call in cases(held, prefill, vocab).items():
        times = {mode: [] for mode in engines}
        for _ in range(2):  # warm-up: kernels, caches' capacity
            for engine in engines.values():
                call(engine)
        for _ in range(repeats):
            for mode, engine in engines.items():
                start = time.perf_counter()
                call(engine)
                times[mode].append(time.perf_counter() - start)
        results[name] = {mode: 1000 * statistics.median(t) for mode, t in times.items()}
    return results


def markdown(results: dict[str, dict[str, float]]) -> str:
    modes = [label(d, i) for d, i in MODES]
    lines = [
        "| forward | "
        + " | ".join(f"{m} (ms)" for m in modes)
        + " | invariant / plain, float32 | invariant / plain, bfloat16"
        + " | bfloat16 invariant / float32 plain |",
        "|---" * (len(modes) + 4) + "|",
    ]
    for name, ms in results.items():
        ratios = (
            ms["float32 invariant"] / ms["float32 plain"],
            ms["bfloat16 invariant"] / ms["bfloat16 plain"],
            ms["bfloat16 invariant"] / ms["float32 plain"],
        )
        cells = [f"{ms[m]:.1f}" for m in modes] + [f"{r:.2f}" for r in ratios]
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (one core stands for the server)")
    ap.add_argument("--held", type=int, default=250, help="cached positions before each round")
    ap.add_argument("--prefill", type=int, default=1024, help="prompt length of the prefill case (0: none)")
    ap.add_argument("--repeats", type=int, default=9)
    ap.add_argument("--json", type=Path, help="write the figures here")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    results = measure(args.target, args.held, args.prefill, args.repeats)
    print(f"{args.threads} torch thread(s), {args.held} cached positions, median of {args.repeats}\n")
    print(markdown(results))
    if args.json:
        args.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(args).items()}, "ms": results}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
