"""Limits on a real `serve`: caps and the KV budget refuse with RESOURCE_EXHAUSTED and a retry hint,
idle sessions end and free their cache, stale floods end, unbounded fields are refused."""

import asyncio
import time

import grpc
import pytest

from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from tests.bad_input_cases import opened, plain_open, retry_hint
from tools.rig.serverproc import ServerProcess
from verifier_service.engine import TargetEngine

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
PROMPT = [5, 60, 70, 80]
IDLE_S = 2.0


@pytest.fixture(scope="module")
def bytes_per_position(test_pair) -> int:
    return TargetEngine.load(test_pair.target_dir, dtype="float32").bytes_per_position


@pytest.fixture(scope="module")
def limited(test_pair, bytes_per_position):
    """Two sessions at most (one client may hold both); a KV budget of 100 positions; idle sessions end
    after IDLE_S; no kept caches."""
    budget_mb = 100 * bytes_per_position / (1 << 20)
    args = [
        "--dtype",
        "float32",
        "--max-sessions",
        "2",
        "--max-sessions-per-client",
        "0",
        "--kv-budget-mb",
        f"{budget_mb}",
        "--client-kv-share",
        "1",
    ]
    args += ["--idle-timeout-s", str(IDLE_S), "--max-stale-per-s", "5"]
    args += ["--prefix-cache-mb", "0"]  # a freed cache is gone, not kept for a next turn
    with ServerProcess(test_pair.target_dir, *args) as server:
        yield server


@pytest.fixture(scope="module")
def per_client(test_pair):
    with ServerProcess(
        test_pair.target_dir, "--dtype", "float32", "--max-sessions-per-client", "1"
    ) as server:
        yield server


async def stats(channel) -> pb.ServerStats:
    return await pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())


async def settle(channel, active: int) -> pb.ServerStats:
    for _ in range(100):
        if (s := await stats(channel)).active_sessions == active:
            return s
        await asyncio.sleep(0.05)
    return await stats(channel)


def test_the_global_cap_refuses_the_third_and_a_release_makes_room(limited):
    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            first, second = await opened(channel), await opened(channel)
            third = await opened(channel)
            first.cancel()
            await settle(channel, 1)
            fourth = await opened(channel)
            for call in (second, fourth):
                call.cancel()
            return first, second, third, fourth

    first, second, third, fourth = asyncio.run(scenario())
    assert isinstance(third, grpc.aio.AioRpcError) and third.code() == EXHAUSTED
    assert "maximum of 2 sessions" in third.details() and retry_hint(third) > 0
    assert not isinstance(fourth, grpc.aio.AioRpcError)


def test_the_per_client_cap_refuses_a_second_session(per_client):
    async def scenario():
        async with grpc.aio.insecure_channel(per_client.address) as channel:
            first, second = await opened(channel), await opened(channel)
            first.cancel()
            return second

    second = asyncio.run(scenario())
    assert isinstance(second, grpc.aio.AioRpcError) and second.code() == EXHAUSTED
    assert "holds its maximum of 1" in second.details() and retry_hint(second) > 0


def test_a_session_past_the_kv_budget_is_refused_not_run(limited):
    """60 + 60 positions do not fit a budget of 100: the second open is refused before its prefill."""

    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            await settle(channel, 0)
            first = await opened(channel, max_new=56)
            before = await stats(channel)
            second = await opened(channel, max_new=56)
            after = await stats(channel)
            small = await opened(channel, max_new=8)
            for call in (first, small):
                call.cancel()
            return second, before, after, small

    second, before, after, small = asyncio.run(scenario())
    assert isinstance(second, grpc.aio.AioRpcError) and second.code() == EXHAUSTED
    assert "KV cache" in second.details() and retry_hint(second) > 0
    assert after.prefill_positions == before.prefill_positions  # no work for the refused open
    assert not isinstance(small, grpc.aio.AioRpcError)


def test_an_idle_session_ends_with_deadline_exceeded_and_frees_its_cache(limited):
    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            await settle(channel, 0)
            call = await opened(channel, max_new=32)
            await call.write(
                pb.EdgeMessage(proposal=pb.Proposal(round=1, start_position=4, draft_token_ids=[1]))
            )
            assert (await call.read()).WhichOneof("kind") == "verdict"
            during = await stats(channel)
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call.read()
            waited = time.monotonic() - start
            return during, error.value, waited, await settle(channel, 0)

    during, error, waited, after = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "freed" in error.details()
    assert IDLE_S - 0.2 <= waited <= IDLE_S + 3
    assert during.active_sessions == 1 and during.cache_bytes > 0
    assert after.active_sessions == 0 and after.cache_bytes < during.cache_bytes


