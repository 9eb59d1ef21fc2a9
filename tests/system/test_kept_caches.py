"""Kept caches are private, on an in-process verifier over the demo target (the fake engine keeps no
caches): an anonymous caller reuses only its own connection's, a token's owner only its own."""

import asyncio
from pathlib import Path

import pytest

from draftwire import wire
from draftwire.contract import SamplingParams, SessionSpec
from tests.wire.test_revocation import TOKENS, Stream, config, connection, creds
from tools.rig.certs import make_certs
from verifier_service.servicer import ServerConfig, start_server

DEMO = Path(__file__).resolve().parents[2] / "models" / "demo"


@pytest.fixture(scope="module")
def certs(tmp_path_factory):
    return make_certs(tmp_path_factory.mktemp("certs"), clients=("alice",))


@pytest.fixture(scope="module")
def demo_engine():
    from verifier_service.engine import TargetEngine

    return TargetEngine.load(DEMO / "target")


def test_kept_caches_serve_their_own_client_and_anonymous_callers_none(demo_engine, certs, tmp_path):
    """Without credentials callers cannot be told apart: an anonymous caller reuses only the caches of
    its own connection, so `reused_positions` says nothing of what others sent. With tokens, only the
    owner reuses, on any connection."""
    prompt = (300, 301, 302, 61, 62, 63, 64, 65)
    spec = SessionSpec(prompt, SamplingParams(), 4, ignore_eos=True)

    async def turns(address: str, credentials, n: int = 1) -> list[int]:
        """The reused positions of `n` opens of the prompt, one after another on one connection."""
        reused = []
        async with connection(address, credentials) as channel:
            for _ in range(n):
                stream = Stream(channel, spec)
                reused.append((await stream.open()).reused_positions)
                stream.call.cancel()
                await asyncio.sleep(0.2)  # the cache is released (and kept, where it may be)
        return reused

    async def turn(address: str, credentials) -> int:
        return (await turns(address, credentials))[0]

    async def run():
        server, port = await start_server(demo_engine, ServerConfig("127.0.0.1", 0))
        address = f"127.0.0.1:{port}"
        try:
            assert [await turn(address, wire.PLAINTEXT) for _ in range(3)] == [0, 0, 0]
            # On one connection, a conversation's next turn still finds its last turn's cache.
            first, second = await turns(address, wire.PLAINTEXT, 2)
            assert first == 0 and second == len(prompt) - 1
        finally:
            await server.stop(None)
        tokens = tmp_path / "tokens"
        tokens.write_text(TOKENS)
        server, port = await start_server(demo_engine, config(certs, tokens))
        address = f"127.0.0.1:{port}"
        try:
            assert await turn(address, creds(certs, "alice-token")) == 0
            assert await turn(address, creds(certs, "bob-token")) == 0  # alice's cache is not bob's
            assert await turn(address, creds(certs, "alice-token")) > 0
        finally:
            await server.stop(None)

    asyncio.run(run())
