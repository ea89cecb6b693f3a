"""``local`` windows: all ranks are threads of one process (loopback domains)."""

from __future__ import annotations

import torch

from ..comm import Comm
from .base import Window
from ..errors import InputError


class LocalWindow(Window):
    provider = "local"

    def __init__(self, rank: int, world: int, local: torch.Tensor, peers: list[torch.Tensor]):
        self.rank, self.world, self.nbytes = rank, world, local.numel()
        self.local = local
        self._peers = peers  # keeps every rank's buffer alive as long as any rank uses it
        self.peer_bases = [p.data_ptr() for p in peers]

    @classmethod
    def create(cls, comm: Comm, nbytes: int, op: str = "window setup") -> "LocalWindow":
        if comm.kind != "loopback":
            raise InputError("ultracomm: the 'local' window needs a LoopbackGroup (ranks as threads of one process)")
        # loopback: objects are shared, not copied
        peers = comm.agree(lambda: torch.zeros(nbytes, dtype=torch.uint8), op=op, what="local window exchange")
        buf = peers[comm.rank]
        return cls(comm.rank, comm.world, buf, peers)

    def close(self) -> None:
        self._peers = []
        self.peer_bases = []
