"""Sampling values whose arithmetic overflows, and ids past 32 bits, are refused by the contract that
every entry point validates with (the CLI, the OpenAI API, the verifier): a tiny temperature or
repetition penalty divides the logits into inf and NaN, and a logit_bias id of 2**32 or more was cut to
its low 32 bits on the wire. JSON output stays JSON whatever a float holds (draftwire/jsonout.py)."""

import json
import math

import pytest

from draftwire import jsonout
from draftwire.contract import MIN_DIVISOR, InvalidSampling, SamplingParams


@pytest.mark.parametrize(
    "params, field",
    [
        (SamplingParams(temperature=5e-324), "temperature"),
        (SamplingParams(temperature=MIN_DIVISOR / 2), "temperature"),
        (SamplingParams(repetition_penalty=5e-324), "repetition_penalty"),
        (SamplingParams(repetition_penalty=MIN_DIVISOR / 2), "repetition_penalty"),
        (SamplingParams(logit_bias=((2**32, 1.0),)), "logit_bias"),
        (SamplingParams(logit_bias=((4294968073, 100.0),)), "logit_bias"),  # acted as 777 before
        (SamplingParams(logit_bias=((-1, 1.0),)), "logit_bias"),
    ],
)
def test_values_that_overflow_and_ids_past_32_bits_are_refused(params, field):
    with pytest.raises(InvalidSampling, match=field):
        params.validate()


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=MIN_DIVISOR),
        SamplingParams(repetition_penalty=MIN_DIVISOR),
        SamplingParams(logit_bias=((2**32 - 1, -100.0),)),
    ],
)
def test_the_smallest_values_allowed_are_taken(params):
    assert params.validate() is params


def test_the_least_divisor_keeps_the_logits_finite():
    """The rule's reason, at its edge: the largest logit a bias can make, divided by MIN_DIVISOR, stays
    finite in float32 (what the target's softmax runs in)."""
    import numpy as np

    assert np.isfinite(np.float32(200.0) / np.float32(MIN_DIVISOR))
    assert not np.isfinite(np.float32(200.0) / np.float32(5e-324))


def test_json_output_is_always_json():
    value = {"logprob": math.nan, "top": [[1, -math.inf], [2, 0.5]], "t": (math.inf,), "ok": 1.0}
    text = jsonout.dumps(value)
    assert json.loads(text) == {"logprob": None, "top": [[1, None], [2, 0.5]], "t": [None], "ok": 1.0}
    with pytest.raises(ValueError):
        json.loads(json.dumps(value), parse_constant=lambda c: (_ for _ in ()).throw(ValueError(c)))
