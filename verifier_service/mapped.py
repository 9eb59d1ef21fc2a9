"""A checkpoint's pages mapped into memory, given back as soon as the tensor on them has been copied.

transformers loads safetensors weights as views of the file mapped into memory. The pages of a view
count in the process's resident memory once read, and stay mapped while any view of the file lives, so
a load that converts each weight to another dtype, or packs it into another layout, holds the file's
pages beside the copies: the weights twice over at the peak. `drop_pages` tells the kernel that the
pages under a view that nothing reads any more may go (madvise DONTNEED: a read-only file mapping
reads them from the file again if ever touched), only where the view lies in a mapped safetensors file:
the pages of an ordinary allocation are never touched. `trim_heap` gives back what the load's proofs
freed and the allocator kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import sys
from functools import cache

import torch

MADV_DONTNEED = 4


@cache
def _libc():
    return ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


def mapped_files() -> list[tuple[int, int]]:
    """The address ranges of safetensors files mapped into this process (Linux; empty elsewhere)."""
    try:
        lines = open("/proc/self/maps").read().splitlines()
    except OSError:
        return []
    ranges = []
    for line in lines:
        fields = line.split()
        if len(fields) >= 6 and fields[5].endswith(".safetensors"):
            start, end = (int(x, 16) for x in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


def drop_pages(tensor: torch.Tensor, files: list[tuple[int, int]]) -> int:
    """Gives back the whole pages under `tensor` where it lies in one of `files` (`mapped_files`);
    returns the bytes given back (0 elsewhere, or where the call fails). Call it only once nothing will
    read the tensor again."""
    if not sys.platform.startswith("linux") or tensor.device.type != "cpu" or not tensor.is_contiguous():
        return 0  # a strided view's extent is not its own: other tensors' pages may lie between
    start = tensor.data_ptr()
    end = start + tensor.numel() * tensor.element_size()
    if not any(lo <= start and end <= hi for lo, hi in files):
        return 0
    first = -(-start // mmap.PAGESIZE) * mmap.PAGESIZE
    last = end // mmap.PAGESIZE * mmap.PAGESIZE
    if last <= first:
        return 0
    if _libc().madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), MADV_DONTNEED):
        return 0
    return last - first


def trim_heap() -> int:
    """Gives the heap's free pages back to the system (glibc's malloc_trim), as a load ends: its proofs
    allocate and free hundreds of MB of random rows and scores, which glibc keeps for reuse (SmolLM2's
    loaded process held 0.4 GB more for it). Returns 1 where memory was given back, 0 where nothing
    was or there is no glibc (another libc, another system)."""
    if not sys.platform.startswith("linux"):
        return 0
    trim = getattr(_libc(), "malloc_trim", None)
    return int(trim(ctypes.c_size_t(0))) if trim is not None else 0
