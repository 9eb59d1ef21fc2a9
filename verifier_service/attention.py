"""Attention whose result for a query never depends on what else shares the call (the invariant mode's,
verifier_service.invariant), and Gemma 2's softly capped attention. Plain torch: any device.

`block_attention` takes all queries of a call at once, each over the keys in fixed blocks of KEY_BLOCK
positions in position order: scores are one matrix product per chunk of queries (the reduction is over
the head dimension alone), the softmax runs over each query's row of whole blocks (masked keys are -inf,
so trailing blocks add exact zeros and the vector lanes of the row's reductions never move), and the
values are summed one block at a time, in order. The load proves it on the machine that serves
(invariant.check_attention)."""

from __future__ import annotations

import torch

KEY_BLOCK = 256  # keys per block of the reduction over keys (a matrix product over 384 keys is split)
QUERY_CHUNK = 256  # query positions per chunk of attention (bounds the scores' memory)
# A call of few query rows is padded: MKL's product of the queries and the transposed keys gave rows of
# 1 or 2 queries (of 8, at a head dimension of 256) other bits than the same rows among more.
MIN_QUERY_ROWS = 16


def block_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    masks: dict | None = None,
) -> torch.Tensor:
    """Causal attention of one session's new positions over its cache, whose result for each query is
    the same bits whatever else the call holds: how many queries, how many keys past the query's own.
    Computed in float32 whatever the dtype.

    query [1, heads, n, head_dim]: the last n of the `held` positions of keys and values
    keys, values [1, kv_heads, held, head_dim]; fewer kv_heads than heads is grouped-query attention.
      Where they are views of a float32 buffer with room past `held` (the engine's caches), that room
      is read up to the next key block instead of padding a copy: its values must be finite (they are
      weighted by exact zeros), as GrowingLayer's zeroed, then stale, positions are.
    window: a sliding window's width, or None
    softcap: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2), or None
    masks: a dict that keeps the masks built here for the next call of the same shape (the other
      layers of a forward), or None
    returns [1, n, heads, head_dim] in the query's dtype
    """
    _, heads, n, dim = query.shape
    kv_heads, held = keys.shape[1], keys.shape[2]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    first = held - n  # the position of the first query
    base = 0 if window is None else max(0, first + 1 - window) // KEY_BLOCK * KEY_BLOCK
    end = -(-held // KEY_BLOCK) * KEY_BLOCK
    k, v = _blocks(keys[0], base, end), _blocks(values[0], base, end)  # [kv_heads, end - base, dim]
    q = query[0].float().reshape(kv_heads, group, n, dim) * scale
    out = query.new_empty(kv_heads, group, n, dim)
    masks = {} if masks is None else masks
    for a in range(0, n, QUERY_CHUNK):
        b = min(n, a + QUERY_CHUNK)
        m = b - a
        # Whole key blocks from the first any query of the chunk sees to the last query's own.
        lo = 0 if window is None else max(0, first + a + 1 - window) // KEY_BLOCK * KEY_BLOCK
        hi = -(-(first + b) // KEY_BLOCK) * KEY_BLOCK
        rows = q[:, :, a:b].reshape(kv_heads, group * m, dim)
        if group * m < MIN_QUERY_ROWS:
            rows = torch.cat([rows, rows.new_zeros(kv_heads, MIN_QUERY_ROWS - group * m, dim)], 1)
        chunk_k, chunk_v = k[:, lo - base : hi - base], v[:, lo - base : hi - base]
        scores = torch.matmul(rows, chunk_k.transpose(1, 2))  # [kv_heads, rows, hi - lo]
        if softcap is not None:
            scores = torch.tanh(scores / softcap) * softcap
        real = scores[:, : group * m].view(kv_heads, group, m, hi - lo)
        for columns, hidden in _hidden(masks, first + a, m, lo, hi, window, query.device):
            real[..., columns].masked_fill_(hidden, float("-inf"))
        weights = torch.softmax(scores, dim=-1)
        out[:, :, a:b] = _weighted_values(weights, chunk_v)[:, : group * m].view(kv_heads, group, m, dim)
    return out.reshape(heads, n, dim).transpose(0, 1)[None]


def _weighted_values(weights: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """The weighted sum of the values, one key block at a time in position order: a matrix product per
    block (the reduction over keys never longer than KEY_BLOCK), each kv head's blocks in one batched
    call, summed from the first block to the last.
    # weights [kv_heads, rows, keys], values [kv_heads, keys, dim] -> [kv_heads, rows, dim]"""
    kv_heads, rows, keys = weights.shape
    blocks = keys // KEY_BLOCK
    out = []
    for h in range(kv_heads):
        per_block = torch.bmm(
            weights[h].view(rows, blocks, KEY_BLOCK).transpose(0, 1),  # [blocks, rows, KEY_BLOCK]
            values[h].reshape(blocks, KEY_BLOCK, -1),
        )
        total = per_block[0].clone()
        for block in per_block[1:]:
            total += block
        out.append(total)
    return torch.stack(out)


def _hidden(
    masks: dict, first: int, m: int, lo: int, hi: int, window: int | None, device: torch.device
) -> list[tuple[slice, torch.Tensor]]:
    """Which keys lo..hi each of m queries from position `first` on does not see, as (columns, mask
    [m, columns]) for the columns where any is hidden: past the first query (causal) and, with a
    window, before the last one's window."""
    shape = (first, m, lo, hi, window)
    if shape not in masks:
        pos = torch.arange(first, first + m, device=device)[:, None]
        parts = []
        start = first + 1 - lo  # keys after the first query's own
        if start < hi - lo:
            key_pos = torch.arange(first + 1, hi, device=device)[None, :]
            parts.append((slice(start, None), key_pos > pos))
        if window is not None:
            stop = max(0, min(first + m - window, hi) - lo)  # keys up to the last query's window
            if stop > 0:
                key_pos = torch.arange(lo, lo + stop, device=device)[None, :]
                parts.append((slice(0, stop), key_pos <= pos - window))
        masks[shape] = parts
    return masks[shape]


def _blocks(states: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Positions lo..hi of one layer's keys or values in float32, zeros (or a float32 buffer's finite
    room) past the held ones.  # states [kv_heads, held, dim] -> [kv_heads, hi - lo, dim]"""
    kv_heads, held, dim = states.shape
    if hi <= held:
        return states[:, lo:hi].float()
    if states.dtype == torch.float32 and _room(states) >= hi:
        return states.as_strided((kv_heads, hi, dim), states.stride(), states.storage_offset())[:, lo:]
    part = states.new_zeros(kv_heads, hi - lo, dim, dtype=torch.float32)
    part[:, : held - lo] = states[:, lo:]
    return part


def _room(states: torch.Tensor) -> int:
    """Positions a [kv_heads, held, dim] view of a [kv_heads, capacity, dim] buffer may read (0 where it
    is no such view)."""
    kv_heads, _, dim = states.shape
    if states.stride(2) != 1 or states.stride(1) != dim or states.stride(0) % dim:
        return 0
    capacity = states.stride(0) // dim
    last = states.storage_offset() + (kv_heads - 1) * states.stride(0) + capacity * dim
    if last * states.element_size() > states.untyped_storage().nbytes():
        return 0
    return capacity


def softcapped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None,
    softcap: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention whose scores are capped softly, softcap * tanh(q.k * scaling / softcap), as Gemma 2
    defines it (scaled_dot_product_attention has no such step); the plain path's, with a mask; the
    softmax runs in float32.

    query [1, heads, n, head_dim]; keys, values [1, kv_heads, held, head_dim]
    mask: [n, held] bool (True: seen), or None for all
    returns [1, heads, n, head_dim]
    """
    groups = query.shape[1] // keys.shape[1]
    keys, values = keys.repeat_interleave(groups, dim=1), values.repeat_interleave(groups, dim=1)
    scale = query.shape[-1] ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, keys.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    return torch.matmul(weights, values)
