"""Page-aligned host buffers for bytes that cross sockets.

The kernel copies a TCP message between its own page-sized buffers and the user's; a user
buffer that starts 64 B into a page (where ``torch.empty`` puts a large CPU tensor: glibc's
``mmap`` chunk header plus torch's 64-byte alignment) makes every page-sized copy straddle two
destination pages.  Measured on this project's CPU machine (perf/README.md section 6b): gloo
receives of 8 MiB into page-aligned buffers took 0.91-0.95x the time of receives into the
same bytes 64 B into a page, side by side in one run.  So the buffers ultracomm owns and moves
over sockets (the ``private`` replica pool, the ``p2p`` transport's receive buffers) start on
a page.  CUDA allocations are already 256-byte aligned and are left as torch makes them.
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
    return raw[skip:skip + nbytes]  # a view: keeps ``raw``'s storage alive


def page_aligned_zeros(nbytes: int, device: Any = None) -> torch.Tensor:
    """:func:`page_aligned_empty`, zeroed."""
    return page_aligned_empty(nbytes, device).zero_()
