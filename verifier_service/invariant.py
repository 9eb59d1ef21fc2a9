"""Invariant mode for the target on CPU: kernels that give a row the same result whatever shares the call.

A position's logits must be a function of its token, its position and the cache before it, bit for bit,
whatever else is in the forward (the other positions of its round, other sessions' rows, padding). With
torch's defaults on CPU two kinds of op break that (measured on SmolLM2-135M, torch 2.13, MKL 2024.2,
oneDNN 3.12, a Xeon with AVX-512 and AMX, and an AMD EPYC with AVX512-BF16; see
tests/unit/test_invariant_kernels.py):

- `F.linear`. In float32 it goes to MKL, which runs one row as a gemv and more rows as a gemm with a
  blocking that changes again with the row count and the thread count. In bfloat16 it goes to oneDNN
  (AMX), which re-lays out the weight on every call in a layout picked for that row count: invariant
  up to 32 rows, not beyond.
- `scaled_dot_product_attention`. It blocks its queries, and its result also changes with the number of
  keys (a masked tail is not the same as a shorter key set) and with whether a mask is given, in both
  dtypes.

RMSNorm, rotary embeddings, SiLU, softmax across rows, embeddings and residual adds compute each row
alike whatever the row count (measured; the model-level check in the tests covers them).

What this module puts in their place:

- `packed_linear` (`InvariantLinear`, and `InvariantConv1D` for GPT-2's transposed linear layers): the
  weight is packed once into oneDNN's blocked layout for a
  fixed row hint, and every call runs oneDNN's inner product on it, in chunks of at most `max_rows` rows
  and at least `min_rows` (zero-padded). With the layout fixed, the kernel reduces every output over
  the inner dimension in the same order for any row count inside those bounds. That is a property of
  the library and the CPU, not a documented promise, so `make_invariant` checks it on the model's
  shapes at load (`check_linear`). It is also faster than `F.linear`: bfloat16 weights are no longer
  re-laid out on every call.
- `exact_attention`: each query attends in a call of its own, over exactly the keys it sees, without a
  mask: precisely the call a one-position forward makes, so the result cannot depend on the others.
  Soft-capped scores (Gemma 2) take `softcapped_attention`, written out, in the same one-query calls.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterable, Mapping

import torch
from torch import nn
from transformers.pytorch_utils import Conv1D

# Per dtype: (the row count the weight is packed for, the fewest rows of one oneDNN call, the most).
# float32: in the layout packed for 32 rows, oneDNN's one-row kernel differs from its many-row one, so a
# lone row is padded to two; measured invariant from 2 to 512 rows. bfloat16: the layout packed for one
# row (AB16b64a2b) measured invariant from 1 to 129 rows on every SmolLM2 shape on a Xeon with AMX (the
# 1536-wide down projection changes at 130; the layout packed for 32 rows changes at 33). On an AMD EPYC
# with AVX512-BF16 and no AMX, oneDNN's one-row kernel differs from its many-row one there (the 1536 -> 576
# down projection), as in float32: padding a lone row to two is invariant on both CPUs, at any row hint.
# Fewer rows than a minimum are padded to it, inside the invariant range, so the same bits whichever
# minimum: PADDINGS are the minimums tried, and `make_invariant` times a lone row through the model's
# linear layers at each and keeps the faster (`choose_padding`). Which wins is the CPU's: on one AMD EPYC
# with AVX512-BF16 (float32, one core, Qwen2.5-1.5B) oneDNN's 2-row kernel was the slower (a one-position
# forward 584 ms padded to 2, 401 ms padded to 4), on another the faster (180 against 201 ms);
# docs/benchmarks.md, "Small forwards padded to 4 rows" and "The padding timed at load". The policy's
# minimum serves calls made outside a model put in invariant mode.
ROW_POLICY: dict[torch.dtype, tuple[int, int, int]] = {
    torch.float32: (32, 4, 256),
    torch.bfloat16: (1, 4, 128),
}
PADDINGS = (2, 4)


class NotInvariant(RuntimeError):
    """The kernels give a row different bits depending on what shares its call, on this machine."""


def supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether this module has kernels for the dtype on the device: CPU with oneDNN only, and for
    bfloat16 a CPU on which oneDNN runs bfloat16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not plain AVX2)."""
    if (
        torch.device(device).type != "cpu"
        or dtype not in ROW_POLICY
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's blocked layout for its dtype's row hint (an opaque mkldnn tensor)."""
    hint, _, _ = ROW_POLICY[weight.dtype]
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), hint)


def packed_linear(
    x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None = None, min_rows: int | None = None
) -> torch.Tensor:
    """x @ weight.T + bias on a `pack_weight`ed weight; each row's result is the same whatever the other
    rows and their number. A call of fewer than `min_rows` rows (default: the dtype's ROW_POLICY) runs
    padded to that many.  # x [..., in] -> [..., out]"""
    _, default_rows, max_rows = ROW_POLICY[x.dtype]
    min_rows = min_rows or default_rows
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    n = rows.shape[0]
    outs = []
    for start in range(0, n, max_rows):
        chunk = rows[start : start + max_rows]
        if chunk.shape[0] < min_rows:  # the padding rows are dropped below
            chunk = torch.cat([chunk, chunk.new_zeros(min_rows - chunk.shape[0], chunk.shape[1])])
        out = torch.ops.mkldnn._linear_pointwise(chunk, packed, bias, "none", [], "")
        outs.append(out[: n - start])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*x.shape[:-1], out.shape[-1])


class InvariantLinear(nn.Linear):
    """nn.Linear running `packed_linear`. `make_invariant` swaps the class of existing nn.Linear modules,
    so parameters, tied weights and state_dict stay as they were; the packed copy is no parameter and
    must be rebuilt (`repack`) if the weight changes."""

    packed: torch.Tensor
    min_rows: int | None = None  # set by make_invariant (choose_padding); None: ROW_POLICY's

    def repack(self) -> None:
        self.packed = pack_weight(self.weight)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias, self.min_rows)


