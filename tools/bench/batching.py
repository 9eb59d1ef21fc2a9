"""Benchmark: one verifier replica's committed tokens/s with N concurrent sessions, batched vs one at a time.

Both arms run in one invocation on the same engine, prompts and proposals (replayed drafts of the
target's own greedy continuation, a share of them corrupted), through a real gRPC server on loopback.
Outputs must equal the target's continuation in both arms.

    python -m tools.bench.batching --target DIR [--sessions 16] [--new-tokens 128] [--repeats 3] [--pool]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import grpc

from draftwire.contract import SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire_cli.models.prompts import id_prompts
from edge_client.replay import ReplayDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import ServerProcess
from verifier_service.batcher import Batcher
from verifier_service.engine import TargetEngine
from verifier_service.session import decode_alone


@dataclass(frozen=True)
class Arm:
    name: str
    max_batch: int  # 1: the replica verifies one session at a time


@dataclass
class Wave:
    """All sessions run once, concurrently, against one arm's server."""

    tokens: int
    wall_s: float
    batches: int
    forwards: int
    engine_s: float
    round_s: list[float]
    exact: bool

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.wall_s


async def run_wave(address: str, vocabulary, scripts, args) -> Wave:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        before = await stub.GetStats(pb.StatsRequest())
        runs = []
        for s, (prompt, script) in enumerate(scripts):
            drafter = ReplayDrafter(prompt + tuple(script), vocabulary, args.corrupt, seed=s)
            request = GenerationRequest(
                prompt, max_new_tokens=args.new_tokens, gamma=args.gamma, ignore_eos=True
            )
            runs.append(EdgeSession(channel, drafter).run(request))
        start = time.perf_counter()
        results = await asyncio.gather(*runs)
        wall = time.perf_counter() - start
        after = await stub.GetStats(pb.StatsRequest())
    return Wave(
        tokens=sum(len(ids) for ids, _ in results),
        wall_s=wall,
        batches=after.engine_batches - before.engine_batches,
        forwards=after.engine_forwards - before.engine_forwards,
        engine_s=after.engine_seconds - before.engine_seconds,
        round_s=[t for _, stats in results for t in stats.round_s],
        exact=all(ids == script for (ids, _), (_, script) in zip(results, scripts, strict=True)),
    )


def summary(arm: Arm, waves: list[Wave]) -> dict:
    rates = [w.tokens_per_s for w in waves]
    return {
        "name": arm.name,
        "tokens_per_s": statistics.median(rates),
        "tokens_per_s_each": rates,
        "mean_batch": sum(w.forwards for w in waves) / max(1, sum(w.batches for w in waves)),
        "p50_round_ms": 1000 * statistics.median(t for w in waves for t in w.round_s),
        "engine_busy": sum(w.engine_s for w in waves) / sum(w.wall_s for w in waves),
        "exact": all(w.exact for w in waves),
    }


async def main_async(args) -> dict:
    engine = TargetEngine.load(args.target)
    prompts = id_prompts(engine.info.vocabulary.size, args.sessions, 24)
    batcher = Batcher(engine)
    try:
        specs = [SessionSpec(p, max_new_tokens=args.new_tokens, ignore_eos=True) for p in prompts]
        scripts = [(s.prompt_token_ids, await decode_alone(batcher, s)) for s in specs]
    finally:
        batcher.close()
    arms = [Arm("one session at a time", 1), Arm(f"batched (up to {args.max_batch})", args.max_batch)]
    # Both replicas run side by side, each in its own process as it would beside remote edges (the
    # clients' Python does not steal its interpreter); the arms take turns, so drift on this machine
    # touches both alike. A first wave each warms up and is not counted.
    flags = ["--batch-window-ms", str(args.window_ms), "--threads", str(args.verifier_threads)]
    if args.pool:  # a one-replica Ray pool behind its front; the replica holds all the machine's cores
        flags += ["--ray", "--replicas", "1", "--replica-cpus", str(os.cpu_count())]
    with contextlib.ExitStack() as stack:
        servers = [
            stack.enter_context(ServerProcess(args.target, "--max-batch", str(arm.max_batch), *flags))
            for arm in arms
        ]
        waves: list[list[Wave]] = [[] for _ in arms]
        for repeat in range(args.repeats + 1):
            for server, arm_waves in zip(servers, waves, strict=True):
                wave = await run_wave(server.address, engine.info.vocabulary, scripts, args)
                if repeat:
                    arm_waves.append(wave)
    serial, batched = (summary(arm, arm_waves) for arm, arm_waves in zip(arms, waves, strict=True))
    return {
        "target": engine.info.target_id,
        "sessions": args.sessions,
        "gamma": args.gamma,
        "new_tokens": args.new_tokens,
        "corrupt": args.corrupt,
        "repeats": args.repeats,
        "arms": [serial, batched],
        "speedup": batched["tokens_per_s"] / serial["tokens_per_s"],
        "speedup_each": [
            b / s for s, b in zip(serial["tokens_per_s_each"], batched["tokens_per_s_each"], strict=True)
        ],
    }


def markdown(report: dict) -> str:
    lines = [
        f"{report['sessions']} concurrent sessions, gamma {report['gamma']}, "
        f"{report['new_tokens']} new tokens each, target {report['target']}; "
        f"median of {report['repeats']} waves per arm, arms taking turns",
        "",
        "| arm | committed tokens/s | each wave | mean batch | p50 round (ms) | engine busy | exact |",
        "|---|---|---|---|---|---|---|",
    ]
    for a in report["arms"]:
        cells = [
            a["name"],
            f"{a['tokens_per_s']:.0f}",
            " ".join(f"{rate:.0f}" for rate in a["tokens_per_s_each"]),
            f"{a['mean_batch']:.1f}",
            f"{a['p50_round_ms']:.1f}",
            f"{a['engine_busy']:.0%}",
        ]
        lines.append("| " + " | ".join([*cells, str(a["exact"])]) + " |")
    each = ", ".join(f"{ratio:.2f}" for ratio in report["speedup_each"])
    lines.append(f"\nbatched / one at a time: **{report['speedup']:.2f}x** (wave by wave: {each})")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--sessions", type=int, default=16)
    ap.add_argument("--new-tokens", type=int, default=128, help="tokens each session commits")
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--corrupt", type=float, default=0.2, help="share of draft tokens replaced")
    ap.add_argument("--max-batch", type=int, default=32)
    ap.add_argument("--window-ms", type=float, default=10.0, help="batcher's longest wait for open sessions")
    ap.add_argument("--verifier-threads", type=int, default=0, help="torch threads of the verifier (0: all)")
    ap.add_argument("--pool", action="store_true", help="each arm a one-replica Ray pool (serve --ray)")
    ap.add_argument("--repeats", type=int, default=3, help="counted waves per arm")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)
    report = asyncio.run(main_async(args))
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if all(a["exact"] for a in report["arms"]) else 1


if __name__ == "__main__":
    raise SystemExit(main())
