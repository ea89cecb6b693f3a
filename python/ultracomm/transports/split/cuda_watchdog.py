"""The GPU ``split`` transport's join, releasable by a host watchdog (the pattern of
:mod:`..copy_engine.watchdog`, smaller: no device reads).

The side stream writes three pinned host words (mapped memory, so the driver's stream
operations reach them and the host reads them with no CUDA call): ``started = epoch`` when it
reaches an op (the watchdog's clock starts then), ``progress = epoch << 20 | k`` after its k-th
message, and ``done = epoch`` at its end.  The caller's stream joins with a wait
``done >= epoch`` instead of an event.  The watchdog thread checks the oldest op in flight every
``poll_s``: done -> retired; started and unfinished for longer than twice the timeout (the
kernel's own waits, bounded by one timeout, fail first and name the peer they waited for; this
bound only catches what the kernel cannot see, e.g. a peer that never posts its receive) ->
``UltracommTimeout`` naming the rank, the operation, the stuck message (expert, chunk, slot,
ranks) and its peer, and ``done = ABORT`` so the caller's stream passes its join and later work
on it runs.  The error is raised by ``check_error()``.

What stays blocked: the side stream itself (a stream wait or an NCCL receive cannot be
cancelled; NCCL's own timeout may abort its communicator) -- so after a failure
:meth:`SideWatchdog.failed` is true, the Context skips device-wide synchronisation and keeps the
window mapped, as for ``copy_engine``.
"""
from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ...errors import UltracommTimeout
from ..copy_engine.watchdog import ABORT, pinned_words
from .stream import COPY, RECV, SEND, StreamOp

__all__ = ["ABORT", "STARTED", "PROGRESS", "DONE", "SideWatchdog", "progress_value", "messages_of"]

STARTED, PROGRESS, DONE = 0, 1, 2  # word indices
_SHIFT = 20


def progress_value(epoch: int, k: int) -> int:
    """The ``progress`` word after the ``k``-th message (1-based) of the op at ``epoch``."""
    return (int(epoch) << _SHIFT) | int(k)


def messages_of(ops: Sequence[StreamOp]) -> list[StreamOp]:
    """The ops that end a message (SEND, RECV, COPY), in stream order: the watchdog's names."""
    return [o for o in ops if o.kind in (SEND, RECV, COPY)]


@dataclass
class _Pending:
    epoch: int
    name: str
    ops: Sequence[StreamOp]  # its stream operations (the messages are picked out only on a timeout)
    t0: Optional[float] = None


class SideWatchdog:
    """Watches one side stream's ops (module docstring).  ``words``: 3 zeroed int64 words of
    pinned host memory (``STARTED``, ``PROGRESS``, ``DONE``); ``on_failure(error)``: called once
    from the watchdog thread (the transport records the error where ``check_error`` finds it)."""

    def __init__(self, rank: int, timeout_s: float, on_failure: Callable[[BaseException], None],
                 words: Optional[torch.Tensor] = None, clock: Callable[[], float] = time.monotonic,
                 poll_s: float = 0.002, autostart: bool = True):
        self.rank, self.timeout_s, self.on_failure = rank, float(timeout_s), on_failure
        self.words = words if words is not None else pinned_words(3)
        self.clock, self.poll_s, self.autostart = clock, poll_s, autostart
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self.failure: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def addr(self, word: int) -> int:
        return int(self.words.data_ptr()) + 8 * word

    def add(self, epoch: int, name: str, ops: Sequence[StreamOp]) -> None:
        with self._lock:
            self._pending.append(_Pending(int(epoch), name, ops))
        if self._thread is None and self.autostart:
            self._thread = threading.Thread(target=self._loop, name=f"ultracomm-split-watchdog-r{self.rank}",
                                            daemon=True)
            self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def failed(self) -> bool:
        return self.failure is not None

    def poll(self) -> None:
        """One check of the oldest ops in flight (the thread's body; tests call it directly)."""
        started, progress, done = (int(x) for x in self.words.tolist())
        if self.failure is not None and done != ABORT:  # a late done write of the blocked stream: keep it released
            self.words[DONE] = ABORT
        with self._lock:
            while self._pending and done >= self._pending[0].epoch:
                self._pending.popleft()
            if not self._pending or self.failure is not None:
                return
            p = self._pending[0]
            if started < p.epoch:
                return  # the side stream has not reached it: the clock has not started
            if p.t0 is None:
                p.t0 = self.clock()
            bound = 2 * self.timeout_s
            if self.clock() - p.t0 <= bound:
                return
            k = progress & ((1 << _SHIFT) - 1) if progress >> _SHIFT == p.epoch else 0
            err = self._timeout(p, k, bound)
            self.failure = err
            self.words[DONE] = ABORT  # release the caller's stream (its join waits done >= epoch)
            self._pending.clear()
        self.on_failure(err)

    def abandon(self, err: BaseException) -> None:
        """An op failed while being enqueued (the caller raises ``err``): give up on the side stream
        as a timeout would -- release any join already queued, forget what is pending -- without
        calling ``on_failure`` (the error is raised where it happened)."""
        with self._lock:
            if self.failure is None:
                self.failure = err
            self.words[DONE] = ABORT
            self._pending.clear()

    def _timeout(self, p: _Pending, k: int, bound: float) -> UltracommTimeout:
        msgs = messages_of(p.ops)
        where = f"ultracomm: rank {self.rank} {p.name} (epoch {p.epoch}, transport split, side stream)"
        if k >= len(msgs):
            return UltracommTimeout(f"{where} gave up after {bound:g} s: all {len(msgs)} messages moved but "
                                    f"the stream did not finish (timeout ULTRACOMM_TIMEOUT_S={self.timeout_s:g})")
        m = msgs[k]
        verb = {SEND: "sending", RECV: "receiving", COPY: "copying"}[m.kind]
        return UltracommTimeout(
            f"{where} gave up after {bound:g} s {verb} message {k + 1} of {len(msgs)}: {m.what}"
            f"{f' (peer rank {m.peer})' if m.kind != COPY else ''}; the other end never took part (a stalled or "
            f"dead rank) or a kernel never produced the chunk (its own error, raised first, says which) "
            f"(timeout ULTRACOMM_TIMEOUT_S={self.timeout_s:g})")

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
