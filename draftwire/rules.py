"""The verification rules: how a token is chosen at a position, and which draft tokens are accepted.

Pure functions over numpy arrays: no I/O, no grpc, no ray, no torch (the edge runs them without it).
Randomness is keyed noise, a function of (seed, position) alone, so the token the target chooses at a
position does not depend on how many positions were verified together, nor on what the draft
proposed. Both the verifier (for the target) and the edge (for the draft) choose tokens with
`choose_tokens`, so a draft that agrees with the target also agrees with its draws.

Vocabulary: draft tokens are proposed; the accepted ones are the leading draft tokens equal to the
target's choices; the target's choice right after them is committed too, as a correction (a draft
token was rejected) or a bonus (all were accepted).
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence

import numpy as np

from draftwire.contract import Finish, SamplingParams, TokenLogprob


def keyed_uniform(seed: int, position: int, vocab_size: int) -> np.ndarray:
    """Uniform noise in [0, 1) for every token id at one absolute position.  # [vocab_size] float64

    Philox is a counter-based generator: keyed by (seed, position), its stream is fixed by numpy's
    stability guarantee for bit generators, and nothing else (batching, gamma) can shift it.
    """
    key = np.array([seed, position], dtype=np.uint64)
    return np.random.Generator(np.random.Philox(key=key)).random(vocab_size)


def keyed_gumbel(seed: int, first_position: int, count: int, vocab_size: int) -> np.ndarray:
    """Gumbel noise for `count` consecutive positions.  # [count, vocab_size] float64"""
    u = np.stack([keyed_uniform(seed, first_position + i, vocab_size) for i in range(count)])
    with np.errstate(divide="ignore"):
        return -np.log(-np.log(u))


def adjusted_logits(
    logits: np.ndarray,
    params: SamplingParams,
    context: Sequence[int],
    prompt_length: int,
    draft: Sequence[int] = (),
) -> np.ndarray:
    """The logits after the session's logit bias and penalties, each row over the tokens before it.

    logits  # [n, vocab]: row i predicts the token after context + draft[:i]; returns [n, vocab]
    context: the committed tokens, the prompt's `prompt_length` first. In this order: logit_bias is
    added; a token seen in the prompt or after it has its logit divided by repetition_penalty when
    positive, multiplied when negative (transformers' RepetitionPenaltyLogitsProcessor); a token
    generated c times before the position loses frequency_penalty * c + presence_penalty * (c > 0)
    (OpenAI's formula, over generated tokens only). A draft token counts as generated at the rows after
    it: acceptance commits exactly the draft tokens before a row. Without adjustments the logits come
    back as they are; otherwise float64, a pure function of (logits, params, history), so the verifier
    and a reference decode adjust a position alike whatever else its forward verified.
    """
    logits = np.asarray(logits)
    if not params.adjusted:
        return logits
    scores = np.array(logits, dtype=np.float64)
    if params.logit_bias:
        ids, biases = zip(*params.logit_bias, strict=True)
        scores[:, list(ids)] += np.asarray(biases, dtype=np.float64)
    if not params.penalized:
        return scores
    # Only the tokens of the history change: work on their columns alone (a few hundred of a vocabulary
    # of 10^5), with each column's seen flag and generated count, row by row.
    rows = scores.shape[0]
    history = np.concatenate(
        [np.asarray(context, dtype=np.int64), np.asarray(draft[: rows - 1], dtype=np.int64)]
    )
    columns, where = np.unique(history, return_inverse=True)
    seen = np.zeros(len(columns), dtype=bool)
    seen[where[: len(context)]] = True
    counts = np.bincount(where[prompt_length : len(context)], minlength=len(columns)).astype(np.float64)
    block = scores[:, columns]
    for i, row in enumerate(block):
        if i:
            seen[where[len(context) + i - 1]] = True
            counts[where[len(context) + i - 1]] += 1.0
        if params.repetition_penalty != 1.0:
            r = row[seen]
            row[seen] = np.where(r < 0, r * params.repetition_penalty, r / params.repetition_penalty)
        if params.frequency_penalty or params.presence_penalty:
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0)
    scores[:, columns] = block
    return scores


def masked_logits(scores: np.ndarray, allowed: np.ndarray) -> np.ndarray:
    """The scores with every token a constraint does not allow at -inf (structured output, after the
    adjustments and before temperature, top-k and top-p).

    scores   # [n, vocab] any float dtype, kept
    allowed  # [n, width] bool: ids past width (padding rows of the logits) are not allowed, and ids past
             # vocab do not exist: Qwen2.5's tokenizer lists 151,936 tokens, its vocabulary 151,665
    """
    width = min(allowed.shape[-1], scores.shape[-1])
    keep = np.zeros(scores.shape, dtype=bool)
    keep[:, :width] = allowed[:, :width]
    return np.where(keep, scores, np.array(-np.inf, dtype=scores.dtype))


