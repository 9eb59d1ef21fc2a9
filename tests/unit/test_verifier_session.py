"""The verifier's round in process, over a fake engine: tables of proposals and what each must do."""

import asyncio
import dataclasses

import pytest

from draftwire.contract import Finish, Proposal, SamplingParams, SessionSpec
from tools.testkit.fakes import FakeEngine, fake_info, target_continuation
from verifier_service.batcher import Batcher
from verifier_service.engine import Forward
from verifier_service.session import InvalidRequest, VerifierLimits, VerifierSession, WrongState

PROMPT = (5, 9, 12)


async def settle(batcher: Batcher) -> None:
    """Returns once everything queued before it (forwards, releases) has run."""
    await batcher.forward(Forward("settle", 0, (1,), wants_logits=False))


def widths(engine: FakeEngine, key: str) -> list[int]:
    """Positions the target ran for one session, forward by forward (the prefill first)."""
    return [len(f.token_ids) for batch in engine.batches for f in batch if f.key == key]


def play(spec: SessionSpec, *proposals: Proposal, engine=None, limits=None):
    """Opens a session over a fake engine and plays the proposals; returns (verdicts, session, engine)."""
    engine = engine or FakeEngine()

    async def run():
        batcher = Batcher(engine)
        try:
            session = await VerifierSession.open(batcher, spec, limits or VerifierLimits(max_gamma=8))
            verdicts = [await session.play(p) for p in proposals]
            await settle(batcher)
            engine.released_before_close = list(engine.released)
            return verdicts, session
        finally:
            batcher.close()

    verdicts, session = asyncio.run(run())
    return verdicts, session, engine


GOOD = target_continuation(PROMPT, 12)


def test_a_perfect_draft_is_accepted_with_a_bonus_and_costs_gamma_plus_one_positions():
    [v], session, engine = play(SessionSpec(PROMPT, max_new_tokens=20), Proposal(1, 3, tuple(GOOD[:4])))
    assert (v.accepted, v.target_token_id, v.finish, v.stale) == (4, GOOD[4], None, False)
    assert session.generated == GOOD[:5]
    assert widths(engine, session.key) == [2, 5]  # prefill; the last committed token and the draft
    assert v.target_positions == 2 + 5  # prefill of all but the last prompt token, then the round


@pytest.mark.parametrize(
    "draft, accepted, target_token",
    [
        pytest.param((GOOD[0], 0, GOOD[2]), 1, GOOD[1], id="second token wrong: correction"),
        pytest.param((0, GOOD[1]), 0, GOOD[0], id="first token wrong: nothing accepted"),
        pytest.param((GOOD[0], GOOD[1]), 2, GOOD[2], id="all accepted: bonus"),
    ],
)
def test_accepted_prefix_and_correction(draft, accepted, target_token):
    [v], session, _ = play(SessionSpec(PROMPT, max_new_tokens=20), Proposal(1, 3, draft))
    assert (v.accepted, v.target_token_id) == (accepted, target_token)
    assert session.generated == GOOD[: accepted + 1]


def test_budget_trims_the_draft_before_the_target_runs():
    [v], session, engine = play(SessionSpec(PROMPT, max_new_tokens=3), Proposal(1, 3, tuple(GOOD[:6])))
    assert (v.accepted, v.target_token_id, v.finish) == (2, GOOD[2], Finish.LENGTH)
    assert widths(engine, session.key) == [2, 3]  # 2 draft tokens kept of 6
    assert session.key in engine.released_before_close  # a finish frees the cache at once


def test_a_stop_inside_the_accepted_tokens_cuts_the_round():
    stop = GOOD[1]
    spec = SessionSpec(PROMPT, max_new_tokens=20, stop_token_ids=(stop,))
    [v], session, _ = play(spec, Proposal(1, 3, tuple(GOOD[:4])))
    assert (v.accepted, v.target_token_id, v.finish) == (2, None, Finish.STOP)
    assert session.generated == GOOD[:2]


@pytest.mark.parametrize("ignore_eos, finish, generated", [(False, Finish.STOP, 2), (True, None, 5)])
def test_eos_finishes_unless_ignored(ignore_eos, finish, generated):
    engine = FakeEngine(dataclasses.replace(fake_info(), eos_token_ids=(GOOD[1],)))
    spec = SessionSpec(PROMPT, max_new_tokens=20, ignore_eos=ignore_eos)
    [v], session, _ = play(spec, Proposal(1, 3, tuple(GOOD[:4])), engine=engine)
    assert v.finish == finish and len(session.generated) == generated


@pytest.mark.parametrize(
    "proposal, why",
    [
        pytest.param(Proposal(1, 2, (GOOD[0],)), "start_position behind", id="start behind"),
        pytest.param(Proposal(1, 4, (GOOD[0],)), "start_position ahead", id="start ahead"),
        pytest.param(
            Proposal(1, 3, (GOOD[0],), assumed_token_ids=(99 % 64,)), "assumed", id="assumed differs"
        ),
    ],
)
def test_stale_proposals_are_answered_without_the_target(proposal, why):
    [v], session, engine = play(SessionSpec(PROMPT, max_new_tokens=20), proposal)
    assert v.stale and v.accepted == 0 and v.target_token_id is None, why
    assert widths(engine, session.key) == [2]  # the prefill only
    assert session.generated == []


