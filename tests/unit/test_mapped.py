"""verifier_service.mapped's `trim_heap`: what a load's proofs freed goes back to the system."""

import platform
import sys

import pytest
import torch

from verifier_service import mapped

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux") or platform.libc_ver()[0] != "glibc", reason="/proc and glibc"
)


def _resident() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * 4096


def test_trim_heap_gives_back_the_freed_pages_the_allocator_kept():
    """Tensors of 64 KB come from malloc's heap (under its mmap threshold); freed beneath a live one,
    glibc keeps their pages. trim_heap returns them: 192 MB freed, at least 100 MB given back."""
    blocks = [torch.ones(16 * 1024) for _ in range(3000)]
    live = torch.ones(16 * 1024)  # above them: free() alone cannot shrink the heap
    del blocks
    before = _resident()
    given = mapped.trim_heap()
    assert given == 1 and before - _resident() > 100e6
    assert live.sum() == 16 * 1024
