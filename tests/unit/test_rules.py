"""Tables of hand-built cases for the verification rules, and statistical checks of keyed sampling."""

import math

import numpy as np
import pytest
import torch
from scipy import stats
from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

from draftwire.contract import Finish, InvalidSampling, SamplingParams
from draftwire.rules import (
    choose_tokens,
    commit_round,
    count_accepted,
    filtered_logits,
    keyed_uniform,
)

V = 8


def peaked(*argmaxes: int) -> np.ndarray:
    """Logits whose argmax per row is known.  # [len(argmaxes), V]"""
    logits = np.zeros((len(argmaxes), V), dtype=np.float32)
    for row, token in enumerate(argmaxes):
        logits[row, token] = 5.0
    return logits


GREEDY_CASES = [
    # draft, target argmaxes (gamma + 1), accepted, target token (correction or bonus)
    pytest.param([1, 2, 3], [1, 2, 3, 4], 3, 4, id="perfect match, bonus"),
    pytest.param([1, 2, 3], [1, 5, 3, 4], 1, 5, id="early mismatch, correction"),
    pytest.param([1, 2, 3], [7, 2, 3, 4], 0, 7, id="all rejected"),
    pytest.param([1, 2, 3], [1, 2, 6, 4], 2, 6, id="last rejected"),
    pytest.param([1, 2, 3, 4], [1, 6, 3, 4, 5], 1, 6, id="matches after a mismatch do not count"),
    pytest.param([4], [4, 0], 1, 0, id="gamma 1 bonus"),
    pytest.param([], [3], 0, 3, id="gamma 0: the target alone"),
]


@pytest.mark.parametrize("draft, argmaxes, accepted, target_token", GREEDY_CASES)
def test_greedy_round(draft, argmaxes, accepted, target_token):
    target = choose_tokens(peaked(*argmaxes), first_position=10, params=SamplingParams()).tolist()
    assert target == argmaxes
    assert commit_round(draft, target, stop_token_ids=(), budget=100) == (accepted, target_token, None)


@pytest.mark.parametrize(
    "draft, target, stops, budget, expected",
    [
        pytest.param([1, 2, 3], [1, 2, 3, 4], {2}, 100, (2, None, Finish.STOP), id="stop inside accepted"),
        pytest.param([1, 2, 3], [1, 5, 3, 4], {5}, 100, (1, 5, Finish.STOP), id="stop is the correction"),
        pytest.param([1, 2, 3], [1, 2, 3, 4], {4}, 100, (3, 4, Finish.STOP), id="stop is the bonus"),
        pytest.param([1, 2, 3], [1, 2, 3, 4], {}, 2, (2, None, Finish.LENGTH), id="budget inside accepted"),
        pytest.param([1, 2, 3], [1, 2, 3, 4], {}, 4, (3, 4, Finish.LENGTH), id="budget is exactly met"),
        pytest.param([1, 2, 3], [9, 2, 3, 4], {}, 1, (0, 9, Finish.LENGTH), id="budget of one"),
        pytest.param([1, 2, 3], [1, 2, 3, 4], {3}, 2, (2, None, Finish.LENGTH), id="stop past the budget"),
        pytest.param([1, 2, 3], [1, 2, 3, 4], {1}, 1, (1, None, Finish.STOP), id="stop at the budget"),
    ],
)
def test_commit_round_stops_and_budget(draft, target, stops, budget, expected):
    assert commit_round(draft, target, stops, budget) == expected


def test_count_accepted_needs_equal_prefix():
    assert count_accepted([3, 3], [3, 3, 1]) == 2
    assert count_accepted([3, 3], [2, 3, 1]) == 0


LOGITS = np.array([[4.0, 3.0, 2.5, 2.0, 1.0, 0.5, 0.0, -1.0]], dtype=np.float32)


