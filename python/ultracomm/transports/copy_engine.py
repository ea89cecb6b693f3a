"""The ``copy_engine`` transport: multicast with zero SMs (the FEPLB idea).

Weights move with ``cuMemcpyAsync`` peer copies (copy engines, not SMs) on one stream per
destination rank; a relay's forward waits on the device for its chunk's arrival flag with
``cuStreamWaitValue64`` and every copy is published with a fenced ``cuStreamWriteValue64``
on the destination's arrival flag, so there is no host round trip per chunk
(:mod:`ultracomm.transports.copy_engine_plan` builds the commands; the driver is opened with
``dlopen``, :mod:`ultracomm.cuda_driver`).

The reduction is not a copy: ``grad_reduce`` runs the ordered reduction of the ``tma``
transport's persistent kernel (``ultracomm._cuda``, the data plane's kernel: fp32
accumulation, sources in the schedule's order), over the same window.

``run`` blocks until this rank's part is done (the Context agrees plans on the CPU first): it
synchronises the device before enqueuing (so the caller's writes to the slots and masters are
complete; on a one-GPU loopback domain it orders its streams after the default stream instead,
since a device-wide sync would wait for peers' streams that wait for this rank), enqueues, then
polls the completion with the Context's timeout.  A wait that never
completes raises :class:`~ultracomm.errors.UltracommTimeout` naming the first unsatisfied flag
(rank, expert, chunk); the stuck stream waits are then released by writing the awaited values
(the Context is broken after a timeout; the released copies may move stale bytes).

Status: compiled/imported and its command lists checked on the CPU (simulated streams against
the host executor); the driver path has not run on a device here.
"""
from __future__ import annotations

import ctypes
import threading
import time
from typing import Any, Sequence

import torch

from ..cuda_driver import driver
from ..cuda_support import NotAvailableError, require
from ..errors import UltracommTimeout
from ..records import Op
from .copy_engine_plan import EPOCH, MAIN, Cmd, multicast_commands
from .host import Masters, op_digest

__all__ = ["CopyEngineTransport"]

_POLL_S = 50e-6


