"""The verifier's own server, in process over the fake engine: every bad input gets its status and the
server survives it, caps and the KV budget refuse with a retry hint, idle and flooding sessions end, the
drain refuses opens and then cuts, thin sessions stay within their read-ahead. The same server code as
`serve`; the subprocess versions with a real model (test_bad_input, test_limits, test_drain, test_thin)
are the real-parts check of the thorough tier."""

from __future__ import annotations

import asyncio
import time

import grpc
import pytest

from draftwire import wire
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from tests.bad_input_cases import (
    CASES,
    INVALID,
    PROMPT,
    START,
    exchange,
    open_msg,
    opened,
    plain_open,
    proposal,
    refused,
    retry_hint,
)
from tools.testkit.fakes import FakeEngine, fake_info, successor
from tools.testkit.inprocess import InProcessServer
from verifier_service.admission import AdmissionConfig
from verifier_service.batcher import CALIBRATION_KEY, BatchConfig
from verifier_service.lifecycle import LifetimeConfig
from verifier_service.servicer import ServerConfig, VerifierLimits

EXHAUSTED = grpc.StatusCode.RESOURCE_EXHAUSTED
VOCAB, CONTEXT = 1000, 512


def engine() -> FakeEngine:
    return FakeEngine(fake_info(vocab=VOCAB, max_context=CONTEXT))


def config(**kw) -> ServerConfig:
    return ServerConfig(port=0, limits=VerifierLimits(max_gamma=8), **kw)


@pytest.fixture(scope="module")
def server():
    with InProcessServer(engine(), config()) as srv:
        yield srv


@pytest.fixture(scope="module")
def info(server) -> pb.ModelInfo:
    with grpc.insecure_channel(server.address) as channel:
        return pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest())


@pytest.mark.parametrize("build, code, pattern", CASES)
def test_bad_input_is_refused_and_the_server_survives(server, info, build, code, pattern):
    refused(server.address, build(info), code, pattern)
    assert server.healthy()


def test_an_oversize_message_is_resource_exhausted(server, info):
    huge = open_msg(info, prompt=[300] * 700_000)  # 2 bytes an id: 1.4 MB, over the 1 MiB limit
    refused(server.address, [huge], EXHAUSTED, "")
    assert server.healthy()


