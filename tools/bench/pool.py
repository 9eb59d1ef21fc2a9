"""Benchmark: the pool's per-round overhead over one verifier, and the transports the design chose between.

One invocation, one target, the same proposals: `draftwire serve` and `draftwire serve --ray
--replicas 1` run side by side as child processes; sessions run one at a time, alternating between
the two, with replayed drafts (draftwire_cli.loadtest), and both must commit the same tokens. Then the raw
transports: a grpc.aio bidirectional-stream round trip on loopback and a Ray actor call.

    python -m tools.bench.pool --target DIR [--generations 24] [--new-tokens 32] [--json FILE]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time
from pathlib import Path

import grpc

from draftwire.v1 import draftwire_pb2 as pb
from draftwire_cli.loadtest import LoadConfig, record
from edge_client.replay import ReplayDrafter
from edge_client.session import EdgeSession, GenerationRequest
from tools.rig.serverproc import ServerProcess

SERVICE = "draftwire.v1.Verifier"


async def compare_rounds(single: str, pool: str, args) -> dict:
    """Median round latency of each server over the same sessions, interleaved."""
    config = LoadConfig(new_tokens=args.new_tokens, gamma=args.gamma, corrupt=args.corrupt, prompts=8)
    rounds = {"single": [], "pool": []}
    outputs = {"single": [], "pool": []}
    async with grpc.aio.insecure_channel(single) as a, grpc.aio.insecure_channel(pool) as b:
        vocab, scripts = await record(a, config)
        for n in range(args.generations):
            prompt, script = scripts[n % len(scripts)]
            for name, channel in (("single", a), ("pool", b)) if n % 2 else (("pool", b), ("single", a)):
                drafter = ReplayDrafter(prompt + script, vocab, args.corrupt, seed=n)
                request = GenerationRequest(
                    prompt, max_new_tokens=args.new_tokens, gamma=args.gamma, ignore_eos=True
                )
                ids, stats = await EdgeSession(channel, drafter).run(request)
                rounds[name] += stats.round_s[1:]  # the first round also carries the open and prefill
                outputs[name].append(ids)
    p50 = {name: 1000 * statistics.median(r) for name, r in rounds.items()}
    return {
        "rounds_each": len(rounds["single"]),
        "single_p50_ms": p50["single"],
        "pool_p50_ms": p50["pool"],
        "overhead_p50_ms": p50["pool"] - p50["single"],
        "same_tokens": outputs["single"] == outputs["pool"],
    }


async def grpc_round_trip_ms(n: int) -> float:
    """One small message each way over a grpc.aio bidirectional stream on loopback."""

    async def echo(request_iterator, context):
        async for message in request_iterator:
            yield message

    server = grpc.aio.server()
    handler = grpc.stream_stream_rpc_method_handler(echo)
    server.add_generic_rpc_handlers([grpc.method_handlers_generic_handler("bench.Echo", {"Echo": handler})])
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    payload = pb.EdgeMessage(proposal=pb.Proposal(round=1, start_position=100, draft_token_ids=[1, 2, 3, 4]))
    async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
        call = channel.stream_stream("/bench.Echo/Echo")()
        times = []
        for _ in range(n):
            t0 = time.perf_counter()
            await call.write(payload.SerializeToString())
            await call.read()
            times.append(time.perf_counter() - t0)
        call.cancel()
    await server.stop(0)
    return 1000 * statistics.median(times)


class _EchoActor:
    async def echo(self, message: bytes) -> bytes:
        return message


def ray_call_ms(n: int) -> float:
    """An async actor call with a small payload, from a driver on the same node."""
    import ray

    actor = ray.remote(num_cpus=0)(_EchoActor).remote()
    payload = b"\x12\x08" + bytes(8)
    ray.get(actor.echo.remote(payload))
    times = []
    for _ in range(n):
        t0 = time.perf_counter()
        ray.get(actor.echo.remote(payload))
        times.append(time.perf_counter() - t0)
    ray.kill(actor)
    return 1000 * statistics.median(times)


def markdown(report: dict) -> str:
    r, t = report["rounds"], report["transports"]
    lines = [
        f"target {report['target']}, {report['generations']} generations of {report['new_tokens']} tokens "
        f"per server, gamma {report['gamma']}, {r['rounds_each']} rounds each, one session at a time, "
        f"{report['threads']} torch thread(s) per server on {report['cpus']} cores",
        "",
        "| path | median round (ms) |",
        "|---|---|",
        f"| single `draftwire serve` | {r['single_p50_ms']:.2f} |",
        f"| pool (`serve --ray --replicas 1`, front + replica) | {r['pool_p50_ms']:.2f} |",
        f"| **pool overhead** | **{r['overhead_p50_ms']:+.2f}** |",
        "",
        f"same tokens from both: {r['same_tokens']}",
        "",
        "| transport, one small message each way | median (ms) |",
        "|---|---|",
        f"| grpc.aio bidirectional stream, loopback | {t['grpc_stream_ms']:.3f} |",
        f"| Ray actor call (async actor, same node) | {t['ray_actor_ms']:.3f} |",
    ]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--target", type=Path, required=True)
    ap.add_argument("--generations", type=int, default=24, help="per server")
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--gamma", type=int, default=4)
    ap.add_argument("--corrupt", type=float, default=0.2)
    ap.add_argument("--messages", type=int, default=2000, help="round trips per transport measurement")
    ap.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    ap.add_argument("--json", type=Path, help="also write the report here")
    args = ap.parse_args(argv)

    # Ray gives an actor OMP_NUM_THREADS = its num_cpus unless the environment sets it: pin both
    # servers alike, so that the comparison measures the path, not torch's threads on a busy machine.
    os.environ["OMP_NUM_THREADS"] = str(args.threads)
    cpus = str(args.threads)
    pool_flags = ("--ray", "--address", "local", "--replicas", "1", "--replica-cpus", cpus)
    pool_flags += ("--replica-host", "127.0.0.1")
    with ServerProcess(args.target) as single, ServerProcess(args.target, *pool_flags, timeout=300) as pool:
        rounds = asyncio.run(compare_rounds(single.address, pool.address, args))

    import ray

    transports = {"grpc_stream_ms": asyncio.run(grpc_round_trip_ms(args.messages))}
    ray.init(address="local", include_dashboard=False, log_to_driver=False)
    try:
        transports["ray_actor_ms"] = ray_call_ms(args.messages)
    finally:
        ray.shutdown()
    report = {
        "target": args.target.name,
        "generations": args.generations,
        "new_tokens": args.new_tokens,
        "gamma": args.gamma,
        "cpus": os.cpu_count(),
        "threads": args.threads,
        "rounds": rounds,
        "transports": transports,
    }
    print(markdown(report))
    if args.json:
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return 0 if rounds["same_tokens"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
