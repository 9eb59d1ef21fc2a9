"""The edge's round loop on a virtual clock: the real Planner, driven in the order EdgeSession._stream
drives it (a waiting verdict first, then a drafted proposal to send, then a draft, else wait), against
the fake verifier, with given costs for drafting, the wire and the verifier's forwards. What it measures
is what the planner's pipelining does with those costs, free of any machine's noise: the ground truth
that edge_client.adaptive's model of tokens per second is tested against, and, with a Tuner choosing,
the whole adaptive policy (its estimates, the model and the hysteresis). Torch-free.
"""

from __future__ import annotations

import dataclasses
import random
from collections.abc import Callable
from dataclasses import dataclass

from draftwire.contract import ModelInfo, Verdict
from edge_client.adaptive import Tuner
from edge_client.planner import GenerationRequest, Planner
from tools.testkit.fakes import FakeVerifier, MistakenDrafter, fake_info, successor


@dataclass(frozen=True)
class Costs:
    """Seconds: a drafter call of n tokens takes draft_fixed + draft_token · n; a forward over n positions
    verify_fixed + verify_position · n (a stale proposal is answered without one); the wire rtt, half
    each way; each times `beside` side by side. Each figure is scaled by a uniform factor in
    [1 - jitter, 1 + jitter]."""

    draft_fixed: float
    draft_token: float
    verify_fixed: float
    verify_position: float
    rtt: float
    jitter: float = 0.0
    # A forward runs this many times slower while the drafter drafts beside it (so costs this much more
    # where it runs beside drafting all through), and a draft made ahead of a verdict costs this much
    # more: the drafter and the verifier sharing one machine's memory bandwidth (1.05-1.3 on the two-core
    # rig).
    beside: float = 1.0
    # The edge's own work on each verdict (streaming, detokenizing: the clock moves on while it applies
    # one), which no figure the tuner is told includes: a cost the speed model does not see.
    edge: float = 0.0


def tokens_per_second(
    costs: Costs,
    acceptance: float | Callable[[int], float],
    gamma: int | None,
    depth: int | None,
    tokens: int = 1000,
    seed: int = 0,
    tuner: Tuner | None = None,
    hand_off: bool = False,
) -> float:
    """Committed tokens per virtual second of one generation of `tokens` at (γ, depth), each draft
    token (and each guessed bonus) right with probability `acceptance` (or `acceptance(i)` at the i-th
    generated token), independently. A γ or depth of
    None is the tuner's to choose, fed through the planner as EdgeSession feeds it: each draft call's
    time, each verdict's forward and its round trip. `hand_off`: speculation off hands the session to
    the verifier (a leg: a round trip to open, then one forward a token, streamed), as EdgeSession does,
    after which a new planner takes it back."""
    rng = random.Random(seed)
    prompt = [5, 6, 7]

    def scaled(seconds: float) -> float:
        return seconds * rng.uniform(1 - costs.jitter, 1 + costs.jitter)

    rate = acceptance if callable(acceptance) else lambda _: acceptance
    wrong = {p for p in range(len(prompt), len(prompt) + tokens + 64) if rng.random() > rate(p - len(prompt))}
    info = ModelInfo(
        fake_info(max_context=len(prompt) + tokens + 64), max_gamma=16, max_message_bytes=1 << 20
    )
    request = GenerationRequest(prompt, max_new_tokens=tokens, gamma=gamma, ignore_eos=True, pipeline=depth)
    plan = Planner(request, info, tuner=tuner, hand_off=hand_off)
    verifier, drafter = (
        FakeVerifier(request.spec(), max_context=info.target.max_context),
        MistakenDrafter(wrong),
    )
    now = server_free = 0.0
    coming: list[_Coming] = []  # in order of arrival at the edge
    while not plan.finished:
        if coming and coming[0].arrival <= now:
            arrived = coming.pop(0)
            plan.apply(arrived.verdict, arrived.arrival)  # timed at its arrival, as EdgeSession's inbox does
            now = max(now, arrived.arrival) + scaled(costs.edge)
        elif (proposal := plan.next_proposal(now)) is not None:
            verdict = verifier.answer(proposal)
            forward = 0.0
            if not verdict.stale:
                positions = len(proposal.draft_token_ids) + 1
                forward = scaled(costs.verify_fixed + costs.verify_position * positions)
            start = max(now + scaled(costs.rtt / 2), server_free)
            server_free = start + forward
            verdict = dataclasses.replace(verdict, verify_seconds=forward)
            coming.append(_Coming(server_free + scaled(costs.rtt / 2), verdict, start, server_free))
        elif (job := plan.next_draft()) is not None and job.handoff:
            generated = plan.committed[len(prompt) :]
            for _ in range(job.handoff):  # the verifier decodes alone: the fake target's own tokens
                generated.append(successor(generated[-1] if generated else prompt[-1]))
                forward = scaled(costs.verify_fixed + costs.verify_position)
                plan.tuner.observe_verify(0, forward)
                now += forward
            now += scaled(costs.rtt)
            plan.tuner.observe_leg(job.handoff)
            plan.stats.generated_tokens += job.handoff
            if len(generated) >= tokens:
                break
            plan = Planner(request, info, generated, plan.stats, plan.tuner, hand_off)
            coming.clear()  # verdicts of stale proposals: the stream handed off was cancelled
            verifier = FakeVerifier(request.spec(generated), max_context=info.target.max_context)
        elif job is not None:
            drafted = drafter.propose(job.base, job.gamma, request.sampling, plan.stops)
            # A plain step (γ 0) calls no drafter (EdgeSession._draft).
            seconds = scaled(costs.draft_fixed + costs.draft_token * job.gamma) if job.gamma else 0.0
            seconds *= costs.beside if job.assumes else 1.0
            server_free += _slow_beside(coming, now, now + seconds, 1 - 1 / costs.beside)
            now += seconds
            plan.add_draft(job, drafted, seconds, now)
        else:
            now = max(now, coming[0].arrival)
    return plan.stats.generated_tokens / now


@dataclass
class _Coming:
    """A verdict on its way: its forward on the verifier from `start` to `end`, then the wire."""

    arrival: float
    verdict: Verdict
    start: float
    end: float


def _slow_beside(coming: list[_Coming], start: float, end: float, slowdown: float) -> float:
    """Drafting from `start` to `end` costs the forwards it overlaps `slowdown` of the overlap (the work
    a slower forward did not do meanwhile), and delays every later one as much; returns the verifier's
    total delay."""
    delay = 0.0
    for c in coming:
        c.start += delay  # a stale proposal's answer takes no forward: it overlaps nothing, but waits
        extra = slowdown * max(0.0, min(end, c.end + delay) - max(start, c.start))
        c.end += delay + extra
        c.arrival += delay + extra
        c.verdict = dataclasses.replace(c.verdict, verify_seconds=c.verdict.verify_seconds + extra)
        delay += extra
    return delay