def test_the_message_limit_is_what_the_context_needs(server, info):
    """By default a verifier takes the largest open its context holds (every id at its longest, 5 bytes,
    and 64 KiB for the rest), stated in its model info. An open far over the context is refused by gRPC
    from its length (RESOURCE_EXHAUSTED), before Python parses it; the 1 MiB limit before let a 750 KB
    one through to the parser (INVALID_ARGUMENT), which took the engine's core (docs/limits.md)."""
    assert info.max_message_bytes == wire.message_bytes_for(info.max_context) < wire.MAX_MESSAGE_BYTES
    over = open_msg(info, prompt=[300] * (info.max_message_bytes // 2))  # 2 bytes an id
    refused(server.address, [over], EXHAUSTED, "")
    # A whole context of the longest ids fits: it reaches the parser, which refuses its ids.
    longest = open_msg(info, prompt=[(1 << 32) - 1] * info.max_context)
    assert longest.ByteSize() > info.max_message_bytes - wire.MESSAGE_SLACK
    refused(server.address, [longest], INVALID, "")
    assert server.healthy()


def test_bytes_that_are_no_message_are_invalid_argument(server):
    async def run():
        async with grpc.aio.insecure_channel(server.address) as channel:
            call = channel.stream_stream("/draftwire.v1.Verifier/Session")(iter([b"\xff\xff\xff"]))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                async for _ in call:
                    pass
            return error.value

    error = asyncio.run(run())
    assert error.code() == INVALID and "not an EdgeMessage" in error.details()


def committed_after(replies, draft_by_round) -> list[int]:
    committed = list(PROMPT)
    for reply in replies:
        if reply.WhichOneof("kind") == "verdict":
            v = reply.verdict
            committed += list(draft_by_round[v.round][: v.accepted]) + [v.target_token_id]
    return committed


def test_committed_tokens_survive_a_refused_proposal_and_the_session_resumes(server, info):
    """Two good rounds, then an out-of-order proposal ends the stream; a new session opened with the
    committed tokens goes on to exactly the target's own continuation."""
    expected = PROMPT + continuation(PROMPT, 12)
    drafts = {1: expected[4:7], 2: [expected[8], 999]}  # all accepted, then one of two
    messages = [open_msg(info, max_new=12), proposal(1, START, drafts[1]), proposal(2, START + 4, drafts[2])]
    replies, error = asyncio.run(exchange(server.address, [*messages, proposal(9, 99, [1])]))
    assert error.code() == INVALID and "out of order" in error.details()
    committed = committed_after(replies, drafts)
    assert committed == expected[: len(committed)] and len(committed) == 4 + 4 + 2

    resumed = open_msg(info, max_new=12)
    resumed.open.generated_token_ids.extend(committed[4:])
    rest = expected[len(committed) :]
    replies, error = asyncio.run(exchange(server.address, [resumed, proposal(1, len(committed), rest)]))
    assert error is None
    v = replies[-1].verdict
    assert v.accepted == len(rest) - 1 and v.finish_reason == pb.FINISH_REASON_LENGTH


def test_an_open_tells_the_verifiers_forward_time_by_positions():
    """Timed at start-up for every size a round can have, then moved by the rounds its sessions play:
    what a new edge's tuner starts from (edge_client.adaptive.Tuner.observe_server_costs)."""
    fake = engine()
    fake.slow_s, fake.slow_per_position_s = 0.002, 0.008
    with InProcessServer(fake, config()) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            info = pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest())
        first, _ = asyncio.run(exchange(srv.address, [open_msg(info, max_new=4)]))
        fake.slow_s = 0.25  # the machine got much busier
        draft = continuation(PROMPT, 2)  # a round of 3 positions
        _, error = asyncio.run(exchange(srv.address, [open_msg(info, max_new=8), proposal(1, START, draft)]))
        later, _ = asyncio.run(exchange(srv.address, [open_msg(info, max_new=4)]))
    assert error is None
    start, moved = dict(first[0].opened.forward_seconds), dict(later[0].opened.forward_seconds)
    assert sorted(start) == list(range(1, info.max_gamma + 2))
    # The sleeps are floors, and a busy machine only adds to a figure: the bounds leave a start-up figure
    # 30 ms of delay (a CI run once saw 13 ms at 3 positions) and the later round any.
    assert start[9] - start[1] > 0.032  # 8 positions more at 8 ms each: 64 ms
    # The round of 3 positions (at least 0.274 s) is averaged with the one start-up figure of that size.
    assert moved[3] > start[3] + 0.05 and moved[5] == start[5]


def test_a_verifier_started_without_calibration_tells_only_what_its_rounds_measured():
    """`serve --no-calibrate`: no forward at start-up, so a first open hears no figure; a round's size
    is told once a session has played it."""
    fake = engine()
    with InProcessServer(fake, config(batch=BatchConfig(calibrate=False))) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            info = pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest())
        first, _ = asyncio.run(exchange(srv.address, [open_msg(info, max_new=4)]))
        draft = continuation(PROMPT, 2)
        _, error = asyncio.run(exchange(srv.address, [open_msg(info, max_new=8), proposal(1, START, draft)]))
        later, _ = asyncio.run(exchange(srv.address, [open_msg(info, max_new=4)]))
    assert error is None and CALIBRATION_KEY not in fake.released
    assert dict(first[0].opened.forward_seconds) == {} and sorted(later[0].opened.forward_seconds) == [3]


