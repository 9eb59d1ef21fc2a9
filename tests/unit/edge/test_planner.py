"""The edge's planner in process, against a fake verifier: pipelining, staleness, budget, resume.

Torch-free: CI runs these in the edge-only environment too.
"""

import dataclasses
import time

import pytest

from draftwire.contract import ModelInfo, SamplingParams
from edge_client.adaptive import Tuner
from edge_client.planner import BadVerdict, DraftTokens, GenerationRequest, Planner
from edge_client.session import Generation
from tools.testkit.fakes import FakeVerifier, MistakenDrafter, drive, fake_info, target_continuation

PROMPT = (5, 9, 12)
INFO = ModelInfo(fake_info(), max_gamma=8, max_message_bytes=1 << 20)


@pytest.mark.parametrize("pipeline, lag", [(0, 0), (1, 1), (2, 2), (3, 1)])
@pytest.mark.parametrize("wrong", [(), (4, 11, 12, 30), tuple(range(3, 60, 3))])
def test_the_output_is_the_targets_whatever_the_pipeline_and_the_draft(pipeline, lag, wrong):
    request = GenerationRequest(PROMPT, max_new_tokens=40, gamma=4, ignore_eos=True, pipeline=pipeline)
    plan, sent = drive(request, INFO, MistakenDrafter(wrong), lag)
    assert plan.committed == [*PROMPT, *target_continuation(PROMPT, 40)]
    assert [p.round for p in sent] == list(range(1, len(sent) + 1))


def test_a_perfect_draft_pipelined_sends_ahead_and_nothing_is_stale():
    request = GenerationRequest(PROMPT, max_new_tokens=40, gamma=4, ignore_eos=True, pipeline=2)
    plan, sent = drive(request, INFO, MistakenDrafter(), lag=2)
    assert plan.stats.sent_ahead > 0 and plan.stats.stale_rounds == 0
    assert plan.stats.restarts == 1 and plan.stats.drafts > plan.stats.restarts  # only the first draft
    assert plan.stats.accepted_tokens == plan.stats.draft_tokens
    assert any(p.assumed_token_ids for p in sent)  # each builds on the guess of the bonus before it


def test_a_rejection_makes_the_proposals_built_on_it_stale():
    request = GenerationRequest(PROMPT, max_new_tokens=40, gamma=4, ignore_eos=True, pipeline=2)
    plan, _ = drive(request, INFO, MistakenDrafter(wrong=(5,)), lag=2)
    assert plan.stats.stale_rounds >= 1
    assert plan.stats.restarts == 2  # the first draft, and the one from the correction


def test_without_pipelining_nothing_is_sent_ahead():
    request = GenerationRequest(PROMPT, max_new_tokens=20, gamma=3, ignore_eos=True)
    plan, sent = drive(request, INFO, MistakenDrafter(wrong=(7,)), lag=0)
    assert plan.stats.sent_ahead == 0 and plan.stats.stale_rounds == 0
    assert all(not p.assumed_token_ids for p in sent)
    assert plan.stats.restarts == plan.stats.drafts == plan.stats.rounds  # every draft waits for a verdict


@pytest.mark.parametrize("max_new_tokens, gamma", [(1, 4), (5, 4), (9, 8), (10, 3)])
def test_the_budget_is_met_exactly_and_no_proposal_starts_past_it(max_new_tokens, gamma):
    request = GenerationRequest(
        PROMPT, max_new_tokens=max_new_tokens, gamma=gamma, ignore_eos=True, pipeline=1
    )
    plan, sent = drive(request, INFO, MistakenDrafter(), lag=1)
    assert len(plan.committed) - len(PROMPT) == max_new_tokens
    assert all(p.start_position < len(PROMPT) + max_new_tokens for p in sent)


def test_resuming_starts_from_the_committed_tokens():
    generated = target_continuation(PROMPT, 6)
    request = GenerationRequest(PROMPT, max_new_tokens=12, gamma=4, ignore_eos=True)
    plan, sent = drive(request, INFO, MistakenDrafter(), generated=generated)
    assert sent[0].start_position == len(PROMPT) + 6
    assert plan.committed == [*PROMPT, *target_continuation(PROMPT, 12)]


def test_a_stop_token_finishes_and_a_guessed_stop_is_never_built_on():
    stop = target_continuation(PROMPT, 10)[6]
    request = GenerationRequest(PROMPT, max_new_tokens=40, gamma=2, stop_token_ids=(stop,), pipeline=3)
    plan, sent = drive(request, INFO, MistakenDrafter(), lag=3)
    assert plan.committed[-1] == stop and len(plan.committed) == len(PROMPT) + 7
    assert all(stop not in p.assumed_token_ids for p in sent)


