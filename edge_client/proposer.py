"""The drafter as a session calls it: tokens in, draft tokens out, on the drafter's executor, under the
draft's matcher of a constrained request (compiled once per constraint)."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Collection, Sequence
from concurrent.futures import Executor
from typing import Protocol

from draftwire.contract import Constraint, SamplingParams
from draftwire.grammar import Matcher
from draftwire.vocab import Vocabulary
from edge_client.planner import DraftJob, GenerationRequest

MATCHERS_KEPT = 8  # constraints whose draft matcher a Proposer keeps (compiled once each)


class Drafter(Protocol):
    """What a session needs from a drafter: its vocabulary, and tokens in, draft tokens out."""

    vocabulary: Vocabulary
    executor: Executor | None  # where propose runs; None: on the event loop (it must be cheap)

    def propose(
        self,
        sequence: Sequence[int],
        gamma: int,
        params: SamplingParams,
        stop_token_ids: Collection[int] = (),
        prompt_length: int = 0,
    ) -> list[int]: ...


class Proposer:
    """Calls one drafter for a session's draft jobs."""

    def __init__(self, drafter: Drafter):
        self.drafter = drafter
        self._matchers: dict[Constraint, Matcher | None] = {}  # the draft's, by constraint (_matcher)

    async def propose(
        self, job: DraftJob, request: GenerationRequest, stops: Collection[int], eos_token_ids: Sequence[int]
    ) -> list[int]:
        """The draft tokens of `job` (a job of γ 0 is a plain step: the session drafts nothing)."""
        params = request.sampling
        executor, prompt_length = self.drafter.executor, len(request.prompt_token_ids)
        matcher = await self._matcher(request, eos_token_ids)
        extra = {"matcher": matcher, "most": job.most} if matcher is not None else {}
        propose = functools.partial(self.drafter.propose, **extra)
        if executor is None:
            return propose(job.base, job.gamma, params, stops, prompt_length)
        return await asyncio.get_running_loop().run_in_executor(
            executor, propose, job.base, job.gamma, params, stops, prompt_length
        )

    async def _matcher(self, request: GenerationRequest, eos: Sequence[int]) -> Matcher | None:
        """The draft's matcher of a constrained request, so that it proposes under the verifier's mask;
        None unconstrained, or where the drafter builds none (it then drafts unmasked, and the verifier
        rejects what the constraint refuses). Kept per constraint: a matcher follows whatever sequence
        it is given (it rolls back to where the sequences part), so requests of one constraint share it."""
        build = getattr(self.drafter, "constraint_matcher", None)
        if request.constraint is None or build is None:
            return None
        if request.constraint not in self._matchers:
            if self.drafter.executor is None:
                matcher = build(request.constraint, eos)
            else:
                loop = asyncio.get_running_loop()
                matcher = await loop.run_in_executor(self.drafter.executor, build, request.constraint, eos)
            while len(self._matchers) >= MATCHERS_KEPT:
                del self._matchers[next(iter(self._matchers))]
            self._matchers[request.constraint] = matcher
        return self._matchers[request.constraint]