def test_a_proposal_of_no_draft_token_is_a_plain_step(server, info):
    """Speculation off (edge_client.adaptive): a drafting edge's proposals of no draft token each commit
    the target's next token, and GetStats counts them as plain steps."""

    def plain_steps() -> int:
        with grpc.insecure_channel(server.address) as channel:
            return pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest()).plain_steps

    assert info.plain_steps  # offered; an older verifier's ModelInfo lacks the field, read as false
    assert not wire.model_info_from_proto(pb.ModelInfo(max_gamma=8)).plain_steps
    expected = continuation(PROMPT, 3)
    before = plain_steps()
    messages = [open_msg(info, max_new=3), *(proposal(k + 1, START + k, []) for k in range(3))]
    replies, error = asyncio.run(exchange(server.address, messages))
    assert error is None
    verdicts = [r.verdict for r in replies if r.WhichOneof("kind") == "verdict"]
    assert [(v.accepted, v.target_token_id) for v in verdicts] == [(0, t) for t in expected]
    assert verdicts[-1].finish_reason == pb.FINISH_REASON_LENGTH
    assert plain_steps() == before + 3


def test_the_global_cap_refuses_with_a_retry_hint_and_a_release_makes_room():
    async def run(address):
        async with grpc.aio.insecure_channel(address) as channel:
            first, second, third = [await opened(channel) for _ in range(3)]
            first.cancel()
            await asyncio.sleep(0.1)
            return second, third, await opened(channel)

    admission = AdmissionConfig(max_sessions=2, max_sessions_per_client=0)  # the global cap alone
    with InProcessServer(engine(), config(admission=admission)) as srv:
        second, third, after = asyncio.run(run(srv.address))
    assert not isinstance(second, grpc.aio.AioRpcError)
    assert third.code() == EXHAUSTED and "maximum of 2 sessions" in third.details() and retry_hint(third) > 0
    assert not isinstance(after, grpc.aio.AioRpcError)


def test_the_connections_of_one_address_share_a_share_and_another_address_has_its_own():
    """Anonymous callers are known by their peer's address (admission.party_of): two connections from
    ::1 hold one share between them, while 127.0.0.1 (a dual-stack server) has a share of its own."""
    admission = AdmissionConfig(max_sessions_per_client=1)

    async def run(port):
        async with connection(f"[::1]:{port}") as a, connection(f"[::1]:{port}") as b:
            async with connection(f"127.0.0.1:{port}") as other:
                return [await opened(a), await opened(b), await opened(other)]

    with InProcessServer(engine(), config(admission=admission, host="[::]")) as srv:
        first, again, other = asyncio.run(run(srv.port))
    assert not isinstance(first, grpc.aio.AioRpcError) and not isinstance(other, grpc.aio.AioRpcError)
    assert again.code() == EXHAUSTED and "maximum of 1 sessions" in again.details()


def test_a_session_past_the_kv_budget_is_refused_before_any_work():
    fake = engine()
    fake.bytes_per_position = 1000
    admission = AdmissionConfig(kv_budget_bytes=100 * 1000, client_kv_share=1)

    async def run(address):
        async with grpc.aio.insecure_channel(address) as channel:
            return await opened(channel, max_new=200), await opened(channel, max_new=50)

    with InProcessServer(fake, config(admission=admission)) as srv:
        big, small = asyncio.run(run(srv.address))
        prefills = [f for batch in fake.batches for f in batch if f.key != CALIBRATION_KEY]
    assert big.code() == EXHAUSTED and "KV cache" in big.details() and retry_hint(big) > 0
    assert not isinstance(small, grpc.aio.AioRpcError)
    assert len(prefills) == 1  # the small session's prefill only


