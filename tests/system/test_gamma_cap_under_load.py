"""The verifier's γ cap under load, end to end through the batcher and the sessions: busy edges hear a
falling cap in their verdicts, obey it, and commit the target's tokens (the cap's rules alone, on
simulated batches: tests/unit/test_gamma_cap.py). An engine that sleeps for its cost stands for the
target."""

from __future__ import annotations

import asyncio
import random

from draftwire.contract import Proposal, SessionSpec
from tests.unit.test_batcher import run
from tools.testkit.fakes import VOCAB, FakeEngine, target_continuation
from verifier_service.batcher import BatchConfig, Batcher
from verifier_service.gamma_cap import CapConfig, GammaCap
from verifier_service.session import VerifierLimits, VerifierSession


def test_busy_sessions_hear_a_falling_cap_in_their_verdicts_and_commit_the_targets_tokens():
    """Eight edges that obey the cap, each drafting 8 tokens at first, accepted i.i.d. at 0.6, on an
    engine whose batch costs 8 ms plus 4 ms a position. By hand, at B = 8 rows:
    S(1) = 8·1.6/0.072 = 178, S(2) = 8·1.96/0.104 = 151 tokens per engine second: γ* = 1.

    The engine's time is long beside the edges' own, so that it stays busy, and the cap under full
    pressure, when the test shares the machine (at 2 ms + 1 ms a position it did not, under xdist); it
    sleeps for seconds in all, so it runs in this tier."""
    engine = FakeEngine()
    engine.slow_s, engine.slow_per_position_s = 0.008, 0.004
    new_tokens = 80

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

    async def edges(batcher: Batcher):
        return await asyncio.gather(*(edge(batcher, i) for i in range(8)))

    cap = GammaCap(8, CapConfig(dwell=1, memory_s=0.2))
    results, _ = run(BatchConfig(window_s=0.005), edges, engine, cap)
    for i, (generated, caps) in enumerate(results):
        assert generated == target_continuation((3 + i, 7, 11 + i), new_tokens)
        assert min(caps) == 1 and caps[-1] <= 2 and all(1 <= c <= 8 for c in caps)
