"""The boundary dataclasses that edge and verifier share: what a session asks, proposes and is told.

Words used everywhere (code, proto, README, metrics):
  committed  the session's sequence for good: the prompt, then every generated token.
  generated  the committed tokens after the prompt: accepted draft tokens and target tokens.
  round      one proposal and its verdict.
  proposal   gamma draft tokens for consecutive positions.
  verdict    the verifier's answer: accepted draft tokens, then a correction (a draft token was
             rejected) or a bonus (all were accepted); or `stale`, when the proposal built on tokens
             that were not committed, and nothing was verified.

No protobuf, grpc, torch or I/O here: `draftwire.wire` converts to and from the wire.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

from draftwire.vocab import Vocabulary


class InvalidSampling(ValueError):
    """Sampling parameters outside their domain."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy; otherwise logits are divided by it (at least MIN_DIVISOR)
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest most-likely set whose probability reaches top_p; (0, 1]
    seed: int = 0  # key of the sampling noise, an unsigned 64-bit integer
    # Adjustments to the logits before all of the above, each at a position over the tokens committed
    # before it (draftwire.rules.adjusted_logits), in this order:
    logit_bias: tuple[
        tuple[int, float], ...
    ] = ()  # (token id, added to its logit in [-100, 100]); distinct ids
    repetition_penalty: float = 1.0  # transformers/CTRL: a logit of a token in the prompt or generated
    # is divided by it when positive, multiplied by it when negative; [MIN_DIVISOR, 10], 1 is off
    frequency_penalty: float = 0.0  # OpenAI: minus this times the token's count among generated ones; [-2, 2]
    presence_penalty: float = 0.0  # OpenAI: minus this when the token was generated before; [-2, 2]
    # After top-k and top-p, keep the tokens at least min_p times as likely as the likeliest; [0, 1],
    # 0 is off (last: positional callers keep their meaning).
    min_p: float = 0.0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def penalized(self) -> bool:
        """Whether a penalty makes a position's logits depend on the tokens before it."""
        return self.repetition_penalty != 1.0 or self.frequency_penalty != 0.0 or self.presence_penalty != 0.0

    @property
    def adjusted(self) -> bool:
        """Whether the logits are changed before temperature, top-k, top-p and min-p."""
        return self.penalized or bool(self.logit_bias)

    def validate(self) -> SamplingParams:
        """Returns self; raises InvalidSampling naming the first field out of its domain."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSampling(f"temperature must be finite and >= 0, got {self.temperature}")
        if 0 < self.temperature < MIN_DIVISOR:  # logits divided by a subnormal overflow to inf, then NaN
            raise InvalidSampling(
                f"temperature must be 0 (greedy) or at least {MIN_DIVISOR:g}, got {self.temperature}"
            )
        if self.top_k < 0:
            raise InvalidSampling(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidSampling(f"top_p must be in (0, 1], got {self.top_p}")
        if not (math.isfinite(self.min_p) and 0.0 <= self.min_p <= 1.0):
            raise InvalidSampling(f"min_p must be in [0, 1], got {self.min_p}")
        if not 0 <= self.seed < 2**64:
            raise InvalidSampling(f"seed must be an unsigned 64-bit integer, got {self.seed}")
        for name in ("frequency_penalty", "presence_penalty"):
            value = getattr(self, name)
            if not (math.isfinite(value) and -2.0 <= value <= 2.0):
                raise InvalidSampling(f"{name} must be in [-2, 2], got {value}")
        if not (math.isfinite(self.repetition_penalty) and MIN_DIVISOR <= self.repetition_penalty <= 10.0):
            raise InvalidSampling(
                f"repetition_penalty must be in [{MIN_DIVISOR:g}, 10], got {self.repetition_penalty}"
            )
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidSampling(f"logit_bias has {len(self.logit_bias)} entries: at most {MAX_LOGIT_BIAS}")
        if len({token for token, _ in self.logit_bias}) != len(self.logit_bias):
            raise InvalidSampling("logit_bias names a token id twice")
        for token, bias in self.logit_bias:
            if not 0 <= token < 2**32:  # never cut to 32 bits on the wire
                raise InvalidSampling(f"logit_bias names token {token}: a token id is in [0, 2**32)")
            if not (math.isfinite(bias) and -100.0 <= bias <= 100.0):
                raise InvalidSampling(f"logit_bias for token {token} must be in [-100, 100], got {bias}")
        return self


MAX_LOGIT_BIAS = 300  # entries, as OpenAI allows
# The least temperature (but 0, greedy) and repetition penalty: the logits are divided by them, and a
# subnormal divisor overflows them to inf (NaN probabilities, garbage tokens). Smaller ones are refused.
MIN_DIVISOR = 1e-4
MAX_TOP_LOGPROBS = 20  # alternatives per token, as OpenAI allows


@dataclass(frozen=True)
class TokenLogprob:
    """A committed token's log-probability under the target's distribution at its position, after the
    session's logit bias, penalties, temperature, top-k and top-p (greedy: after bias and penalties, at
    temperature 1); and, when asked for, the most likely tokens there with theirs. float32 values."""

    logprob: float
    top: tuple[tuple[int, float], ...] = ()  # (token id, logprob), most likely first, lower id on ties


class Drafting(Enum):
    """Who drafts for a session (OpenSession.drafting)."""

    EDGE = "edge"  # the edge proposes
    NONE = "none"  # thin: the verifier decodes with the target alone
    NGRAM = "ngram"  # thin: the verifier drafts by prompt lookup (draftwire/ngram.py)


class ConstraintKind(Enum):
    """What a session's output must match (OpenSession.constraint)."""

    JSON_OBJECT = "json_object"  # any JSON object
    JSON_SCHEMA = "json_schema"  # a JSON Schema, as JSON text
    GRAMMAR = "grammar"  # a grammar in llguidance's Lark syntax
    REGEX = "regex"  # a regular expression the whole output matches