def test_an_idle_session_ends_with_deadline_exceeded_and_frees_its_cache():
    fake = engine()

    async def run(address):
        async with grpc.aio.insecure_channel(address) as channel:
            call = await opened(channel)
            start = time.monotonic()
            with pytest.raises(grpc.aio.AioRpcError) as error:
                await call.read()
            return error.value, time.monotonic() - start

    with InProcessServer(fake, config(lifetime=LifetimeConfig(idle_timeout_s=0.3))) as srv:
        error, waited = asyncio.run(run(srv.address))
        time.sleep(0.1)
    assert error.code() == grpc.StatusCode.DEADLINE_EXCEEDED and "freed" in error.details()
    assert 0.25 <= waited < 3 and len(fake.released) == 2 and not fake.held  # the calibration's, then its


def test_a_stale_flood_ends_the_session():
    async def run(address):
        async with grpc.aio.insecure_channel(address) as channel:
            call = await opened(channel)
            verdicts = 0
            with pytest.raises(grpc.aio.AioRpcError) as error:
                for r in range(1, 40):  # one at a time: a write racing the end would hide its status
                    await call.write(proposal(r, 99, [1]))
                    verdicts += (await call.read()).verdict.stale
            return verdicts, error.value

    with InProcessServer(engine(), config(admission=AdmissionConfig(max_stale_per_s=5))) as srv:
        verdicts, error = asyncio.run(run(srv.address))
    assert error.code() == EXHAUSTED and "stale proposals in a second" in error.details()
    assert verdicts == 5


def test_the_drain_refuses_new_opens_then_cuts_the_running_sessions():
    async def run(srv):
        async with grpc.aio.insecure_channel(srv.address) as channel:
            running = await opened(channel)
            drain = asyncio.wrap_future(asyncio.run_coroutine_threadsafe(srv.server.drain(0.3), srv.loop))
            await asyncio.sleep(0.1)
            refused_open = await opened(channel)
            with pytest.raises(grpc.aio.AioRpcError) as cut:
                await running.read()
            await drain
            return refused_open, cut.value

    srv = InProcessServer(engine(), config())
    refused_open, cut = asyncio.run(run(srv))
    srv.loop.call_soon_threadsafe(srv.loop.stop)
    assert refused_open.code() == grpc.StatusCode.UNAVAILABLE and "shutting down" in refused_open.details()
    assert cut.code() == grpc.StatusCode.UNAVAILABLE and "resume elsewhere" in cut.details()


def test_a_thin_session_plays_no_further_than_read_ahead_and_refuses_proposals():
    limits = VerifierLimits(max_gamma=8, read_ahead=8)

    async def run(address):
        async with grpc.aio.insecure_channel(address) as channel:
            call = pb_grpc.VerifierStub(channel).Session()
            await call.write(pb.EdgeMessage(open=thin_spec(200)))
            replies = [await call.read() for _ in range(9)]  # opened, then a round a token
            await asyncio.sleep(0.2)
            await call.write(
                pb.EdgeMessage(read=pb.Read(committed_length=replies[-1].verdict.committed_length))
            )
            more = await call.read()
            await call.write(proposal(1, 3, [1]))
            with pytest.raises(grpc.aio.AioRpcError) as error:
                while True:
                    await call.read()
            return replies, more, error.value

    with InProcessServer(engine(), ServerConfig(port=0, limits=limits)) as srv:
        replies, more, error = asyncio.run(run(srv.address))
    assert replies[0].opened.read_ahead == 8
    assert [r.verdict.committed_length for r in replies[1:]] == list(range(4, 12))
    assert more.verdict.committed_length == 12
    assert error.code() == INVALID and "thin session takes no proposals" in error.details()


def test_a_thin_read_out_of_bounds_is_refused(server):
    replies, error = asyncio.run(
        exchange(
            server.address,
            [pb.EdgeMessage(open=thin_spec(4)), pb.EdgeMessage(read=pb.Read(committed_length=99))],
        )
    )
    assert error.code() == INVALID and "read up to 99" in error.details()