@pytest.mark.parametrize(
    "top_k, top_p, kept",
    [
        pytest.param(0, 1.0, list(range(V)), id="no filter"),
        pytest.param(1, 1.0, [0], id="top-k 1"),
        pytest.param(3, 1.0, [0, 1, 2], id="top-k 3"),
        pytest.param(V + 5, 1.0, list(range(V)), id="top-k above vocab"),
        pytest.param(0, 1e-9, [0], id="tiny top-p keeps the most likely"),
        pytest.param(0, 0.5, [0], id="top-p below the first mass"),
        pytest.param(0, 0.7, [0, 1], id="top-p crossing the second"),
        pytest.param(2, 0.99, [0, 1], id="top-k before top-p"),
    ],
)
def test_filtered_logits_keeps_expected_set(top_k, top_p, kept):
    out = filtered_logits(LOGITS, SamplingParams(temperature=1.0, top_k=top_k, top_p=top_p, seed=0))
    assert np.flatnonzero(np.isfinite(out[0])).tolist() == kept


def test_top_p_boundary_is_inclusive_of_crossing_token():
    probs = torch.softmax(torch.from_numpy(LOGITS[0]).double(), -1)
    p_first = float(probs[0])
    # Exactly the first token's mass: it reaches top_p, so only it is kept.
    out = filtered_logits(LOGITS, SamplingParams(temperature=1.0, top_p=p_first, seed=0))
    assert np.isfinite(out[0]).sum() == 1
    out = filtered_logits(LOGITS, SamplingParams(temperature=1.0, top_p=p_first + 1e-6, seed=0))
    assert np.isfinite(out[0]).sum() == 2


def test_keyed_noise_depends_only_on_seed_and_position():
    a = keyed_uniform(7, 42, 100)
    assert np.array_equal(a, keyed_uniform(7, 42, 100))
    assert np.array_equal(keyed_uniform(7, 42, 50), a[:50])  # a longer vocabulary extends, never reshuffles
    assert not np.array_equal(a, keyed_uniform(7, 43, 100))
    assert not np.array_equal(a, keyed_uniform(8, 42, 100))


def test_sampled_token_does_not_depend_on_how_many_positions_are_chosen_together():
    logits = np.random.default_rng(0).standard_normal((6, 50)).astype(np.float32)
    params = SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=123)
    together = choose_tokens(logits, 100, params).tolist()
    alone = [int(choose_tokens(logits[i : i + 1], 100 + i, params)[0]) for i in range(6)]
    assert together == alone


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", math.nan),
        ("temperature", math.inf),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_p", math.nan),
        ("top_k", -1),
        ("seed", 2**64),
    ],
)
def test_invalid_sampling_is_refused(field, value):
    with pytest.raises(InvalidSampling, match=field):
        SamplingParams(**{"temperature": 1.0, field: value}).validate()


def hf_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """The reference distribution from transformers' own logits warpers.  # [vocab]"""
    scores = logits.double()[None]
    scores = TemperatureLogitsWarper(temperature)(None, scores)
    if top_k:
        scores = TopKLogitsWarper(top_k)(None, scores)
    if top_p < 1.0:
        scores = TopPLogitsWarper(top_p)(None, scores)
    return torch.softmax(scores[0], -1).numpy()


def chi_square_p(samples: list[int], probs: np.ndarray) -> float:
    """p-value that `samples` follow `probs`; tokens with zero probability must never appear."""
    counts = np.bincount(samples, minlength=len(probs))
    support = probs > 0
    assert counts[~support].sum() == 0, "sampled a token that the filters remove"
    return stats.chisquare(counts[support], probs[support] * len(samples)).pvalue


@pytest.mark.parametrize(
    "temperature, top_k, top_p", [(1.0, 0, 1.0), (0.7, 0, 1.0), (1.3, 5, 1.0), (0.8, 0, 0.8)]
)
def test_keyed_sampling_follows_the_filtered_softmax(temperature, top_k, top_p):
    torch.manual_seed(1)
    logits = torch.randn(12) * 1.5
    probs = hf_probs(logits, temperature, top_k, top_p)
    samples = [
        int(choose_tokens(logits[None].numpy(), 17, SamplingParams(temperature, top_k, top_p, seed))[0])
        for seed in range(3000)
    ]
    assert chi_square_p(samples, probs) > 0.001
