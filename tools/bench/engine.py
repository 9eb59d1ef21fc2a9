"""Benchmark: the target engine alone, N sessions' rounds in one `forward_many` against one at a time,
at several cached lengths (no gRPC, no rules: what batching saves inside the engine).

    python -m tools.bench.engine --target DIR [--sessions 16] [--lengths 40,120,400] [--gamma 4]
    python -m tools.bench.engine --target DIR --prefill-at 4500 [--dtype float32]

With --prefill-at N: what prefill positions at N positions of context cost, alone and riding with one
session's round (γ + 1 positions at a short context), the floor of what a long prompt's chunk adds to a
bystander's round (serve --prefill-share).
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from draftwire_cli.models.prompts import id_prompts
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


SHORT = 50  # cached positions of the round a prefill rides with


def prefill_costs(engine: TargetEngine, held: int, gamma: int, repeats: int) -> list[tuple[str, float]]:
    """Median milliseconds of: one round alone (γ + 1 positions after SHORT cached), and 1, 2, 4 prefill
    positions after `held` (at least SHORT) cached, alone and in one pass with the round."""
    long_prompt, short = id_prompts(engine.info.vocabulary.size, 2, held)
    engine.forward("long", 0, list(long_prompt), wants_logits=False)
    engine.forward("short", 0, list(short[:SHORT]), wants_logits=False)
    round_ = Forward("short", SHORT, tuple(range(5, 6 + gamma)))
    rows = [("round alone", median_ms(lambda: engine.forward_many([round_]), repeats))]
    try:
        for k in (1, 2, 4):
            prefill = Forward("long", held, tuple(range(100, 100 + k)), wants_logits=False)
            arms = ((f"{k} prefill alone", [prefill]), (f"round + {k} prefill", [round_, prefill]))
            for name, forwards in arms:
                rows.append((name, median_ms(lambda f=forwards: engine.forward_many(f), repeats)))
    finally:
        engine.release("long")
        engine.release("short")
    return rows


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--lengths", default="40,120,400", help="cached positions of the first session")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=30)
    ap.add_argument("--prefill-at", type=int, help="instead: prefill positions' cost at this context")
    ap.add_argument("--dtype", default="auto", help="the target's dtype (serve --dtype)")
    args = ap.parse_args(argv)
    if args.prefill_at is not None and args.prefill_at < SHORT:
        ap.error(f"--prefill-at must be at least {SHORT}: the round it rides with keeps {SHORT} positions")
    engine = TargetEngine.load(args.target, dtype=args.dtype)
    if args.prefill_at:
        print(f"target {engine.info.target_id}, {engine.numerics.dtype}, prefill at {args.prefill_at}\n")
        print("| forward | ms |\n|---|---|")
        for name, ms in prefill_costs(engine, args.prefill_at, args.gamma, args.repeats):
            print(f"| {name} | {ms:.1f} |")
        return 0
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