def test_a_verifier_without_thin_sessions_says_so_and_refuses_them(info):
    """`serve --no-thin-sessions`: ModelInfo says so (edges then fall back to plain steps, not hand-offs),
    a thin open is refused with FAILED_PRECONDITION, and an edge's session still runs."""
    limits = VerifierLimits(max_gamma=8, thin_sessions=False)
    with InProcessServer(engine(), ServerConfig(port=0, limits=limits)) as srv:
        with grpc.insecure_channel(srv.address) as channel:
            strict = pb_grpc.VerifierStub(channel).GetModelInfo(pb.ModelInfoRequest())
        _, error = asyncio.run(exchange(srv.address, [pb.EdgeMessage(open=thin_spec(4))]))
        replies, ended = asyncio.run(exchange(srv.address, [open_msg(strict), proposal(1, START, [])]))
    assert info.thin_sessions and info.plain_steps and not strict.thin_sessions
    assert error.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "decodes no thin session (drafting none)" in error.details()
    assert ended is None and replies[-1].verdict.committed_length == START + 1


def test_a_hand_off_is_a_thin_session_counted_apart(server):
    def counts() -> tuple[int, int]:
        with grpc.insecure_channel(server.address) as channel:
            s = pb_grpc.VerifierStub(channel).GetStats(pb.StatsRequest())
            return s.thin_sessions, s.handoffs

    before = counts()
    handoff = thin_spec(4)
    handoff.handoff = True
    for spec in (handoff, thin_spec(4)):
        replies, error = asyncio.run(exchange(server.address, [pb.EdgeMessage(open=spec)]))
        assert error is None and replies[-1].verdict.finish_reason == pb.FINISH_REASON_LENGTH
    assert counts() == (before[0] + 2, before[1] + 1)


# Helpers.


def thin_spec(max_new: int) -> pb.OpenSession:
    stop = pb.StopConditions(max_new_tokens=max_new, ignore_eos=True)
    return pb.OpenSession(prompt_token_ids=[5, 6, 7], stop=stop, drafting=pb.DRAFTING_NONE)


def continuation(sequence: list[int], count: int) -> list[int]:
    """The fake target's greedy tokens after `sequence`."""
    out = [sequence[-1]]
    for _ in range(count):
        out.append(successor(out[-1], VOCAB))
    return out[1:]


def connection(address: str) -> grpc.aio.Channel:
    """A channel on a TCP connection of its own (channels of one process share connections otherwise)."""
    return grpc.aio.insecure_channel(address, options=[("grpc.use_local_subchannel_pool", 1)])


def test_a_client_whose_opens_are_refused_too_often_is_refused_unread_for_a_second():
    """Past 5 refused opens in a second (`max_refused_opens_per_s`), a connection's next opens get
    RESOURCE_EXHAUSTED before they are parsed, with the time to wait; another address is served (the
    connections of one address are one client), and so is the first once the second has passed."""
    admission = AdmissionConfig(max_refused_opens_per_s=5)
    empty = pb.EdgeMessage(open=pb.OpenSession(prompt_token_ids=[]))

    async def one(channel, message) -> grpc.aio.AioRpcError | None:
        call = pb_grpc.VerifierStub(channel).Session(iter([message]))
        try:
            async for _ in call:
                pass
        except grpc.aio.AioRpcError as e:
            return e
        return None

    async def run(port):
        async with connection(f"[::1]:{port}") as flood, connection(f"127.0.0.1:{port}") as other:
            codes = [(await one(flood, empty)).code() for _ in range(7)]
            unread = await one(flood, plain_open(2))
            elsewhere = await one(other, plain_open(2))
            await asyncio.sleep(retry_hint(unread) / 1000 + 0.05)
            return codes, unread, elsewhere, await one(flood, plain_open(2))

    with InProcessServer(engine(), config(admission=admission, host="[::]")) as srv:
        codes, unread, elsewhere, later = asyncio.run(run(srv.port))
    assert codes == [INVALID] * 5 + [EXHAUSTED] * 2
    assert (
        unread.code() == EXHAUSTED and "refused unread" in unread.details() and 0 < retry_hint(unread) <= 1000
    )
    assert elsewhere is None and later is None
