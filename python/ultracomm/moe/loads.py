"""Per-rank expert loads, gathered from every rank of the group.

Two ways, the same result (int64 ``[world, E]``, rank order):

* :class:`LoadBoard` (a Context whose window every rank maps in host memory: the host
  executor over ``host_shm`` or ``local``): each rank writes its ``[E]`` counts into its own
  region of a small symmetric window and raises an epoch flag; the others wait (bounded) for
  the flag and read the counts -- an all-gather over shared memory, no store and no
  ``torch.distributed`` call per step.
* :func:`gather_loads` (any other Context): the group's bounded store exchange.
"""
from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from .. import _core
from ..comm import Comm
from ..errors import UltracommTimeout

__all__ = ["gather_loads", "LoadBoard"]

_ENTRIES = 2  # a rank can be at most one exchange ahead of the slowest reader (it waits for all)


def gather_loads(comm: Comm, counts: torch.Tensor, op: str = "step") -> np.ndarray:
    """int64 ``[world, E]``: every rank's ``counts`` (tokens it routes to each expert).

    One ``[E]`` copy to the host (the planners run on the CPU), then the group's bounded
    exchange: a stalled or dead peer raises ``UltracommTimeout`` naming it after
    ``ULTRACOMM_TIMEOUT_S`` instead of hanging.
    """
    mine = counts.detach().to("cpu", torch.int64).numpy()
    return np.stack(comm.all_gather_object(mine, op=op, what="expert loads")).astype(np.int64)


class LoadBoard:
    """Expert loads exchanged through a host-memory window (see the module docstring).

    Layout per rank: ``_ENTRIES`` entries of (uint64 epoch flag, int64 ``[E]`` counts); the
    exchange ``n`` uses entry ``n % _ENTRIES``.  A rank posts exchange ``n + 1`` only after it
    read every rank's ``n``, so no entry is overwritten while a peer still reads it.
    """

    def __init__(self, window: Any, num_experts: int, rank: int, world: int, timeout_s: float):
        self.window, self.E, self.rank, self.world = window, int(num_experts), rank, world
        self.timeout_s = float(timeout_s)
        self.entry_bytes = 8 * (1 + self.E)
        self.seq = 0

    @classmethod
    def for_context(cls, ctx: Any) -> "LoadBoard | None":
        """A board beside ``ctx`` when every rank maps every other's host memory, else None."""
        w = ctx.window
        if w.provider not in ("host_shm", "local") or w.local.device.type != "cpu" or not all(w.peer_bases):
            return None
        from ..windows import open_window

        nbytes = -(-(_ENTRIES * 8 * (1 + ctx.num_experts)) // 64) * 64
        board = open_window(w.provider, ctx.comm, nbytes, op="ReplicaManager setup (load board)")
        return cls(board, ctx.num_experts, ctx.rank, ctx.world, ctx.config.timeout_s)

    def _entry(self, rank: int, n: int) -> int:
        return self.window.peer_bases[rank] + (n % _ENTRIES) * self.entry_bytes

    def gather(self, counts: torch.Tensor, op: str = "step") -> np.ndarray:
        """int64 ``[world, E]``: every rank's ``counts``; bounded by the Context's timeout."""
        mine = counts.detach().to("cpu", torch.int64).numpy()
        if mine.shape != (self.E,):
            raise ValueError(f"ultracomm: expert counts must be [{self.E}], got {list(mine.shape)}")
        self.seq += 1
        n = self.seq
        own = self._entry(self.rank, n)
        ctypes.memmove(own + 8, np.ascontiguousarray(mine).ctypes.data, 8 * self.E)
        _core.store_release(own, n)  # the counts are visible before the flag says so
        out = np.empty((self.world, self.E), np.int64)
        missing = []
        for q in range(self.world):
            addr = self._entry(q, n)
            status, _ = _core.wait_flag(addr, n, self.timeout_s if not missing else 1e-3)
            if status != 0:
                missing.append(q)
                continue
            out[q] = np.ctypeslib.as_array((ctypes.c_int64 * self.E).from_address(addr + 8))
        if missing:
            raise UltracommTimeout(
                f"ultracomm: rank {self.rank} {op} (expert loads) timed out after {self.timeout_s:g} s: ranks "
                f"{missing} did not post their loads (timeout ULTRACOMM_TIMEOUT_S={self.timeout_s:g}); they are "
                "likely stalled or dead, or called a different operation: every rank must call step() for the same "
                "layers in the same order")
        return out

    def close(self) -> None:
        self.window.close()
