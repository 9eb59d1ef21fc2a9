"""CUDA's process-wide settings for exact loads: what the portable backend (verifier_service/invariant.py)
needs from CUDA for a call to give the same bits every time, set before the first CUDA call of a load,
and a record of them that a bench or a test puts back."""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from dataclasses import dataclass

import torch

# cuBLAS keeps a workspace per stream; with this size and count its kernels are deterministic run to run
# (NVIDIA's documented setting for reproducibility), read when the first cuBLAS handle is made.
CUBLAS_WORKSPACE = ":4096:8"


def determinism() -> None:
    """Sets what CUDA needs for the portable backend's calls to give the same bits every time, before
    the first CUDA call of a load: a fixed cuBLAS workspace (CUBLAS_WORKSPACE_CONFIG, unless set), no
    TF32 in float32 products or convolutions, no reduced-precision reductions in bfloat16 and float16
    products (a split-K that reduces in the narrow type), and torch's deterministic algorithms (no atomics
    in reductions). The split-K that cuBLAS picks by shape is left fixed by the backend itself: every
    call of one weight has one shape (portable_rows)."""
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", CUBLAS_WORKSPACE)
    matmul = torch.backends.cuda.matmul
    matmul.allow_tf32 = False
    matmul.allow_fp16_reduced_precision_reduction = False
    matmul.allow_bf16_reduced_precision_reduction = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cudnn.benchmark = False  # no kernel chosen by timing
    torch.use_deterministic_algorithms(True, warn_only=True)


@dataclass(frozen=True)
class CudaSettings:
    """What `determinism` changes, process-wide, as it stands (read) and put back (apply): a bench that
    times plain kernels beside exact ones, and the tests that call it, restore it."""

    tf32: bool
    fp16_reduced: bool
    bf16_reduced: bool
    cudnn_tf32: bool
    cudnn_benchmark: bool
    deterministic: bool
    warn_only: bool

    @classmethod
    def read(cls) -> CudaSettings:
        matmul = torch.backends.cuda.matmul
        return cls(
            matmul.allow_tf32,
            matmul.allow_fp16_reduced_precision_reduction,
            matmul.allow_bf16_reduced_precision_reduction,
            torch.backends.cudnn.allow_tf32,
            torch.backends.cudnn.benchmark,
            torch.are_deterministic_algorithms_enabled(),
            torch.is_deterministic_algorithms_warn_only_enabled(),
        )

    def apply(self) -> None:
        matmul = torch.backends.cuda.matmul
        matmul.allow_tf32 = self.tf32
        matmul.allow_fp16_reduced_precision_reduction = self.fp16_reduced
        matmul.allow_bf16_reduced_precision_reduction = self.bf16_reduced
        torch.backends.cudnn.allow_tf32 = self.cudnn_tf32
        torch.backends.cudnn.benchmark = self.cudnn_benchmark
        torch.use_deterministic_algorithms(self.deterministic, warn_only=self.warn_only)

    @contextlib.contextmanager
    def applied(self) -> Iterator[None]:
        before = CudaSettings.read()
        self.apply()
        try:
            yield
        finally:
            before.apply()