def test_a_proposal_assuming_the_committed_tokens_is_verified():
    first = Proposal(1, 3, tuple(GOOD[:2]))
    second = Proposal(2, 6, tuple(GOOD[3:5]), assumed_token_ids=(GOOD[2],))
    [a, b], session, _ = play(SessionSpec(PROMPT, max_new_tokens=20), first, second)
    assert not b.stale and b.accepted == 2
    assert session.generated == GOOD[:6]


@pytest.mark.parametrize(
    "spec, proposals, error, message",
    [
        pytest.param(SessionSpec(()), (), InvalidRequest, "prompt is empty", id="empty prompt"),
        pytest.param(SessionSpec((70,)), (), InvalidRequest, "outside the vocabulary", id="prompt id"),
        pytest.param(SessionSpec(PROMPT, max_new_tokens=300), (), InvalidRequest, "context", id="too long"),
        pytest.param(
            SessionSpec(PROMPT, SamplingParams(temperature=-1)),
            (),
            InvalidRequest,
            "temperature",
            id="sampling",
        ),
        pytest.param(
            SessionSpec(PROMPT, tokenizer_fingerprint="other", vocab_size=3),
            (),
            WrongState,
            "vocabulary mismatch",
            id="vocabulary",
        ),
        pytest.param(
            SessionSpec(PROMPT), (Proposal(2, 3, (1,)),), InvalidRequest, "out of order", id="round"
        ),
        pytest.param(
            SessionSpec(PROMPT), (Proposal(1, 3, (1,) * 9),), InvalidRequest, "gamma 9", id="gamma big"
        ),
        pytest.param(
            SessionSpec(PROMPT), (Proposal(1, 3, (64,)),), InvalidRequest, "draft token id", id="id"
        ),
        pytest.param(
            SessionSpec(PROMPT),
            (Proposal(1, 3, (1, 2), forced=(2,)),),
            InvalidRequest,
            "forced",
            id="forced past",
        ),
        pytest.param(
            SessionSpec(PROMPT),
            (Proposal(1, 3, (1, 2), forced=(1, 1)),),
            InvalidRequest,
            "forced",
            id="forced twice",
        ),
        pytest.param(
            SessionSpec(PROMPT, max_new_tokens=1),
            (Proposal(1, 3, (GOOD[0],)), Proposal(2, 4, (GOOD[1],))),
            WrongState,
            "finished",
            id="after the finish",
        ),
    ],
)
def test_refusals(spec, proposals, error, message):
    with pytest.raises(error, match=message):
        play(spec, *proposals)


def test_tokens_a_constraint_forced_count_apart_from_drafts():
    """A proposal names the draft tokens a constraint forced: they are verified like the others, and
    the counters give the draft model's tokens alone (forced_tokens: those committed)."""
    verdicts, session, _ = play(
        SessionSpec(PROMPT, max_new_tokens=20),
        Proposal(1, 3, tuple(GOOD[:4]), forced=(1, 3)),  # all four accepted, two of them forced
        Proposal(2, 8, (GOOD[5], 0, GOOD[7]), forced=(2,)),  # the draft model's second token refused
    )
    assert [v.accepted for v in verdicts] == [4, 1]
    s = session.stats
    assert (s.drafts, s.draft_tokens, s.accepted_tokens, s.forced_tokens) == (2, 4, 3, 2)
    assert s.accepted_per_position == [2, 1]


def test_a_refused_proposal_changes_nothing():
    engine = FakeEngine()

    async def run():
        batcher = Batcher(engine)
        try:
            session = await VerifierSession.open(batcher, SessionSpec(PROMPT, max_new_tokens=20))
            with pytest.raises(InvalidRequest):
                await session.play(Proposal(1, 3, (64,)))
            verdict = await session.play(Proposal(1, 3, (GOOD[0],)))  # round 1 is still expected
            return verdict, session.generated
        finally:
            batcher.close()

    verdict, generated = asyncio.run(run())
    assert verdict.accepted == 1 and generated == GOOD[:2]


def test_resuming_prefills_the_generated_tokens():
    spec = SessionSpec(PROMPT, max_new_tokens=10, generated_token_ids=tuple(GOOD[:3]))
    [v], session, engine = play(spec, Proposal(1, 6, (GOOD[3],)))
    assert widths(engine, session.key)[0] == 5  # prompt + generated but the last
    assert v.accepted == 1 and session.generated == GOOD[:5]


def test_a_session_left_open_keeps_its_cache_until_closed():
    [v], session, engine = play(SessionSpec(PROMPT, max_new_tokens=20), Proposal(1, 3, (GOOD[0],)))
    assert v.finish is None and session.key not in engine.released_before_close
