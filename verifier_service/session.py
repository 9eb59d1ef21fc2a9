"""A verification session: checks each proposal against the target and commits the round's tokens.

Knows the rules and the engine, not the transport: requests come in as dataclasses, contract
violations go out as SessionError subclasses that the servicer maps to gRPC status codes.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from verifier_service.engine import Forward, TargetEngine
from verifier_service.rules import Finish, InvalidSampling, SamplingParams, choose_tokens, commit_round


class SessionError(Exception):
    """A request that breaks the contract; the message says what was wrong."""


class InvalidRequest(SessionError):
    """Malformed whatever the session's state (gRPC INVALID_ARGUMENT)."""


class WrongState(SessionError):
    """Well formed but not valid now: finished session, mismatched vocabulary (FAILED_PRECONDITION)."""


@dataclass(frozen=True)
class SessionSpec:
    prompt_token_ids: tuple[int, ...]  # at least one id
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 0  # 0: until the context is full
    stop_token_ids: tuple[int, ...] = ()  # finish with STOP when committed, besides EOS
    ignore_eos: bool = False  # EOS does not finish the session
    generated_token_ids: tuple[int, ...] = ()  # committed earlier; resuming re-prefills them
    tokenizer_fingerprint: str = ""  # the edge's vocabulary; empty skips the check
    vocab_size: int = 0  # the edge's vocabulary size, for the error message


@dataclass(frozen=True)
class Proposal:
    round: int  # 1, 2, ... within the session
    start_position: int  # committed length the draft started from
    draft_token_ids: tuple[int, ...]  # [gamma]
    assumed_token_ids: tuple[int, ...] = ()  # committed tokens the edge assumes right before start


@dataclass(frozen=True)
class Verdict:
    round: int
    start_position: int
    accepted: int  # leading draft tokens committed
    target_token_id: int | None  # correction or bonus; None when cut by a finish, or stale
    finish: Finish | None  # set when the session is done
    stale: bool  # start_position was not the committed length; nothing happened
    committed_length: int
    target_positions: int  # positions the target computed for this session, prefill included


@dataclass(frozen=True)
class Round:
    """A round between `begin` and `complete`: what the target computes for one proposal."""

    proposal: Proposal
    draft: tuple[int, ...]  # the draft tokens verified (those past the budget are dropped)
    budget: int  # tokens this session may still commit
    forward: Forward  # the last committed token then the draft, on top of the session's cache


@dataclass(frozen=True)
class VerifierLimits:
    max_gamma: int = 16  # most draft tokens per proposal
    min_gamma: int = 1  # the reference decoder runs rounds of 0 draft tokens


@dataclass
class VerifierStats:
    """Counters over all sessions of a process."""

    sessions_opened: int = 0
    rounds: int = 0
    generated_tokens: int = 0
    round_positions: int = 0
    prefill_positions: int = 0

    @property
    def target_positions_per_token(self) -> float:
        return self.round_positions / self.generated_tokens if self.generated_tokens else 0.0


_keys = itertools.count(1)


