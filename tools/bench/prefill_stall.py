"""A bystander's rounds while long prompts arrive: prefill bounded by time (serve --prefill-share) against
positions alone (--prefill-share 0), side by side on the same target and the same rig. With --thin N,
the flood is N thin sessions whose edge never reads (`serve --thin-read-ahead`, each arm's value from
--read-aheads) instead of long prompts.

    python -m tools.bench.prefill_stall [--target DIR] [--prompt-tokens 5000] [--floods 2]
    python -m tools.bench.prefill_stall --prompt-tokens 5000 --floods 1 --min-prefill 1,0.125 \
        [--serve-flags '--prefill-share 0.2']
    python -m tools.bench.prefill_stall --thin 50 --thin-tokens 1000 --read-aheads 64,100000
    python -m tools.bench.prefill_stall --refused 2000 --refusal-limits 0,20
    python -m tools.bench.prefill_stall --refused 2000 --message-limits 1048576,auto

With --refused N, the flood is N opens of about 750 KB each (a prompt far over the context), 8 at a time on
the bystander's connection; the arms differ in `serve --max-refused-opens-per-s` (0: every open parsed
and refused with INVALID_ARGUMENT; 20: past 20 refusals in a second, the client's next opens are refused
unread), or with --message-limits in `serve --max-message-bytes` (an open over it is refused by gRPC from
its length, RESOURCE_EXHAUSTED, before Python sees it), and each reports its opens per second and their
statuses.

Each arm starts its own `serve` pinned to the verifier's core. A bystander (on the other core) plays
rounds of 5 draft tokens with a 20 ms pause between them (its draft), first alone, then while `--floods`
sessions open with prompts of `--prompt-tokens` random ids one after another. Prints the bystander's
round time alone (median, p95) and under the floods (median, p95, max), their ratios to the median alone,
and the p95's to the p95 alone (the rig's own jitter is in both), and the forward's time within the
rounds (median, p95; alone and crowded). The
bystander opens a new session every `--renew` rounds, so that its context, and so its own round's cost,
stays the same alone and crowded.
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import json
import os
import random
import shlex
import statistics
import time
from pathlib import Path

import grpc

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from draftwire_cli.figures import percentile
from tools.rig.serverproc import ServerProcess
from verifier_service.grpc_kit import SERVICE

SMOLLM2 = Path.home() / ".local/share/draftwire/models/smollm2/target"


async def bystander_rounds(
    stub,
    stop: asyncio.Event,
    pause_s: float,
    out: list[float],
    tokens: list[int] | None = None,
    renew: int = 50,
    opens: list[tuple[int, float]] | None = None,
    verify: list[float] | None = None,
) -> None:
    """Plays rounds until `stop`, appending each round's time (request to verdict) to `out`, and the
    tokens it committed to `tokens`. Every `renew` rounds it opens a new session with the same 32-token
    prompt, so that its own rounds cost the same all along (a round's attention grows with its context:
    over a long flood the same session would reach thousands of positions, and its rounds alone would
    slow by as much as the flood does); each open's time (request to SessionOpened) goes to `opens`,
    with the number of rounds played before it; each verdict's forward time (the batch it rode in) to
    `verify`."""
    prompt = [random.Random(1).randrange(100, 40000) for _ in range(32)]
    stop_at = pb.StopConditions(max_new_tokens=8000, ignore_eos=True)
    while not stop.is_set():
        call, start = stub.Session(), time.perf_counter()
        await call.write(pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=prompt, stop=stop_at)))
        length = (await call.read()).opened.committed_length
        if opens is not None:
            opens.append((len(out), time.perf_counter() - start))
        for round_ in range(1, renew + 1):
            if stop.is_set():
                break
            start = time.perf_counter()
            proposal = pb.Proposal(
                round=round_, start_position=length, draft_token_ids=[100, 101, 102, 103, 104]
            )
            await call.write(pb.EdgeMessage(proposal=proposal))
            verdict = (await call.read()).verdict
            out.append(time.perf_counter() - start)
            before, length = length, verdict.committed_length
            if verify is not None:
                verify.append(verdict.verify_seconds)
            if tokens is not None:
                tokens.append(length - before)
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


async def thin_flood(stub, sessions: int, tokens: int) -> list:
    """`sessions` thin sessions (the target alone) of `tokens` new tokens whose edge never reads a
    verdict nor sends a Read; returns their calls, left open."""
    stop_at = pb.StopConditions(max_new_tokens=tokens, ignore_eos=True)
    calls = []
    for seed in range(sessions):
        prompt = [random.Random(seed).randrange(100, 40000) for _ in range(16)]
        call = stub.Session()
        await call.write(
            pb.EdgeMessage(
                open=pb.OpenSession(prompt_token_ids=prompt, stop=stop_at, drafting=pb.DRAFTING_NONE)
            )
        )
        calls.append(call)
    return calls


async def refused_flood(channel, opens: int, concurrency: int = 8) -> collections.Counter:
    """`opens` oversized opens (about 1 MiB: 250,000 ids, far over the context), `concurrency` at a
    time; returns how many ended with each status (INVALID_ARGUMENT: parsed and refused;
    RESOURCE_EXHAUSTED: refused unread, the client having had too many refused, or by gRPC from the
    message's length, over --max-message-bytes)."""
    prompt = [random.Random(7).randrange(1 << 14, 1 << 21) for _ in range(250_000)]
    message = pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=prompt)).SerializeToString()
    left, codes = opens, collections.Counter()

    async def worker():
        nonlocal left
        while left > 0:
            left -= 1
            call = channel.stream_stream(f"/{SERVICE}/Session")()  # bytes as they are
            try:
                await call.write(message)
                await call.read()
            except (grpc.aio.AioRpcError, asyncio.InvalidStateError):
                pass
            codes[(await call.code()).name] += 1

    await asyncio.gather(*(worker() for _ in range(concurrency)))
    return codes


