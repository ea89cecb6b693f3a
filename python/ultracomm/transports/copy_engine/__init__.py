"""The ``copy_engine`` transport: multicast from internal streams (the FEPLB idea), stream-ordered.

Since issue 35 it is no longer zero-SM: its copies run in gate kernels (one CTA per destination
stream) so that a lost peer releases them (see below); graph conditional nodes around copy-engine
copies would give the zero-SM path back with the same guarantee (not built: no device to test).

Same contract as ``tma`` (:mod:`ultracomm.cuda.stream_ordered`): ``run(..., stream=)`` only enqueues
on the caller's stream and returns; the Work completes with that stream; failures are raised by
``check_error()`` at ``Work.wait()`` / ``Context.synchronize()``.

Weights move on one internal stream per destination rank (non-blocking streams of the driver),
forked from the caller's stream with an event and joined back to it by waits on host words.
Every wait on a flag a peer writes (a destination's ready flag and digest, a relay's arrival
flag) is a *gate* (:func:`.plan.gate_commands`, :mod:`.gate`): one launch of a one-CTA kernel
that spins on the flags or on this rank's abort word, then copies the chunk and writes the
destination's arrival flag (release) -- or, once the watchdog set the abort word, does
nothing, so no internal stream waits for good on a lost peer (issue 35).  The copies are
therefore SM copies (one CTA per destination stream), not copy-engine ones: a copy engine's
``cuMemcpyAsync`` cannot be skipped once enqueued behind a wait.  No host round trip per chunk.  Before anything moves this rank
publishes its op digest beside ``ready[multicast]``, and a sender waits for each destination's
digest to *equal* its own before copying into it (:mod:`.plan` builds the commands
and says why the order is sound).  Stream waits cannot time out: a watchdog thread
(:mod:`.watchdog`) bounds them with the Context's timeout, detects a peer on
another plan, and releases the caller's stream on a failure (its limits are listed there).

The reduction is not a copy: ``grad_reduce`` runs the ordered reduction of the ``tma``
transport's persistent kernel (``ultracomm._cuda``, the data plane's kernel: fp32 accumulation,
sources in the schedule's order) on the caller's stream, over the same window.

Loopback windows (``cuda_local``, every rank a thread of one process on one GPU): as for
``tma``, each rank's n-th call joins the n-th set (:mod:`ultracomm.cuda.loopback_launch`, one
stream) and the call completing the set enqueues every rank's commands, merged in one deadlock-
free order (a rank that never calls leaves the set unenqueued; the Works of the others complete
without it, as with ``tma``).  Not capturable in a CUDA graph: the commands carry the epoch as
a literal.  The watchdog thread polls host words every 2 ms while operations are in flight:
it is off the critical path (the caller's stream passes its joins on the device by itself),
so it only bounds how late a failure is seen.

Status: command lists, gates, fork/join and the watchdog are checked on the CPU (simulated
streams, fakes; the gate kernel compiles).  On an H200 (perf/gpu/README.md) the driver path
(then with copy-engine copies) copied bit-exactly and refused graph capture; its stalled-peer and
plan-mismatch paths hung or half-reported there.  The gates have not run on a device yet.
"""

from __future__ import annotations

import ctypes
import time
from typing import Any, Sequence

import numpy as np
import torch

from ...cuda.driver import driver
from ...cuda.support import NotAvailableError, require
from ...errors import UltracommError
from ...cuda.loopback_launch import Deposit, launches_for
from ...records import Op
from .gate import KERNEL, PTX, THREADS, pack
from .plan import (
    EPOCH,
    MAIN,
    Cmd,
    abort_addr,
    flag_addr,
    gate_commands,
    host_words,
    multicast_commands,
    submission_order,
    word_addr,
)
from .watchdog import KEPT, Pending, Watchdog, abandoned, device_watchdogs, pending_for, pinned_words, quiesce
from ..base import Masters, Transport, op_digest

__all__ = ["CopyEngineTransport"]

_READ_WAIT_S = 1.0  # bound on the watchdog's device reads (a side copy behind a blocked queue)
_SIDE = -3  # stream key of the watchdog's reads (MAIN, DRAIN and ranks are the others)
_KEPT = KEPT  # reduce kernels of transports whose streams were abandoned land here (see close)


