"""``private`` windows: the replica pool of transports that need no peer mapping.

The ``p2p`` transport moves bytes with ``torch.distributed`` point-to-point messages, so no
rank addresses another's memory: the "window" is this rank's pool alone (same byte layout as
every window, so the Context's replica views are unchanged), on the CPU or on the Context's
CUDA device.  ``peer_bases`` holds only this rank's own address (0 for peers): a transport
that dereferences a peer's base cannot run over it, and says so when it checks its providers.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from ..cuda.support import resolve_device
from ..host_memory import page_aligned_zeros
from .base import Window


class PrivateWindow(Window):
    provider = "private"
    device_type = "any"  # where the Context's device says: the CPU or a CUDA device

    def __init__(self, rank: int, world: int, local: torch.Tensor):
        self.rank, self.world, self.nbytes = rank, world, local.numel()
        self.local = local
        self.peer_bases = [local.data_ptr() if r == rank else 0 for r in range(world)]

    @staticmethod
    def unavailable_reason(comm: Comm) -> str | None:
        return None

    @classmethod
    def create(cls, comm: Comm, nbytes: int, op: str = "window setup", device: Any = None) -> "PrivateWindow":
        """This rank's zeroed pool (CPU when ``device`` is ``None``; page-aligned there, see
        :mod:`ultracomm.host_memory`); every rank agrees it was allocated (bounded), so a rank
        that ran out of memory fails every rank."""
        dev = torch.device("cpu") if device is None else resolve_device(device)

        pool: list[torch.Tensor] = []
        # only the outcome is exchanged (a torch group pickles what agree returns)
        comm.agree(lambda: pool.append(page_aligned_zeros(nbytes, dev)), op=op, what="private replica pool allocation")
        return cls(comm.rank, comm.world, pool[0])

    def close(self) -> None:
        self.peer_bases = []
