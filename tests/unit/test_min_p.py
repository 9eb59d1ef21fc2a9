"""min_p: the kept set and the draws against transformers' own warpers (an independent reference), its
domain, and its way over the wire."""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import MinPLogitsWarper, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from draftwire import wire
from draftwire.contract import InvalidSampling, SamplingParams
from draftwire.rules import choose_tokens, filtered_logits


def hf_scores(logits: torch.Tensor, p: SamplingParams) -> torch.Tensor:
    """transformers' warpers in `generate`'s order: temperature, top-k, top-p, min-p.  # [n, vocab]"""
    scores = TemperatureLogitsWarper(p.temperature)(None, logits.double())
    if p.top_k:
        scores = TopKLogitsWarper(p.top_k)(None, scores)
    if p.top_p < 1.0:
        scores = TopPLogitsWarper(p.top_p)(None, scores)
    if p.min_p > 0.0:
        scores = MinPLogitsWarper(p.min_p)(None, scores)
    return scores


CASES = [
    SamplingParams(1.0, min_p=0.05),
    SamplingParams(0.7, min_p=0.3),
    SamplingParams(1.5, min_p=0.9),
    SamplingParams(1.0, min_p=1.0),  # the likeliest alone
    SamplingParams(1.0, top_k=5, min_p=0.2),
    SamplingParams(0.8, top_p=0.6, min_p=0.1),  # top-p counts mass before min-p drops anything
    SamplingParams(1.1, top_k=20, top_p=0.9, min_p=0.05),
]


@pytest.mark.parametrize("params", CASES, ids=str)
def test_the_kept_tokens_are_transformers(params):
    logits = torch.randn(8, 64, generator=torch.Generator().manual_seed(3)) * 2.5
    ours = np.isfinite(filtered_logits(logits.numpy(), params))
    theirs = np.isfinite(hf_scores(logits, params).numpy())
    assert (ours == theirs).all()
    assert ours.sum() < ours.size  # the case filters something


def test_min_p_keeps_tokens_at_least_that_fraction_as_likely_as_the_likeliest():
    probs = np.array([[0.5, 0.25, 0.2, 0.05]])
    kept = np.isfinite(filtered_logits(np.log(probs), SamplingParams(1.0, min_p=0.4)))
    assert kept.tolist() == [[True, True, True, False]]  # 0.2 >= 0.4 * 0.5 is kept, 0.05 is not


@pytest.mark.parametrize("temperature, top_p, min_p", [(1.0, 1.0, 0.1), (0.7, 0.9, 0.2)])
def test_keyed_sampling_with_min_p_follows_transformers_distribution(temperature, top_p, min_p):
    logits = torch.randn(1, 12, generator=torch.Generator().manual_seed(1)) * 1.5
    params = SamplingParams(temperature, top_p=top_p, min_p=min_p)
    probs = torch.softmax(hf_scores(logits, params)[0], -1).numpy()
    draws = [
        int(choose_tokens(logits.numpy(), 17, SamplingParams(temperature, 0, top_p, seed, min_p=min_p))[0])
        for seed in range(3000)
    ]
    counts = np.bincount(draws, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, "drew a token that min-p removes"
    assert stats.chisquare(counts[support], probs[support] * len(draws)).pvalue > 0.001


@pytest.mark.parametrize("value", [-0.1, 1.5, math.nan, math.inf])
def test_min_p_outside_its_domain_is_refused(value):
    with pytest.raises(InvalidSampling, match="min_p"):
        SamplingParams(1.0, min_p=value).validate()


def test_min_p_crosses_the_wire():
    params = SamplingParams(0.8, 3, 0.9, 7, min_p=0.25)
    assert wire.sampling_from_proto(wire.sampling_to_proto(params)) == params
    assert wire.sampling_from_proto(wire.sampling_to_proto(SamplingParams())).min_p == 0.0
