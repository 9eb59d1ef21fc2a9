"""Logit bias, penalties and logprobs in the rules (draftwire.rules), on small hand-made logits: each
figure below is worked out from the documented formulas (OpenAI's frequency/presence penalty,
transformers' repetition penalty), not from the code under test."""

import math

import numpy as np
import pytest

from draftwire import wire
from draftwire.contract import InvalidSampling, SamplingParams, SessionSpec, TokenLogprob, Verdict
from draftwire.rules import adjusted_logits, choose_tokens, token_logprobs

LOGITS = np.array([[2.0, -1.0, 0.5, 1.0, -3.0]] * 3, dtype=np.float32)


def test_nothing_asked_leaves_the_logits_as_they_are():
    out = adjusted_logits(LOGITS, SamplingParams(temperature=0.7, top_k=2), [1, 2], 1, [3, 4])
    assert out.dtype == np.float32 and np.array_equal(out, LOGITS)


def test_logit_bias_is_added_at_every_row():
    out = adjusted_logits(LOGITS, SamplingParams(logit_bias=((0, -100.0), (4, 5.5))), [1], 1, [2, 3])
    assert out[:, 0].tolist() == [-98.0] * 3 and out[:, 4].tolist() == [2.5] * 3
    assert out[:, 1:4].tolist() == LOGITS[:, 1:4].tolist()


def test_repetition_penalty_over_prompt_and_generated_and_the_draft_before_each_row():
    # Context: prompt [1], generated [2]; the draft proposes 3 then 4 (rows 1 and 2 see them).
    out = adjusted_logits(LOGITS, SamplingParams(repetition_penalty=2.0), [1, 2], 1, [3, 4])
    # Row 0: 1 (-1.0, negative: times 2) and 2 (0.5: halved) are seen.
    assert out[0].tolist() == [2.0, -2.0, 0.25, 1.0, -3.0]
    assert out[1].tolist() == [2.0, -2.0, 0.25, 0.5, -3.0]  # and draft token 3
    assert out[2].tolist() == [2.0, -2.0, 0.25, 0.5, -6.0]  # and draft token 4


def test_frequency_and_presence_count_generated_tokens_only():
    # Prompt [0, 0, 3]; generated [3, 3, 2]; OpenAI: mu[j] - c[j] * a_freq - (c[j] > 0) * a_pres.
    params = SamplingParams(frequency_penalty=0.5, presence_penalty=0.25)
    out = adjusted_logits(LOGITS, params, [0, 0, 3, 3, 3, 2], 3, [2, 1])
    assert out[0].tolist() == [2.0, -1.0, 0.5 - 0.5 - 0.25, 1.0 - 1.0 - 0.25, -3.0]
    assert out[1].tolist() == [2.0, -1.0, 0.5 - 1.0 - 0.25, 1.0 - 1.0 - 0.25, -3.0]
    assert out[2].tolist() == [2.0, -1.0 - 0.5 - 0.25, 0.5 - 1.0 - 0.25, 1.0 - 1.0 - 0.25, -3.0]


def test_a_penalty_changes_the_greedy_choice():
    params = SamplingParams(presence_penalty=2.0)
    assert choose_tokens(adjusted_logits(LOGITS[:1], params, [1, 0], 1), 2, params).tolist() == [3]
    assert choose_tokens(LOGITS[:1], 2, params).tolist() == [0]