async def arm(address: str, args) -> dict:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        await flood(stub, 64, 99)  # warm-up
        stop, alone, tokens, opens, verify = asyncio.Event(), [], [], [], []
        bystander = bystander_rounds(
            stub, stop, args.pause_ms / 1000, alone, tokens, args.renew, opens, verify
        )
        task = asyncio.create_task(bystander)
        await asyncio.sleep(args.alone_s)
        crowded: list[float] = []
        mark = len(alone)
        before = await stub.GetStats(pb.StatsRequest())
        start = time.perf_counter()
        refused = None
        if args.refused:
            refused = await refused_flood(channel, args.refused)
        elif args.thin:
            calls = await thin_flood(stub, args.thin, args.thin_tokens)
            await asyncio.sleep(args.thin_s)
            for call in calls:
                call.cancel()
        else:
            for seed in range(args.floods):
                await flood(stub, args.prompt_tokens, seed)
        prefill_s = time.perf_counter() - start
        after = await stub.GetStats(pb.StatsRequest())
        bystander_tokens = sum(tokens[mark:])
        crowded, verify_crowded = alone[mark:], verify[mark : len(alone)]
        stop.set()
        await task
        alone, verify_alone = alone[2:mark], verify[2:mark]
    opens_alone = [seconds for rounds, seconds in opens[1:] if rounds <= mark]
    opens_crowded = [seconds for rounds, seconds in opens if rounds > mark]
    base = statistics.median(alone)
    crowded.sort()
    tail, tail_alone = percentile(crowded, 0.95), percentile(alone, 0.95)
    return {
        "alone_ms": round(1000 * base, 1),
        "alone_p95_ms": round(1000 * tail_alone, 1),
        "crowded_median_ms": round(1000 * statistics.median(crowded), 1),
        "crowded_p95_ms": round(1000 * tail, 1),
        "crowded_max_ms": round(1000 * crowded[-1], 1),
        "max_over_alone": round(crowded[-1] / base, 2),
        "p95_over_alone": round(tail / base, 2),
        # The tail against the tail: the rig's own jitter (the I/O and the engine share a core) is in both.
        "p95_over_alone_p95": round(tail / tail_alone, 2),
        # The forward's share of a round (Verdict.verify_seconds; the rest is the wire, the loop, and
        # waiting for a batch under way): where the jitter alone comes from.
        "alone_verify_ms": _median_p95_ms(verify_alone),
        "crowded_verify_ms": _median_p95_ms(verify_crowded),
        "rounds_crowded": len(crowded),
        "open_alone_ms": round(1000 * statistics.median(opens_alone), 1) if opens_alone else None,
        "opens_crowded": len(opens_crowded),
        "open_crowded_max_ms": round(1000 * max(opens_crowded), 1) if opens_crowded else None,
        "floods_s": round(prefill_s, 1),
        "flood_tokens": after.generated_tokens - before.generated_tokens - bystander_tokens,
        "engine_s": round(after.engine_seconds - before.engine_seconds, 1),
        **(
            {}
            if refused is None
            else {"refused": dict(refused), "opens_per_s": round(refused.total() / prefill_s)}
        ),
    }


