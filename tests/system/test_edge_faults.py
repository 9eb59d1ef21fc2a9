"""The edge against faulty verifiers, in process: a hung one (no verdict), one that goes away, one
that answers a bad verdict. The edge resumes with backoff for its time budget, then gives up saying so,
with the committed tokens kept; a bad verdict is the verifier's fault (INTERNAL), never applied."""

import asyncio
import time

import grpc
import pytest

from draftwire import wire
from draftwire.contract import ModelInfo, Verdict
from draftwire.v1 import draftwire_pb2 as pb
from draftwire.v1 import draftwire_pb2_grpc as pb_grpc
from edge_client.session import EdgeSession, GenerationRequest, GenerationStats, Timeouts, VerifierError
from tools.testkit.fakes import FakeVerifier, MistakenDrafter, fake_info

PROMPT = (5, 9, 12)
INFO = ModelInfo(fake_info(), max_gamma=8, max_message_bytes=1 << 20)
REQUEST = GenerationRequest(PROMPT, max_new_tokens=40, gamma=4, ignore_eos=True)


class Faulty(pb_grpc.VerifierServicer):
    """Answers `good` rounds honestly (the fake target), then does what `fault` says: "hang" (no more
    verdicts), "drop" (UNAVAILABLE) or "oov" (a verdict whose token is outside the vocabulary)."""

    def __init__(self, fault: str, good: int):
        self.fault, self.good, self.opens = fault, good, 0

    async def GetModelInfo(self, request, context):
        return wire.model_info_to_proto(INFO)

    async def Session(self, request_iterator, context):
        verifier = None
        async for message in request_iterator:
            if message.WhichOneof("kind") == "open":
                self.opens += 1
                verifier = FakeVerifier(wire.spec_from_proto(message.open))
                yield pb.VerifierMessage(opened=pb.SessionOpened(session_id="s"))
                continue
            verdict = verifier.answer(wire.proposal_from_proto(message.proposal))
            if self.good > 0:
                self.good -= 1
            elif self.fault == "hang":
                await asyncio.sleep(3600)
            elif self.fault == "drop":
                await context.abort(grpc.StatusCode.UNAVAILABLE, "gone")
            else:
                verdict = Verdict(**{**verdict.__dict__, "target_token_id": 10**6})
            yield pb.VerifierMessage(verdict=wire.verdict_to_proto(verdict))


async def run_against(servicer: Faulty, timeouts: Timeouts):
    server = grpc.aio.server()
    pb_grpc.add_VerifierServicer_to_server(servicer, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    stats, committed = GenerationStats(), []
    try:
        async with grpc.aio.insecure_channel(f"127.0.0.1:{port}") as channel:
            session = EdgeSession(channel, MistakenDrafter(), timeouts)
            start = time.monotonic()
            with pytest.raises(VerifierError) as error:
                async for _ in session.generate(REQUEST, stats, committed):
                    pass
            return error.value, stats, committed, time.monotonic() - start
    finally:
        await server.stop(0)


@pytest.mark.parametrize("fault", ["hang", "drop"])
def test_the_edge_resumes_with_backoff_then_gives_up_keeping_what_was_committed(fault):
    timeouts = Timeouts(verdict_s=0.3, resume_s=1.5, backoff_s=0.1, max_backoff_s=0.4)
    servicer = Faulty(fault, good=2)
    error, stats, committed, took = asyncio.run(run_against(servicer, timeouts))
    assert error.code == grpc.StatusCode.UNAVAILABLE and "gave up after" in error.details
    assert len(committed) >= 2 and f"{len(committed)} tokens committed" in error.details
    assert 2 <= stats.resumes <= 6 and servicer.opens == stats.resumes + 1  # backoff 0.1, 0.2, 0.4, ...
    assert 1.0 <= took <= 5.0
    if fault == "hang":
        assert "no verdict from the verifier within 0.3 s" in error.details


def test_a_bad_verdict_ends_the_generation_as_a_verifier_fault():
    error, stats, committed, _ = asyncio.run(run_against(Faulty("oov", good=1), Timeouts()))
    assert error.code == grpc.StatusCode.INTERNAL and "outside the vocabulary" in error.details
    assert stats.resumes == 0 and 1 <= len(committed) <= 5  # the good round's tokens, nothing of the bad one
    assert all(t < INFO.target.vocabulary.size for t in committed)