@dataclass(frozen=True)
class Constraint:
    """Structured output: each generated token is chosen under this constraint's mask (draftwire.grammar)."""

    kind: ConstraintKind
    source: str = ""  # the schema, grammar or regex; empty for JSON_OBJECT


MAX_CONSTRAINT_BYTES = 32 << 10  # a constraint's source, UTF-8


class Finish(Enum):
    STOP = "stop"  # an end-of-sequence or stop token was committed
    LENGTH = "length"  # the token budget is spent


@dataclass(frozen=True)
class SessionSpec:
    """What an edge opens a session with."""

    prompt_token_ids: tuple[int, ...]  # at least one id
    sampling: SamplingParams = SamplingParams()
    max_new_tokens: int = 0  # 0: until the context is full
    stop_token_ids: tuple[int, ...] = ()  # finish with STOP when committed, besides EOS
    ignore_eos: bool = False  # EOS does not finish the session
    generated_token_ids: tuple[int, ...] = ()  # generated earlier; resuming re-prefills them
    tokenizer_fingerprint: str = ""  # the edge's vocabulary; empty skips the check
    vocab_size: int = 0  # the edge's vocabulary size, for the error message
    drafting: Drafting = Drafting.EDGE  # who drafts
    numerics: str = ""  # the Numerics.identity the session must be verified with (a resume); "" any
    top_logprobs: int | None = None  # None: no logprobs; k: each token's, and the k most likely (k <= 20)
    handoff: bool = False  # a thin session an edge hands over while speculation does not pay
    constraint: Constraint | None = None  # structured output; None: unconstrained

    @property
    def thin(self) -> bool:
        """The verifier decodes this session itself (no drafts from the edge)."""
        return self.drafting is not Drafting.EDGE


def proposed_among(forced: Collection[int], n: int) -> int:
    """How many of the first `n` draft tokens the draft model proposed: those whose index is not in
    `forced` (a constraint forced them, with no draft step)."""
    return n - sum(i < n for i in forced)


@dataclass(frozen=True)
class Proposal:
    round: int  # 1, 2, ... within the session
    start_position: int  # committed length the draft started from
    draft_token_ids: tuple[int, ...]  # [gamma]
    assumed_token_ids: tuple[int, ...] = ()  # committed tokens the edge assumes right before start
    forced: tuple[int, ...] = ()  # increasing indexes into the draft of tokens a constraint forced

    def proposed(self, n: int) -> int:
        """How many of the first `n` draft tokens the draft model proposed (not forced)."""
        return proposed_among(self.forced, n)


