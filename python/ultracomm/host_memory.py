"""Page-aligned host buffers for bytes that cross sockets.

A large CPU tensor from ``torch.empty`` starts 64 B into a page (glibc's ``mmap`` chunk header
plus torch's 64-byte alignment).  gloo receives into such buffers were slower than into the same
bytes starting on a page: 1.19x at world 4 and 1.06x at world 8, 8 MiB experts, paired rounds
on this project's CPU machine (``perf/bench_recv_alignment.py``, perf/README.md section 6b; a
buffer 2048 B into a page was as fast as one on a page, and why the kernel's copy minds 64 B was
not traced).  So the buffers ultracomm owns and moves over sockets (the ``private`` replica pool,
the ``p2p`` transport's receive buffers) start on a page.  CUDA allocations are already 256-byte
aligned and are left as torch makes them.
"""

from __future__ import annotations

import mmap
from typing import Any

import torch

__all__ = ["PAGE_BYTES", "page_aligned_empty", "page_aligned_zeros"]

PAGE_BYTES = mmap.PAGESIZE


def page_aligned_empty(nbytes: int, device: Any = None) -> torch.Tensor:
    """``uint8 [nbytes]`` whose first byte starts a page (CPU); on a CUDA ``device``, a plain
    ``torch.empty`` (already aligned for every use ultracomm makes of it)."""
    dev = torch.device("cpu") if device is None else torch.device(device)
    if dev.type != "cpu" or nbytes == 0:
        return torch.empty(nbytes, dtype=torch.uint8, device=dev)
    raw = torch.empty(nbytes + PAGE_BYTES - 1, dtype=torch.uint8)
    skip = -raw.data_ptr() % PAGE_BYTES
    return raw[skip : skip + nbytes]  # a view: keeps ``raw``'s storage alive


def page_aligned_zeros(nbytes: int, device: Any = None) -> torch.Tensor:
    """:func:`page_aligned_empty`, zeroed."""
    return page_aligned_empty(nbytes, device).zero_()
