"""Benchmark: the target engine alone, N sessions' rounds in one `forward_many` against one at a time,
at several cached lengths (no gRPC, no rules: what batching saves inside the engine).

    python -m tools.bench.engine --target DIR [--sessions 16] [--lengths 40,120,400] [--gamma 4]
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from tools.models.prompts import id_prompts
from verifier_service.engine import Forward, TargetEngine


def median_ms(fn, repeats: int) -> float:
    for _ in range(3):  # warm-up
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return 1000 * statistics.median(times)


def measure(engine: TargetEngine, sessions: int, length: int, gamma: int, repeats: int) -> tuple[float, ...]:
    """Median milliseconds of one round of every session: (batched, one at a time)."""
    held = {f"L{length}-s{s}": length + 3 * s for s in range(sessions)}  # ragged cached lengths
    prompts = id_prompts(engine.info.vocabulary.size, sessions, max(held.values()))
    for (key, n), prompt in zip(held.items(), prompts, strict=True):
        engine.forward(key, 0, list(prompt[:n]), wants_logits=False)
    rounds = [Forward(key, n, tuple(range(5, 6 + gamma))) for key, n in held.items()]
    try:
        batched = median_ms(lambda: engine.forward_many(rounds), repeats)
        alone = median_ms(lambda: [engine.forward_many([f]) for f in rounds], repeats)
    finally:
        for key in held:
            engine.release(key)
    return batched, alone


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--lengths", default="40,120,400", help="cached positions of the first session")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    args = ap.parse_args(argv)
    engine = TargetEngine.load(args.target)
    print(f"{args.sessions} sessions, gamma {args.gamma}, target {engine.info.target_id}\n")
    print("| cached positions | one pass (ms) | one at a time (ms) | ratio |")
    print("|---|---|---|---|")
    for length in (int(n) for n in args.lengths.split(",")):
        batched, alone = measure(engine, args.sessions, length, args.gamma, args.repeats)
        last = length + 3 * (args.sessions - 1)
        print(f"| {length} to {last} | {batched:.1f} | {alone:.1f} | {alone / batched:.2f} x |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
