"""``cuda_local`` windows: every rank of a loopback domain on ONE GPU, in one process.

The test vehicle of the GPU data plane (issue 8, section 4): ranks are threads of one
process (a :class:`~ultracomm.comm.LoopbackGroup`), each rank's window is a separate
allocation on the same device, and ``peer_bases`` are plain device addresses.  The ``tma``
transport launches all loopback ranks in one grid so that every rank's CTAs are resident
together; ``shared`` (the domain's dict, one object for all ranks) is where its ranks meet.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from ..cuda.support import resolve_device, torch_cuda_reason
from .base import Window
from .gpu_common import check_usable, zero_and_barrier
from ..errors import InputError


class CudaLocalWindow(Window):
    provider = "cuda_local"
    device_type = "cuda"
    loopback = True

    def __init__(self, rank: int, world: int, local: torch.Tensor, peers: list[torch.Tensor], shared: dict):
        self.rank, self.world, self.nbytes = rank, world, local.numel()
        self.local = local
        self._peers = peers  # every rank's buffer stays alive while any rank uses the window
        self.peer_bases = [p.data_ptr() for p in peers]
        self.shared: dict[Any, Any] = shared

    @staticmethod
    def unavailable_reason(comm: Comm) -> str | None:
        if comm.kind != "loopback":
            return "cuda_local needs a LoopbackGroup (all ranks as threads of one process); use cuda_ipc or torch_symm"
        return torch_cuda_reason()

    @classmethod
    def create(cls, comm: Comm, nbytes: int, op: str = "window setup", device: Any = None) -> "CudaLocalWindow":
        check_usable(cls, comm)
        # loopback collectives share objects: peers get the tensors themselves
        peers = comm.agree(
            lambda: torch.empty(nbytes, dtype=torch.uint8, device=resolve_device(device)),
            op=op,
            what="cuda_local window allocation",
        )
        devices = [p.device.index for p in peers]
        if len(set(devices)) != 1:
            raise InputError(
                f"ultracomm: cuda_local puts every loopback rank on one GPU, but ranks chose devices "
                f"{devices}; pass the same device= on every rank"
            )
        local = peers[comm.rank]
        zero_and_barrier(comm, local, op)
        return cls(comm.rank, comm.world, local, peers, comm.domain.shared)

    def peer_view(self, r: int) -> torch.Tensor:
        """Rank ``r``'s window as a uint8 tensor on this device (tests, debugging)."""
        return self._peers[r]

    def close(self) -> None:
        self._peers = []
        self.peer_bases = []
