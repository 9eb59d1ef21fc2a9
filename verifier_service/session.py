"""A verification session: checks each proposal against the target and commits the round's tokens.

Knows the rules and the batcher, not the transport: requests come in as the contract's dataclasses,
contract violations go out as SessionError subclasses that the servicer maps to gRPC status codes.
`play` is the round, start to end; the servicer, the reference decoder and the tests all run it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from draftwire.contract import (
    MAX_TOP_LOGPROBS,
    Drafting,
    Finish,
    InvalidSampling,
    Proposal,
    SessionSpec,
    TokenLogprob,
    Verdict,
    generation_budget,
    is_stale,
    stop_set,
)
from draftwire.grammar import InvalidConstraint
from draftwire.ngram import NGRAM_GAMMA, ngram_draft
from draftwire.rules import adjusted_logits, choose_tokens, commit_round, masked_logits, token_logprobs
from verifier_service.batcher import Batcher, Engine
from verifier_service.constraints import grammar_tokenizer, session_matcher
from verifier_service.engine import Forward
from verifier_service.settings import VerifierLimits


class SessionError(Exception):
    """A request that breaks the contract; the message says what was wrong."""


class InvalidRequest(SessionError):
    """Malformed whatever the session's state (gRPC INVALID_ARGUMENT)."""