def test_a_stale_flood_ends_the_session(limited):
    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            await settle(channel, 0)
            stale = [
                pb.EdgeMessage(proposal=pb.Proposal(round=r, start_position=99, draft_token_ids=[1]))
                for r in range(1, 40)
            ]
            call = pb_grpc.VerifierStub(channel).Session(iter([plain_open(), *stale]))
            replies = []
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for reply in call:
                    replies.append(reply)
            return replies, error.value

    replies, error = asyncio.run(scenario())
    assert error.code() == EXHAUSTED and "stale proposals" in error.details()
    assert sum(r.WhichOneof("kind") == "verdict" for r in replies) == 5


def test_unbounded_stop_ids_are_refused(limited):
    async def scenario():
        async with grpc.aio.insecure_channel(limited.address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(plain_open(stop=list(range(300)) * 100))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call.read()
            return error.value

    error = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT and "stop token ids" in error.details()


def rss_mb(pid: int) -> int:
    status = open(f"/proc/{pid}/status").read()
    return int(status.split("VmRSS:")[1].split()[0]) >> 10


def test_refused_large_opens_do_not_stay_in_memory(test_pair):
    """Opens of 200,000 out-of-vocabulary ids (about 8 MB each as Python ints) are refused; the server's
    memory levels off instead of keeping every refused request (it grew by 1.1 GB per 200 before)."""
    bad = pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=[10**6] * 200_000))

    async def refusals(address: str, n: int) -> set:
        options = [("grpc.max_send_message_length", 8 << 20)]
        async with grpc.aio.insecure_channel(address, options=options) as channel:
            stub = pb_grpc.VerifierStub(channel)

            async def one():
                try:
                    async for _ in stub.Session(iter([bad])):
                        pass
                except grpc.aio.AioRpcError as e:
                    return e.code()

            codes = set()
            for _ in range(n // 40):
                codes |= set(await asyncio.gather(*(one() for _ in range(40))))
            return codes

    # Every open parsed and refused (none refused unread: that path is tests/wire's). The default
    # message limit follows the context and would have gRPC refuse these from their length, unparsed
    # (tests/wire): 1 MiB lets them reach the parser, whose memory this test is about.
    flags = ("--dtype", "float32", "--max-refused-opens-per-s", "0", "--max-message-bytes", str(1 << 20))
    with ServerProcess(test_pair.target_dir, *flags) as server:
        warm = asyncio.run(refusals(server.address, 80))
        before = rss_mb(server.proc.pid)
        codes = asyncio.run(refusals(server.address, 160))
        after = rss_mb(server.proc.pid)
    assert warm == codes == {grpc.StatusCode.INVALID_ARGUMENT}
    assert after - before < 250, (before, after)


def test_an_invalid_open_is_told_so_and_spends_no_slot(per_client):
    """With the client's one slot taken, an open with an empty prompt still gets INVALID_ARGUMENT: the
    spec is checked before admission, and a refused open holds nothing."""

    async def scenario():
        async with grpc.aio.insecure_channel(per_client.address) as channel:
            await settle(channel, 0)
            held = await opened(channel)
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=[])))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call.read()
            held.cancel()
            await settle(channel, 0)
            return error.value, await opened(channel)

    error, after = asyncio.run(scenario())
    assert error.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not isinstance(after, grpc.aio.AioRpcError)  # the slot was free again


def test_a_run_of_stale_proposals_ends_the_session(per_client):
    """By default: 64 stale proposals in a row are answered (a pipelined edge makes at most its depth
    stale per rejected draft), the 65th ends the session."""

    async def scenario():
        async with grpc.aio.insecure_channel(per_client.address) as channel:
            await settle(channel, 0)
            stale = [
                pb.EdgeMessage(proposal=pb.Proposal(round=r, start_position=99, draft_token_ids=[1]))
                for r in range(1, 100)
            ]
            call = pb_grpc.VerifierStub(channel).Session(iter([plain_open(), *stale]))
            replies = []
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for reply in call:
                    replies.append(reply)
            return replies, error.value

    replies, error = asyncio.run(scenario())
    assert error.code() == EXHAUSTED and "in a row" in error.details()
    assert sum(r.WhichOneof("kind") == "verdict" for r in replies) == 64
