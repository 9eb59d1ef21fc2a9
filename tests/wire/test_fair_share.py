"""Fair shares on an in-process verifier at its default limits (the fake engine): a client flooding it,
by token or anonymously from many connections, holds its share and is refused with a retry hint, while a
bystander opens at once; a full verifier ends an idle session of a client over its fair share to let a
newcomer in, and says so with the session's committed tokens. The probe's scenarios (issue 55)."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from tests.bad_input_cases import START, plain_open, proposal, retry_hint
from tools.testkit.fakes import FakeEngine, fake_info
from tools.testkit.inprocess import InProcessServer
from verifier_service.admission import AdmissionConfig
from verifier_service.auth import AuthConfig
from verifier_service.servicer import ServerConfig, VerifierLimits

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
DEFAULT_CAP = AdmissionConfig().max_sessions  # 256
# The guarantee docs/security.md states is 2 s (measured: milliseconds); asserted generously, so that a busy
# machine does not fail it (before the fix the bystander was refused, not slow).
BYSTANDER_S = 10.0


def engine() -> FakeEngine:
    return FakeEngine(fake_info(vocab=1000, max_context=512))


def connection(address: str) -> grpc.aio.Channel:
    """A channel on a TCP connection of its own."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


async def open_session(channel, token: str | None = None):
    """A session opened and held (its call), or the AioRpcError of its refusal."""
    metadata = (("authorization", f"Bearer {token}"),) if token else None
    call = pb_grpc.VerifierStub(channel).Session(metadata=metadata)
    await call.write(plain_open(max_new=16))
    try:
        assert (await call.read()).WhichOneof("kind") == "opened"
    except grpc.aio.AioRpcError as e:
        return e
    return call


async def flood(channels: list, token: str | None = None, attempts: int = DEFAULT_CAP + 16):
    """Opens as many sessions as the verifier takes, round robin over `channels`: (held, refusals)."""
    results = await asyncio.gather(
        *(open_session(channels[i % len(channels)], token) for i in range(attempts))
    )
    held = [r for r in results if not isinstance(r, grpc.aio.AioRpcError)]
    return held, [r for r in results if isinstance(r, grpc.aio.AioRpcError)]


async def bystander(address: str, token: str | None = None):
    """How long the bystander's open took, and what it got."""
    async with connection(address) as channel:
        start = time.monotonic()
        result = await open_session(channel, token)
        took = time.monotonic() - start
        if not isinstance(result, grpc.aio.AioRpcError):
            result.cancel()
        return took, result


def check_refusals(refusals: list, client: str) -> None:
    assert refusals, "the flooding client was never refused"
    shares = [
        r for r in refusals if r.code() == EXHAUSTED and f"{client!r} holds its maximum of 64" in r.details()
    ]
    assert shares, refusals[0].details()
    assert all(r.code() == EXHAUSTED and retry_hint(r) > 0 for r in refusals)


def test_a_client_by_token_holds_its_share_and_a_bystander_opens(tmp_path):
    tokens = tmp_path / "tokens"
    tokens.write_text("flood flood-token\nbystander bystander-token\n")
    config = ServerConfig(port=0, limits=VerifierLimits(max_gamma=8), auth=AuthConfig(tokens_file=tokens))

    async def run(address):
        async with connection(address) as channel:
            held, refusals = await flood([channel], "flood-token")
            took, result = await bystander(address, "bystander-token")
            for call in held:
                call.cancel()
            return held, refusals, took, result

    with InProcessServer(engine(), config) as srv:
        held, refusals, took, result = asyncio.run(run(srv.address))
    assert len(held) == DEFAULT_CAP // 4  # a quarter of the default 256, not every slot
    check_refusals(refusals, "flood")
    assert not isinstance(result, grpc.aio.AioRpcError), result.details()
    assert took < BYSTANDER_S