@dataclass
class VerifierSession:
    engine: TargetEngine
    spec: SessionSpec
    limits: VerifierLimits = VerifierLimits()
    stats: VerifierStats = field(default_factory=VerifierStats)
    key: str = field(default_factory=lambda: f"s{next(_keys)}")

    def __post_init__(self) -> None:
        """Validates the spec and prefills; raises InvalidRequest or WrongState."""
        info, spec = self.engine.info, self.spec
        if spec.tokenizer_fingerprint and spec.tokenizer_fingerprint != info.vocabulary.fingerprint:
            raise WrongState(
                f"vocabulary mismatch: the draft has {spec.vocab_size} tokens, fingerprint "
                f"{spec.tokenizer_fingerprint[:16]}; the target {info.target_id!r} has "
                f"{info.vocabulary.describe()}"
            )
        if not spec.prompt_token_ids:
            raise InvalidRequest("the prompt is empty: send at least one token id")
        self._check_ids(spec.prompt_token_ids, "prompt")
        self._check_ids(spec.generated_token_ids, "generated")
        try:
            spec.sampling.validate()
        except InvalidSampling as e:
            raise InvalidRequest(str(e)) from None
        self.committed = [*spec.prompt_token_ids, *spec.generated_token_ids]
        room = info.max_context - len(spec.prompt_token_ids)
        if spec.max_new_tokens > room:
            raise InvalidRequest(
                f"prompt ({len(spec.prompt_token_ids)} tokens) plus max_new_tokens ({spec.max_new_tokens}) "
                f"exceeds the target's context of {info.max_context}"
            )
        self.max_new_tokens = spec.max_new_tokens or room
        if len(spec.generated_token_ids) >= self.max_new_tokens:
            raise InvalidRequest(
                f"{len(spec.generated_token_ids)} tokens already generated: max_new_tokens "
                f"({self.max_new_tokens}) leaves nothing to generate"
            )
        stops = set(spec.stop_token_ids)
        if not spec.ignore_eos:
            stops.update(info.eos_token_ids)
        self.stop_token_ids = frozenset(stops)
        self.last_round = 0
        self.finish: Finish | None = None
        self.target_positions = 0
        self.stats.sessions_opened += 1

    def prefill(self) -> Forward:
        """The forward that fills the cache with every committed position but the last."""
        self.target_positions = len(self.committed) - 1
        self.stats.prefill_positions += self.target_positions
        return Forward(self.key, 0, tuple(self.committed[:-1]), logits=False)

    @property
    def generated(self) -> list[int]:
        return self.committed[len(self.spec.prompt_token_ids) :]

    def verify(self, proposal: Proposal) -> Verdict:
        """Runs one round on the engine directly (no batching); raises what begin raises."""
        step = self.begin(proposal)
        if isinstance(step, Verdict):
            return step
        return self.complete(step, self.engine.forward_many([step.forward])[0])

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
        length = len(self.committed)
        assumed = proposal.assumed_token_ids
        stale = proposal.start_position != length or (
            assumed and tuple(self.committed[length - len(assumed) :]) != assumed
        )
        if not stale and self.finish is not None:
            raise WrongState(f"session finished ({self.finish.value}); no proposal is accepted after that")
        self.last_round = proposal.round
        if stale:
            return self._verdict(proposal, 0, None, stale=True)
        budget = self.max_new_tokens - len(self.generated)
        # Draft tokens past the budget could never be committed: do not spend the target on them.
        draft = tuple(proposal.draft_token_ids[: budget - 1])
        forward = Forward(self.key, length - 1, (self.committed[-1], *draft))
        return Round(proposal, draft, budget, forward)

    def complete(self, step: Round, logits: torch.Tensor) -> Verdict:
        """Applies the rules to the target's logits for a round begun with `begin`.

        logits  # [len(step.draft) + 1, vocab]
        """
        length = len(self.committed)
        target = choose_tokens(logits, length, self.spec.sampling).tolist()
        accepted, target_token, self.finish = commit_round(
            step.draft, target, self.stop_token_ids, step.budget
        )
        self.committed += [*step.draft[:accepted], *([target_token] if target_token is not None else [])]
        positions = len(step.forward.token_ids)
        self.target_positions += positions
        self.stats.rounds += 1
        self.stats.round_positions += positions
        self.stats.generated_tokens += len(self.committed) - length
        return self._verdict(step.proposal, accepted, target_token)

    def close(self) -> None:
        """Frees the session's KV cache; safe to call twice."""
        self.engine.release(self.key)

    def _verdict(self, proposal: Proposal, accepted: int, target_token: int | None, stale=False) -> Verdict:
        return Verdict(
            round=proposal.round,
            start_position=proposal.start_position,
            accepted=accepted,
            target_token_id=target_token,
            finish=None if stale else self.finish,
            stale=stale,
            committed_length=len(self.committed),
            target_positions=self.target_positions,
        )

    def _check_ids(self, ids: Sequence[int], what: str) -> None:
        size = self.engine.info.vocabulary.size
        bad = next((t for t in ids if not 0 <= t < size), None)
        if bad is not None:
            raise InvalidRequest(f"{what} token id {bad} outside the vocabulary [0, {size})")


def reference_decode(engine: TargetEngine, spec: SessionSpec) -> list[int]:
    """The target alone, one token per forward through the same engine and rules: the oracle.

    Returns the generated ids; raises what VerifierSession raises.
    """
    session = VerifierSession(engine, spec, VerifierLimits(min_gamma=0, max_gamma=0))
    engine.forward_many([session.prefill()])
    try:
        while session.finish is None:
            session.verify(Proposal(session.last_round + 1, len(session.committed), ()))
        return session.generated
    finally:
        session.close()
