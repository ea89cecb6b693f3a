"""The load board in GPU windows (``cuda_ipc``, ``torch_symm``, ``nvshmem``: one GPU per process;
``cuda_local``: every rank of a loopback domain on one GPU): the expert-load all-gather of :mod:`ultracomm.moe.board_layout`
run by a kernel (``_cuda.load_exchange``, csrc/cuda/k_loads.cu) on the caller's current stream.

``post(counts)`` enqueues the exchange and returns the device tensor ``[world, E]`` (int32)
that holds every rank's counts once the stream reached it: no host synchronisation, no store
or ``torch.distributed`` call, capturable (the exchange number is a device counter).
``gather(counts, op, tag)`` is what ``ReplicaManager.step`` calls while its planners run on the
host: ``post``, then one copy of the result (and the kernel's status) to the host; a rank
that never posted is named after ``ULTRACOMM_TIMEOUT_S`` (the kernel's bounded wait), a rank
whose record names another exchange (its :class:`~ultracomm.moe.board_layout.ExchangeTag`,
checked by the kernel) raises ``PlanMismatchError``.  On the device control plane the build
refuses loads whose status says either (nothing is built from them).

Loopback (``cuda_local``): spinning kernels of several ranks must run in one launch (one
rank's CTA would otherwise wait on a rank queued behind it), launched cooperatively so that
every rank's CTA is resident at once (up to ``_cuda.LOAD_EXCHANGE_MAX_RANKS`` = 288 ranks; a GPU
that cannot hold them all refuses the launch with a ValueError that names the numbers,
``_cuda.load_exchange_max_coresident``), so each rank deposits its share
and the rank completing the set launches every rank (:mod:`ultracomm.cuda.loopback_launch`: same
order of calls, one stream); ``gather`` then waits (bounded) until that launch is enqueued, so
loopback ranks calling ``gather`` need a thread each.
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Sequence

import numpy as np
import torch

from ..cuda.support import NotAvailableError, cuda_runtime
from ..errors import InputError, PlanMismatchError, UltracommError, UltracommTimeout
from ..cuda.loopback_launch import Deposit, launches_for
from .board_layout import BoardLayout, mismatch_text, timeout_text

__all__ = ["GpuLoadBoard"]

log = logging.getLogger("ultracomm")

_STATUS_WORDS = 8  # int32 status [4] padded to 32 bytes ahead of the gathered counts
_STATUS_TIMEOUT, _STATUS_MISMATCH = 1, 2  # _cuda.LOAD_STATUS_TIMEOUT / LOAD_STATUS_MISMATCH
#: window providers whose boards the kernel can use: each maps every peer's board into this device's
#: address space (``peer_bases``), which is all the kernel needs -- torch_symm, the default GPU window of
#: a process group, included, so that the default multi-GPU setup keeps its control plane on the device
BOARD_PROVIDERS = ("cuda_ipc", "torch_symm", "nvshmem", "cuda_local")


class _Share:
    """One loopback rank's share of a launch: its kernel arguments and when it was enqueued."""

    def __init__(self, entry: dict):
        self.entry, self.done, self.error = entry, threading.Event(), None


