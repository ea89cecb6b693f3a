"""The host transport: runs a rank's task list with the C++ host executor (``_core.run_host``)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from .. import _core
from ..records import Op

GRAD_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


@dataclass(frozen=True)
class Masters:
    """Addresses of this rank's master experts for one layer.

    ``weight_ptrs[i * M + m]`` / ``grad_ptrs[i * M + m]``: member ``m`` of local expert ``i``.
    The tensors are kept so the addresses stay valid.
    """

    weights: tuple[torch.Tensor, ...]
    grads: tuple[torch.Tensor, ...]
    weight_ptrs: tuple[int, ...]
    grad_ptrs: tuple[int, ...]


def master_pointers(tensors: Sequence[torch.Tensor], experts_per_rank: int) -> tuple[int, ...]:
    """Per (local expert, member) addresses of ``[experts_per_rank, *shape]`` member tensors."""
    ptrs = []
    for i in range(experts_per_rank):
        for t in tensors:
            per_expert = t.numel() // experts_per_rank * t.element_size()
            ptrs.append(t.data_ptr() + i * per_expert)
    return tuple(ptrs)


class HostTransport:
    """CPU executor over host windows (``host_shm`` or ``local``)."""

    name = "host"
    window_providers = ("host_shm", "local")

    def __init__(self, *, rank: int, world: int, window, wlayout: dict, layout, num_workers: int,
                 timeout_s: float, jitter_us: int = 0):
        self.rank, self.world = rank, world
        self.window = window
        self.wlayout = wlayout
        self.layout = layout
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.jitter_us = jitter_us
        self._grad_code = GRAD_DTYPE_CODE[layout.grad_dtype]

    def run(self, op: Op, schedule, epoch: int, masters: Masters, my_slots: Sequence[int],
            local_index_of: Sequence[int]) -> None:
        """Run ``op`` of ``schedule`` for this rank at ``epoch``; blocks until done here."""
        lay = self.layout
        if op == Op.MULTICAST:
            member_off, member_bytes, ptrs = lay.weight_offsets, lay.weight_sizes, masters.weight_ptrs
        else:
            member_off, member_bytes, ptrs = lay.grad_offsets, lay.grad_sizes, masters.grad_ptrs
        _core.run_host(
            int(op), self.rank, self.world, epoch,
            self.wlayout["slots"], self.wlayout["weight_slot_bytes"], self.wlayout["grad_slot_bytes"],
            self.wlayout["chunk_bytes"], list(self.window.peer_bases),
            list(member_off), list(member_bytes), list(ptrs), list(local_index_of),
            self._grad_code, list(my_slots),
            schedule.tasks(op, self.rank), schedule.refs(op, self.rank),
            self.num_workers, self.timeout_s, self.jitter_us, epoch,
            slot_parent=schedule.tree(op)[0][self.rank].tolist(),
        )
