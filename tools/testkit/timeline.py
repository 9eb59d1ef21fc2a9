"""The edge's round loop on a virtual clock: the real Planner, driven in the order EdgeSession._stream
drives it (a waiting verdict first, then a drafted proposal to send, then a draft, else wait), against
the fake verifier, with given costs for drafting, the wire and the verifier's forwards. What it measures
is what the planner's pipelining does with those costs, free of any machine's noise: the ground truth
that edge_client.adaptive's model of tokens per second is tested against. Torch-free.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from draftwire.contract import ModelInfo
from edge_client.planner import GenerationRequest, Planner
from tools.testkit.fakes import FakeVerifier, MistakenDrafter, fake_info


@dataclass(frozen=True)
class Costs:
    """Seconds: a drafter call of n tokens takes draft_fixed + draft_token · n; a forward over n positions
    verify_fixed + verify_position · n (a stale proposal is answered without one); the wire rtt, half
    each way. Each figure is scaled by a uniform factor in [1 - jitter, 1 + jitter]."""

    draft_fixed: float
    draft_token: float
    verify_fixed: float
    verify_position: float
    rtt: float
    jitter: float = 0.0


def tokens_per_second(
    costs: Costs, acceptance: float, gamma: int, depth: int, tokens: int = 1000, seed: int = 0
) -> float:
    """Committed tokens per virtual second of one generation of `tokens` at (γ, depth), each draft
    token (and each guessed bonus) right with probability `acceptance`, independently."""
    rng = random.Random(seed)
    prompt = [5, 6, 7]

    def scaled(seconds: float) -> float:
        return seconds * rng.uniform(1 - costs.jitter, 1 + costs.jitter)

    wrong = {p for p in range(len(prompt), len(prompt) + tokens + 64) if rng.random() > acceptance}
    info = ModelInfo(
        fake_info(max_context=len(prompt) + tokens + 64), max_gamma=16, max_message_bytes=1 << 20
    )
    request = GenerationRequest(prompt, max_new_tokens=tokens, gamma=gamma, ignore_eos=True, pipeline=depth)
    plan = Planner(request, info)
    verifier, drafter = (
        FakeVerifier(request.spec(), max_context=info.target.max_context),
        MistakenDrafter(wrong),
    )
    now = server_free = 0.0
    coming: list[tuple[float, object]] = []  # (arrival at the edge, verdict), in order
    while not plan.finished:
        if coming and coming[0][0] <= now:
            plan.apply(coming.pop(0)[1])
        elif (proposal := plan.next_proposal()) is not None:
            verdict = verifier.answer(proposal)
            forward = (
                0.0
                if verdict.stale
                else costs.verify_fixed + costs.verify_position * (len(proposal.draft_token_ids) + 1)
            )
            server_free = max(now + scaled(costs.rtt / 2), server_free) + scaled(forward)
            coming.append((server_free + scaled(costs.rtt / 2), verdict))
        elif (job := plan.next_draft()) is not None:
            tokens_drafted = drafter.propose(job.base, job.gamma, request.sampling, plan.stops)
            now += scaled(costs.draft_fixed + costs.draft_token * job.gamma)
            plan.add_draft(job, tokens_drafted)
        else:
            now = max(now, coming[0][0])
    return plan.stats.generated_tokens / now