class CopyEngineTransport:
    """Zero-SM multicast over GPU windows; reduction by the ``tma`` kernel."""

    name = "copy_engine"
    window_providers = ("cuda_local", "torch_symm", "cuda_ipc", "nvshmem")

    def __init__(self, *, rank: int, world: int, window, wlayout: dict, layout, timeout_s: float, **tma_kw: Any):
        require("transport 'copy_engine'", need_module=False)
        self.driver = driver()
        self.rank, self.world = rank, world
        self.window, self.wlayout, self.layout = window, wlayout, layout
        self.timeout_s = float(timeout_s)
        self.device = window.local.device
        self._tma_kw = dict(rank=rank, world=world, window=window, wlayout=wlayout, layout=layout,
                            timeout_s=timeout_s, **tma_kw)
        self._tma = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._cache: dict[int, list[Cmd]] = {}

    # ------------------------------------------------------------------ reduce: the tma kernel
    def _reducer(self):
        if self._tma is None:
            from . import resolve_transport

            try:
                cls = resolve_transport("tma", "cuda")
            except NotAvailableError as e:
                raise NotAvailableError(f"ultracomm: transport 'copy_engine' cannot reduce: its reduction is the tma "
                                        f"transport's ordered reduction kernel, which is not available ({e})") from None
            import inspect

            params = inspect.signature(cls).parameters
            self._tma = cls(**{k: v for k, v in self._tma_kw.items() if k in params})
        return self._tma

    def _reduce(self, schedule, epoch, masters, my_slots, local_index_of, op_name) -> None:
        tma = self._reducer()
        stream = torch.cuda.current_stream(self.device)
        tma.run(Op.REDUCE, schedule, epoch, masters, my_slots, local_index_of, op_name, stream=stream.cuda_stream)
        if getattr(self.window, "loopback", False):
            # one loopback launch runs every rank: wait until every rank deposited (the last one launched)
            barrier = self.window.shared.setdefault(("copy_engine.reduce", tuple(self.window.peer_bases)),
                                                    threading.Barrier(self.world))
            try:
                barrier.wait(self.timeout_s)
            except threading.BrokenBarrierError:
                raise UltracommTimeout(
                    f"ultracomm: rank {self.rank} {op_name} (epoch {epoch}, transport copy_engine): not every loopback "
                    f"rank started the reduction within {self.timeout_s:g} s (timeout ULTRACOMM_TIMEOUT_S)") from None
            torch.cuda.synchronize(self.device)
        else:
            stream.synchronize()
        tma.check_error()

    # ------------------------------------------------------------------ multicast: copy engines
    def _stream(self, key: int) -> torch.cuda.Stream:
        s = self._streams.get(key)
        if s is None:
            s = self._streams[key] = torch.cuda.Stream(self.device)
        return s

    def commands(self, schedule, masters: Masters, my_slots: Sequence[int], local_index_of: Sequence[int]) -> list[Cmd]:
        """This rank's multicast commands for ``schedule`` (cached per schedule and masters)."""
        key = hash((schedule.digest, masters.weight_ptrs))
        cmds = self._cache.get(key)
        if cmds is None:
            if len(self._cache) >= 64:
                self._cache.clear()
            cmds = multicast_commands(self.rank, self.wlayout, list(self.window.peer_bases),
                                      schedule.tasks(Op.MULTICAST, self.rank), schedule.refs(Op.MULTICAST, self.rank),
                                      list(self.layout.weight_offsets), list(self.layout.weight_sizes),
                                      list(masters.weight_ptrs), list(local_index_of), list(my_slots),
                                      op_digest(schedule.digest, Op.MULTICAST))
            self._cache[key] = cmds
        return cmds

    def _enqueue(self, cmds: list[Cmd], epoch: int) -> torch.cuda.Event:
        drv = self.driver
        for cmd in cmds:
            if cmd.kind == "join":
                main = self._stream(MAIN)
                for k, s in self._streams.items():
                    if k != MAIN:
                        main.wait_stream(s)
                continue
            stream = self._stream(cmd.stream).cuda_stream
            value = epoch if cmd.value == EPOCH else cmd.value
            if cmd.kind == "copy":
                drv.memcpy(cmd.addr, cmd.src, cmd.nbytes, stream)
            elif cmd.kind == "write":
                drv.write_value(stream, cmd.addr, value)
            else:
                drv.wait_value(stream, cmd.addr, value)
        done = torch.cuda.Event()
        done.record(self._stream(MAIN))
        return done

    def _read_flag(self, addr: int) -> int:
        out = ctypes.c_uint64()
        side = torch.cuda.Stream(self.device)
        self.driver.memcpy(ctypes.addressof(out), addr, 8, side.cuda_stream)
        side.synchronize()
        return out.value

    def _timed_out(self, cmds: list[Cmd], epoch: int, op_name: str) -> UltracommTimeout:
        stuck = [c for c in cmds if c.kind == "wait" and self._read_flag(c.addr) < epoch]
        for c in stuck:  # release the stream waits: nothing else would ever satisfy them
            self.driver.write_value(torch.cuda.Stream(self.device).cuda_stream, c.addr, epoch)
        what = stuck[0].what if stuck else "the copies to complete"
        return UltracommTimeout(
            f"ultracomm: rank {self.rank} {op_name} (epoch {epoch}, transport copy_engine) timed out after "
            f"{self.timeout_s:g} s waiting for {what} (timeout ULTRACOMM_TIMEOUT_S={self.timeout_s:g}); the rank "
            "that should raise it is likely stalled or dead")

    def run(self, op: Op, schedule, epoch: int, masters: Masters, my_slots: Sequence[int],
            local_index_of: Sequence[int], op_name: str | None = None) -> None:
        """Run ``op`` for this rank at ``epoch``; blocks until done here (see the module docstring)."""
        op_name = op_name or Op(op).name.lower()
        with torch.cuda.device(self.device):
            if getattr(self.window, "loopback", False):
                # loopback ranks share the device: a device-wide sync would wait for peers' streams that
                # wait for this rank; order after the driving thread's default stream instead
                dflt = torch.cuda.default_stream(self.device)
                for k in (MAIN, *range(self.world)):
                    self._stream(k).wait_stream(dflt)
            else:
                torch.cuda.synchronize(self.device)  # the caller's writes to masters and slots are complete
            if Op(op) == Op.REDUCE:
                self._reduce(schedule, epoch, masters, my_slots, local_index_of, op_name)
                return
            cmds = self.commands(schedule, masters, my_slots, local_index_of)
            done = self._enqueue(cmds, epoch)
            deadline = time.monotonic() + self.timeout_s
            while not done.query():
                if time.monotonic() > deadline:
                    raise self._timed_out(cmds, epoch, op_name)
                time.sleep(_POLL_S)
