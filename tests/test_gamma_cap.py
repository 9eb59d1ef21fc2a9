"""The verifier's γ cap under load (verifier_service/gamma_cap.py). Fed the figures of simulated batches:
it stays off while the engine has room, falls to the γ that serves the most tokens per engine second
when the engine is the bottleneck (worked out by hand below for three cost lines), and moves without a
cliff. Then in the verifier's sessions over a fake engine whose forward costs its positions: the verdicts
of busy sessions advertise it, and the tokens do not change. The gauge of a live server: test_metrics.py."""

import asyncio
import itertools
import random

import pytest

from draftwire.contract import Proposal, SessionSpec
from tools.testkit.fakes import VOCAB, FakeEngine, target_continuation
from verifier_service.batcher import BatchConfig, Batcher
from verifier_service.gamma_cap import CapConfig, GammaCap
from verifier_service.session import VerifierLimits, VerifierSession

CPU = (0.025, 0.007)  # a forward's seconds: fixed, per position (one core, SmolLM2-135M-like)
GPU = (0.020, 0.00002)  # nearly flat in positions


def simulate(cap: GammaCap, batches: int, rows, busy, alpha: float, edge_gamma: int = 8, costs=CPU, seed=0):
    """Feeds `batches` batches: `rows(i)` sessions a batch, each sending min(edge_gamma, cap) draft
    tokens accepted i.i.d. at `alpha`, the engine busy `busy(i)` of the time. Returns the cap after
    each batch."""
    rng = random.Random(seed)
    caps = []
    for i in range(batches):
        gamma = min(edge_gamma, cap.value)
        for _ in range(rows(i)):
            accepted = 0
            while accepted < gamma and rng.random() < alpha:
                accepted += 1
            cap.observe_round(gamma, accepted)
        positions = rows(i) * (gamma + 1)
        seconds = costs[0] + costs[1] * positions
        cap.observe_batch(rows(i), positions, seconds, seconds / busy(i))
        caps.append(cap.value)
    return caps


def test_an_engine_with_room_caps_nothing():
    cap = GammaCap(16)
    caps = simulate(cap, 300, rows=lambda i: 16, busy=lambda i: 0.45, alpha=0.8)
    assert set(caps) == {16}


# Served tokens per engine second, S(γ) = B·E(γ) / (F + s·B·(γ+1)), E(γ) = (1 - α^(γ+1)) / (1 - α):
#   B = 4, α = 0.9, CPU:  S(1) = 7.60/0.081 = 93.8   S(2) = 10.84/0.109 = 99.4   S(3) = 13.76/0.137 = 100.4
#                         S(4) = 16.38/0.165 = 99.3   -> γ* = 3
#   B = 16, α = 0.8, CPU: S(1) = 28.8/0.249 = 115.7   S(2) = 39.0/0.361 = 108.1   -> γ* = 1
#   B = 16, α = 0.9, GPU: S(8) = 98.1/0.02288 = 4287   S(16) = 133.3/0.02544 = 5240 -> γ* = 16
@pytest.mark.parametrize(
    "rows, alpha, costs, best", [(4, 0.9, CPU, 3), (16, 0.8, CPU, 1), (16, 0.9, GPU, 16)]
)
def test_a_saturated_engine_caps_at_the_gamma_that_serves_the_most(rows, alpha, costs, best):
    cap = GammaCap(16)
    caps = simulate(
        cap, 400, rows=lambda i: rows, busy=lambda i: 1.0, alpha=alpha, edge_gamma=16, costs=costs
    )
    assert caps[-1] == best
    assert cap.best_gamma() == best


@pytest.mark.parametrize("shape", ["ramp", "step"])
def test_the_cap_moves_a_step_at_a_time_and_never_turns_speculation_off(shape):
    """Load rises to saturation and falls back, gradually or at once: below the largest γ the edges send,
    the cap moves by at most one step per `dwell` batches (no cliff); it drops faster only while it binds
    nobody."""
    config = CapConfig()
    cap = GammaCap(16, config)
    n = 1200
    if shape == "ramp":
        ramp = [min(i, n - i) / (n / 2) for i in range(n)]  # 0 -> 1 -> 0
    else:
        ramp = [1.0 if n / 4 <= i < 3 * n / 4 else 0.0 for i in range(n)]
    caps = simulate(
        cap, n, rows=lambda i: 1 + round(31 * ramp[i]), busy=lambda i: 0.3 + 0.7 * ramp[i], alpha=0.8
    )
    assert min(caps) == 1 and caps[-1] == 16  # it went all the way down, and back up when the load left
    edge_gamma = 8
    for before, after in itertools.pairwise(caps):
        if before <= edge_gamma:
            assert abs(after - before) <= 1
        else:  # binding nobody: it may come down to what the edges send, and a step below it
            assert after >= min(before - 1, edge_gamma - 1)
    moves = [i for i in range(1, n) if caps[i] != caps[i - 1] and caps[i - 1] <= edge_gamma]
    assert all(b - a >= config.dwell for a, b in itertools.pairwise(moves))


def test_a_disabled_cap_stays_at_max_gamma():
    cap = GammaCap(16, CapConfig(enabled=False))
    caps = simulate(cap, 200, rows=lambda i: 16, busy=lambda i: 1.0, alpha=0.8)
    assert set(caps) == {16}


def test_busy_sessions_hear_a_falling_cap_in_their_verdicts_and_commit_the_targets_tokens():
    """Eight edges that obey the cap, each drafting 8 tokens at first, accepted i.i.d. at 0.6, on an
    engine whose batch costs 2 ms plus 1 ms a position. By hand, at B = 8 rows:
    S(1) = 8·1.6/0.018 = 711, S(2) = 8·1.96/0.026 = 603 tokens per engine second: γ* = 1."""
    engine = FakeEngine()
    engine.slow_s, engine.slow_per_position_s = 0.002, 0.001
    new_tokens = 120

    async def edge(batcher: Batcher, i: int):
        prompt = (3 + i, 7, 11 + i)
        spec = SessionSpec(prompt, max_new_tokens=new_tokens, ignore_eos=True)
        session = await VerifierSession.open(batcher, spec, VerifierLimits(max_gamma=8))
        rng, gamma, caps = random.Random(i), 8, []
        while session.finish is None:
            draft = target_continuation(session.committed, gamma)
            for k in range(gamma):  # the first rejected position is drafted wrong
                if rng.random() > 0.6:
                    draft[k] = (draft[k] + 1) % VOCAB
                    break
            proposal = Proposal(session.last_round + 1, len(session.committed), tuple(draft))
            verdict = await session.play(proposal)
            caps.append(verdict.gamma_cap)
            gamma = min(8, verdict.gamma_cap)
        return session.generated, caps

    async def run():
        batcher = Batcher(engine, BatchConfig(window_s=0.005), GammaCap(8, CapConfig(dwell=1)))
        try:
            return await asyncio.gather(*(edge(batcher, i) for i in range(8)))
        finally:
            batcher.close()

    for i, (generated, caps) in enumerate(asyncio.run(run())):
        assert generated == target_continuation((3 + i, 7, 11 + i), new_tokens)
        assert min(caps) == 1 and caps[-1] <= 2 and all(1 <= c <= 8 for c in caps)