def token_logprobs(
    scores: np.ndarray, token_ids: Sequence[int], params: SamplingParams, top: int
) -> list[TokenLogprob]:
    """Each chosen token's log-probability, and the `top` most likely tokens', at consecutive positions.

    scores  # [n, vocab]: adjusted logits (adjusted_logits), row i the position of token_ids[i]
    The distribution is the one the token was drawn from: softmax of the filtered logits (temperature,
    top-k, top-p; filtered-out tokens have -inf), or greedy, softmax of the adjusted logits at
    temperature 1. Computed in float64, rounded to float32 (the wire's width).
    """
    # Row by row into one buffer: a temporary of the whole [n, vocab] costs more in fresh pages than in
    # arithmetic (5 rows of a 49k vocabulary: 5 ms against 0.4).
    scaled = np.array(scores, dtype=np.float64)
    if params.top_k or params.top_p < 1.0 or params.min_p > 0.0:
        scaled = filtered_logits(scaled, params)
    elif not params.greedy:
        scaled /= params.temperature  # what filtered_logits computes without a filter, in place
    vocab = scaled.shape[-1]
    work = np.empty(vocab)
    out = []
    for row, token in zip(scaled, token_ids, strict=True):
        peak = row.max()
        np.subtract(row, peak, out=work)
        np.exp(work, out=work)
        lse = peak + math.log(work.sum())  # log of the softmax's denominator
        best: tuple[tuple[int, float], ...] = ()
        if top:
            k = min(top, vocab)
            np.copyto(work, row)
            work.partition(vocab - k)
            candidates = np.flatnonzero(row >= work[vocab - k])  # at least the k largest
            order = np.lexsort((candidates, -row[candidates]))[:k]  # most likely first, lower id on ties
            best = tuple((int(t), float(np.float32(row[t] - lse))) for t in candidates[order])
        out.append(TokenLogprob(float(np.float32(row[token] - lse)), best))
    return out


def filtered_logits(logits: np.ndarray, params: SamplingParams) -> np.ndarray:
    """Logits divided by the temperature, with tokens outside top-k, top-p and min-p set to -inf.

    logits  # [n, vocab] any float dtype; returns [n, vocab] float64
    Top-k keeps exactly k tokens (ties broken towards the lower id); top-p then keeps the smallest
    prefix of the remaining tokens, most likely first, whose probability reaches top_p; min-p then keeps
    those at least min_p times as likely as the likeliest (transformers' order and rules).
    """
    scaled = np.asarray(logits, dtype=np.float64) / params.temperature
    if params.top_k > 0 or params.top_p < 1.0:
        scaled = _top_k_top_p(scaled, params)
    if params.min_p > 0.0:
        # A ratio to the likeliest, which top-k and top-p always keep.
        below = scaled < scaled.max(axis=-1, keepdims=True) + math.log(params.min_p)
        scaled = np.where(below, -np.inf, scaled)
    return scaled


def _top_k_top_p(scaled: np.ndarray, params: SamplingParams) -> np.ndarray:
    order = np.argsort(-scaled, axis=-1, kind="stable")  # most likely first, lower id first on ties
    sorted_logits = np.take_along_axis(scaled, order, axis=-1)
    drop = np.zeros(sorted_logits.shape, dtype=bool)
    if params.top_k > 0:
        drop[:, params.top_k :] = True
    if params.top_p < 1.0:
        kept = np.where(drop, -np.inf, sorted_logits)
        probs = np.exp(kept - kept.max(axis=-1, keepdims=True))
        probs /= probs.sum(axis=-1, keepdims=True)
        mass_before = np.cumsum(probs, axis=-1) - probs
        drop |= mass_before >= params.top_p
    dropped = np.zeros_like(drop)
    np.put_along_axis(dropped, order, drop, axis=-1)
    return np.where(dropped, -np.inf, scaled)


def choose_tokens(logits: np.ndarray, first_position: int, params: SamplingParams) -> np.ndarray:
    """The token chosen at each of consecutive positions.

    logits  # [n, vocab]: row i predicts absolute position first_position + i
    returns # [n] int64
    Greedy is argmax (the lowest id among equal maxima). Sampling is Gumbel-max over the filtered
    logits with noise keyed by (params.seed, position): an exact draw from softmax(filtered logits).
    """
    logits = np.asarray(logits)
    if params.greedy:
        return logits.argmax(axis=-1)
    scores = filtered_logits(logits, params)
    noise = keyed_gumbel(params.seed, first_position, logits.shape[0], logits.shape[-1])
    return (scores + noise).argmax(axis=-1)


def count_accepted(draft_token_ids: Sequence[int], target_token_ids: Sequence[int]) -> int:
    """Length of the longest prefix of the draft equal to the target's choices.

    draft_token_ids   # [gamma]
    target_token_ids  # [gamma + 1]: the target's choice at each draft position, then one more
    """
    for i, (draft, target) in enumerate(zip(draft_token_ids, target_token_ids, strict=False)):
        if draft != target:
            return i
    return len(draft_token_ids)


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
    accepted = count_accepted(draft_token_ids, target_token_ids)
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
