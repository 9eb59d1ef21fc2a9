"""Graceful drain on a real `serve`: SIGTERM stops admitting (health NOT_SERVING, opens UNAVAILABLE),
running sessions finish; those still running at the drain timeout end with UNAVAILABLE, and their
edges resume on another verifier to exactly the undisturbed output."""

import asyncio
import signal

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from draftwire.contract import SessionSpec
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.drafter import DrafterConfig, LlamaDrafter
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats
from tools.rig.serverproc import ServerProcess
from tools.testkit.fakes import Paced
from verifier_service.engine import TargetEngine
from verifier_service.session import reference_decode

PROMPT = (5, 60, 70, 80)
NEW = 40
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING


@pytest.fixture(scope="module")
def drafter(test_pair):
    return LlamaDrafter(DrafterConfig(test_pair.draft_q4_0, n_ctx=512))


@pytest.fixture(scope="module")
def expected(test_pair) -> list[int]:
    engine = TargetEngine.load(test_pair.target_dir, dtype="float32")
    return reference_decode(engine, SessionSpec(PROMPT, max_new_tokens=NEW, ignore_eos=True))


def request() -> GenerationRequest:
    return GenerationRequest(PROMPT, max_new_tokens=NEW, gamma=2, ignore_eos=True)


async def health(address: str) -> int:
    async with grpc.aio.insecure_channel(address) as channel:
        reply = await health_pb2_grpc.HealthStub(channel).Check(health_pb2.HealthCheckRequest(), timeout=5)
        return reply.status


async def open_refusal(address: str) -> grpc.aio.AioRpcError | None:
    open_msg = pb.OpenSession(prompt_token_ids=PROMPT, stop=pb.StopConditions(max_new_tokens=4))
    async with grpc.aio.insecure_channel(address) as channel:
        call = pb_grpc.VerifierStub(channel).Session(iter([pb.EdgeMessage(open=open_msg)]))
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e
    return None


async def generate_until_signalled(address, drafter, server: ServerProcess, delay_s: float, during):
    """A paced generation on `address`; once it committed a few tokens, SIGTERM to `server`, then
    `during()`. Returns (ids, stats, what during returned)."""
    ids, stats = [], GenerationStats()
    async with grpc.aio.insecure_channel(address) as channel:
        session = EdgeSession(channel, Paced(drafter, delay_s))
        task = asyncio.create_task(_drain(session.generate(request(), stats, ids)))
        while len(ids) < 4:
            await asyncio.sleep(0.01)
        server.proc.send_signal(signal.SIGTERM)
        seen = await during()
        await task
    return ids, stats, seen


async def _drain(stream) -> None:
    async for _ in stream:
        pass


def test_sigterm_stops_admitting_and_lets_a_running_session_finish(test_pair, drafter, expected):
    server = ServerProcess(test_pair.target_dir, "--dtype", "float32", "--drain-timeout-s", "60")

    async def during():
        await asyncio.sleep(0.2)
        return await health(server.address), await open_refusal(server.address)

    try:
        ids, stats, (status, refusal) = asyncio.run(
            generate_until_signalled(server.address, drafter, server, 0.05, during)
        )
        code = server.proc.wait(timeout=30)
    finally:
        server.stop()
    assert status == NOT_SERVING
    assert refusal is not None and refusal.code() == grpc.StatusCode.UNAVAILABLE
    assert "resume elsewhere" in refusal.details()
    assert ids == expected and stats.resumes == 0  # finished on the draining verifier
    assert code == 0


def test_past_the_drain_timeout_the_edge_resumes_on_another_verifier(test_pair, drafter, expected):
    first = ServerProcess(test_pair.target_dir, "--dtype", "float32", "--drain-timeout-s", "0.5")
    second = ServerProcess(test_pair.target_dir, "--dtype", "float32")

    async def during():
        return None

    try:
        # One channel over both addresses (pick_first): the first until it goes away, then the second.
        both = f"ipv4:{first.address},{second.address}"
        ids, stats, _ = asyncio.run(generate_until_signalled(both, drafter, first, 0.15, during))

        async def opened_on_second():
            async with grpc.aio.insecure_channel(second.address) as channel:
                return (await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())).sessions_opened

        resumed_there = asyncio.run(opened_on_second())
        code = first.proc.wait(timeout=30)
    finally:
        first.stop()
        second.stop()
    assert ids == expected  # every committed token kept, none repeated
    assert stats.resumes >= 1 and resumed_there >= 1
    assert code == 0
