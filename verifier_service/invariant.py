"""Invariant mode for the target: kernels that give a row the same result whatever shares the call.

A position's logits must be a function of its token, its position and the cache before it, bit for bit,
whatever else is in the forward (the other positions of its round, other sessions' rows, padding, a
prefill's other positions). With torch's defaults two kinds of op break that (measured on CPU with torch
2.13, MKL and oneDNN, on Xeons with AVX-512 and AMX and AMD EPYCs with AVX512-BF16; see
tests/unit/test_invariant_kernels.py):

- `F.linear`. In float32 it goes to MKL, which runs one row as a gemv and more rows as a gemm whose
  blocking changes with the row count. In bfloat16 it goes to oneDNN, which re-lays out the weight on
  every call in a layout picked for that row count.
- `scaled_dot_product_attention`. Its flash kernel blocks queries and keys by their counts, so a query's
  reduction over its keys changes with how many keys and queries the call holds.

RMSNorm, rotary embeddings, SiLU, embeddings and residual adds compute each row alike whatever the row
count (measured; the model-level check at load covers them).

What this module puts in their place, as two backends (`--kernels`):

- Linear layers run in calls of a bounded number of rows, padded with zero rows up to a minimum, inside
  the range where the library reduces every output over the inner dimension in the same order:
  - `onednn` (CPU): the weight packed once into oneDNN's blocked layout, each call oneDNN's inner
    product on it (`packed_linear`); the packed weight replaces the original, so the weights are held
    once. Measured invariant from 2 to 512 rows in float32, 1 to 129 in bfloat16. A long input goes
    first in calls of exactly 1,024, 512 or 256 rows, each count proven at load (WHOLE_CALLS).
  - `portable` (any device, plain torch): `F.linear` on the model's own weight, every call of the same
    shape (PORTABLE_ROWS rows, padded), so that the library picks the same kernel and the same blocking
    every time. Row counts alone do not do it: MKL's float32 gemm changed a row's bits between 5 and 6
    rows on small shapes.
- Attention (`block_attention`, both backends, plain torch): all queries of a call at once, each over
  the keys in fixed blocks of KEY_BLOCK positions in position order. Scores are one matrix product per
  chunk of queries (the reduction is over the head dimension alone), the softmax runs over each query's
  row of whole blocks (masked keys are -inf, so trailing blocks add exact zeros and the vector lanes of
  the row's reductions never move), and the values are summed one block at a time, in order, so the
  reduction over keys never depends on how many keys or queries the call holds.

None of that is a documented promise of the libraries, so the load proves it on the machine that serves
(`check_linear` on the model's shapes and `whole_calls` here, verifier_service/attention_checks.py's
`check_attention`, then the engine's model-level check).
"""

from __future__ import annotations

import contextlib
import functools
import statistics
import time
from collections import Counter
from collections.abc import Callable, Iterable, Mapping

import torch
import torch.nn.functional as F
from torch import nn
from transformers.pytorch_utils import Conv1D

from verifier_service import mapped

BACKENDS = ("onednn", "portable")  # what --kernels names besides auto (verifier_service/numerics.py)

# onednn, per dtype: (the row count the weight is packed for, the fewest rows of one call, the most).
# float32: in the layout packed for 32 rows, oneDNN's one-row kernel differs from its many-row one, so a
# lone row is padded; measured invariant from 2 to 512 rows. bfloat16: the layout packed for one row
# measured invariant from 1 to 129 rows on a Xeon with AMX; on an AMD EPYC with AVX512-BF16 and no AMX
# the one-row kernel differs from the many-row one, as in float32, so a lone row is padded there too.
# PADDINGS are the minimums tried: `make_invariant` times a lone row through the model's linear layers
# at each and keeps the faster (`choose_padding`); which wins is the CPU's (docs/portability.md).
# The most rows of one call are what the load proves (proven_rows): larger calls would run a prefill
# faster (oneDNN's bfloat16 kernels on a Xeon with AMX took 2.2x as long in calls of 128 rows as in one
# of 2,000), but only a check of every row count up to the most proves a size, and that costs the square
# of it at load: calls of up to 1,024 bfloat16 rows, checked at sampled counts, passed on a Xeon with
# AMX, yet 1536 -> 576 gave rows other bits among 201, 202, 247, 252 and 256 rows, and a Ray pool under
# load wrote other tokens.
ROW_POLICY: dict[torch.dtype, tuple[int, int, int]] = {
    torch.float32: (32, 4, 256),
    torch.bfloat16: (1, 4, 128),
}
PADDINGS = (2, 4)
# onednn, whole calls: a long input (a prefill) goes first in calls of exactly one of these row counts,
# the largest that fits first, then the rest in calls of at most the dtype's most. Each count is one more
# shape, so the load proves it on its own (`whole_calls`: one call of that many rows against the same rows
# in the proven range, at both thread counts), and one a machine does not prove is not made. A prefill's
# linear layers then run near the speed of one call: SmolLM2's shapes at 2,000 rows in bfloat16 on an AMD
# EPYC took 2.15x one call in calls of 128 rows and 1.13x in calls of 512. The lm_head (a prefill runs it
# on its last position alone) and layers past WHOLE_WEIGHTS keep the proven range: their proof would cost
# seconds at load.
WHOLE_CALLS = (1024, 512, 256)
WHOLE_WEIGHTS = 32 << 20
# portable: the rows of every call, per device type. A decode pads its one row to this many, which a
# GPU does not feel; on CPU, where a row costs compute, fewer.
PORTABLE_ROWS = {"cpu": 16}
PORTABLE_ROWS_ELSEWHERE = 64


