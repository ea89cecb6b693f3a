"""A CPU model of the GPU split transport's side streams (ultracomm.transports.split.stream).

Every rank's stream operations run on ONE FIFO queue per rank; a SEND completes only together
with the matching RECV at the head of the peer's queue (rendezvous: the most NCCL promises).
Two drivers:

* :func:`run_key_model` -- no memory, no interpreter: a WAIT_GE passes once every message of a
  smaller (chunk, level) finished (the interpreter's dependency structure, the assumption of
  the order argument).  Deterministic, single-threaded; a stuck state is a :class:`StreamDeadlock`.
* :class:`SimHub` / :class:`SimBridge` -- stands in for the CPU split transport's gloo bridge
  (``ultracomm.transports.split.BridgeRun``): the real host interpreter runs over real windows
  and shadows, and the hub executes every rank's stream over that memory.  A state in which no
  queue can move and no head waits for a flag (all heads are unmatched SEND/RECV) is a
  deadlock, detected, not timed; a head waiting for a flag is the interpreter's to raise.
"""

from __future__ import annotations

import ctypes
import threading
import time
from typing import Callable, Optional, Sequence

from ultracomm import _core
from ultracomm.errors import UltracommError
from ultracomm.transports.split.stream import (
    COPY,
    OWN,
    RECV,
    SEND,
    WAIT_GE,
    WRITE,
    StreamOp,
    loopback_sequence,
    messages,
    rank_stream,
)


class StreamDeadlock(UltracommError):
    """No stream can move and none waits for a flag."""


def _heads(streams: dict[int, Sequence[StreamOp]], pos: dict[int, int]) -> str:
    return "; ".join(
        f"rank {r}: {s[pos[r]].kind} {s[pos[r]].what}" for r, s in sorted(streams.items()) if pos[r] < len(s)
    )


class _Queues:
    """The queues and the rendezvous rule shared by both drivers."""

    def __init__(self, streams: dict[int, Sequence[StreamOp]]):
        self.streams = {r: list(s) for r, s in streams.items()}
        self.pos = {r: 0 for r in self.streams}

    def head(self, r: int) -> Optional[StreamOp]:
        s = self.streams.get(r)
        return s[self.pos[r]] if s is not None and self.pos[r] < len(s) else None

    def done(self) -> bool:
        return all(self.head(r) is None for r in self.streams)

    def step(
        self,
        wait_ok: Callable[[int, StreamOp], bool],
        write: Callable[[int, StreamOp], None],
        move: Callable[[int, StreamOp, int, StreamOp], None],
    ) -> tuple[bool, bool]:
        """Advance every queue as far as it goes once; (progress, some head waits for a flag)."""
        progress = waiting = False
        for r in sorted(self.streams):
            op = self.head(r)
            if op is None:
                continue
            if op.kind == WAIT_GE:
                if wait_ok(r, op):
                    self.pos[r] += 1
                    progress = True
                else:
                    waiting = True
            elif op.kind == WRITE:
                write(r, op)
                self.pos[r] += 1
                progress = True
            elif op.kind == COPY:  # loopback: a SEND paired with its RECV, one copy
                move(op.peer, StreamOp(SEND, op.src, op.rank, op.nbytes, op.key), op.rank, op)
                self.pos[r] += 1
                progress = True
            elif op.kind == SEND:
                peer = self.head(op.peer)
                if peer is not None and peer.kind == RECV and peer.peer == r and peer.key == op.key:
                    if peer.nbytes != op.nbytes:
                        raise StreamDeadlock(
                            f"rank {r} sends {op.nbytes} bytes, rank {op.peer} receives {peer.nbytes}: {op.what}"
                        )
                    move(r, op, op.peer, peer)
                    self.pos[r] += 1
                    self.pos[op.peer] += 1
                    progress = True
        return progress, waiting


def run_key_model(streams: dict[int, Sequence[StreamOp]]) -> int:
    """Run ``streams`` under the key model (module docstring); the number of messages moved, or
    :class:`StreamDeadlock` naming every queue's head."""
    q = _Queues(streams)
    total = {op.key for s in streams.values() for op in s if op.kind in (SEND, RECV)}
    finished: set[tuple] = set()

    def wait_ok(r: int, op: StreamOp) -> bool:
        level = op.key[:2]
        return all(k in finished for k in total if k[:2] < level)

    def move(r: int, send: StreamOp, d: int, recv: StreamOp) -> None:
        finished.add(send.key)

    while not q.done():
        progress, _ = q.step(wait_ok, lambda r, op: None, move)
        if not progress:
            raise StreamDeadlock(f"ultracomm split model: no stream can move: {_heads(q.streams, q.pos)}")
    return len(finished)


def streams_of(progs, wl: dict, order: str = "global") -> dict[int, list[StreamOp]]:
    """Every rank's stream of ``progs`` (one BridgeProgram per rank, ranks without crossings left out)."""
    return {p.rank: rank_stream(messages(p, wl), p.rank, order) for p in progs if p.peers}


