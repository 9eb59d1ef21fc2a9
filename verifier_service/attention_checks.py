"""The load's proofs that an attention function gives each query the same bits whatever shares its call,
on the machine that serves (verifier_service/attention.py has the functions; invariant.py the linear
layers' proofs): `check_attention`, and which attention the engine takes here (`fused_attention_holds`
on a CPU, `batched_attention_holds` off one). Nothing here is assumed from a library's documentation.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from verifier_service.attention import (
    CAUSAL_MIN,
    KEY_BLOCK,
    QUERY_CHUNK,
    batched_block_attention,
    block_attention,
    fused_attention,
)
from verifier_service.invariant import NotInvariant, at_threads, other_thread_count


def check_attention(
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    seed: int = 0,
    attend: Callable[..., torch.Tensor] = block_attention,
) -> None:
    """Raises NotInvariant unless `attend` (block_attention, or fused_attention) gives each query the same
    bits alone (a decode), as the last of a γ + 1 call (a round), and inside a whole prefill, at short
    and long context (past 1,024 keys, across several key blocks and query chunks), with grouped-query
    heads, and with and without a sliding window; and the prefill the same bits at another thread count
    (1, or 2 where this process runs 1). A fraction of a second on CPU."""
    generator = torch.Generator().manual_seed(seed)
    cases = (  # heads, kv heads, head dimension, window, positions held
        (6, 2, 64, None, 2 * QUERY_CHUNK + KEY_BLOCK * 3 + 37),  # 1,317
        (4, 4, 32, 300, 2 * QUERY_CHUNK + KEY_BLOCK * 3 + 37),
        (4, 1, 256, 512, 40),  # Gemma 3's heads
        (12, 2, 128, None, 40),  # Qwen2.5's
        (12, 2, 128, None, CAUSAL_MIN + 37),  # and prefills in one causal call
        (4, 1, 256, None, CAUSAL_MIN + 37),
    )
    for heads, kv_heads, dim, window, held in cases:
        q, k, v = (
            torch.randn(1, h, held, dim, generator=generator).to(device, dtype)
            for h in (heads, kv_heads, kv_heads)
        )
        whole = attend(q, k, v, None, window)
        with at_threads(other_thread_count()):
            if not torch.equal(attend(q, k, v, None, window), whole):
                raise NotInvariant(f"{dtype} attention gives other bits at another thread count here")
        for p in sorted({0, 1, 4, KEY_BLOCK - 1, KEY_BLOCK, QUERY_CHUNK + 3, 1024, 1100, held - 1}):
            if p >= held:
                continue
            seen = slice(0, p + 1)
            # Keys and values of exactly the positions seen (copies), as a short cache holds them.
            alone = attend(q[:, :, p : p + 1], k[:, :, seen].clone(), v[:, :, seen].clone(), None, window)
            start = max(0, p - 4)
            round_ = attend(q[:, :, start : p + 1], k[:, :, seen], v[:, :, seen], None, window)
            if not (torch.equal(alone[0, 0], whole[0, p]) and torch.equal(alone[0, 0], round_[0, -1])):
                raise NotInvariant(
                    f"{dtype} attention at position {p} differs alone, in a round and in a prefill "
                    "on this machine"
                )


def fused_attention_holds(dtype: torch.dtype, device: torch.device | str = "cpu") -> bool:
    """Whether `fused_attention` (torch's fused kernel) passes `check_attention` here: asked of the
    machine at load, since the kernel's blocking is torch's choice, not a promise."""
    try:
        check_attention(dtype, device, attend=fused_attention)
    except NotInvariant:
        return False
    return True


def batched_attention_holds(dtype: torch.dtype, device: torch.device | str = "cpu", seed: int = 0) -> bool:
    """Whether `batched_block_attention` gives every query of a batch of sessions the bits that
    `block_attention` gives it on its own here, in two companies: rounds, a decode and a prefill chunk
    past QUERY_CHUNK at short and long context beside each other, then one round beside a long prefill
    (which widens the padded rows and key span of everything in the call). A GPU's kernels may pick their
    reductions by a tensor's size, so this is asked of the machine, not assumed."""
    generator = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim = 12, 2, 128  # Qwen2.5's
    companies = (
        [(40, 5), (1000, 1), (300, 9), (QUERY_CHUNK + 40, QUERY_CHUNK + 40)],
        [(300, 5), (1500, 600)],
    )
    for sessions in companies:
        qs, ks, vs = [], [], []
        for held, n in sessions:
            qs.append(torch.randn(1, heads, n, dim, generator=generator).to(device, dtype))
            for states in (ks, vs):
                states.append(torch.randn(1, kv_heads, held, dim, generator=generator).to(device, dtype))
        alone = torch.cat([block_attention(q, k, v) for q, k, v in zip(qs, ks, vs, strict=True)], 1)
        batched = batched_block_attention(torch.cat(qs, 2), ks, vs, [n for _, n in sessions])
        if not torch.equal(alone, batched):
            return False
    return True