class NotInvariant(RuntimeError):
    """The kernels give a row different bits depending on what shares its call, on this machine."""


def supported(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether the onednn backend has kernels for the dtype on the device: CPU with oneDNN only, and for
    bfloat16 a CPU on which oneDNN runs bfloat16 (AVX-512 BW/VL/DQ or AVX-NE-CONVERT; not plain AVX2)."""
    if (
        torch.device(device).type != "cpu"
        or dtype not in ROW_POLICY
        or not torch.backends.mkldnn.is_available()
    ):
        return False
    return dtype != torch.bfloat16 or bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())


def resolve(kernels: str, dtype: torch.dtype, device: torch.device | str = "cpu") -> str:
    """The backend that `--kernels` names for this dtype on this device: auto takes onednn where it has
    kernels, else portable. Raises ValueError for an unknown name, or onednn where it has none."""
    if kernels != "auto" and kernels not in BACKENDS:
        raise ValueError(f"unknown kernels {kernels!r}: choose one of auto, {', '.join(BACKENDS)}")
    if kernels == "auto":
        return "onednn" if supported(dtype, device) else "portable"
    if kernels == "onednn" and not supported(dtype, device):
        raise ValueError(f"--kernels onednn has no {dtype} kernels on {device}: use portable")
    return kernels


def portable_rows(dtype: torch.dtype, device: torch.device | str = "cpu") -> tuple[int, int]:
    """(fewest, most) rows of one portable linear call for the dtype on the device: the same, one shape
    for every call."""
    rows = PORTABLE_ROWS.get(torch.device(device).type, PORTABLE_ROWS_ELSEWHERE)
    return rows, rows


def in_row_chunks(
    x: torch.Tensor,
    linear: Callable[[torch.Tensor], torch.Tensor],
    min_rows: int,
    max_rows: int,
    whole: tuple[int, ...] = (),
) -> torch.Tensor:
    """`linear` over x's rows: first in calls of exactly one of the `whole` counts (largest first) while
    one fits, then in calls of `min_rows` to `max_rows` rows, a short call padded with zero rows that are
    dropped again.  # x [..., in] -> [..., out]"""
    rows = x.reshape(-1, x.shape[-1]).contiguous()
    n = rows.shape[0]
    outs, done = [], 0
    for size in whole:
        while n - done >= size:
            outs.append(linear(rows[done : done + size]))
            done += size
    for start in range(done, n, max_rows):
        chunk = rows[start : start + max_rows]
        if chunk.shape[0] < min_rows:
            chunk = torch.cat([chunk, chunk.new_zeros(min_rows - chunk.shape[0], chunk.shape[1])])
        outs.append(linear(chunk)[: n - start])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(*x.shape[:-1], out.shape[-1])


def pack_weight(weight: torch.Tensor) -> torch.Tensor:
    """The weight [out, in] in oneDNN's blocked layout for its dtype's row hint (an opaque mkldnn tensor)."""
    hint, _, _ = ROW_POLICY[weight.dtype]
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(), hint)