def cap_schedule(round_: int) -> int:
    """A verifier whose load rises, then falls: no cap, then 3, 1, 2, then max_gamma again."""
    return 0 if round_ < 4 else 3 if round_ < 8 else 1 if round_ < 12 else 2 if round_ < 16 else 8


@pytest.mark.parametrize("gamma, pipeline", [(6, 0), (6, 2), (None, None)])
@pytest.mark.parametrize("wrong", [(), (4, 11, 12, 30)])
def test_the_verifiers_gamma_cap_bounds_the_next_proposals_and_changes_no_token(gamma, pipeline, wrong):
    request = GenerationRequest(PROMPT, max_new_tokens=90, gamma=gamma, ignore_eos=True, pipeline=pipeline)
    lag = pipeline or 0
    plan, sent = drive(request, INFO, MistakenDrafter(wrong), lag=lag, caps=cap_schedule)
    assert plan.committed == [*PROMPT, *target_continuation(PROMPT, 90)]
    # Round r is drafted once at least the verdicts up to round r - lag - 1 were applied, and at most
    # those before r: it obeys the cap of one of those rounds.
    for p in sent:
        window = [cap_schedule(k) for k in range(max(1, p.round - lag - 1), p.round)]
        if window and all(window):
            assert len(p.draft_token_ids) <= max(window), (p.round, len(p.draft_token_ids), window)
    assert any(len(p.draft_token_ids) == 1 for p in sent)  # the cap of 1 was obeyed
    if gamma is not None:  # and it lifted (a tuner climbs back as its estimates allow; here it has none)
        assert max(len(p.draft_token_ids) for p in sent if p.round >= 16 + lag) == gamma


def test_a_verdict_for_another_round_is_refused():
    request = GenerationRequest(PROMPT, max_new_tokens=10)
    plan = Planner(request, INFO)
    plan.add_draft(plan.next_draft(), [1, 2, 3, 4])
    proposal = plan.next_proposal()
    verdict = FakeVerifier(request.spec()).answer(proposal)
    with pytest.raises(BadVerdict, match="expected round 1"):
        plan.apply(type(verdict)(**{**verdict.__dict__, "round": 2}))


def _first_round(gamma_tokens=(1, 2, 3, 4)):
    """A planner with round 1 in flight, and the honest verdict for it."""
    request = GenerationRequest(PROMPT, max_new_tokens=10)
    plan = Planner(request, INFO)
    plan.add_draft(plan.next_draft(), list(gamma_tokens))
    proposal = plan.next_proposal()
    return plan, FakeVerifier(request.spec()).answer(proposal)


@pytest.mark.parametrize(
    "change, match",
    [
        ({"round": 2}, "expected round 1"),
        ({"start_position": 1}, "starts at 1"),
        ({"target_token_id": 10**6}, "outside the vocabulary"),
        ({"target_token_id": -1}, "outside the vocabulary"),
        ({"accepted": 9}, "9 of 4 draft tokens"),
        ({"accepted": 0, "target_token_id": None, "finish": None}, "commits nothing"),
        ({"stale": True, "target_token_id": None}, "builds on the committed tokens"),
        ({"committed_length": 99}, "committed length 99"),
    ],
)
def test_a_bad_verdict_is_a_fault_of_the_verifier(change, match):
    plan, verdict = _first_round()
    with pytest.raises(BadVerdict, match=match):
        plan.apply(type(verdict)(**{**verdict.__dict__, **change}))
    assert plan.committed == list(PROMPT)  # nothing of a bad verdict is committed


def test_an_honest_verdict_passes_the_checks():
    plan, verdict = _first_round()
    assert plan.apply(verdict)


