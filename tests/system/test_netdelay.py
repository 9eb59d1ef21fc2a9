"""The delaying proxy delays what it claims; a dropped connection is resumed with no token lost."""

import asyncio
import time

import grpc
import pytest

from draftwire import wire
from draftwire.contract import SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats
from tools.rig.certs import make_certs
from tools.rig.netdelay import DelayConfig, DelayProxy
from verifier_service.auth import TlsConfig
from verifier_service.engine import TargetEngine
from verifier_service.servicer import ServerConfig, start_server
from verifier_service.session import reference_decode


async def best_rtt_ms(address: str, n: int = 15) -> float:
    async with grpc.aio.insecure_channel(address) as channel:
        stub = pb_grpc.VerifierStub(channel)
        await stub.GetStats(pb.StatsRequest())  # connect first
        times = []
        for _ in range(n):
            start = time.perf_counter()
            await stub.GetStats(pb.StatsRequest())
            times.append(1000 * (time.perf_counter() - start))
        # The fastest of several: what the path costs, without the machine's scheduling hiccups.
        return min(times)


@pytest.mark.parametrize("rtt_ms", [10, 30])
def test_proxy_adds_the_round_trip_time_it_claims(server, rtt_ms):
    host, port = server.address.rsplit(":", 1)

    async def measure():
        direct = await best_rtt_ms(server.address)
        async with DelayProxy(DelayConfig(host, int(port), rtt_ms / 1000)) as proxy:
            delayed = await best_rtt_ms(proxy.address)
            return direct, delayed, proxy.bytes_up, proxy.bytes_down

    direct, delayed, up, down = asyncio.run(measure())
    assert rtt_ms - 1 <= delayed - direct <= rtt_ms + max(5, 0.2 * rtt_ms), (direct, delayed)
    assert up > 0 and down > 0


PROMPT = (11, 22, 33, 44, 55)
NEW_TOKENS = 40


@pytest.fixture(scope="module")
def undisturbed(test_pair) -> tuple[TargetEngine, list[int]]:
    """The target (float32) and its own tokens for PROMPT."""
    engine = TargetEngine.load(test_pair.target_dir, dtype="float32")
    spec = SessionSpec(PROMPT, max_new_tokens=NEW_TOKENS, ignore_eos=True)
    return engine, reference_decode(engine, spec)


async def generate_through(
    proxy: DelayProxy, credentials, drafter, fault
) -> tuple[list[int], GenerationStats]:
    """Generates PROMPT through `proxy`, calling `fault(proxy)` once the third chunk of tokens arrived."""
    async with wire.channel(proxy.address, credentials) as channel:
        stats, committed, chunks = GenerationStats(), [], 0
        request = GenerationRequest(PROMPT, max_new_tokens=NEW_TOKENS, gamma=3, ignore_eos=True)
        async for _ in EdgeSession(channel, drafter).generate(request, stats, committed):
            chunks += 1
            if chunks == 3:
                fault(proxy)
        return committed, stats


def test_dropped_connection_resumes_with_every_committed_token(server, test_pair, undisturbed):
    host, port = server.address.rsplit(":", 1)
    drafter = LlamaDrafter(DrafterConfig(test_pair.draft_q4_0, n_ctx=256))

    async def run():
        async with DelayProxy(DelayConfig(host, int(port), 0.002)) as proxy:
            return await generate_through(proxy, wire.PLAINTEXT, drafter, DelayProxy.drop)

    committed, stats = asyncio.run(run())
    assert stats.resumes >= 1
    assert committed == undisturbed[1]


def test_a_tls_connection_corrupted_in_flight_resumes_with_every_committed_token(
    test_pair, tmp_path, undisturbed
):
    """A bit flipped on the wire fails TLS's record check and kills the connection; the edge resumes
    like after any other loss (not an UNKNOWN that ends the generation), with the target's exact tokens."""
    engine, expected = undisturbed
    certs = make_certs(tmp_path / "certs", clients=())
    drafter = LlamaDrafter(DrafterConfig(test_pair.draft_q4_0, n_ctx=256))
    tls = TlsConfig.from_files(certs.cert("server"), certs.key("server"))
    credentials = wire.ClientCredentials(tls=True, ca=certs.ca().read_bytes())

    async def run():
        server, port = await start_server(engine, ServerConfig(port=0, tls=tls))
        try:
            async with DelayProxy(DelayConfig("127.0.0.1", port, 0.002)) as proxy:
                return await generate_through(proxy, credentials, drafter, DelayProxy.corrupt)
        finally:
            await server.stop(None)

    committed, stats = asyncio.run(run())
    assert stats.resumes >= 1
    assert committed == expected