def _median_p95_ms(seconds: list[float]) -> list[float]:
    return [round(1000 * statistics.median(seconds), 1), round(1000 * percentile(seconds, 0.95), 1)]


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--target", type=Path, default=SMOLLM2)
    p.add_argument("--prompt-tokens", type=int, default=5000)
    p.add_argument("--floods", type=int, default=2)
    p.add_argument("--pause-ms", type=float, default=20.0)
    p.add_argument("--alone-s", type=float, default=5.0)
    p.add_argument("--renew", type=int, default=50, help="the bystander's rounds a session")
    p.add_argument("--shares", default="0.5,0", help="the --prefill-share of each arm")
    p.add_argument("--prefill-s", help="each arm's --max-prefill-s instead (--prefill-share at its default)")
    p.add_argument("--min-prefill", help="each arm's --min-prefill-positions instead (1: a position a round)")
    p.add_argument("--serve-flags", default="", help="more serve flags for every arm ('--prefill-share 0.2')")
    p.add_argument("--verifier-cpu", type=int, default=1)
    p.add_argument("--thin", type=int, default=0, help="flood with this many unread thin sessions instead")
    p.add_argument("--thin-tokens", type=int, default=1000, help="new tokens each thin session asks for")
    p.add_argument("--thin-s", type=float, default=20.0, help="how long the thin sessions stay open")
    p.add_argument("--refused", type=int, default=0, help="flood with this many oversized opens instead")
    p.add_argument("--read-aheads", default="64,100000", help="with --thin: each arm's --thin-read-ahead")
    p.add_argument(
        "--refusal-limits", default="0,20", help="with --refused: each arm's --max-refused-opens-per-s"
    )
    p.add_argument(
        "--message-limits",
        help="with --refused: each arm's --max-message-bytes instead (auto: serve's default, the context's)",
    )
    args = p.parse_args(argv)
    os.sched_setaffinity(0, {1 - args.verifier_cpu})  # the bystander and floods: the other core
    results = {}
    flag, values = ("--prefill-share", args.shares)
    if args.thin:
        flag, values = "--thin-read-ahead", args.read_aheads
    elif args.refused and args.message_limits:
        flag, values = "--max-message-bytes", args.message_limits
    elif args.refused:
        flag, values = "--max-refused-opens-per-s", args.refusal_limits
    elif args.prefill_s:
        flag, values = "--max-prefill-s", args.prefill_s
    elif args.min_prefill:
        flag, values = "--min-prefill-positions", args.min_prefill
    for value in values.split(","):
        arm_flag = [] if value == "auto" else [flag, value]
        extra = ["--dtype", "float32", *arm_flag, "--prefix-cache-mb", "0", "--max-sessions", "512"]
        extra += ["--max-sessions-per-client", "512", "--client-kv-share", "1"]
        extra += shlex.split(args.serve_flags)
        with ServerProcess(args.target, *extra, cpus=(args.verifier_cpu,), timeout=300) as server:
            results[f"{flag} {value}"] = asyncio.run(arm(server.address, args))
        print(json.dumps({f"{flag} {value}": results[f"{flag} {value}"]}), flush=True)
    print(json.dumps({"prompt_tokens": args.prompt_tokens, "floods": args.floods, **results}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