def packed_linear(
    x: torch.Tensor,
    packed: torch.Tensor,
    bias: torch.Tensor | None = None,
    min_rows: int | None = None,
    max_rows: int | None = None,
    whole: tuple[int, ...] = (),
) -> torch.Tensor:
    """x @ weight.T + bias on a `pack_weight`ed weight; each row's result is the same whatever the other
    rows and their number. Calls of at most `max_rows` rows, after those of the `whole` counts
    (`in_row_chunks`); one of fewer than `min_rows` runs padded to that many (defaults: the dtype's
    ROW_POLICY).  # x [..., in] -> [..., out]"""
    _, default_min, default_max = ROW_POLICY[x.dtype]

    def call(chunk: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(chunk, packed, bias, "none", [], "")

    return in_row_chunks(x, call, min_rows or default_min, max_rows or default_max, whole)


class _InvariantMixin:
    """What the invariant linear layers share: `packed` (onednn) or None (portable, the module's own
    weight), and the rows of one call."""

    packed: torch.Tensor | None = None
    min_rows: int | None = None  # set by make_invariant; None: ROW_POLICY's (onednn)
    max_rows: int | None = None  # likewise
    whole: tuple[int, ...] = ()  # onednn: the WHOLE_CALLS counts the load proved for this layer

    def _weight_out_in(self) -> torch.Tensor:
        raise NotImplementedError

    def repack(self) -> None:
        self.packed = pack_weight(self._weight_out_in())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return packed_linear(x, self.packed, self.bias, self.min_rows, self.max_rows, self.whole)
        weight = self._weight_out_in()
        return in_row_chunks(x, lambda c: F.linear(c, weight, self.bias), self.min_rows, self.max_rows)


class InvariantLinear(_InvariantMixin, nn.Linear):
    """nn.Linear in invariant mode. `make_invariant` swaps the class of existing nn.Linear modules, so
    parameters and tied weights stay as they were (onednn then releases a weight nothing else holds)."""

    def _weight_out_in(self) -> torch.Tensor:
        return self.weight


class InvariantConv1D(_InvariantMixin, Conv1D):
    """transformers' Conv1D (GPT-2's projections: a linear layer whose weight is stored [in, out]) in
    invariant mode, swapped in like InvariantLinear."""

    def _weight_out_in(self) -> torch.Tensor:
        return self.weight.t()


def _shape(module: nn.Module) -> tuple[int, int]:
    """(in_features, out_features) of a linear layer of either kind."""
    fan_out, fan_in = module.weight.shape
    return (fan_out, fan_in) if isinstance(module, Conv1D) else (fan_in, fan_out)


_INVARIANT = {nn.Linear: InvariantLinear, Conv1D: InvariantConv1D}


def make_invariant(
    model: nn.Module, kernels: str = "auto", check: bool = True, padding: int | None = None
) -> int:
    """Puts a loaded transformers model (already on its device, in its final dtype) into invariant mode:
    every plain nn.Linear (attention projections, MLP, lm_head) and transformers Conv1D (GPT-2's) runs
    on the `kernels` backend. onednn packs each weight, releases the original where nothing else holds it
    (a tied lm_head keeps the embedding's), and pads small calls to `padding` rows (None: whichever of
    PADDINGS is faster here, timed); portable calls F.linear in the device's row range. Attention is the
    caller's to route through `block_attention`. Returns the fewest rows of a call.

    Raises ValueError for a backend without kernels for the model's dtype and device; NotInvariant when
    `check` finds the kernels not row-invariant on this machine for the model's shapes (then the mode
    cannot be trusted, and the model is left half converted: load it again).
    """
    kinds = {*_INVARIANT, *_INVARIANT.values()}
    linears = [m for m in model.modules() if type(m) in kinds]
    weight = linears[0].weight if linears else next(model.parameters())
    backend = resolve(kernels, weight.dtype, weight.device)
    for module in linears:
        if backend == "onednn" and not supported(module.weight.dtype, module.weight.device):
            raise ValueError(
                f"invariant mode has no kernels for {module.weight.dtype} on {module.weight.device}"
            )
        module.__class__ = _INVARIANT.get(type(module), type(module))
    if backend == "portable":
        low, high = portable_rows(weight.dtype, weight.device)
        for module in linears:
            module.packed, module.min_rows, module.max_rows = None, low, high
        padding = low
    else:
        holders = Counter(id(p) for _, p in model.named_parameters(remove_duplicate=False))
        files = mapped.mapped_files()
        for module in linears:
            module.repack()
            if holders[id(module.weight)] == 1:
                _release_weight(module, files)
        mapped.trim_heap()  # the released weights, back to the system before the proofs allocate
        padding = padding or choose_padding(time_paddings(linears))
        set_padding(model, padding)
    if check:
        for dtype in {m.weight.dtype for m in linears}:
            layers = [m for m in linears if m.weight.dtype == dtype]
            own = {_shape(m): m for m in layers}  # one layer of each shape, checked on its own weight
            if backend == "portable":
                check_linear(dtype, set(own), min_rows=padding, kernels=backend, device=weight.device)
                continue
            most = proven_rows(dtype, own, padding)
            head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
            whole = whole_calls({s: m for s, m in own.items() if m is not head}, padding, most)
            for module in layers:
                module.max_rows = most
                module.whole = whole.get(_shape(module), ())
    mapped.trim_heap()  # the proofs' rows, freed: else later allocations grow the heap past them
    return padding


def _release_weight(module: nn.Module, files: list[tuple[int, int]]) -> None:
    """Replaces a packed layer's own weight by a placeholder of its shape and dtype that holds one
    element, and gives back its pages where it was a view of the checkpoint's mapped file: the packed
    copy is the one the layer computes with, so the weights are held once."""
    w = module.weight
    mapped.drop_pages(w, files)
    placeholder = torch.zeros(1, dtype=w.dtype, device=w.device).expand(w.shape)
    module.weight = nn.Parameter(placeholder, requires_grad=False)


def set_padding(model: nn.Module, rows: int) -> None:
    """Small calls of the model's onednn layers padded to `rows` from now on (one of PADDINGS: inside
    the invariant range, so the same bits)."""
    for module in model.modules():
        if isinstance(module, _InvariantMixin) and module.packed is not None:
            module.min_rows = rows


def time_paddings(linears: list[nn.Module], repeats: int = 3) -> dict[int, float]:
    """Seconds of one row through every layer of `linears` (packed), per padding of PADDINGS: the median
    of `repeats`, the paddings taking turns. A whole pass reads every weight, as a forward of one
    position does (0.2-0.6 s for a 1.5B model in float32 on one core)."""
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


def proven_rows(
    dtype: torch.dtype, shapes: Mapping[tuple[int, int], nn.Module] | set[tuple[int, int]], min_rows: int
) -> int:
    """ROW_POLICY's most rows of one onednn call, once `check_linear` proves calls of up to that many
    row-invariant on `shapes` here (a mapping to packed layers checks those layers' own weights); raises
    NotInvariant where it does not."""
    most = ROW_POLICY[dtype][2]
    layers = shapes if isinstance(shapes, Mapping) else None
    check_linear(dtype, set(shapes), min_rows=min_rows, max_rows=most, layers=layers)
    return most


def whole_calls(
    layers: Mapping[tuple[int, int], nn.Module], min_rows: int, most: int, seed: int = 0
) -> dict[tuple[int, int], tuple[int, ...]]:
    """The WHOLE_CALLS counts (past `most`) each shape's packed layer gives the bits of the proven range
    at: one call of that many random rows against the same rows in calls of `min_rows` to `most`, at
    this thread count and the other. A count a machine does not prove for every shape is made for none
    (no error: the proven range serves alone). Shapes past WHOLE_WEIGHTS get none."""
    generator = torch.Generator().manual_seed(seed)
    small = {
        shape: layer
        for shape, layer in layers.items()
        if shape[0] * shape[1] <= WHOLE_WEIGHTS and getattr(layer, "packed", None) is not None
    }
    proven = [c for c in WHOLE_CALLS if c > most]
    for (fan_in, _), layer in small.items():
        if not proven:
            break
        x = torch.randn(max(proven), fan_in, generator=generator).to(layer.weight.dtype)
        ranged = packed_linear(x, layer.packed, None, min_rows, most)  # row-invariant: slices hold
        for size in list(proven):
            whole = functools.partial(packed_linear, x[:size], layer.packed, None, min_rows, most, (size,))
            with at_threads(other_thread_count()):
                elsewhere = whole()
            if not (torch.equal(whole(), ranged[:size]) and torch.equal(elsewhere, ranged[:size])):
                proven.remove(size)
    return {shape: tuple(proven) for shape in small}


def _linear_of(
    weight: torch.Tensor, kernels: str, min_rows: int | None, max_rows: int | None = None
) -> Callable[[torch.Tensor], torch.Tensor]:
    """x -> x @ weight.T on the backend, as a model's layer in invariant mode computes it."""
    if kernels == "onednn":
        packed = pack_weight(weight)
        return lambda x: packed_linear(x, packed, None, min_rows, max_rows)
    low, high = portable_rows(weight.dtype, weight.device)
    return lambda x: in_row_chunks(x, lambda c: F.linear(c, weight), min_rows or low, high)


def check_linear(
    dtype: torch.dtype,
    shapes: Iterable[tuple[int, int]],
    seed: int = 0,
    min_rows: int | None = None,
    kernels: str = "onednn",
    device: torch.device | str = "cpu",
    max_rows: int | None = None,
    layers: Mapping[tuple[int, int], nn.Module] | None = None,
) -> None:
    """Raises NotInvariant unless the backend's linear layer, in calls of at most `max_rows` rows
    (default: ROW_POLICY's), gives rows bitwise the same result alone as among others, on random inputs,
    for each (in_features, out_features): every row count up to one call and one past it (and to 65) and
    one of two calls on small shapes (under 4M weights), a few up to one call on large ones (an lm_head:
    sampled, not every count). Every row of a count is compared with the same row of the largest count,
    and its first and last rows with those rows alone: oneDNN's bfloat16 8960 -> 1536 (Qwen2.5-1.5B's
    down projection) kept rows 0 and n - 1 among 33 rows and changed rows between them. The largest
    count is also computed at another thread count (1, or 2 where this process runs 1): the bits must
    not depend on it, since the numerics identity names none (oneDNN split that shape's reduction across
    threads at few rows). The weights are
    random, or, for a shape in `layers`, that packed layer's own (no second copy of an lm_head at load).
    A second or a few on CPU."""
    if kernels == "onednn":
        most = max_rows or ROW_POLICY[dtype][2]
    else:
        most = portable_rows(dtype, device)[1]
    between = {c for c in (100, 129, 257, 513, 1000) if c < most}
    few = sorted({1, 2, 3, 5, 9, 12, 17, 24, 33, 48, 65, 96, most} | {c for c in between if c > 200})
    every = sorted(set(range(1, max(most + 2, 66))) | {2 * most + 1})
    generator = torch.Generator().manual_seed(seed)
    for fan_in, fan_out in sorted(shapes):
        counts = every if fan_in * fan_out <= 4 << 20 else few
        x = torch.randn(max(counts), fan_in, generator=generator).to(device, dtype)
        layer = (layers or {}).get((fan_in, fan_out))
        if kernels == "onednn" and getattr(layer, "packed", None) is not None:
            linear = functools.partial(_packed_rows, packed=layer.packed, min_rows=min_rows, most=most)
        else:
            weight = torch.randn(fan_out, fan_in, generator=generator) / fan_in**0.5
            linear = _linear_of(weight.to(device, dtype), kernels, min_rows, most)
        # Row i alone, for the first and last row of each count (all rows would cost seconds on an lm_head).
        alone = {i: linear(x[i : i + 1]) for i in {0} | {n - 1 for n in counts}}
        whole = linear(x)
        for n in counts:
            out = whole if n == len(x) else linear(x[:n])
            same = torch.equal(out, whole[:n]) and torch.equal(out[:1], alone[0])
            if not (same and torch.equal(out[n - 1 : n], alone[n - 1])):
                raise NotInvariant(
                    f"the {kernels} {dtype} linear layer is not row-invariant on this machine "
                    f"({n} rows, {fan_in} -> {fan_out})"
                )
        threads, other = torch.get_num_threads(), other_thread_count()
        with at_threads(other):
            elsewhere = linear(x)
        if not torch.equal(elsewhere, whole):
            raise NotInvariant(
                f"the {kernels} {dtype} linear layer gives other bits at {other} threads than at {threads} "
                f"({fan_in} -> {fan_out})"
            )


def other_thread_count() -> int:
    """The thread count the checks compare against: 1, or 2 where this process runs 1."""
    return 1 if torch.get_num_threads() > 1 else 2


@contextlib.contextmanager
def at_threads(n: int):
    """torch's intra-op threads set to `n` for a while (a verifier with another thread count must get the
    same bits: the numerics identity names no thread count)."""
    before = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def _packed_rows(rows: torch.Tensor, packed: torch.Tensor, min_rows: int | None, most: int) -> torch.Tensor:
    return packed_linear(rows, packed, None, min_rows, most)