@dataclass(frozen=True)
class Verdict:
    round: int
    start_position: int
    accepted: int  # leading draft tokens committed
    target_token_id: int | None  # correction or bonus; None when cut by a finish, or stale
    finish: Finish | None  # set when the session is done
    stale: bool  # the proposal built on tokens that were not committed; nothing happened
    committed_length: int
    target_positions: int  # positions the target computed for this session, prefill included
    verify_seconds: float = 0.0  # the verifying forward pass's duration (0 when stale)
    batch_size: int = 0  # sessions that shared that forward pass (0 when stale)
    server_draft_token_ids: tuple[int, ...] = ()  # a thin session's server drafts this round
    server_forced_tokens: int = 0  # how many of those (the leading ones) a constraint forced
    gamma_cap: int = 0  # the most draft tokens the verifier asks for now (0: it names none)
    logprobs: tuple[TokenLogprob, ...] = ()  # one per committed token, when the session asks for them

    @property
    def thin_committed(self) -> tuple[int, ...]:
        """In a thin session: every token this verdict commits (accepted server drafts, then the target's)."""
        return (*self.server_draft_token_ids[: self.accepted], *self.committed_token_ids)

    @property
    def committed_token_ids(self) -> tuple[int, ...]:
        """What the verdict adds after the proposal's accepted draft tokens (the target's token)."""
        return () if self.target_token_id is None else (self.target_token_id,)


@dataclass(frozen=True)
class TargetInfo:
    """What the verifier's target is: read from its tokenizer and config."""

    target_id: str  # model directory name or configured id
    vocabulary: Vocabulary  # the tokenizer's ids and fingerprint
    max_context: int  # longest committed sequence the model accepts
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]
    pad_token_id: int | None
    chat_template: str  # Jinja, empty when the tokenizer has none


@dataclass(frozen=True)
class Numerics:
    """How a verifier computes the target's logits: what decides their bits. Two verifiers of the same
    identity give a session the same tokens; a session never moves between identities (a pool routes
    it, and a resume asks for it, by `identity`)."""

    dtype: str  # "float32", "bfloat16"
    kernels: str  # the kernel class: "onednn-avx2", "onednn-avx512_core_amx", "aten-cuda", …
    device: str  # "cpu", "cuda", …
    exact: bool  # invariant kernels: a position's logits do not depend on what shares its forward

    @property
    def identity(self) -> str:
        return f"{self.dtype}/{self.kernels}/{self.device}/{'exact' if self.exact else 'plain'}"

    @classmethod
    def parse(cls, identity: str) -> Numerics:
        """The inverse of `identity`; raises ValueError for a string that is none."""
        parts = identity.split("/")
        if len(parts) != 4 or parts[3] not in ("exact", "plain") or not all(parts):
            raise ValueError(f"not a numerics identity: {identity!r}")
        return cls(parts[0], parts[1], parts[2], parts[3] == "exact")


@dataclass(frozen=True)
class ModelInfo:
    """What a verifier tells edges: its target, its limits and its numerics."""

    target: TargetInfo
    max_gamma: int  # most draft tokens one proposal may carry
    max_message_bytes: int  # largest message the verifier receives
    numerics: Numerics | None = None  # None: an older verifier that does not say
    # Takes proposals of no draft token (plain steps: the edge's fallback where speculation does not
    # pay, edge_client.adaptive). False from an older verifier, which refuses them.
    plain_steps: bool = True
    # Decodes thin sessions (the verifier plays the rounds), where an edge hands a session over while
    # speculation does not pay. False from an older verifier, or one that refuses them.
    thin_sessions: bool = True
    # Takes a session's constraint (structured output). False from an older verifier, or one without
    # its target's tokenizer.
    constraints: bool = False


def is_stale(committed: Sequence[int], proposal: Proposal) -> bool:
    """Whether a proposal built on tokens that are not the committed ones: its start is not the committed
    length, or its assumed tokens are not the committed tokens right before that start."""
    assumed = proposal.assumed_token_ids
    if proposal.start_position != len(committed):
        return True
    return bool(assumed) and tuple(committed[len(committed) - len(assumed) :]) != assumed


def stop_set(stop_token_ids: Collection[int], ignore_eos: bool, eos_token_ids: Collection[int]) -> frozenset:
    """The ids whose commitment finishes a session: the extra stop ids, and EOS unless ignored."""
    return frozenset(stop_token_ids) | (frozenset() if ignore_eos else frozenset(eos_token_ids))


def generation_budget(max_new_tokens: int, max_context: int, prompt_length: int) -> int:
    """How many tokens a session may generate: max_new_tokens, or (0) until the context is full."""
    return max_new_tokens or max_context - prompt_length


# Bucket bounds of the verifier's engine-batch histograms (ServerStats.batch_*_counts, the metrics).
BATCH_SECONDS_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
BATCH_SIZE_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128)


def bucket(bounds: tuple[float, ...], value: float) -> int:
    """Index of the first bucket whose upper bound holds `value`; len(bounds) is the open-ended one."""
    return next((i for i, bound in enumerate(bounds) if value <= bound), len(bounds))
