"""Per-rank expert loads, gathered from every rank of the group.

Two ways, the same result (int64 ``[world, E]``, rank order):

* a load board (a Context whose window every rank maps): each rank writes its ``[E]`` counts
  into every rank's board with an epoch flag, then waits (bounded) for every rank's flag in its
  own board -- an all-gather over symmetric memory, no store and no ``torch.distributed`` call
  per step.  Each record names what its exchange is for
  (:class:`~ultracomm.moe.board_layout.ExchangeTag`: layer, micro-batch slot, operation), so
  ranks out of step raise ``PlanMismatchError``.  :class:`LoadBoard` does it in host memory (the
  host executor over ``host_shm`` or ``local``); :class:`~ultracomm.moe.loads_gpu.GpuLoadBoard`
  in GPU windows (``cuda_ipc``, ``cuda_local``) with a kernel, no device-to-host copy before the
  exchange.  One layout and protocol for both: :mod:`ultracomm.moe.board_layout`.
* :func:`gather_loads` (any other Context): the group's bounded store exchange; its ``op`` names
  the same (``str(tag)``), and ranks in different exchanges raise ``PlanMismatchError`` there too.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from .. import _core
from ..comm import Comm
from ..errors import InputError, PeerError, PlanMismatchError, UltracommTimeout
from .board_layout import MAX_COUNT, BoardLayout, mismatch_text, timeout_text

__all__ = ["gather_loads", "LoadBoard", "board_for_context", "timeout_text", "mismatch_text"]


def gather_loads(comm: Comm, counts: torch.Tensor, op: str = "step") -> np.ndarray:
    """int64 ``[world, E]``: every rank's ``counts`` (tokens it routes to each expert).

    One ``[E]`` copy to the host (the planners run on the CPU), then the group's bounded
    exchange: a stalled or dead peer raises ``UltracommTimeout`` naming it after
    ``ULTRACOMM_TIMEOUT_S`` instead of hanging.
    """
    mine = counts.detach().to("cpu", torch.int64).numpy()
    return np.stack(comm.all_gather_object(mine, op=op, what="expert loads")).astype(np.int64)


def check_counts(counts: np.ndarray, num_experts: int) -> np.ndarray:
    """int32 ``[E]`` of one rank's counts, or ValueError naming what is wrong."""
    if counts.shape != (num_experts,):
        raise InputError(f"ultracomm: expert counts must be [{num_experts}], got {list(counts.shape)}")
    if counts.size and (counts.min() < 0 or counts.max() > MAX_COUNT):
        raise InputError(
            f"ultracomm: expert counts must be in 0..{MAX_COUNT} (int32 on the load board), got "
            f"{int(counts.min())}..{int(counts.max())}"
        )
    return np.ascontiguousarray(counts, dtype=np.int32)


def board_for_context(ctx: Any) -> Any:
    """The load board beside ``ctx``: host memory (:class:`LoadBoard`), GPU windows
    (:class:`~ultracomm.moe.loads_gpu.GpuLoadBoard`), or None (the store exchange)."""
    board = LoadBoard.for_context(ctx)
    if board is None:
        from .loads_gpu import GpuLoadBoard

        board = GpuLoadBoard.for_context(ctx)
    return board


class LoadBoard:
    """Expert loads exchanged through host-memory boards (layout and protocol:
    :mod:`ultracomm.moe.board_layout`; memcpy and host release/acquire atomics)."""

    def __init__(self, window: Any, num_experts: int, rank: int, world: int, timeout_s: float):
        self.window, self.E, self.rank, self.world = window, int(num_experts), rank, world
        self.layout = BoardLayout(world, self.E)
        self.timeout_s = float(timeout_s)
        self.seq = 0
        #: the Context's :class:`ultracomm.blame.Witness` (``for_context`` sets it), or None
        self.witness = None

    @classmethod
    def for_context(cls, ctx: Any) -> "LoadBoard | None":
        """A board beside ``ctx`` when every rank maps every other's host memory, else None."""
        w = ctx.window
        if w.provider not in ("host_shm", "local") or w.local.device.type != "cpu" or not all(w.peer_bases):
            return None
        from ..windows import open_window

        nbytes = BoardLayout(ctx.world, ctx.num_experts).total_bytes
        board = open_window(w.provider, ctx.comm, nbytes, op="ReplicaManager setup (load board)")
        out = cls(board, ctx.num_experts, ctx.rank, ctx.world, ctx.config.timeout_s)
        out.witness = getattr(ctx.comm, "witness", None)
        return out

    def gather(self, counts: torch.Tensor, op: str = "step", tag: int = 0) -> np.ndarray:
        """int64 ``[world, E]``: every rank's ``counts``; bounded by the Context's timeout.

        ``tag``: what this exchange is for (:attr:`ExchangeTag.value`, ``op`` its words); a rank
        that posted another raises ``PlanMismatchError`` here, on every rank."""
        mine = check_counts(counts.detach().to("cpu", torch.int64).numpy(), self.E)
        tag = int(tag) & 0xFFFFFFFFFFFFFFFF
        self.seq += 1
        n, L, bases = self.seq, self.layout, self.window.peer_bases
        for q in range(self.world):  # push into every board, then publish (release after the tag and counts)
            ctypes.c_uint64.from_address(bases[q] + L.tag(n, self.rank)).value = tag
            ctypes.memmove(bases[q] + L.counts(n, self.rank), mine.ctypes.data, 4 * self.E)
            _core.store_release(bases[q] + L.record(n, self.rank), n)
        own = bases[self.rank]
        out = np.empty((self.world, self.E), np.int64)
        missing, posted = [], {}
        for q in range(self.world):
            status, _ = _core.wait_flag(own + L.record(n, q), n, self.timeout_s if not missing else 1e-3)
            if status != 0:
                missing.append(q)
                continue
            theirs = ctypes.c_uint64.from_address(own + L.tag(n, q)).value
            if theirs != tag:
                posted.setdefault(theirs, []).append(q)
            out[q] = np.ctypeslib.as_array((ctypes.c_int32 * self.E).from_address(own + L.counts(n, q)))
        if posted:  # before the timeout: ranks out of step are the cause where both happen
            raise PlanMismatchError(mismatch_text(self.rank, op, n, posted))
        if missing:
            w = self.witness
            why = None if w is None else w.explain(w.epoch(), f"{op} (expert loads) timed out", missing)
            raise UltracommTimeout(timeout_text(self.rank, op, self.timeout_s, missing, why))
        bad = [q for q in range(self.world) if out[q].size and (out[q].min() < 0 or out[q].max() > MAX_COUNT)]
        if bad:  # every sender checked its own counts: what arrived is not what a rank posted
            raise PeerError(
                f"ultracomm: rank {self.rank} {op} (expert loads): ranks {bad} posted counts outside "
                f"0..{MAX_COUNT} (rank {bad[0]}: {int(out[bad[0]].min())}..{int(out[bad[0]].max())}); "
                "their boards were overwritten, or they run another ultracomm: the group is unusable"
            )
        return out

    def close(self) -> None:
        self.window.close()
