"""Attention whose result for a query never depends on what else shares the call (the invariant mode's,
verifier_service.invariant), and Gemma 2's softly capped attention. Plain torch: any device.

`block_attention` takes all queries of a call at once, each over the keys in fixed blocks of KEY_BLOCK
positions in position order: scores are one matrix product per chunk of queries (the reduction is over
the head dimension alone), the softmax runs over each query's row of whole blocks (masked keys are -inf,
so trailing blocks add exact zeros and the vector lanes of the row's reductions never move), and the
values are summed one block at a time, in order. The load proves it on the machine that serves
(attention_checks.check_attention).

`fused_attention` gives the same property through torch's fused kernel (scaled_dot_product_attention,
whose CPU kernel runs a query over the keys in blocks of FUSED_BLOCK positions with an online softmax):
the keys padded with zeros to whole blocks from position 0, hidden keys masked, the query rows padded
to whole blocks of FUSED_ROWS. A trailing block a query does not see leaves its running sums exactly as
they were, so a longer call adds nothing. 2-3x faster than `block_attention` at a prefill in bfloat16;
used where the load proves it (attention_checks.fused_attention_holds)."""

from __future__ import annotations

import torch

KEY_BLOCK = 256  # keys per block of the reduction over keys (a matrix product over 384 keys is split)
QUERY_CHUNK = 256  # query positions per chunk of attention (bounds the scores' memory)
# A call of few query rows is padded: MKL's product of the queries and the transposed keys gave rows of
# 1 or 2 queries (of 8, at a head dimension of 256) other bits than the same rows among more.
MIN_QUERY_ROWS = 16
# torch's fused CPU attention runs a call's queries in blocks of 32 rows (calls under 192 rows) over its
# keys in blocks of 512 (calls of 512 keys or more). A call of whole blocks of both, padded, gives every
# product in it one shape: a row among 8 (the tail of a call of 40) got other bits than among 16.
FUSED_BLOCK = 512  # keys
FUSED_ROWS = 32  # queries
FUSED_CHUNK = 5 * FUSED_ROWS  # query rows of one call: under 192
# A prefill from position 0 of at least CAUSAL_MIN queries goes as one causal call instead (the kernel
# skips the key blocks past a query block's last row): calls of 768 rows or more run in query blocks of
# CAUSAL_ROWS, padded to whole ones here.
CAUSAL_ROWS = 256
CAUSAL_MIN = 3 * CAUSAL_ROWS


