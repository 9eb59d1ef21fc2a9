"""The device check's arithmetic and verdicts (tools/bench/gpu_check.py), from figures given here: CI runs the
check itself (scripts/gpu_check.sh --device cpu)."""

from dataclasses import replace

import pytest

from tools.bench.gpu_check import (
    PLANS,
    Capacity,
    Cost,
    LoadProof,
    Report,
    ServedCheck,
    capacity_goal,
    cost_goal,
    exact_goal,
    verified_per_round,
)


@pytest.mark.parametrize("gamma", [1, 4, 8])
@pytest.mark.parametrize("acceptance", [0.0, 0.733, 0.85])
def test_a_round_commits_the_accepted_drafts_and_the_targets_token(acceptance, gamma):
    # Draft token k is reached with probability a^k; the target's own token always comes.
    expected = sum(acceptance**k for k in range(gamma + 1))
    assert verified_per_round(acceptance, gamma) == pytest.approx(expected)
    assert verified_per_round(1.0, gamma) == gamma + 1


def report(**figures) -> Report:
    return Report("cuda", "real", {}, list(PLANS["real"].shapes[:1]), **figures)


def served(mismatched=()) -> ServedCheck:
    return ServedCheck("Qwen2.5-1.5B", "bfloat16", "seeded", (1, 2), 8, tuple(mismatched), 0.4, 1.5, 2.0, 1.0)


def test_capacity_is_judged_at_64_sessions_on_the_best_gamma_against_plain_serving():
    # At 0.85, γ 4 commits 3.71 tokens a round and γ 6 4.53: verify rounds of 2x and 1.5x a decode step.
    rows = [
        Capacity("Qwen2.5-1.5B", "bfloat16", 64, 4, verify_ms=20, decode_plain_ms=10, decode_exact_ms=10),
        Capacity("Qwen2.5-1.5B", "bfloat16", 64, 6, verify_ms=15, decode_plain_ms=10, decode_exact_ms=5),
        Capacity("Qwen2.5-1.5B", "bfloat16", 16, 6, verify_ms=1, decode_plain_ms=10, decode_exact_ms=10),
    ]
    goal = capacity_goal(report(capacity=rows))
    assert goal.passed and "γ 6): 3.02x plain, 1.51x exact" in goal.detail
    assert not capacity_goal(report(capacity=rows[:1])).passed
    assert capacity_goal(report(capacity=rows[2:])).passed is None


def test_the_cost_goal_reads_the_bfloat16_verify_batch():
    rows = [
        Cost("Qwen2.5-1.5B", "bfloat16", "verify 16 sessions x 5 positions at 512", plain_ms=10, exact_ms=12),
        Cost("Qwen2.5-1.5B", "bfloat16", "prefill of 2000 positions", plain_ms=10, exact_ms=30),
        Cost("Qwen2.5-1.5B", "float32", "verify 16 sessions x 5 positions at 512", plain_ms=10, exact_ms=30),
    ]
    assert cost_goal(report(cost=rows)).passed
    assert not cost_goal(report(cost=[replace(rows[0], exact_ms=13)])).passed
    assert cost_goal(report(cost=rows[1:])).passed is None


def test_bfloat16_refused_fails_its_goal_not_the_run():
    loads = [
        LoadProof("Qwen2.5-1.5B", "float32", True, 1.0, "float32/portable-NVIDIA_H200/cuda/exact"),
        LoadProof("Qwen2.5-1.5B", "bfloat16", False, 1.0, refusal="NoExactPath: not here"),
    ]
    run = report(loads=loads, served=[served()])
    goal = exact_goal(run)
    assert goal.passed is False and "NoExactPath: not here" in goal.detail
    assert run.exact


def test_a_served_token_off_reference_fails_the_run():
    loads = [LoadProof("Qwen2.5-1.5B", "bfloat16", True, 1.0, "bfloat16/portable-NVIDIA_H200/cuda/exact")]
    assert report(loads=loads, served=[served()]).exact
    wrong = report(loads=loads, served=[served(mismatched=[1])])
    assert not wrong.exact
    assert not exact_goal(wrong).passed and "1 of 2 sessions" in exact_goal(wrong).detail
    assert not report(served=[served()]).exact  # no dtype proven exact at load