class _Epoch:
    """One op (epoch) of the hub: the ranks' streams, their address resolvers and abort words."""

    def __init__(self):
        self.progs: dict[int, object] = {}
        self.streams: dict[int, list[StreamOp]] = {}
        self.resolve: dict[int, Callable[[object], int]] = {}
        self.bridges: dict[int, "SimBridge"] = {}
        self.thread: Optional[threading.Thread] = None


class SimHub:
    """Shared by every rank's :class:`SimBridge` of one test: executes the registered streams."""

    def __init__(self, order: str = "global", timeout_s: float = 30.0):
        """``order``: each rank's stream order (``global`` or ``sends_first``), or ``loopback``: every
        rank's messages merged into one stream (:func:`loopback_sequence`)."""
        self.order, self.timeout_s = order, timeout_s
        self._lock = threading.Lock()
        self._epochs: dict[int, _Epoch] = {}
        self.moved = 0  # messages moved, all epochs
        self.deadlocks: list[str] = []

    def bridge(self, messenger, prog, epoch, digest, local, own_base, shadows, wl, abort, timeout_s, where):
        """``BridgeRun``'s signature (monkeypatched into ultracomm.transports.split)."""
        return SimBridge(self, prog, int(epoch), int(own_base), shadows, wl, abort, where)

    def _register(self, b: "SimBridge") -> None:
        with self._lock:
            e = self._epochs.setdefault(b.epoch, _Epoch())
            e.progs[b.rank] = b.prog
            e.resolve[b.rank] = b.addr
            e.bridges[b.rank] = b
            if e.thread is None and set(e.progs) >= {q for p in e.progs.values() for q in p.peers}:
                if self.order == "loopback":
                    e.streams = {-1: loopback_sequence([e.progs[r] for r in sorted(e.progs)], b.wl)}
                else:
                    e.streams = {r: rank_stream(messages(p, b.wl), r, self.order) for r, p in e.progs.items()}
                e.thread = threading.Thread(
                    target=self._run, args=(b.epoch, e), daemon=True, name=f"split-sim-{b.epoch}"
                )
                e.thread.start()

    def _run(self, epoch: int, e: _Epoch) -> None:
        q = _Queues(e.streams)

        def wait_ok(r: int, op: StreamOp) -> bool:  # op.rank: whose spaces (loopback sequence)
            return _core.load_acquire(e.resolve[op.rank if op.rank >= 0 else r](op.ref)) >= epoch

        def write(r: int, op: StreamOp) -> None:
            _core.store_release(e.resolve[op.rank if op.rank >= 0 else r](op.ref), epoch)

        def move(r: int, send: StreamOp, d: int, recv: StreamOp) -> None:
            ctypes.memmove(e.resolve[d](recv.ref), e.resolve[r](send.ref), send.nbytes)
            self.moved += 1

        deadline = time.monotonic() + self.timeout_s
        try:
            while not q.done():
                if any(b.stopped() for b in e.bridges.values()):
                    raise UltracommError(f"ultracomm split sim: epoch {epoch} stopped by a failure")
                progress, waiting = q.step(wait_ok, write, move)
                if progress:
                    continue
                if not waiting:
                    msg = f"ultracomm split sim: epoch {epoch}: no stream can move: {_heads(q.streams, q.pos)}"
                    self.deadlocks.append(msg)
                    raise StreamDeadlock(msg)
                if time.monotonic() > deadline:
                    raise UltracommError(
                        f"ultracomm split sim: epoch {epoch}: heads still wait for flags after "
                        f"{self.timeout_s} s: {_heads(q.streams, q.pos)}"
                    )
                time.sleep(0.0002)  # a head waits for the interpreter: poll its flags again
        except BaseException as err:  # noqa: BLE001 - every rank of the epoch gets it
            for b in e.bridges.values():
                b.fail(err)
        for b in e.bridges.values():
            b.finished.set()


class SimBridge:
    """``BridgeRun``'s interface (start / fail / join / error) over :class:`SimHub`."""

    def __init__(self, hub: SimHub, prog, epoch: int, own_base: int, shadows, wl: dict, abort, where: str):
        self.hub, self.prog, self.epoch, self.rank = hub, prog, epoch, prog.rank
        self.own_base, self.shadows, self.wl, self.where = own_base, shadows, wl, where
        self.abort_addr = int(abort.data_ptr())
        self.error: Optional[BaseException] = None
        self.finished = threading.Event()

    def addr(self, ref) -> int:
        return (self.own_base if ref.shadow == OWN else self.shadows.base(ref.shadow)) + ref.off

    def stopped(self) -> bool:
        return _core.load_acquire(self.abort_addr) != 0

    def start(self, lanes=None) -> None:  # lanes: BridgeRun's persistent threads, not used here
        self.hub._register(self)

    def fail(self, error: BaseException) -> None:
        if self.error is None:
            self.error = error
        _core.store_release(self.abort_addr, 1)

    def join(self) -> bool:
        return self.finished.wait(self.hub.timeout_s + 5)
