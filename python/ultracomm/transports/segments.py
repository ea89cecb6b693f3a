"""A chunk's member byte ranges and one segment's reduction in the documented order: the parts of
the executors' protocol that the Python executors (``p2p``, ``copy_engine``'s command lists) run
themselves, and the references (:mod:`ultracomm.tools.reference`) replay."""

from __future__ import annotations

from typing import Iterator, Sequence

import torch


def member_segments(
    offset: int, nbytes: int, member_off: Sequence[int], member_bytes: Sequence[int]
) -> Iterator[tuple[int, int, int]]:
    """``(m, lo, hi)`` for every member ``m`` intersecting ``[offset, offset + nbytes)``, in member
    order: the byte ranges an executor's copy or reduce of that range touches (the executors'
    ``for_each_segment``; padding between members is never moved)."""
    end = offset + nbytes
    for m, (off, nb) in enumerate(zip(member_off, member_bytes)):
        lo, hi = max(offset, off), min(end, off + nb)
        if lo < hi:
            yield m, lo, hi


def _typed(t: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A ``uint8`` range as ``dtype`` (a copy only where the range is not aligned for a view)."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return t.clone().view(dtype)


def ordered_sum(dst: torch.Tensor, srcs: Sequence[torch.Tensor], dtype: torch.dtype) -> None:
    """The determinism contract on one segment, in place: ``dst = dtype(f32(dst) + f32(srcs[0]) +
    f32(srcs[1]) + ...)``, left to right, one rounding at the end.  ``dst`` and ``srcs`` are
    equally long ``uint8`` tensors holding ``dtype`` elements."""
    d = _typed(dst, dtype)
    # fp32 in place when dst is a view (each fp32 add rounds once either way); else one fp32 copy.
    # add_ upcasts a bf16/fp16 source exactly, as .float() would: the same bits, no temporaries
    in_place = dtype == torch.float32 and d.data_ptr() == dst.data_ptr()
    acc = d if in_place else d.float()
    for s in srcs:
        acc.add_(_typed(s, dtype))
    if not in_place:
        dst.copy_(acc.to(dtype).view(torch.uint8))
