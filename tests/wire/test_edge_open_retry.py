"""An edge whose open finds the verifier frozen for a moment (its model info misses the call deadline, as
through a front with a stopped replica) retries within its resume budget instead of failing at once with
DEADLINE_EXCEEDED and 0 committed tokens (issue 55); a verifier that stays frozen past the budget is
UNAVAILABLE saying so, with the resumes it tried. In process over the fake engine."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from edge_client.session import EdgeSession, GenerationRequest, Timeouts, VerifierError
from tools.testkit.fakes import FakeEngine, MistakenDrafter, target_continuation
from tools.testkit.inprocess import InProcessServer
from verifier_service.servicer import ServerConfig, VerifierLimits, VerifierServicer

PROMPT = (5, 17, 42)


@pytest.fixture()
def frozen_model_info(monkeypatch):
    """The verifier's GetModelInfo hangs `calls[0]` times (each past the edge's deadline), then answers."""
    calls = [0]
    answer = VerifierServicer.GetModelInfo

    async def hanging(self, request, context):
        if calls[0] > 0:
            calls[0] -= 1
            await asyncio.sleep(30)
        return await answer(self, request, context)

    monkeypatch.setattr(VerifierServicer, "GetModelInfo", hanging)
    return calls


def generate(address: str, timeouts: Timeouts):
    async def run():
        async with grpc.aio.insecure_channel(address) as channel:
            session = EdgeSession(channel, MistakenDrafter(), timeouts)
            return await session.run(GenerationRequest(PROMPT, max_new_tokens=12, ignore_eos=True))

    return asyncio.run(run())


def test_an_open_that_misses_its_deadline_is_retried_within_the_resume_budget(frozen_model_info):
    frozen_model_info[0] = 2
    with InProcessServer(FakeEngine(), ServerConfig(port=0, limits=VerifierLimits(max_gamma=8))) as srv:
        ids, stats = generate(srv.address, Timeouts(call_s=0.3, resume_s=30))
    assert ids == target_continuation(PROMPT, 12) and stats.resumes == 2


def test_a_verifier_frozen_past_the_budget_is_unavailable_saying_so(frozen_model_info):
    frozen_model_info[0] = 100
    with InProcessServer(FakeEngine(), ServerConfig(port=0, limits=VerifierLimits(max_gamma=8))) as srv:
        with pytest.raises(VerifierError) as error:
            generate(srv.address, Timeouts(call_s=0.2, resume_s=1.0))
    assert error.value.code == grpc.StatusCode.UNAVAILABLE and "gave up after" in error.value.details
