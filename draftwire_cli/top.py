"""`draftwire top HOST:PORT`: the live figures of a verifier or a pool's front, from GetStats, refreshed
in the terminal (rates over the last interval). `--once` prints one JSON snapshot instead."""

from __future__ import annotations

import asyncio
import sys
import time

from draftwire import jsonout, wire
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc


def snapshot(
    address: str, credentials: wire.ClientCredentials = wire.PLAINTEXT, timeout: float = 10
) -> pb.ServerStats:
    """The server's GetStats (an admin's token, where clients authenticate). Raises grpc.aio.AioRpcError."""

    async def ask() -> pb.ServerStats:
        async with wire.channel(address, credentials) as channel:
            return await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest(), timeout=timeout)

    return asyncio.run(ask())


def figures(now: pb.ServerStats, before: pb.ServerStats | None, seconds: float) -> dict:
    """What `top` shows: totals, and rates between two snapshots `seconds` apart."""
    before = before or pb.ServerStats()
    d = lambda name: getattr(now, name) - getattr(before, name)  # noqa: E731
    rate = lambda name: d(name) / seconds if seconds > 0 else 0.0  # noqa: E731
    return {
        "active_sessions": now.active_sessions,
        "sessions_opened": now.sessions_opened,
        "tokens_per_s": rate("generated_tokens"),
        "rounds_per_s": rate("rounds"),
        "acceptance": d("accepted_tokens") / d("draft_tokens") if d("draft_tokens") else 0.0,
        "tokens_per_round": d("generated_tokens") / d("rounds") if d("rounds") else 0.0,
        "mean_batch_size": d("engine_forwards") / d("engine_batches") if d("engine_batches") else 0.0,
        "engine_busy": rate("engine_seconds"),
        "target_positions_per_token": now.target_positions_per_token,
        "gamma_cap": now.gamma_cap,
        "prefill_computed": now.prefill_positions,
        "prefill_reused": now.reused_positions,
        "kept_caches": now.kept_caches,
        "cache_mib": now.cache_bytes / (1 << 20),
        "stale_proposals": now.stale_proposals,
        "plain_steps": now.plain_steps,
        "handoffs": now.handoffs,
        "refusals": dict(now.refusals),
    }


def render(address: str, f: dict) -> str:
    refusals = ", ".join(f"{k} {v}" for k, v in sorted(f["refusals"].items())) or "none"
    return "\n".join(
        [
            f"draftwire top {address}   {time.strftime('%H:%M:%S')}",
            f"sessions   active {f['active_sessions']:>5}   opened {f['sessions_opened']:>8}",
            f"tokens/s {f['tokens_per_s']:>8.1f}   rounds/s {f['rounds_per_s']:>7.1f}   "
            f"tokens/round {f['tokens_per_round']:>5.2f}   acceptance {f['acceptance']:>5.0%}",
            f"engine     busy {f['engine_busy']:>5.0%}   mean batch {f['mean_batch_size']:>5.1f}   "
            f"target positions/token {f['target_positions_per_token']:>5.2f}   γ cap {f['gamma_cap']:>3}",
            f"prefill    computed {f['prefill_computed']:>8}   reused {f['prefill_reused']:>8}   "
            f"kept caches {f['kept_caches']:>4}   KV {f['cache_mib']:>8.1f} MiB",
            f"speculation off   plain steps {f['plain_steps']:>8}   hand-offs {f['handoffs']:>6}   "
            f"stale {f['stale_proposals']:>8}",
            f"refusals {refusals}",
        ]
    )


def run(
    address: str, interval: float, once: bool, credentials: wire.ClientCredentials = wire.PLAINTEXT
) -> int:
    before, then = None, time.monotonic()
    if once:
        print(jsonout.dumps(figures(snapshot(address, credentials), None, 0.0)))
        return 0
    while True:
        now, at = snapshot(address, credentials), time.monotonic()
        text = render(address, figures(now, before, at - then if before is not None else 0.0))
        sys.stdout.write("\x1b[2J\x1b[H" + text + "\n" if sys.stdout.isatty() else text + "\n\n")
        sys.stdout.flush()
        before, then = now, at
        time.sleep(interval)
