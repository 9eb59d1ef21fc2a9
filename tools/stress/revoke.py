"""Time to revoke: how long a revoked token's open sessions keep running on a verifier, and how soon a
broken token file refuses new sessions, with the default recheck interval.

    python -m tools.stress.revoke [--sessions 20] [--repeats 10] [--recheck-s 1]

An in-process verifier (TLS, a token file; the fake engine: revocation does not depend on the model)
holds `--sessions` open sessions of one client. The file is then rewritten without that client (a new
file renamed over the old one) at a random moment of the recheck cycle, and the seconds until each
session's stream ends with UNAUTHENTICATED are recorded. Then the file is made unparseable, and the
seconds until a new session is refused (UNAVAILABLE). Prints min, median and max over every session of
every repeat, as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import grpc

from draftwire import wire
from draftwire.contract import SamplingParams, SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from tools.rig.certs import make_certs
from tools.testkit.fakes import FakeEngine
from verifier_service.auth import AuthConfig, TlsConfig
from verifier_service.lifecycle import LifetimeConfig
from verifier_service.servicer import ServerConfig, start_server

TOKENS = "alice alice-token\nops ops-token admin\n"
SPEC = SessionSpec((5, 17, 42), SamplingParams(), 200, ignore_eos=True)


def _replace(path: Path, text: str) -> None:
    new = path.with_suffix(".new")
    new.write_text(text)
    new.replace(path)


async def _ended(call, start_box: list[float]) -> tuple[str, float]:
    """Waits, sending nothing, for the stream's end: its status and the seconds since the revocation."""
    try:
        while await call.read() is not grpc.aio.EOF:
            pass
        code = "OK"
    except grpc.aio.AioRpcError as e:
        code = e.code().name
    return code, time.monotonic() - start_box[0]


async def one_revocation(address: str, credentials, sessions: int, tokens: Path, recheck_s: float) -> list:
    async with wire.channel(address, credentials) as channel:
        calls = []
        for _ in range(sessions):
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(pb.EdgeMessage(open=wire.spec_to_proto(SPEC)))
            assert (await call.read()).WhichOneof("kind") == "opened"
            calls.append(call)
        await asyncio.sleep(random.uniform(0, recheck_s))  # any moment of the recheck cycle
        start = [time.monotonic()]
        waits = [asyncio.create_task(_ended(call, start)) for call in calls]
        _replace(tokens, TOKENS.replace("alice alice-token", "# alice revoked"))
        start[0] = time.monotonic()
        results = await asyncio.gather(*waits)
        _replace(tokens, TOKENS)
        return results


async def broken_file(address: str, credentials, tokens: Path) -> float:
    """Seconds from a token file that no longer parses to the refusal of a new session."""
    _replace(tokens, "alice\n")  # a name without a token: the file does not parse
    start = time.monotonic()
    async with wire.channel(address, credentials) as channel:
        while True:
            try:
                await pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest(), timeout=10)
            except grpc.aio.AioRpcError as e:
                assert e.code() == grpc.StatusCode.UNAVAILABLE, e
                took = time.monotonic() - start
                break
            await asyncio.sleep(0.001)
    _replace(tokens, TOKENS)
    return took


async def run(args) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        certs = make_certs(Path(tmp) / "certs")
        tokens = Path(tmp) / "tokens"
        tokens.write_text(TOKENS)
        config = ServerConfig(
            "127.0.0.1",
            0,
            tls=TlsConfig.from_files(certs.cert("server"), certs.key("server")),
            auth=AuthConfig(tokens_file=tokens),
            lifetime=LifetimeConfig(recheck_s=args.recheck_s),
        )
        server, port = await start_server(FakeEngine(), config)
        address = f"127.0.0.1:{port}"
        alice = wire.ClientCredentials.from_files(certs.ca(), None, None, "alice-token")
        try:
            ends = []
            for _ in range(args.repeats):
                ends += await one_revocation(address, alice, args.sessions, tokens, args.recheck_s)
                await asyncio.sleep(2 * args.recheck_s)  # the re-admitted file settles
            broken = [await broken_file(address, alice, tokens) for _ in range(args.repeats)]
        finally:
            await server.stop(0)
    seconds = sorted(s for _, s in ends)
    return {
        "recheck_s": args.recheck_s,
        "sessions_revoked": len(ends),
        "codes": sorted({code for code, _ in ends}),
        "revoked_to_end_s": {
            "min": round(seconds[0], 3),
            "median": round(statistics.median(seconds), 3),
            "max": round(seconds[-1], 3),
        },
        "broken_file_to_refusal_s": {
            "median": round(statistics.median(broken), 4),
            "max": round(max(broken), 4),
        },
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--sessions", type=int, default=20)
    p.add_argument("--repeats", type=int, default=10)
    p.add_argument("--recheck-s", type=float, default=1.0, help="serve's recheck interval (the default)")
    print(json.dumps(asyncio.run(run(p.parse_args(argv))), indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