def test_a_forward_after_every_drafter_call_ended_ran_beside_none_even_if_drafted_ahead():
    """The share of a forward spent beside drafting comes from the drafter calls' times once the
    transport gives them: a forward that began after every call had ended ran beside none, whatever the
    proposal's mark, also when an earlier verdict had already let go of every call's record. Only a
    transport that gives no times falls back on the mark."""
    shares = []

    class Spy(Tuner):
        def observe_verify(self, draft_tokens, seconds, beside=0.0):
            shares.append(beside)
            super().observe_verify(draft_tokens, seconds, beside)

    plans = []
    for timed in (True, False):
        request = GenerationRequest(PROMPT, max_new_tokens=10)
        plan = Planner(request, INFO, tuner=Spy())
        job = plan.next_draft()
        plan.add_draft(job, [1, 2, 3, 4], seconds=0.01 if timed else None, now=1.0 if timed else None)
        proposal = plan.next_proposal(now=1.0 if timed else None)
        sent = plan.in_flight[0] = dataclasses.replace(plan.in_flight[0], ahead=True)  # as if drafted beside
        verdict = FakeVerifier(request.spec()).answer(proposal)
        plan.apply(dataclasses.replace(verdict, verify_seconds=0.2), arrived=5.0 if timed else None)
        plans.append((plan, sent))
    assert shares == [0.0, 1.0]
    plan, sent = plans[0]
    assert plan._beside(sent, 0.2, 6.0) == 0.0  # no call's record left, and none beside it


@pytest.mark.parametrize(
    "wrong_at, counted",
    [
        (3, (3, 1, False, 2)),  # the forced tokens 1 and 2 accepted, then the draft's third token refused
        (0, (3, 0, False, 0)),  # the draft's first token refused: the forced ones after it go unjudged
        (None, (3, 3, False, 2)),  # all accepted
    ],
)
def test_tokens_a_constraint_forced_are_counted_apart_from_the_draft_models(wrong_at, counted):
    """A constraint's forced tokens (DraftTokens.forced) were sent with no draft step: the acceptance and
    the tuner count the draft model's proposals alone (draft tokens, accepted), the stats the forced
    tokens committed apart, and the committed tokens are the same."""
    seen = []

    class Spy(Tuner):
        def observe_verdict(self, draft_tokens, accepted, cut):
            seen.append((draft_tokens, accepted, cut))
            super().observe_verdict(draft_tokens, accepted, cut)

    request = GenerationRequest(PROMPT, max_new_tokens=10)
    plan = Planner(request, INFO, tuner=Spy())
    tokens = target_continuation(PROMPT, 5)
    if wrong_at is not None:
        tokens[wrong_at] += 1
    plan.add_draft(plan.next_draft(), DraftTokens(tokens, forced=[1, 2]))
    proposal = plan.next_proposal()
    assert proposal.forced == (1, 2)  # named on the wire too: the verifier counts them apart as well
    verdict = FakeVerifier(request.spec()).answer(proposal)
    new = plan.apply(verdict)
    assert new == target_continuation(PROMPT, len(new))
    assert (*seen[0], plan.stats.forced_tokens) == counted
    assert (plan.stats.draft_tokens, plan.stats.accepted_tokens) == counted[:2]
    assert plan.stats.generated_tokens == len(new)


def test_a_round_of_forced_tokens_alone_is_no_plain_step_to_the_tuner():
    """A draft the constraint forced whole proposed nothing: the tuner neither judges the draft model by
    it nor counts it as a plain step (speculation off)."""
    request = GenerationRequest(PROMPT, max_new_tokens=10)
    plan = Planner(request, INFO)
    plan.add_draft(plan.next_draft(), DraftTokens(target_continuation(PROMPT, 3), forced=[0, 1, 2]))
    plan.apply(FakeVerifier(request.spec()).answer(plan.next_proposal()))
    assert (plan.tuner.plain_steps, plan.stats.plain_steps) == (0, 0)
    assert (plan.stats.draft_tokens, plan.stats.forced_tokens, plan.stats.generated_tokens) == (0, 3, 4)


def test_the_decode_rate_leaves_out_the_prefill_and_the_first_verdicts_tokens():
    generation = Generation(GenerationRequest((1, 2, 3), SamplingParams(), 16, 4))
    generation.stats.started_at = time.perf_counter() - 1.0
    generation.commit([7, 8, 9, 10, 11], [])  # a speculative first verdict: 5 tokens at once
    generation.commit([12], [])
    stats = generation.stats
    assert stats.first_tokens == 5 and stats.first_token_s >= 1.0
    stats.generated_tokens, stats.wall_s, stats.step_s = 9, stats.first_token_s + 2.0, 0.1
    assert stats.decode_rate == pytest.approx(2.0)  # 4 tokens in the 2 s after the first verdict
    assert stats.speculation_gain == pytest.approx(0.2)
    stats.generated_tokens = 5  # nothing after the first verdict: no rate
    assert stats.decode_rate == 0.0 and stats.speculation_gain == 0.0