class CopyEngineTransport(Transport):
    """Multicast over GPU windows from internal streams, through releasable gates (one CTA per
    destination stream); reduction by the ``tma`` kernel (module docstring)."""

    name = "copy_engine"
    window_providers = ("cuda_local", "torch_symm", "cuda_ipc", "nvshmem")
    stream_ordered = True
    # its reduction is the tma transport's kernel: it takes that transport's executor options
    options = frozenset({"num_workers", "jitter_us", "multicast_sms", "reduce_sms"})
    window_flags = True

    def __init__(self, *, rank: int, world: int, window, wlayout: dict, layout, timeout_s: float, **tma_kw: Any):
        require("transport 'copy_engine'", need_module=False)
        self.driver = driver()
        self.rank, self.world = rank, world
        self.window, self.wlayout, self.layout = window, wlayout, layout
        self.timeout_s = float(timeout_s)
        self.device = window.local.device
        self._ordinal = torch.device(self.device).index or 0  # for Driver.bind (a CUDA tensor's has an index)
        self._loopback = bool(getattr(window, "loopback", False))
        self._tma_kw = dict(
            rank=rank, world=world, window=window, wlayout=wlayout, layout=layout, timeout_s=timeout_s, **tma_kw
        )
        self._tma = None
        self._streams: dict[int, torch.cuda.Stream] = {}
        self._cache: dict[int, list[Cmd]] = {}
        # id(cmds) -> (cmds, gated commands, their descriptors: pinned host memory the gates read)
        self._gated: dict[int, tuple] = {}
        self._retired: list = []  # descriptors of evicted entries, kept until no operation is in flight
        # started, done[DRAIN], done[d]: pinned host memory, so the watchdog reads and writes
        # them without a CUDA call (and its abort never waits behind a blocked stream)
        self._words = pinned_words(host_words(world))
        self._scratch = pinned_words(64)
        self._fork = torch.cuda.Event()
        self._dog = Watchdog(rank, self.timeout_s, self._read_device)
        # the watchdog's read stream exists before any operation: creating a stream waits for the
        # legacy default stream, and a caller's legacy stream blocked on a join only the watchdog
        # releases would then never let the watchdog read (seen on an H200, 2026-12-04)
        with torch.cuda.device(self.device):
            self.driver.bind(self._ordinal)
            self._stream(_SIDE)
        self._dog.start()
        # the watchdogs whose failure can leave streams blocked on this device in this process:
        # every rank's of a loopback domain (they share the device), else this rank's
        self._dogs = device_watchdogs(window, "ultracomm.copy_engine_watchdogs", self._dog, self._loopback)

    # ------------------------------------------------------------------ reduce: the tma kernel
    def _reducer(self):
        if self._tma is None:
            try:  # the sibling transport itself (not through resolve_transport: no circle with the package)
                require("transport 'tma'")
                from ..tma import TmaTransport as cls
            except (NotAvailableError, ImportError) as e:
                raise NotAvailableError(
                    f"ultracomm: transport 'copy_engine' cannot reduce: its reduction is the tma "
                    f"transport's ordered reduction kernel, which is not available ({e})"
                ) from None
            common = {"rank", "world", "window", "wlayout", "layout", "timeout_s"}
            self._tma = cls(**{k: v for k, v in self._tma_kw.items() if k in common or k in cls.options})
        return self._tma

    # ------------------------------------------------------------------ multicast: commands
    def commands(self, schedule, masters: Masters, my_slots: Sequence[int], local_index_of: Sequence[int]) -> list[Cmd]:
        """This rank's multicast commands for ``schedule`` (cached per schedule and masters)."""
        key = hash((schedule.digest, masters.weight_ptrs, tuple(my_slots)))
        cmds = self._cache.get(key)
        if cmds is None:
            if len(self._cache) >= 64:
                self._cache.clear()
                self._retired += self._gated.values()  # a gate still queued may read them
                self._gated.clear()
            cmds = multicast_commands(
                self.rank,
                self.wlayout,
                list(self.window.peer_bases),
                schedule.tasks(Op.MULTICAST, self.rank),
                schedule.refs(Op.MULTICAST, self.rank),
                list(self.layout.weight_offsets),
                list(self.layout.weight_sizes),
                list(masters.weight_ptrs),
                list(local_index_of),
                list(my_slots),
                op_digest(schedule.digest, Op.MULTICAST),
                self._words.data_ptr(),
                schedule.tree(Op.MULTICAST)[0][self.rank].tolist(),
            )
            self._cache[key] = cmds
        return cmds

    def _pending(self, cmds: list[Cmd], epoch: int, digest: int, op_name: str | None) -> Pending:
        return pending_for(
            cmds,
            epoch,
            digest,
            op_name,
            self.wlayout,
            self.window.peer_bases,
            word_addr(self._words.data_ptr(), None),
            self._abort_word(),
        )

    def _abort_word(self) -> int:
        return abort_addr(self._words.data_ptr(), self.world)

    def gated(self, cmds: list[Cmd]) -> list[Cmd]:
        """``cmds`` as submitted: :func:`.plan.gate_commands`, each gate's ``src`` the address of its
        descriptor (pinned host memory, cached with ``cmds``)."""
        hit = self._gated.get(id(cmds))
        if hit is not None and hit[0] is cmds:
            return hit[1]
        if not self._dog.pending():
            self._retired.clear()  # every operation joined: no gate reads them any more
        g = gate_commands(cmds, self._words.data_ptr(), self._words.numel())
        words, at = pack(g)
        desc = pinned_words(len(words)) if len(words) else None
        if desc is not None:
            desc.numpy()[:] = words.view(np.int64)
        base = desc.data_ptr() if desc is not None else 0
        import dataclasses

        g = [dataclasses.replace(c, src=base + 8 * at[i]) if c.kind == "gate" else c for i, c in enumerate(g)]
        self._gated[id(cmds)] = (cmds, g, desc)
        return g

    # ------------------------------------------------------------------ multicast: streams
    def _stream(self, key: int) -> torch.cuda.ExternalStream:
        """The internal stream ``key``: created by the driver, not taken from torch's pool (a pooled
        stream may be the caller's or anyone's: a blocked wait would stall their work); the
        watchdog's reads get the highest priority."""
        s = self._streams.get(key)
        if s is None:
            handle = self.driver.stream_create(-1 if key == _SIDE else 0)
            s = self._streams[key] = torch.cuda.ExternalStream(handle, device=self.device)
        return s

    def _submit(self, cmd: Cmd, epoch: int, caller: torch.cuda.ExternalStream) -> None:
        """One command on its stream (``MAIN``: the caller's)."""
        value = epoch if cmd.value == EPOCH else cmd.value
        if cmd.kind == "fork":
            self._fork.record(caller)
            return
        if cmd.kind == "forked":
            self._stream(cmd.stream).wait_event(self._fork)
            return
        handle = caller.cuda_stream if cmd.stream == MAIN else self._stream(cmd.stream).cuda_stream
        if cmd.kind == "gate":
            self.driver.launch(
                self.driver.function(PTX, KERNEL),
                THREADS,
                handle,
                [ctypes.c_void_p(cmd.src), ctypes.c_uint64(epoch), ctypes.c_void_p(self._abort_word())],
            )
        elif cmd.kind == "copy":
            self.driver.memcpy(cmd.addr, cmd.src, cmd.nbytes, handle)
        elif cmd.kind == "write":
            self.driver.write_value(handle, cmd.addr, value)
        else:
            self.driver.wait_value(handle, cmd.addr, value, equal=cmd.kind == "wait_eq")

    @staticmethod
    def _enqueue(
        items: Sequence[tuple["CopyEngineTransport", list[Cmd], Pending | None]], epoch: int, stream: int
    ) -> None:
        """Enqueue ranks' commands (one rank, or every rank of a loopback domain) on ``stream``
        and their internal streams, in :func:`submission_order`; the watchdogs watch first."""
        for t, _, p in items:
            if p is not None:
                t._dog.add(p)
        try:
            items[0][0].driver.bind(items[0][0]._ordinal)  # this thread may have no current context yet
            caller = torch.cuda.ExternalStream(stream, device=items[0][0].device)
            for r, cmd in submission_order([t.gated(c) for t, c, _ in items]):
                items[r][0]._submit(cmd, epoch, caller)
        except Exception as e:
            # what was enqueued stays queued: the caller's stream may wait on joins no stream will
            # write, and an operation whose `started` word is never written has no clock.  Fail
            # every rank's watchdog: the joins are released, the streams count as abandoned.
            for t, _, _ in items:
                t._dog.fail(
                    UltracommError(
                        f"ultracomm: rank {t.rank}: enqueueing a copy_engine operation (epoch {epoch}) failed: {e}"
                    )
                )
            raise

    def run(
        self,
        op: Op,
        schedule,
        epoch: int,
        masters: Masters,
        my_slots: Sequence[int],
        local_index_of: Sequence[int],
        op_name: str | None = None,
        *,
        stream: int,
    ) -> bool:
        """Enqueue ``op`` at ``epoch`` on ``stream`` (a ``cudaStream_t`` as int) and return: ``True``
        when this call enqueued work, ``False`` for a loopback rank's share that the rank
        completing the set enqueues."""
        op = Op(int(op))
        if self._dog.failure is not None:
            raise UltracommError(
                f"ultracomm: rank {self.rank} {op_name or op.name.lower()}: an earlier copy_engine "
                f"operation failed ({self._dog.failure}); create a new Context"
            )
        if torch.cuda.is_current_stream_capturing():
            raise UltracommError(
                "ultracomm: transport 'copy_engine' cannot be captured in a CUDA graph (its stream "
                "commands carry each operation's epoch as a literal); use transport='tma'"
            )
        if op == Op.REDUCE:
            done = self._reducer().run(op, schedule, epoch, masters, my_slots, local_index_of, op_name, stream=stream)
            return done is not False
        with torch.cuda.device(self.device):
            cmds = self.commands(schedule, masters, my_slots, local_index_of)
            digest = op_digest(schedule.digest, Op.MULTICAST)
            if not self._loopback:
                self._enqueue([(self, cmds, self._pending(cmds, epoch, digest, op_name))], epoch, stream)
                return True
            return self._deposit(Op.MULTICAST, epoch, stream, (self, cmds, digest, op_name))

    def _deposit(self, op: Op, epoch: int, stream: int, item: tuple) -> bool:
        def launch(deps: Sequence[Deposit]) -> None:
            e = max(d.epoch for d in deps)  # every rank's epoch, as one launch of the tma kernel
            items = [
                (t, cmds, t._pending(cmds, e, dg, name) if dg is not None else None)
                for t, cmds, dg, name in (d.item for d in deps)
            ]
            self._enqueue(items, e, stream)

        return launches_for(self.window).deposit(Deposit(self.rank, int(op), int(epoch), int(stream), item), launch)

    def reject(self, op: Op, epoch: int, stream: int) -> None:
        """This rank rejected its plan: publish kRejectedDigest beside ``ready[op] = epoch``
        (stream-ordered); a peer's digest wait never passes and its watchdog raises "rank r
        rejected its plan".  In a loopback domain this is the rank's share of the set."""
        from ... import _core

        me = self.window.peer_bases[self.rank]
        cmds = [
            Cmd("write", MAIN, flag_addr(self.wlayout, me, "digest", op=Op(op)), int(_core.REJECTED_DIGEST), phase=0),
            Cmd("write", MAIN, flag_addr(self.wlayout, me, "ready", op=Op(op)), phase=0),
        ]
        with torch.cuda.device(self.device):
            if self._loopback:
                self._deposit(Op(op), epoch, stream, (self, cmds, None, None))
            else:
                self._enqueue([(self, cmds, None)], int(epoch), stream)

    # ------------------------------------------------------------------ the watchdog's reads
    def _read_device(self, addrs: Sequence[int]) -> list[int] | None:
        """uint64 words of device memory (own or peers' windows), through a side stream; ``None``
        when the copy did not finish within a bound (never blocks the watchdog for long)."""
        out: list[int] = []
        with torch.cuda.device(self.device):
            self.driver.bind(self._ordinal)  # the watchdog's thread made no runtime call before
            side = self._stream(_SIDE)
            n = self._scratch.numel()
            for i in range(0, len(addrs), n):
                part = addrs[i : i + n]
                for j, a in enumerate(part):
                    self.driver.memcpy(self._scratch.data_ptr() + 8 * j, a, 8, side.cuda_stream)
                ev = torch.cuda.Event()
                ev.record(side)
                deadline = time.monotonic() + _READ_WAIT_S
                while not ev.query():
                    if time.monotonic() > deadline:
                        return None
                    time.sleep(1e-4)
                out += [ctypes.c_uint64.from_address(self._scratch.data_ptr() + 8 * j).value for j in range(len(part))]
        return out

    # ------------------------------------------------------------------ failures, close
    def check_error(self) -> None:
        """Raise the first failure recorded since the last call (watchdog, then the reduce kernel)."""
        err = self._dog.take_error()
        if err is not None:
            raise err
        if self._tma is not None:
            self._tma.check_error()

    def quiesce(self) -> None:
        """Wait until no copy_engine operation on this device (loopback: of any rank) is in flight:
        each ends done or failed within its timeout once its stream reached it (the watchdogs).
        Before a device-wide synchronize, which must not start while an operation may still
        fail and leave its streams blocked."""
        quiesce(self._dogs)

    def abandoned_streams(self) -> bool:
        """True after a failure (in a loopback domain: of any rank, they share the device):
        internal streams may stay blocked on a lost peer's flags, so a device-wide synchronize
        would not return and the window must stay mapped."""
        return abandoned(self._dogs)

    def close(self) -> None:
        """Stop the watchdog and free the reduce kernel's plans (after the caller's synchronize;
        after a failure the Context keeps the window mapped: :meth:`abandoned_streams`)."""
        self._dog.stop()
        streams, self._streams = self._streams, {}
        with torch.cuda.device(self.device):
            if streams:
                self.driver.bind(self._ordinal)
            for s in streams.values():  # queued work (even blocked for good) keeps its stream alive
                self.driver.stream_destroy(s.cuda_stream)
        if self._tma is not None:
            if self.abandoned_streams():
                # freeing its device plans or runner is a cudaFree, which waits for every stream of
                # the device: the blocked ones never finish
                _KEPT.append(self._tma)
            else:
                self._tma.close()
