"""The verification rules: how a token is chosen at a position, and which draft tokens are accepted.

Pure functions over tensors: no I/O, no grpc, no ray. Randomness is keyed noise, a function of
(seed, position) alone, so the token the target chooses at a position does not depend on how many
positions were verified together, nor on what the draft proposed. Both the verifier (for the target)
and the edge (for the draft) choose tokens with `choose_tokens`, so a draft that agrees with the
target also agrees with its draws.

Vocabulary: draft tokens are proposed; the accepted ones are the leading draft tokens equal to the
target's choices; the target's choice right after them is committed too, as a correction (a draft
token was rejected) or a bonus (all were accepted).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from enum import Enum

import numpy as np
import torch


class InvalidSampling(ValueError):
    """Sampling parameters outside their domain."""


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 is greedy; otherwise logits are divided by it
    top_k: int = 0  # keep the k most likely tokens; 0 keeps all
    top_p: float = 1.0  # keep the smallest most-likely set whose probability reaches top_p; (0, 1]
    seed: int = 0  # key of the sampling noise, an unsigned 64-bit integer

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def validate(self) -> SamplingParams:
        """Returns self; raises InvalidSampling naming the first field out of its domain."""
        if not math.isfinite(self.temperature) or self.temperature < 0:
            raise InvalidSampling(f"temperature must be finite and >= 0, got {self.temperature}")
        if self.top_k < 0:
            raise InvalidSampling(f"top_k must be >= 0, got {self.top_k}")
        if not (math.isfinite(self.top_p) and 0.0 < self.top_p <= 1.0):
            raise InvalidSampling(f"top_p must be in (0, 1], got {self.top_p}")
        if not 0 <= self.seed < 2**64:
            raise InvalidSampling(f"seed must be an unsigned 64-bit integer, got {self.seed}")
        return self


def keyed_uniform(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """Uniform noise in [0, 1) for every token id at one absolute position.  # [vocab_size] float64

    Philox is a counter-based generator: keyed by (seed, position), its stream is fixed by numpy's
    stability guarantee for bit generators, and nothing else (batching, gamma) can shift it.
    """
    key = np.array([seed, position], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key)).random(vocab_size)


def keyed_gumbel(seed: int, first_position: int, count: int, vocab_size: int) -> torch.Tensor:
    """Gumbel noise for `count` consecutive positions.  # [count, vocab_size] float64"""
    u = np.stack([keyed_uniform(seed, first_position + i, vocab_size) for i in range(count)])
    with np.errstate(divide="ignore"):
        return torch.from_numpy(-np.log(-np.log(u)))


def filtered_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Logits divided by the temperature, with tokens outside top-k and top-p set to -inf.

    logits  # [n, vocab] any float dtype; returns [n, vocab] float64
    Top-k keeps exactly k tokens (ties broken towards the lower id); top-p then keeps the smallest
    prefix of the remaining tokens, most likely first, whose probability reaches top_p.
    """
    scaled = logits.double() / params.temperature
    if params.top_k == 0 and params.top_p >= 1.0:
        return scaled
    sorted_logits, order = torch.sort(scaled, dim=-1, descending=True, stable=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)
    drop = torch.zeros_like(sorted_logits, dtype=torch.bool)
    if params.top_k > 0:
        drop |= ranks >= params.top_k
    if params.top_p < 1.0:
        probs = torch.softmax(sorted_logits.masked_fill(drop, -math.inf), dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop |= mass_before >= params.top_p
    dropped = torch.zeros_like(drop).scatter(-1, order, drop)
    return scaled.masked_fill(dropped, -math.inf)


def choose_tokens(logits: torch.Tensor, first_position: int, params: SamplingParams) -> torch.Tensor:
    """The token chosen at each of consecutive positions.

    logits  # [n, vocab]: row i predicts absolute position first_position + i
    returns # [n] int64
    Greedy is argmax. Sampling is Gumbel-max over the filtered logits with noise keyed by
    (params.seed, position): an exact draw from softmax(filtered logits).
    """
    if params.greedy:
        return logits.argmax(dim=-1)
    scores = filtered_logits(logits, params)
    noise = keyed_gumbel(params.seed, first_position, logits.shape[0], logits.shape[-1])
    return (scores + noise.to(scores.device)).argmax(dim=-1)


def count_accepted(draft_token_ids: torch.Tensor, target_token_ids: torch.Tensor) -> int:
    """Length of the longest prefix of the draft equal to the target's choices.

    draft_token_ids   # [gamma]
    target_token_ids  # [gamma + 1]: the target's choice at each draft position, then one more
    """
    gamma = draft_token_ids.shape[0]
    mismatches = (draft_token_ids != target_token_ids[:gamma]).nonzero()
    return int(mismatches[0, 0]) if mismatches.numel() else gamma


class Finish(Enum):
    STOP = "stop"  # an end-of-sequence or stop token was committed
    LENGTH = "length"  # the token budget is spent


def commit_round(
    draft_token_ids: Sequence[int],
    target_token_ids: Sequence[int],
    stop_token_ids: Collection[int],
    budget: int,
) -> tuple[int, int | None, Finish | None]:
    """What one round commits: (accepted, target token or None, finish or None).

    draft_token_ids   # [gamma]
    target_token_ids  # [gamma + 1]
    budget: how many more tokens may be committed, >= 1.
    Commits the accepted draft tokens, then the target's token after them, cut right after the
    first stop token or when the budget is spent. The target token is None when the cut falls
    inside the accepted draft tokens.
    """
    accepted = count_accepted(torch.as_tensor(draft_token_ids), torch.as_tensor(target_token_ids))
    committed = [*draft_token_ids[:accepted], target_token_ids[accepted]]
    for i, token in enumerate(committed[:budget]):
        if token in stop_token_ids:
            return _cut(committed, accepted, i + 1, Finish.STOP)
    if len(committed) >= budget:
        return _cut(committed, accepted, budget, Finish.LENGTH)
    return accepted, committed[-1], None


def _cut(committed: list[int], accepted: int, keep: int, finish: Finish) -> tuple[int, int | None, Finish]:
    if keep <= accepted:
        return keep, None, finish
    return accepted, committed[accepted], finish