class WrongState(SessionError):
    """Well formed but not valid now: finished session, mismatched vocabulary (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class Round:
    """A round between `begin` and `complete`: what the target computes for one proposal."""

    proposal: Proposal
    draft: tuple[int, ...]  # the draft tokens verified (those past the budget are dropped)
    budget: int  # tokens this session may still generate
    forward: Forward  # the last committed token then the draft, on top of the session's cache


@dataclass
class VerifierStats:
    """Counters over all sessions of a process."""

    sessions_opened: int = 0
    rounds: int = 0
    generated_tokens: int = 0
    round_positions: int = 0
    prefill_positions: int = 0
    reused_positions: int = 0  # prefill positions taken from kept caches instead of computed
    drafts: int = 0  # verified proposals with at least one draft token
    draft_tokens: int = 0  # their draft tokens the target verified (those past the budget are not)
    accepted_tokens: int = 0
    accepted_per_position: list[int] = field(
        default_factory=list
    )  # [i]: proposals whose draft i was accepted
    stale_proposals: int = 0
    thin_sessions: int = 0  # sessions the verifier decoded itself
    plain_steps: int = 0  # edge sessions' verified rounds of no draft token (speculation off)
    handoffs: int = 0  # thin sessions an edge handed over while its speculation did not pay
    forced_tokens: int = 0  # committed tokens a constraint forced (Proposal.forced): not drafts

    @property
    def target_positions_per_token(self) -> float:
        return self.round_positions / self.generated_tokens if self.generated_tokens else 0.0


_keys = itertools.count(1)


class VerifierSession:
    """One session's committed tokens, rounds and KV cache (held by the batcher's engine under `key`)."""

    def __init__(
        self,
        batcher: Batcher,
        spec: SessionSpec,
        limits: VerifierLimits = VerifierLimits(),
        stats: VerifierStats | None = None,
        key: str | None = None,
        owner: str = "",
    ):
        """Validates the spec; raises InvalidRequest or WrongState. `open` also prefills. `owner`: the
        client the session belongs to; it starts only from caches its owner's sessions left."""
        self.batcher, self.spec, self.limits = batcher, spec, limits
        self.stats = stats if stats is not None else VerifierStats()
        self.key = key or f"s{next(_keys)}"
        self.owner = owner
        info = batcher.info
        self._check_served(spec, limits, info, batcher.engine.numerics.identity)
        # Lengths first: an oversized open is refused before anything looks at its ids.
        prompt_length = len(spec.prompt_token_ids)
        self.check_lengths(info, prompt_length, spec.max_new_tokens)
        self._check_ids(spec.prompt_token_ids, "prompt")
        self._check_ids(spec.generated_token_ids, "generated")
        if len(spec.stop_token_ids) > limits.max_stop_token_ids:
            raise InvalidRequest(
                f"{len(spec.stop_token_ids)} stop token ids: at most {limits.max_stop_token_ids}"
            )
        try:
            spec.sampling.validate()
        except InvalidSampling as e:
            raise InvalidRequest(str(e)) from None
        self._check_ids([token for token, _ in spec.sampling.logit_bias], "logit_bias")
        if spec.top_logprobs is not None and not 0 <= spec.top_logprobs <= MAX_TOP_LOGPROBS:
            raise InvalidRequest(f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {spec.top_logprobs}")
        self.max_new_tokens = generation_budget(spec.max_new_tokens, info.max_context, prompt_length)
        if len(spec.generated_token_ids) >= self.max_new_tokens:
            raise InvalidRequest(
                f"{len(spec.generated_token_ids)} tokens already generated: max_new_tokens "
                f"({self.max_new_tokens}) leaves nothing to generate"
            )
        self.stop_token_ids = stop_set(spec.stop_token_ids, spec.ignore_eos, info.eos_token_ids)
        self.matcher = self._constraint_matcher(spec)  # structured output: None when unconstrained
        self.committed = [*spec.prompt_token_ids, *spec.generated_token_ids]  # prompt + generated
        self.read_length = len(self.committed)  # a thin session: what its edge says it has read
        self.last_round = 0
        self.finish: Finish | None = None
        self.target_positions = 0  # positions the target computed for this session
        self.reused_positions = 0  # prefill positions taken from a kept cache

    @staticmethod
    def _check_served(spec: SessionSpec, limits: VerifierLimits, info, numerics: str) -> None:
        """Raises WrongState when this verifier cannot serve the session at all: thin sessions turned
        off, another vocabulary, or (a resume) other numerics."""
        if spec.thin and not limits.thin_sessions:
            raise WrongState(
                f"this verifier decodes no thin session (drafting {spec.drafting.value}): "
                "its operator keeps it for edges that draft"
            )
        if spec.tokenizer_fingerprint and spec.tokenizer_fingerprint != info.vocabulary.fingerprint:
            raise WrongState(
                f"vocabulary mismatch: the draft has {spec.vocab_size} tokens, fingerprint "
                f"{spec.tokenizer_fingerprint[:16]}; the target {info.target_id!r} has "
                f"{info.vocabulary.describe()}"
            )
        if spec.numerics and spec.numerics != numerics:
            raise WrongState(
                f"this session was verified with numerics {spec.numerics}; this verifier computes "
                f"{numerics}, which could give other tokens: it cannot continue the session here"
            )

    def _constraint_matcher(self, spec: SessionSpec):
        """The constraint's matcher after the resumed tokens; raises InvalidRequest for one that does not
        compile (naming the field) or that the resumed tokens break, WrongState where none is served."""
        if spec.constraint is None:
            return None
        if spec.ignore_eos:
            raise InvalidRequest("ignore_eos cannot go with a constraint: the output ends where it completes")
        try:
            matcher = session_matcher(self.batcher.engine, spec)
        except InvalidConstraint as e:
            raise InvalidRequest(str(e)) from None
        except LookupError as e:
            raise WrongState(str(e)) from None
        held = matcher.follow(spec.generated_token_ids)
        if held < len(spec.generated_token_ids):
            raise InvalidRequest(
                f"generated token {held} ({spec.generated_token_ids[held]}) breaks the session's constraint"
            )
        return matcher

    @staticmethod
    def check_lengths(info, prompt_length: int, max_new_tokens: int) -> None:
        """Raises InvalidRequest for an empty prompt, or one that with max_new_tokens exceeds the
        target's context: what the servicer asks of an open before it converts any id (a refused
        1 MiB open then costs a protobuf parse, not a walk over its ids)."""
        if not prompt_length:
            raise InvalidRequest("the prompt is empty: send at least one token id")
        if max_new_tokens > info.max_context - prompt_length:
            raise InvalidRequest(
                f"prompt ({prompt_length} tokens) plus max_new_tokens ({max_new_tokens}) "
                f"exceeds the target's context of {info.max_context}"
            )

    @property
    def max_positions(self) -> int:
        """The most positions the session's cache can come to hold: the prompt and every token it may
        generate (a round's draft is cut at the budget, `begin`). Its cache never grows past this
        (engine.adopt), so admission reserves exactly this much memory."""
        return len(self.spec.prompt_token_ids) + self.max_new_tokens

    @classmethod
    async def open(cls, batcher: Batcher, spec: SessionSpec, *args, admit=None, **kwargs) -> VerifierSession:
        """A validated session whose cache holds every committed position but the last: those a kept
        cache already holds (a conversation's earlier turns, `PrefixCache`) are taken from it, the rest
        computed. `admit(session)`, when given, runs once the spec is valid and before any work: what it
        raises (the servicer's admission refusal) ends the open with nothing held.

        Raises InvalidRequest or WrongState before any work, and what the engine raises.
        """
        if spec.constraint is not None:  # its vocabulary built once, off the loop (a second at 150k ids)
            await asyncio.to_thread(grammar_tokenizer, batcher.engine)
        session = cls(batcher, spec, *args, **kwargs)
        if admit is not None:
            admit(session)
        session.stats.sessions_opened += 1
        session.stats.thin_sessions += spec.thin
        session.stats.handoffs += spec.thin and spec.handoff
        batcher.join(session.key)
        try:
            prefix = session.committed[:-1]
            session.reused_positions = await batcher.adopt(
                session.key, prefix, session.owner, session.max_positions
            )
            session.target_positions = len(prefix) - session.reused_positions
            session.stats.prefill_positions += session.target_positions
            session.stats.reused_positions += session.reused_positions
            prefill = tuple(prefix[session.reused_positions :])
            await batcher.forward(Forward(session.key, session.reused_positions, prefill, wants_logits=False))
        except BaseException:
            session.close()
            raise
        return session

    @property
    def generated(self) -> list[int]:
        return self.committed[len(self.spec.prompt_token_ids) :]

    async def play(self, proposal: Proposal) -> Verdict:
        """One round, proposal to verdict:

        1. check the proposal against the contract and the committed tokens (a stale one is
           answered at once, without the target);
        2. run the target over the last committed token and the draft, batched with whatever
           other sessions' rounds are queued;
        3. choose the target's token at every position, accept the draft's matching prefix,
           commit it and the correction or bonus, cut at a stop or the budget;
        4. on a finish, free the KV cache.
        Raises InvalidRequest or WrongState (changing nothing), or what the engine raises.
        """
        begun = self.begin(proposal)
        if isinstance(begun, Verdict):
            return begun
        verdict = self.complete(begun, await self.batcher.forward(begun.forward))
        if verdict.finish is not None:
            self.close()
        return verdict

    def read(self, committed_length: int) -> None:
        """A thin session's edge has read the verdicts up to `committed_length`. Raises InvalidRequest
        for an edge session, or a length below an earlier one or past the committed tokens."""
        if not self.spec.thin:
            raise InvalidRequest("only a thin session sends `read`: an edge session sends proposals")
        if not self.read_length <= committed_length <= len(self.committed):
            raise InvalidRequest(
                f"read up to {committed_length}: must be between the last read ({self.read_length}) "
                f"and the committed length ({len(self.committed)})"
            )
        self.read_length = committed_length

    @property
    def plays_on(self) -> bool:
        """Whether the verifier plays a thin session's next round now: it is not finished, and is less
        than `read_ahead` tokens past what its edge has read."""
        ahead = len(self.committed) - self.read_length
        return self.spec.thin and self.finish is None and ahead < self.limits.read_ahead

    def own_proposal(self) -> Proposal:
        """A thin session's next round: the verifier's own draft from the committed tokens. Under a
        constraint, the tokens it forces from here (a JSON key, a brace, quotes: llguidance's fast-forward
        tokens), which the masked target chooses whatever its logits or the seed, so that one forward
        commits the run and the next token instead of one forward each (the bits of each position are
        the same: the invariant kernels); else prompt lookup's draft, or none."""
        draft, forced = (), ()
        if self.matcher is not None:
            draft = tuple(self.matcher.forced()[: self.gamma_cap])
            forced = tuple(range(len(draft)))
        if not draft and self.spec.drafting is Drafting.NGRAM:
            draft = tuple(ngram_draft(self.committed, min(NGRAM_GAMMA, self.gamma_cap)))
        return Proposal(self.last_round + 1, len(self.committed), draft, forced=forced)

    def begin(self, proposal: Proposal) -> Round | Verdict:
        """Checks a proposal and says what the target must compute for it, or answers a stale one at
        once. Raises InvalidRequest or WrongState, and then changes nothing.

        Stale: start_position is not the committed length, or the assumed tokens are not the
        committed ones before it. An edge that pipelines sends proposals before the verdicts that
        commit their base; those a rejection or a finish made obsolete come back stale.
        """
        if proposal.round != self.last_round + 1:
            raise InvalidRequest(
                f"proposal round {proposal.round} out of order: expected {self.last_round + 1}"
            )
        gamma = len(proposal.draft_token_ids)
        if not self.limits.min_gamma <= gamma <= self.limits.max_gamma:
            raise InvalidRequest(
                f"gamma {gamma} outside [{self.limits.min_gamma}, {self.limits.max_gamma}] draft tokens"
            )
        if len(proposal.assumed_token_ids) > self.limits.max_gamma + 1:
            raise InvalidRequest(
                f"{len(proposal.assumed_token_ids)} assumed tokens: at most max_gamma + 1 "
                f"({self.limits.max_gamma + 1})"
            )
        self._check_ids(proposal.draft_token_ids, "draft")
        self._check_ids(proposal.assumed_token_ids, "assumed")
        forced = proposal.forced
        if any(i >= gamma for i in forced) or any(a >= b for a, b in itertools.pairwise(forced)):
            raise InvalidRequest(
                f"forced indexes {list(forced[:8])} must be increasing indexes into the {gamma} draft tokens"
            )
        length = len(self.committed)
        stale = is_stale(self.committed, proposal)
        if not stale and self.finish is not None:
            raise WrongState(f"session finished ({self.finish.value}); no proposal is accepted after that")
        self.last_round = proposal.round
        if stale:
            self.stats.stale_proposals += 1
            return self._verdict(proposal, 0, None, stale=True)
        budget = self.max_new_tokens - len(self.generated)
        # Draft tokens past the budget could never be committed: do not spend the target on them.
        draft = tuple(proposal.draft_token_ids[: budget - 1])
        forward = Forward(self.key, length - 1, (self.committed[-1], *draft))
        return Round(proposal, draft, budget, forward)

    def complete(self, begun: Round, logits: torch.Tensor) -> Verdict:
        """Applies the rules to the target's logits for a round begun with `begin`.

        logits  # [len(begun.draft) + 1, vocab]
        """
        length, params = len(self.committed), self.spec.sampling
        prompt_length = len(self.spec.prompt_token_ids)
        scores = adjusted_logits(logits.numpy(), params, self.committed, prompt_length, begun.draft)
        if self.matcher is not None:  # each row under the constraint after the draft tokens before it
            scores = masked_logits(scores, self.matcher.masks(begun.draft, self.stop_token_ids))
        target = choose_tokens(scores, length, params).tolist()
        accepted, target_token, self.finish = commit_round(
            begun.draft, target, self.stop_token_ids, begun.budget
        )
        new = [*begun.draft[:accepted], *([target_token] if target_token is not None else [])]
        self.committed += new
        if self.matcher is not None:
            self.matcher.follow(self.generated)
        logprobs = ()
        if self.spec.top_logprobs is not None:  # from the rows that chose the committed tokens
            logprobs = tuple(token_logprobs(scores[: len(new)], new, params, self.spec.top_logprobs))
        positions = len(begun.forward.token_ids)
        self.target_positions += positions
        stats = self.stats
        stats.rounds += 1
        stats.round_positions += positions
        stats.generated_tokens += len(self.committed) - length
        stats.plain_steps += not begun.draft and not self.spec.thin
        # The draft model's tokens alone: a constraint's forced ones (the edge's, own_proposal's) count apart.
        proposal = begun.proposal
        proposed, accepted_proposed = proposal.proposed(len(begun.draft)), proposal.proposed(accepted)
        stats.forced_tokens += accepted - accepted_proposed
        if proposed:
            stats.drafts += 1
            stats.draft_tokens += proposed
            stats.accepted_tokens += accepted_proposed
            per_position = stats.accepted_per_position
            per_position += [0] * (accepted_proposed - len(per_position))
            for i in range(accepted_proposed):
                per_position[i] += 1
            if self.batcher.gamma_cap is not None and not self.spec.thin:
                cut = self.finish is not None or accepted in proposal.forced
                self.batcher.gamma_cap.observe_round(proposed, accepted_proposed, cut=cut)
        verify_seconds, batch_size = self.batcher.stats.last.get(self.key, (0.0, 0))
        if verify_seconds and positions == len(begun.draft) + 1:  # a round's forward, no prefill in it
            self.batcher.stats.round_costs.observe(positions, verify_seconds)
        verdict = self._verdict(begun.proposal, accepted, target_token, verify=(verify_seconds, batch_size))
        if logprobs:
            verdict = dataclasses.replace(verdict, logprobs=logprobs)
        if self.spec.thin:  # the edge learns the server's drafts it accepted from the verdict
            forced = len(begun.draft) - proposed  # own_proposal's forced runs lead the draft
            verdict = dataclasses.replace(
                verdict, server_draft_token_ids=begun.draft, server_forced_tokens=forced
            )
        return verdict

    def close(self) -> None:
        """Frees the session's KV cache after its queued forwards; safe to call twice."""
        self.batcher.release(self.key)

    @property
    def gamma_cap(self) -> int:
        """The most draft tokens the verifier asks for now: max_gamma, lowered under load (gamma_cap.py)."""
        cap = self.batcher.gamma_cap
        return min(cap.value, self.limits.max_gamma) if cap is not None else self.limits.max_gamma

    def _verdict(
        self, proposal: Proposal, accepted: int, target_token: int | None, stale=False, verify=(0.0, 0)
    ) -> Verdict:
        return Verdict(
            round=proposal.round,
            start_position=proposal.start_position,
            accepted=accepted,
            target_token_id=target_token,
            finish=None if stale else self.finish,
            stale=stale,
            committed_length=len(self.committed),
            target_positions=self.target_positions,
            verify_seconds=verify[0],
            batch_size=verify[1],
            gamma_cap=self.gamma_cap,
        )

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        size = self.batcher.info.vocabulary.size
        if not ids or (min(ids) >= 0 and max(ids) < size):  # in C: the common case costs no loop
            return
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:
            raise InvalidRequest(f"{what} token id {bad} outside the vocabulary [0, {size})")


async def decode_alone(
    batcher: Batcher, spec: SessionSpec, logprobs: list[TokenLogprob] | None = None
) -> list[int]:
    """The target alone, one token per round of no draft tokens, through the same batcher, engine and
    rules as speculative sessions. Returns the generated ids; `logprobs`, when given, receives theirs
    (spec.top_logprobs set). Raises what VerifierSession raises."""
    session = await VerifierSession.open(batcher, spec, VerifierLimits(max_gamma=0))
    try:
        while session.finish is None:
            verdict = await session.play(Proposal(session.last_round + 1, len(session.committed), ()))
            if logprobs is not None:
                logprobs += verdict.logprobs
        return session.generated
    finally:
        session.close()


def reference_decode(
    engine: Engine, spec: SessionSpec, logprobs: list[TokenLogprob] | None = None
) -> list[int]:
    """`decode_alone` on an event loop and a batcher of its own, blocking the caller (from a running
    event loop too: it then runs on a thread of its own).

    An invariance check, not an independent oracle: it shares the engine and the rules with the
    verifier, so it shows that gamma, batching and pipelining do not change the output; the tests
    compare greedy output with transformers' own `generate` for independence.
    """

    async def run() -> list[int]:
        batcher = Batcher(engine)
        try:
            return await decode_alone(batcher, spec, logprobs)
        finally:
            batcher.close()

    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(run())
    with ThreadPoolExecutor(max_workers=1) as thread:
        return thread.submit(asyncio.run, run()).result()