class InvariantConv1D(Conv1D):
    """transformers' Conv1D (GPT-2's projections: a linear layer whose weight is stored [in, out]) running
    `packed_linear` on the transposed weight, swapped in like InvariantLinear."""

    packed: torch.Tensor
    min_rows: int | None = None

    def repack(self) -> None:
        self.packed = pack_weight(self.weight.t())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias, self.min_rows)


def _shape(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer of either kind."""
    fan_out, fan_in = module.weight.shape
    return (fan_out, fan_in) if isinstance(module, Conv1D) else (fan_in, fan_out)


_INVARIANT = {nn.Linear: InvariantLinear, Conv1D: InvariantConv1D}


def make_invariant(model: nn.Module, check: bool = True, padding: int | None = None) -> int:
    """Puts a loaded transformers model (on CPU, already in its final dtype) into invariant mode: every
    plain nn.Linear (attention projections, MLP, lm_head) and transformers Conv1D (GPT-2's) runs
    `packed_linear`, small calls padded to `padding` rows (None: whichever of PADDINGS is faster here,
    timed). Attention is the caller's to route through `exact_attention`. Returns the padding.

    Raises ValueError for a dtype or device without kernels here; NotInvariant when `check` finds
    oneDNN not row-invariant on this machine for the model's shapes at that padding (then the mode
    cannot be trusted, and the model is left half converted: load it again).
    """
    kinds = {*_INVARIANT, *_INVARIANT.values()}
    linears = [m for m in model.modules() if type(m) in kinds]
    for module in linears:
        if not supported(module.weight.dtype, module.weight.device):
            raise ValueError(
                f"invariant mode has no kernels for {module.weight.dtype} on {module.weight.device}"
            )
    for module in linears:
        module.__class__ = _INVARIANT.get(type(module), type(module))
        module.repack()
    padding = padding or choose_padding(time_paddings(linears))
    set_padding(model, padding)
    if check:
        for dtype in {m.weight.dtype for m in linears}:
            check_linear(dtype, {_shape(m) for m in linears if m.weight.dtype == dtype}, min_rows=padding)
    return padding


def set_padding(model: nn.Module, rows: int) -> None:
    """Small calls of the model's invariant layers padded to `rows` from now on (one of PADDINGS: inside
    the invariant range, so the same bits)."""
    for module in model.modules():
        if isinstance(module, (InvariantLinear, InvariantConv1D)):
            module.min_rows = rows


def time_paddings(linears: list[nn.Module], repeats: int = 3) -> dict[int, float]:
    """Seconds of one row through every layer of `linears` (in invariant mode), per padding of PADDINGS:
    the median of `repeats`, the paddings taking turns. A whole pass reads every weight, as a forward of
    one position does (0.2-0.6 s for a 1.5B model in float32 on one core)."""
    rows = {id(m): torch.zeros(1, _shape(m)[0], dtype=m.weight.dtype) for m in linears}
    seconds: dict[int, list[float]] = {p: [] for p in PADDINGS}
    with torch.no_grad():
        for _ in range(repeats):
            for padding in PADDINGS:
                start = time.perf_counter()
                for m in linears:
                    packed_linear(rows[id(m)], m.packed, None, padding)
                seconds[padding].append(time.perf_counter() - start)
    return {p: statistics.median(s) for p, s in seconds.items()}


def choose_padding(seconds: Mapping[int, float]) -> int:
    """The padding of the fastest lone-row pass (`time_paddings`); the larger on a tie."""
    return min(seconds, key=lambda p: (seconds[p], -p))


def check_linear(
    dtype: torch.dtype, shapes: Iterable[tuple[int, int]], seed: int = 0, min_rows: int | None = None
) -> None:
    """Raises NotInvariant unless `packed_linear`, padding to `min_rows`, gives rows bitwise the same
    result alone as among others, on random data, for each (in_features, out_features): every row count
    up to 65 and some up to two chunks on small shapes, a few up to one chunk on large ones (an lm_head).
    About a second."""
    _, _, max_rows = ROW_POLICY[dtype]
    few = [1, 2, 3, 5, 9, 17, 33, 65, max_rows]
    every = sorted(set(range(1, 66)) | {100, max_rows - 1, max_rows, max_rows + 1, 2 * max_rows + 1})
    generator = torch.Generator().manual_seed(seed)
    for fan_in, fan_out in sorted(shapes):
        counts = every if fan_in * fan_out <= 4 << 20 else few
        weight = (torch.randn(fan_out, fan_in, generator=generator) / fan_in**0.5).to(dtype)
        x = torch.randn(max(counts), fan_in, generator=generator).to(dtype)
        packed = pack_weight(weight)
        # Row i alone, for the first and last row of each count (all rows would cost seconds on an lm_head).
        alone = {
            i: packed_linear(x[i : i + 1], packed, None, min_rows) for i in {0} | {n - 1 for n in counts}
        }
        for n in counts:
            out = packed_linear(x[:n], packed, None, min_rows)
            if not (torch.equal(out[:1], alone[0]) and torch.equal(out[n - 1 : n], alone[n - 1])):
                raise NotInvariant(
                    f"oneDNN's {dtype} inner product is not row-invariant on this machine "
                    f"({n} rows, {fan_in} -> {fan_out})"
                )


def exact_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None = None,
    window: int | None = None,
    softcap: float | None = None,
) -> torch.Tensor:
    """Causal attention of one session's new positions over its cache, one query per call over exactly
    the keys it sees (no mask): each output is what a one-position forward computes for that position.

    query [1, heads, n, head_dim]: the last n of the `held` positions of keys and values
    keys, values [1, kv_heads, held, head_dim]; fewer kv_heads than heads is grouped-query attention
    window: a sliding window's width, or None
    softcap: scores become softcap * tanh(scores / softcap) before the softmax (Gemma 2), or None
    returns [1, n, heads, head_dim]
    """
    n, held = query.shape[-2], keys.shape[-2]
    outs = []
    for j in range(n):
        end = held - n + j + 1  # this query's position + 1
        start = 0 if window is None else max(0, end - window)
        one = (query[:, :, j : j + 1], keys[:, :, start:end], values[:, :, start:end])
        if softcap is None:
            out = torch.nn.functional.scaled_dot_product_attention(*one, scale=scaling, enable_gqa=True)
        else:
            out = softcapped_attention(*one, scaling, softcap)
        outs.append(out)
    out = outs[0] if n == 1 else torch.cat(outs, dim=2)
    return out.transpose(1, 2)


def softcapped_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    scaling: float | None,
    softcap: float,
    mask: torch.Tensor | None = None,
) -> torch.Tensor:
    """Attention whose scores are capped softly, softcap * tanh(q.k * scaling / softcap), as Gemma 2
    defines it (scaled_dot_product_attention has no such step); the softmax runs in float32.

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
