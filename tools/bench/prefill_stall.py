"""A bystander's rounds while long prompts arrive: prefill bounded by time (serve --prefill-share) against
positions alone (--prefill-share 0), side by side on the same target and the same rig.

    python -m tools.bench.prefill_stall [--target DIR] [--prompt-tokens 5000] [--floods 2]

Each arm starts its own `serve` pinned to the verifier's core. A bystander (on the other core) plays
rounds of 5 draft tokens with a 20 ms pause between them (its draft), first alone, then while `--floods`
sessions open with prompts of `--prompt-tokens` random ids one after another. Prints the bystander's
round time alone (median) and under the floods (median, p95, max), and each max's ratio to alone.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import time
from pathlib import Path

import grpc

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from tools.testkit.serverproc import ServerProcess

SMOLLM2 = Path.home() / ".local/share/draftwire/models/smollm2/target"


async def bystander_rounds(stub, stop: asyncio.Event, pause_s: float, out: list[float]) -> None:
    """Plays rounds until `stop`, appending each round's time (request to verdict) to `out`."""
    call = stub.Session()
    prompt = [random.Random(1).randrange(100, 40000) for _ in range(32)]
    stop_at = pb.StopConditions(max_new_tokens=4000, ignore_eos=True)
    await call.write(pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=prompt, stop=stop_at)))
    length = (await call.read()).opened.committed_length
    round_ = 0
    while not stop.is_set():
        round_ += 1
        start = time.perf_counter()
        proposal = pb.Proposal(round=round_, start_position=length, draft_token_ids=[100, 101, 102, 103, 104])
        await call.write(pb.EdgeMessage(proposal=proposal))
        length = (await call.read()).verdict.committed_length
        out.append(time.perf_counter() - start)
        await asyncio.sleep(pause_s)
    call.cancel()


async def flood(stub, tokens: int, seed: int) -> None:
    """One session with a long random prompt: waits for its open (the prefill), then leaves."""
    rng = random.Random(seed)
    prompt = [rng.randrange(100, 40000) for _ in range(tokens)]
    call = stub.Session()
    stop_at = pb.StopConditions(max_new_tokens=1, ignore_eos=True)
    await call.write(pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=prompt, stop=stop_at)))
    await call.read()
    call.cancel()


async def arm(address: str, args) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        await flood(stub, 64, 99)  # warm-up
        stop, alone = asyncio.Event(), []
        task = asyncio.create_task(bystander_rounds(stub, stop, args.pause_ms / 1000, alone))
        await asyncio.sleep(args.alone_s)
        crowded: list[float] = []
        mark = len(alone)
        start = time.perf_counter()
        for seed in range(args.floods):
            await flood(stub, args.prompt_tokens, seed)
        prefill_s = time.perf_counter() - start
        crowded = alone[mark:]
        stop.set()
        await task
        alone = alone[2:mark]
    base = statistics.median(alone)
    crowded.sort()
    return {
        "alone_ms": round(1000 * base, 1),
        "crowded_median_ms": round(1000 * statistics.median(crowded), 1),
        "crowded_p95_ms": round(1000 * crowded[int(0.95 * (len(crowded) - 1))], 1),
        "crowded_max_ms": round(1000 * crowded[-1], 1),
        "max_over_alone": round(crowded[-1] / base, 2),
        "p95_over_alone": round(crowded[int(0.95 * (len(crowded) - 1))] / base, 2),
        "rounds_crowded": len(crowded),
        "floods_s": round(prefill_s, 1),
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=SMOLLM2)
    p.add_argument("--prompt-tokens", type=int, default=5000)
    p.add_argument("--floods", type=int, default=2)
    p.add_argument("--pause-ms", type=float, default=20.0)
    p.add_argument("--alone-s", type=float, default=5.0)
    p.add_argument("--shares", default="0.5,0", help="the --prefill-share of each arm")
    p.add_argument("--verifier-cpu", type=int, default=1)
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {1 - args.verifier_cpu})  # the bystander and floods: the other core
    results = {}
    for share in args.shares.split(","):
        extra = ["--dtype", "float32", "--prefill-share", share, "--prefix-cache-mb", "0"]
        with ServerProcess(args.target, *extra, cpus=(args.verifier_cpu,), timeout=300) as server:
            results[f"share {share}"] = asyncio.run(arm(server.address, args))
        print(json.dumps({f"share {share}": results[f"share {share}"]}), flush=True)
    print(json.dumps({"prompt_tokens": args.prompt_tokens, "floods": args.floods, **results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