class GpuLoadBoard:
    """Expert loads exchanged through GPU boards (see the module docstring).

    ``window``: the board (a GPU window of :attr:`BoardLayout.total_bytes`, zeroed, every
    rank's base in ``peer_bases`` as this device addresses it).
    """

    def __init__(self, window: Any, num_experts: int, rank: int, world: int, timeout_s: float):
        self.window, self.E, self.rank, self.world = window, int(num_experts), rank, world
        self.layout = BoardLayout(world, self.E)
        self.timeout_s = float(timeout_s)
        dev = window.local.device
        self.device = dev
        index = dev.index if dev.index is not None else (torch.cuda.current_device() if dev.type == "cuda" else 0)
        self._cuda = cuda_runtime(index, "the GPU load board")
        # allocated once: the kernel's arguments are fixed addresses (a captured graph replays them)
        self._bases = torch.tensor([int(b) for b in window.peer_bases], dtype=torch.int64, device=dev)
        self._counts = torch.zeros(self.E, dtype=torch.int32, device=dev)
        self._buf = torch.zeros(_STATUS_WORDS + world * self.E, dtype=torch.int32, device=dev)
        self._seq = torch.zeros(1, dtype=torch.int64, device=dev)
        self.out = self._buf[_STATUS_WORDS:].view(world, self.E)
        #: int32 status words of the last exchange: word 0 nonzero when it failed (1: a rank never
        #: posted, 2: a rank posted another tag), word 1 names that rank, words 2-3 what it posted
        #: (the flag it was at, or its tag)
        self.status = self._buf[:_STATUS_WORDS]
        self._loopback = bool(getattr(window, "loopback", False))
        self._last: _Share | None = None

    def _stream(self) -> int:
        """The caller's current stream on the board's device (the exchange is enqueued there)."""
        return torch.cuda.current_stream(self.device).cuda_stream

    @classmethod
    def for_context(cls, ctx: Any) -> "GpuLoadBoard | None":
        """A board beside ``ctx`` on its GPU window's provider, or None (no GPU window, or no
        ``_cuda``: the store exchange then)."""
        w = ctx.window
        if w.provider not in BOARD_PROVIDERS or w.local.device.type != "cuda" or not all(w.peer_bases):
            return None
        try:
            cuda_runtime(w.local.device.index or 0, "the GPU load board")
        except NotAvailableError as e:
            log.info("ultracomm: expert loads go through the store: %s", e)
            return None
        from ..windows import open_window

        nbytes = BoardLayout(ctx.world, ctx.num_experts).total_bytes
        board = open_window(w.provider, ctx.comm, nbytes, op="ReplicaManager setup (load board)", device=w.local.device)
        return cls(board, ctx.num_experts, ctx.rank, ctx.world, ctx.config.timeout_s)

    def _entry(self, tag: int) -> dict:
        return dict(
            counts=self._counts.data_ptr(),
            out=self.out.data_ptr(),
            status=self._buf.data_ptr(),
            bases=self._bases.data_ptr(),
            seq=self._seq.data_ptr(),
            rank=self.rank,
            tag=tag,
        )

    def _launch(self, entries: Sequence[dict], stream: int) -> None:
        L = self.layout
        self._cuda.load_exchange(
            list(entries), L.world, L.num_experts, L.entries, L.record_bytes, self.timeout_s, stream
        )

    def post(self, counts: torch.Tensor, tag: int = 0) -> torch.Tensor:
        """Enqueue this rank's exchange of ``counts`` (``[E]``, any integer dtype, on this device)
        on the current stream; returns ``[world, E]`` int32, valid once the stream reached it.
        ``tag``: what the exchange is for (:attr:`ExchangeTag.value`; a kernel argument, so a
        captured graph replays the tag of its capture); a peer that posted another sets
        :attr:`status` word 0 to 2."""
        if tuple(counts.shape) != (self.E,):
            raise InputError(f"ultracomm: expert counts must be [{self.E}], got {list(counts.shape)}")
        if counts.device != self.device:
            raise InputError(
                f"ultracomm: expert counts must be on the load board's device {self.device}, got {counts.device}"
            )
        self._counts.copy_(counts.detach())  # on the stream, ahead of the exchange
        stream = self._stream()
        tag = int(tag) & 0xFFFFFFFFFFFFFFFF
        if not self._loopback:
            self._launch([self._entry(tag)], stream)
            return self.out
        share = self._last = _Share(self._entry(tag))

        def launch(deps: Sequence[Deposit]) -> None:
            shares = [d.item for d in deps]
            try:
                self._launch([s.entry for s in shares], deps[0].stream)
            except BaseException as e:
                for s in shares:
                    s.error = e
                raise
            finally:
                for s in shares:
                    s.done.set()

        launches_for(self.window, "ultracomm.load_board").deposit(Deposit(self.rank, "loads", 0, stream, share), launch)
        return self.out

    def _wait_launched(self, op: str) -> None:
        share = self._last
        if share is None:
            return
        if not share.done.wait(self.timeout_s):
            raise UltracommTimeout(timeout_text(self.rank, op, self.timeout_s, self._missing_loopback()))
        if share.error is not None:
            raise UltracommError(
                f"ultracomm: rank {self.rank} {op} (expert loads): the shared loopback launch failed: {share.error}"
            )

    def _missing_loopback(self) -> list[int]:
        pending = launches_for(self.window, "ultracomm.load_board").pending()
        here = next((set(r) for r in pending.values() if self.rank in r), set())
        return [q for q in range(self.world) if q not in here]

    def exchange(self, counts: torch.Tensor, op: str = "step", tag: int = 0) -> torch.Tensor:
        """:meth:`post`, and on a loopback domain wait (bounded, on the host: no device sync)
        until the shared launch is enqueued, so work this rank enqueues next reads the result.
        Returns ``[world, E]`` int32 on the device."""
        out = self.post(counts, tag)
        self._wait_launched(op)
        return out

    def gather(self, counts: torch.Tensor, op: str = "step", tag: int = 0) -> np.ndarray:
        """int64 ``[world, E]`` on the host: :meth:`post`, then one copy back (the host
        planners need the loads); a rank that never posted raises ``UltracommTimeout`` naming it,
        a rank that posted another ``tag`` ``PlanMismatchError``."""
        self.exchange(counts, op, tag)
        host = self._buf.cpu()  # waits for the exchange on this stream
        status = host[:4].tolist()
        if status[0] == _STATUS_MISMATCH:
            theirs = (status[2] & 0xFFFFFFFF) | (status[3] & 0xFFFFFFFF) << 32
            raise PlanMismatchError(mismatch_text(self.rank, op, int(self._seq.cpu().item()), {theirs: [status[1]]}))
        if status[0] != 0:
            raise UltracommTimeout(timeout_text(self.rank, op, self.timeout_s, [int(status[1])]))
        return host[_STATUS_WORDS:].numpy().reshape(self.world, self.E).astype(np.int64)

    def close(self) -> None:
        self.window.close()
