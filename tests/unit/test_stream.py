"""The verifier's stream without any wire (verifier_service/stream.py over the fake engine): the contract's
messages in, its replies out, its endings as the project's exceptions; and the servicer's one table
from those exceptions to gRPC statuses."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from draftwire.contract import Proposal, SamplingParams, SessionSpec
from tools.testkit.fakes import FakeEngine, fake_info, successor
from verifier_service.admission import AdmissionConfig, Refused
from verifier_service.auth import Refusal
from verifier_service.lifecycle import LifetimeConfig, Revoked, ShutDown, TimedOut
from verifier_service.servicer import status_of
from verifier_service.session import InvalidRequest, WrongState
from verifier_service.stream import Flooded, Open, Opened, Read, StreamConfig, Unknown, Verifier

SPEC = SessionSpec((5, 6, 7), SamplingParams(), 8, ignore_eos=True)


def opening(spec: SessionSpec = SPEC) -> Open:
    return Open(len(spec.prompt_token_ids), spec.max_new_tokens, lambda: spec)


async def stream(verifier: Verifier, messages, client: str = "c") -> tuple[list, Exception | None]:
    """Runs one stream over `messages`; its replies and how it ended (None: the edge half-closed)."""
    replies = []

    async def arrivals():
        for m in messages:
            yield lambda m=m: m

    async def write(reply):
        replies.append(reply)

    try:
        await verifier.run(client, None, arrivals(), write)
    except Exception as e:
        return replies, e
    return replies, None


def run(messages, **config):
    async def go():
        verifier = Verifier(FakeEngine(fake_info(vocab=64)), StreamConfig(**config))
        return (*await stream(verifier, messages), verifier)

    return asyncio.run(go())


def test_an_open_and_proposals_give_the_target_s_tokens_and_free_everything():
    t1 = successor(7)
    replies, ending, verifier = run([opening(), Proposal(1, 3, (t1, 0))])
    assert ending is None
    opened, verdict = replies
    assert isinstance(opened, Opened) and opened.committed_length == 3 and opened.read_ahead == 0
    assert verdict.accepted == 1 and verdict.target_token_id == successor(t1)
    assert verifier.admission.active == 0 and verifier.stats.sessions_opened == 1


@pytest.mark.parametrize(
    "messages, kind, words",
    [
        ([Proposal(1, 3, (1,))], InvalidRequest, "first message"),
        ([Read(3)], InvalidRequest, "first message"),
        ([opening(), opening()], InvalidRequest, "already open"),
        ([opening(), Unknown()], InvalidRequest, "already open"),
        ([opening(), Read(3)], InvalidRequest, "only a thin session"),
        ([opening(), Proposal(1, 3, (1,)), Proposal(1, 3, (1,))], InvalidRequest, "out of order"),
    ],
)
def test_a_broken_rule_ends_the_stream_with_the_project_s_own_error(messages, kind, words):
    _, ending, verifier = run(messages)
    assert type(ending) is kind and words in str(ending)
    assert verifier.admission.active == 0


def test_an_open_past_the_context_is_refused_before_it_is_parsed():
    def parse():
        raise AssertionError("parsed")

    _, ending, _ = run([Open(3, 10_000, parse)])
    assert isinstance(ending, InvalidRequest) and "context" in str(ending)


def test_admission_refuses_with_a_hint_and_the_drain_with_shut_down():
    async def go():
        verifier = Verifier(FakeEngine(), StreamConfig(admission=AdmissionConfig(max_sessions=1)))
        hold = asyncio.Event()

        async def held():
            yield opening
            await hold.wait()

        first = asyncio.create_task(verifier.run("a", None, held(), lambda r: asyncio.sleep(0)))
        await asyncio.sleep(0.05)
        _, refused = await stream(verifier, [opening()], "b")
        hold.set()
        await first
        verifier.draining = True
        _, drained = await stream(verifier, [opening()])
        return refused, drained

    refused, drained = asyncio.run(go())
    assert isinstance(refused, Refused) and refused.retry_after_s > 0
    assert isinstance(drained, ShutDown)


def test_an_idle_edge_times_out():
    async def go():
        verifier = Verifier(FakeEngine(), StreamConfig(lifetime=LifetimeConfig(idle_timeout_s=0.1)))

        async def silent():
            yield opening
            await asyncio.sleep(10)

        try:
            await verifier.run("c", None, silent(), lambda r: asyncio.sleep(0))
        except TimedOut as e:
            return e

    assert "no message from the edge" in str(asyncio.run(go()))


def test_stale_proposals_in_a_row_end_the_session():
    stale = [Proposal(r, 99, (1,)) for r in range(1, 10)]
    replies, ending, _ = run([opening(), *stale], admission=AdmissionConfig(max_stale_in_a_row=4))
    assert isinstance(ending, Flooded) and "4 stale proposals in a row" in str(ending)
    assert sum(r.stale for r in replies[1:]) == 4


@pytest.mark.parametrize(
    "error, code",
    [
        (InvalidRequest("x"), grpc.StatusCode.INVALID_ARGUMENT),
        (WrongState("x"), grpc.StatusCode.FAILED_PRECONDITION),
        (Refused("x", 0.25), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (Flooded("x"), grpc.StatusCode.RESOURCE_EXHAUSTED),
        (TimedOut("x"), grpc.StatusCode.DEADLINE_EXCEEDED),
        (ShutDown(), grpc.StatusCode.UNAVAILABLE),
        (Revoked(Refusal(grpc.StatusCode.UNAUTHENTICATED, "revoked")), grpc.StatusCode.UNAUTHENTICATED),
        (Revoked(Refusal(grpc.StatusCode.UNAVAILABLE, "broken file")), grpc.StatusCode.UNAVAILABLE),
        (RuntimeError("device lost"), grpc.StatusCode.INTERNAL),
    ],
)
def test_each_ending_has_one_status(error, code):
    got, details, metadata = status_of(error)
    assert got == code
    if isinstance(error, Refused):
        assert metadata == (("retry-after-ms", "250"),) and "retry after 250 ms" in details
    else:
        assert metadata == ()
    if code == grpc.StatusCode.INTERNAL:
        assert "RuntimeError: device lost" in details