def whole(n: int, block: int) -> int:
    """`n` rounded up to whole blocks of `block`."""
    return -(-n // block) * block


def key_span(first: int, end: int, window: int | None, block: int) -> tuple[int, int]:
    """The whole key blocks that queries at positions first..end-1 read: from the block of the first
    key the first query sees (0 without a sliding `window`) to the block past the last query's own."""
    lo = 0 if window is None else max(0, first + 1 - window) // block * block
    return lo, whole(end, block)


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
    base, end = key_span(first, held, window, KEY_BLOCK)
    k, v = _blocks(keys[0], base, end), _blocks(values[0], base, end)  # [kv_heads, end - base, dim]
    q = query[0].float().reshape(kv_heads, group, n, dim) * scale
    out = query.new_empty(kv_heads, group, n, dim)
    masks = {} if masks is None else masks
    for a in range(0, n, QUERY_CHUNK):
        b = min(n, a + QUERY_CHUNK)
        m = b - a
        # Whole key blocks from the first any query of the chunk sees to the last query's own.
        lo, hi = key_span(first + a, first + b, window, KEY_BLOCK)
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


def fused_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
    window: int | None = None,
    masks: dict | None = None,
) -> torch.Tensor:
    """`block_attention`'s contract (no softcap) through torch's fused attention kernel: per chunk of
    queries, the key blocks of FUSED_BLOCK positions from the first any of them sees to the last one's
    own, zeros past the held positions (or a cache buffer's room), hidden keys masked, the query rows
    padded to whole blocks of FUSED_ROWS, at most FUSED_CHUNK rows a call. A few queries (a decode, a
    round) go as one call whose rows are a kv head's grouped query heads; more, in calls of FUSED_CHUNK
    queries per head. Every product of the kernel then has one shape, so the two layouts give a query
    the same bits (proven at load). Computed in the query's dtype with float accumulation, as the
    kernel does.

    query [1, heads, n, head_dim]; keys, values [1, kv_heads, held, head_dim]
    returns [1, n, heads, head_dim] in the query's dtype
    """
    _, heads, n, dim = query.shape
    kv_heads, held = keys.shape[1], keys.shape[2]
    if held == n and n >= CAUSAL_MIN and window is None:
        return _causal_prefill(query, keys, values, scaling)
    group = heads // kv_heads
    fold = group if group * n <= FUSED_CHUNK else 1  # query heads of a kv head as rows of one call
    first = held - n
    q = query[0].reshape(heads // fold, fold, n, dim)
    out = query.new_empty(heads // fold, fold, n, dim)
    masks = {} if masks is None else masks
    step = n if fold > 1 else FUSED_CHUNK
    for a in range(0, n, step):
        b = min(n, a + step)
        m = b - a
        lo, hi = key_span(first + a, first + b, window, FUSED_BLOCK)
        rows = q[:, :, a:b].reshape(heads // fold, fold * m, dim)
        padded = whole(fold * m, FUSED_ROWS)
        if padded > fold * m:
            rows = torch.nn.functional.pad(rows, (0, 0, 0, padded - fold * m))
        shape = ("fused", first + a, m, fold, lo, hi, window)
        if shape not in masks:
            masks[shape] = _seen(first + a, m, fold, padded, lo, hi, window, query.device)
        k, v = (_blocks(s[0], lo, hi, query.dtype)[None] for s in (keys, values))
        result = torch.nn.functional.scaled_dot_product_attention(
            rows[None], k, v, attn_mask=masks[shape], scale=scaling, enable_gqa=fold == 1
        )
        out[:, :, a:b] = result[0, :, : fold * m].view(heads // fold, fold, m, dim)
    return out.reshape(heads, n, dim).transpose(0, 1)[None]


def _causal_prefill(
    query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scaling: float | None
) -> torch.Tensor:
    """`fused_attention` of a whole prefill from position 0 as one causal call: the query rows padded with
    zeros to whole blocks of CAUSAL_ROWS, the keys to whole blocks of FUSED_BLOCK (a padding row's keys
    are zeros or a buffer's room, and its result is dropped). Each query runs over the same key blocks in
    the same order as in fused_attention's other calls; blocks wholly past it are skipped, which its
    running sums could not tell from blocks of weight exactly 0.
    # query [1, heads, n, dim]; keys, values [1, kv_heads, n, dim] -> [1, n, heads, dim]"""
    _, heads, n, dim = query.shape
    padded, hi = whole(n, CAUSAL_ROWS), whole(n, FUSED_BLOCK)
    rows = torch.nn.functional.pad(query, (0, 0, 0, padded - n))
    k, v = (_blocks(s[0], 0, hi, query.dtype)[None] for s in (keys, values))
    result = torch.nn.functional.scaled_dot_product_attention(
        rows, k, v, is_causal=True, scale=scaling, enable_gqa=True
    )
    return result[:, :, :n].transpose(1, 2)


def _seen(
    first: int, m: int, group: int, rows: int, lo: int, hi: int, window: int | None, device
) -> torch.Tensor:
    """Which keys lo..hi each of `rows` query rows sees: row g * m + j is query j (at position first + j)
    of group head g (itself and earlier, within the window); padding rows see what the last query sees.
    # [rows, hi - lo] bool"""
    row = torch.arange(rows, device=device)
    pos = (first + (row % m).masked_fill(row >= group * m, m - 1))[:, None]
    key_pos = torch.arange(lo, hi, device=device)[None, :]
    seen = key_pos <= pos
    if window is not None:
        seen &= key_pos > pos - window
    return seen


def batched_block_attention(
    query: torch.Tensor,
    keys: list[torch.Tensor],
    values: list[torch.Tensor],
    widths: list[int],
    scaling: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
    masks: dict | None = None,
) -> torch.Tensor:
    """`block_attention` of many sessions' new positions in one set of calls, not one set per session:
    the sessions' query chunks (items) padded to one row count and their keys to one key span, both with
    zeros, then one product for the scores, one softmax and one product per key block for the values,
    summed in position order. Each query gets the bits block_attention gives it alone: the padding adds
    rows that no other row reads, and key blocks of weight exactly 0 at the end of a row, as a longer
    call of block_attention does (asked of the machine at load: attention_checks.batched_attention_holds).

    query [1, heads, sum(widths), head_dim]: each session's new positions, one after another
    keys, values: per session [1, kv_heads, held, head_dim], its new positions last
    masks: a dict that keeps what is built here for the next layer of the forward, or None
    returns [1, sum(widths), heads, head_dim] in the query's dtype
    """
    _, heads, total, dim = query.shape
    kv_heads = keys[0].shape[1]
    group = heads // kv_heads
    scale = dim**-0.5 if scaling is None else scaling
    masks = {} if masks is None else masks
    held = [k.shape[2] for k in keys]
    plan = masks.get(("batched", window, tuple(held)))
    if plan is None:
        plan = masks[("batched", window, tuple(held))] = _BatchPlan(widths, held, group, window, query.device)
    q = (query[0].float() * scale).reshape(kv_heads, group, total, dim)
    q = torch.cat([q, q.new_zeros(kv_heads, group, 1, dim)], 2)  # position `total`: the padding rows' zeros
    rows = q[:, plan.q_group, plan.q_token].transpose(0, 1)  # [items, kv_heads, R, dim]
    k, v = (_spans(states, plan) for states in (keys, values))  # [items, kv_heads, K, dim]
    scores = torch.matmul(rows, k.transpose(2, 3))  # [items, kv_heads, R, K]
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    scores.masked_fill_(plan.hidden, float("-inf"))
    weights = torch.softmax(scores, dim=-1)
    items, _, r, span = weights.shape
    blocks = span // KEY_BLOCK
    per_block = torch.bmm(
        weights.view(items, kv_heads, r, blocks, KEY_BLOCK)
        .permute(0, 1, 3, 2, 4)
        .reshape(items * kv_heads * blocks, r, KEY_BLOCK),
        v.reshape(items * kv_heads * blocks, KEY_BLOCK, dim),
    ).view(items, kv_heads, blocks, r, dim)
    out = per_block[:, :, 0].clone()
    for block in range(1, blocks):
        out += per_block[:, :, block]
    # Back to each token's heads: token t's head (h, g) is row g * m + j of its item.
    picked = out.transpose(1, 2)[plan.out_item, plan.out_row]  # [total, group, kv_heads, dim]
    return picked.transpose(1, 2).reshape(1, total, heads, dim).to(query.dtype)


class _BatchPlan:
    """Where each query chunk of a batch of sessions sits, built once a forward and kept for its other
    layers: the items (a session's chunk of at most QUERY_CHUNK queries, with the key blocks they
    read), the gathers in and out, and which keys each row does not see."""

    def __init__(self, widths: list[int], held: list[int], group: int, window: int | None, device):
        items = []  # (session, first query's position, queries, lo, hi, the chunk's first token)
        offset = 0
        for s, (n, h) in enumerate(zip(widths, held, strict=True)):
            first = h - n
            for a in range(0, n, QUERY_CHUNK):
                b = min(n, a + QUERY_CHUNK)
                lo, hi = key_span(first + a, first + b, window, KEY_BLOCK)
                items.append((s, first + a, b - a, lo, hi, offset + a))
            offset += n
        self.items = items
        r = max(MIN_QUERY_ROWS, group * max(m for _, _, m, _, _, _ in items))
        span = max(hi - lo for _, _, _, lo, hi, _ in items)
        total = offset
        q_group = torch.zeros(len(items), r, dtype=torch.long)
        q_token = torch.full((len(items), r), total, dtype=torch.long)  # the zero row
        q_pos = torch.full((len(items), r), -1, dtype=torch.long)  # -1: a padding row
        out_item = torch.empty(total, group, dtype=torch.long)
        out_row = torch.empty(total, group, dtype=torch.long)
        for i, (_, position, m, _, _, token) in enumerate(items):
            j = torch.arange(m)
            for g in range(group):
                q_group[i, g * m : (g + 1) * m] = g
                q_token[i, g * m : (g + 1) * m] = token + j
                q_pos[i, g * m : (g + 1) * m] = position + j
                out_item[token : token + m, g] = i
                out_row[token : token + m, g] = g * m + j
        lo = torch.tensor([it[3] for it in items])[:, None, None]
        hi = torch.tensor([it[4] for it in items])[:, None, None]
        key_pos = lo + torch.arange(span)[None, None, :]  # [items, 1, K]
        pos = q_pos[:, :, None]  # [items, R, 1]
        real = pos >= 0
        hidden = (key_pos >= hi) | (real & (key_pos > pos))
        if window is not None:
            hidden |= real & (key_pos <= pos - window)
        self.hidden = hidden[:, None].to(device)  # [items, 1, R, K]
        self.q_group, self.q_token = q_group.to(device), q_token.to(device)
        self.out_item, self.out_row = out_item.to(device), out_row.to(device)
        self.span = span


def _spans(states: list[torch.Tensor], plan: _BatchPlan) -> torch.Tensor:
    """Each item's key blocks lo..hi of its session's keys (or values) in float32, zeros past the held
    positions and past the item's own span, as one tensor.  # -> [items, kv_heads, K, dim]"""
    parts = [states[s][0, :, lo:hi].transpose(0, 1) for s, _, _, lo, hi, _ in plan.items]
    padded = torch.nn.utils.rnn.pad_sequence(parts, batch_first=True)  # [items, longest, kv_heads, dim]
    if padded.shape[1] < plan.span:
        padded = torch.nn.functional.pad(padded, (0, 0, 0, 0, 0, plan.span - padded.shape[1]))
    return padded.float().permute(0, 2, 1, 3)


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


def _blocks(states: torch.Tensor, lo: int, hi: int, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Positions lo..hi of one layer's keys or values in `dtype`, zeros (or the finite room of a buffer
    in that dtype) past the held ones.  # states [kv_heads, held, dim] -> [kv_heads, hi - lo, dim]"""
    kv_heads, held, dim = states.shape
    if hi <= held:
        return states[:, lo:hi].to(dtype)
    if states.dtype == dtype and _room(states) >= hi:
        return states.as_strided((kv_heads, hi, dim), states.stride(), states.storage_offset())[:, lo:]
    part = states.new_zeros(kv_heads, hi - lo, dim, dtype=dtype)
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