def test_an_anonymous_host_on_many_connections_holds_one_share_and_another_host_opens():
    """The flooder comes from ::1 on 30 connections, the bystander from 127.0.0.1 (a dual-stack server):
    two peer addresses, two clients."""
    config = ServerConfig(host="[::]", port=0, limits=VerifierLimits(max_gamma=8))

    async def run(port):
        channels = [connection(f"[::1]:{port}") for _ in range(30)]
        try:
            held, refusals = await flood(channels)
            took, result = await bystander(f"127.0.0.1:{port}")
            for call in held:
                call.cancel()
        finally:
            for channel in channels:
                await channel.close()
        return held, refusals, took, result

    with InProcessServer(engine(), config) as srv:
        held, refusals, took, result = asyncio.run(run(srv.port))
    assert len(held) == DEFAULT_CAP // 4
    check_refusals(refusals, "#address ipv6:[::1]")
    assert not isinstance(result, grpc.aio.AioRpcError), result.details()
    assert took < BYSTANDER_S


def test_a_full_verifier_ends_an_idle_session_of_a_client_over_its_fair_share(tmp_path):
    """No per-client cap, 4 sessions: one client holds all 4, idle after a round each. A newcomer is let
    in, and the longest idle of those sessions ends UNAVAILABLE (the edge resumes) saying why and with
    its committed tokens; the others go on."""
    tokens = tmp_path / "tokens"
    tokens.write_text("flood flood-token\nbystander bystander-token\n")
    admission = AdmissionConfig(max_sessions=4, max_sessions_per_client=0, preempt_idle_s=0.3)
    config = ServerConfig(
        port=0, limits=VerifierLimits(max_gamma=8), auth=AuthConfig(tokens_file=tokens), admission=admission
    )

    async def run(address):
        async with connection(address) as channel:
            held = [await open_session(channel, "flood-token") for _ in range(4)]
            for call in held:
                await call.write(proposal(1, START, []))
                assert (await call.read()).WhichOneof("kind") == "verdict"
            refused = await open_session(channel, "flood-token")  # over its share: no preemption
            await asyncio.sleep(0.5)  # the flood's sessions idle past preempt_idle_s
            took, result = await bystander(address, "bystander-token")
            ended = []
            for call in held:
                try:
                    await asyncio.wait_for(call.read(), 0.5)
                except grpc.aio.AioRpcError as e:
                    ended.append(e)
                except TimeoutError:
                    pass
                call.cancel()
            return refused, took, result, ended

    with InProcessServer(engine(), config) as srv:
        refused, took, result, ended = asyncio.run(run(srv.address))
        preempted = srv.server.servicer.verifier.preempted_sessions
    assert refused.code() == EXHAUSTED and "maximum of 4 sessions" in refused.details()
    assert not isinstance(result, grpc.aio.AioRpcError), result.details()
    assert took < BYSTANDER_S
    assert preempted == 1 and len(ended) == 1
    assert ended[0].code() == grpc.StatusCode.UNAVAILABLE
    assert "fair share" in ended[0].details() and "(1 generated tokens committed)" in ended[0].details()


@pytest.mark.parametrize("preempt_idle_s", [0.0])
def test_no_preemption_when_it_is_off(preempt_idle_s):
    admission = AdmissionConfig(max_sessions=2, max_sessions_per_client=0, preempt_idle_s=preempt_idle_s)
    config = ServerConfig(host="[::]", port=0, limits=VerifierLimits(max_gamma=8), admission=admission)

    async def run(port):
        async with connection(f"[::1]:{port}") as channel:
            held = [await open_session(channel) for _ in range(2)]
            await asyncio.sleep(0.2)
            took, result = await bystander(f"127.0.0.1:{port}")
            for call in held:
                call.cancel()
            return result

    with InProcessServer(engine(), config) as srv:
        result = asyncio.run(run(srv.port))
    assert result.code() == EXHAUSTED and "maximum of 2 sessions" in result.details()
