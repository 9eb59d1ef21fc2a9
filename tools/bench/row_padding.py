"""Benchmark: invariant mode's padding of small forwards (verifier_service/invariant.py PADDINGS). One
session's round of n new positions over a cached prefix, its linear layers' calls padded to at least 2
rows against at least 4, taking turns within each repeat on one engine, and the logits of the two
compared bit for bit; beside them, the padding the engine chose at load (timed, choose_padding).

    python -m tools.bench.row_padding --target DIR [--dtype float32] [--held 40] [--repeats 8]

Prints a markdown table (median milliseconds a round, per n and padding); --json writes the figures.
Pin it to one core (taskset -c 1) to stand for a one-core verifier.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time
from pathlib import Path

import torch

from verifier_service import invariant
from verifier_service.engine import Forward, TargetEngine

POSITIONS = (1, 2, 3, 4, 5, 7, 9)
PADDINGS = invariant.PADDINGS


def measure(engine: TargetEngine, held: int, repeats: int) -> tuple[dict[int, dict[int, float]], bool]:
    """Median milliseconds per (positions, padding), and whether every round's logits were the same
    bits under both paddings."""
    rng = random.Random(0)
    vocab = engine.info.vocabulary.size
    engine.forward_many([Forward("s", 0, tuple(rng.randrange(100, vocab) for _ in range(held)), False)])
    times: dict[int, dict[int, list[float]]] = {n: {p: [] for p in PADDINGS} for n in POSITIONS}
    same = True
    try:
        for _ in range(repeats):
            for n in POSITIONS:
                tokens = tuple(rng.randrange(100, vocab) for _ in range(n))
                logits = []
                for padding in PADDINGS:
                    invariant.set_padding(engine.model, padding)
                    start = time.perf_counter()
                    logits.append(engine.forward_many([Forward("s", held, tokens)])[0])
                    times[n][padding].append(time.perf_counter() - start)
                same = same and torch.equal(*logits)
    finally:
        invariant.set_padding(engine.model, engine.padding)
    medians = {n: {p: 1000 * statistics.median(t) for p, t in row.items()} for n, row in times.items()}
    return medians, same


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, required=True)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    p.add_argument("--held", type=int, default=40, help="cached positions before each round")
    p.add_argument("--repeats", type=int, default=8)
    p.add_argument("--json", type=Path)
    args = p.parse_args(argv)
    engine = TargetEngine.load(args.target, dtype=args.dtype)
    medians, same = measure(engine, args.held, args.repeats)
    print(f"| new positions | padded to 2, ms | padded to 4, ms | 2 over 4 |  ({engine.numerics.kernels})")
    print("|---|---|---|---|")
    for n, row in medians.items():
        print(f"| {n} | {row[2]:.0f} | {row[4]:.0f} | {row[2] / row[4]:.2f} |")
    print("the logits under both paddings the same bits:", same)
    print("the padding chosen at load:", engine.padding)
    if args.json:
        figures = {
            "dtype": args.dtype,
            "held": args.held,
            "ms": medians,
            "same": same,
            "chosen": engine.padding,
        }
        args.json.write_text(json.dumps(figures))
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