def test_logprobs_greedy_at_temperature_one_and_sampled_after_the_filters():
    logits = LOGITS[:1].astype(np.float64)
    softmax = np.exp(logits[0]) / np.exp(logits[0]).sum()
    [greedy] = token_logprobs(logits, [3], SamplingParams(), 2)
    assert greedy.logprob == pytest.approx(math.log(softmax[3]), abs=1e-6)
    assert [t for t, _ in greedy.top] == [0, 3]
    assert greedy.top[0][1] == pytest.approx(math.log(softmax[0]), abs=1e-6)
    # Temperature 0.5 and top-k 2: the distribution over {0, 3} of logits / 0.5.
    [sampled] = token_logprobs(logits, [3], SamplingParams(temperature=0.5, top_k=2), 3)
    kept = np.exp(np.array([2.0, 1.0]) / 0.5)
    assert sampled.logprob == pytest.approx(math.log(kept[1] / kept.sum()), abs=1e-6)
    assert [t for t, _ in sampled.top[:2]] == [0, 3] and sampled.top[2][1] == -math.inf
    # Values are float32, as the wire carries them.
    assert sampled.logprob == float(np.float32(sampled.logprob))


def test_top_logprobs_break_ties_towards_the_lower_id():
    logits = np.array([[1.0, 3.0, 3.0, 1.0, 3.0]])
    [t] = token_logprobs(logits, [4], SamplingParams(), 4)
    assert [i for i, _ in t.top] == [1, 2, 4, 0]


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("frequency_penalty", 2.5),
        ("presence_penalty", -2.01),
        ("presence_penalty", math.nan),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", 11.0),
        ("logit_bias", ((5, 101.0),)),
        ("logit_bias", ((5, 1.0), (5, 2.0))),
        ("logit_bias", tuple((i, 1.0) for i in range(301))),
    ],
)
def test_out_of_range_fields_are_named(field, value):
    with pytest.raises(InvalidSampling, match=field):
        SamplingParams(**{field: value}).validate()


def test_the_wire_carries_them_and_is_unchanged_without_them():
    params = SamplingParams(0.7, 5, 0.9, 3, ((4, -1.5), (2, 100.0)), 1.2, 0.5, -0.5)
    spec = SessionSpec((1, 2), params, 8, top_logprobs=3)
    back = wire.spec_from_proto(wire.spec_to_proto(spec))
    assert back.sampling == SamplingParams(0.7, 5, 0.9, 3, ((2, 100.0), (4, -1.5)), 1.2, 0.5, -0.5)
    assert back.top_logprobs == 3
    assert wire.spec_from_proto(wire.spec_to_proto(SessionSpec((1, 2)))).top_logprobs is None
    assert wire.spec_to_proto(SessionSpec((1, 2))) == wire.spec_to_proto(
        SessionSpec((1, 2), SamplingParams())
    )
    logprobs = (TokenLogprob(-0.5, ((3, -0.5), (9, -1.25))), TokenLogprob(-2.0, ()))
    verdict = Verdict(1, 2, 1, 7, None, False, 4, 5, logprobs=logprobs)
    assert wire.verdict_from_proto(wire.verdict_to_proto(verdict)) == verdict
    # Without them the messages are what they were: no field set, not a byte more.
    plain = wire.spec_to_proto(SessionSpec((1, 2)))
    assert not plain.HasField("top_logprobs") and not plain.sampling.HasField("repetition_penalty")
    assert plain.sampling.ByteSize() == 9  # top_p alone, as before
    assert not wire.verdict_to_proto(Verdict(1, 2, 1, 7, None, False, 4, 5)).logprobs


def test_the_edge_refuses_logprobs_it_did_not_ask_for_or_cannot_read():
    from edge_client.planner import BadVerdict, check_logprobs

    one = (TokenLogprob(-0.5, ((3, -0.5), (4, -1.0))),)
    verdict = Verdict(1, 2, 0, 3, None, False, 3, 3, logprobs=one)
    check_logprobs(verdict, 1, 2, 10)  # as asked
    for committed, top, vocab, why in (
        (1, None, 10, "1 logprobs for 0"),
        (2, 2, 10, "for 2 tokens"),
        (1, 1, 10, "more than 1"),
        (1, 2, 4, "outside the vocabulary"),
    ):
        with pytest.raises(BadVerdict, match=why):
            check_logprobs(verdict, committed, top, vocab)
