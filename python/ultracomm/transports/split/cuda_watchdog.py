"""The GPU ``split`` transport's join and side stream, releasable by a host watchdog (the
pattern of :mod:`..copy_engine.watchdog`, smaller: no device reads).

The side stream writes three pinned host words (mapped memory, so the driver's stream
operations reach them and the host reads them with no CUDA call): ``started = epoch`` when it
reaches an op (the watchdog's clock starts then), ``progress = epoch << 20 | k`` after its k-th
message, and ``done = epoch`` at its end.  The caller's stream joins with a wait
``done >= epoch`` instead of an event.  The watchdog thread checks the oldest op in flight every
``poll_s``: done -> retired; started and unfinished for longer than the timeout (issue 35: one
timeout, so the named error comes within a few polls of start + timeout; the kernel's own waits
have the same bound and whichever fails first is raised first by ``check_error``) ->
``UltracommTimeout`` naming the rank, the operation, the stuck message (expert, chunk, slot,
ranks) and its peer.  Then, in this order (:meth:`SideWatchdog.release`):

1. ``done = ABORT``: the caller's stream passes its join and later work on it runs; the error is
   recorded (``on_failure``) and raised by ``check_error()``;
2. ``skip = 1`` (:data:`SKIP`): every write gate of the side stream not yet started
   (:mod:`.cuda_gates`: the flag writes after a receive or a send) writes nothing, so no flag
   says a chunk arrived that did not -- before step 3 releases the receives;
3. ``abort_group()`` (the transport's: torch's abort of the side stream's own NCCL group,
   :meth:`.cuda_movers.NcclMessenger.abort`) in a thread of its own: NCCL's kernels poll the
   communicator's abort flag (set first thing by ``ncclCommAbort``) and leave every send and
   receive moving nothing more, so a receive whose peer died returns.  Its own thread, because
   ``ncclCommAbort`` may wait for the device (NCCL issue 1013) and must not hold up step 4;
4. once that call returned, or after ``grace_s`` (50 ms), ``open = 1`` (:data:`OPEN`): every
   wait gate (the flag waits before a send) leaves its wait, so the side stream drains.  After
   the group abort, so that an NCCL send behind a released wait finds its communicator aborted
   and moves nothing to a live peer; a send whose wait was released before NCCL set its flag --
   an abort call that took longer than ``grace_s`` to get there -- can still deliver stale
   bytes, and that peer then fails on its next message instead.

An op that fails while being enqueued (:meth:`SideWatchdog.abandon`) is released the same way,
without ``on_failure`` (its error is raised where it happened).  After a failure
:meth:`SideWatchdog.failed` stays true: the Context skips device-wide synchronisation and keeps
the window mapped, as for ``copy_engine`` (a gate that passed its wait just before the abort may
still be writing).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Callable, Optional, Sequence

import torch

from ...errors import InputError, UltracommTimeout
from ..copy_engine.watchdog import ABORT, pinned_words
from .stream import COPY, RECV, SEND, StreamOp

__all__ = [
    "ABORT",
    "STARTED",
    "PROGRESS",
    "DONE",
    "SKIP",
    "OPEN",
    "WORDS",
    "SideWatchdog",
    "progress_value",
    "messages_of",
]

# word indices; SKIP, OPEN: the abort words of the side stream's write gates and wait gates (.cuda_gates)
STARTED, PROGRESS, DONE, SKIP, OPEN = 0, 1, 2, 3, 4
WORDS = 5
_SHIFT = 20
GRACE_S = 0.05  # release(): how long the gates stay closed while the group abort has not returned

log = logging.getLogger("ultracomm")


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
    """Watches one side stream's ops (module docstring).  ``words``: :data:`WORDS` zeroed int64
    words of pinned host memory (``STARTED``, ``PROGRESS``, ``DONE``, ``SKIP``, ``OPEN``); ``on_failure(error)``:
    called once from the watchdog thread (the transport records the error where ``check_error``
    finds it); ``abort_group()``: what releases the side stream's NCCL operations (None: nothing
    to abort, e.g. a loopback domain), called once on a failure (:meth:`release`)."""

    def __init__(
        self,
        rank: int,
        timeout_s: float,
        on_failure: Callable[[BaseException], None],
        words: Optional[torch.Tensor] = None,
        clock: Callable[[], float] = time.monotonic,
        poll_s: float = 0.002,
        autostart: bool = True,
        abort_group: Optional[Callable[[], None]] = None,
        grace_s: float = GRACE_S,
    ):
        self.rank, self.timeout_s, self.on_failure = rank, float(timeout_s), on_failure
        self.words = words if words is not None else pinned_words(WORDS)
        if self.words.numel() < WORDS:
            raise InputError(f"ultracomm split: the side watchdog needs {WORDS} host words, got {self.words.numel()}")
        self.clock, self.poll_s, self.autostart = clock, poll_s, autostart
        self.abort_group, self.grace_s = abort_group, float(grace_s)
        self.abort_error: Optional[BaseException] = None  # what abort_group raised, if anything
        self._released = False
        self._aborter: Optional[threading.Thread] = None
        self._pending: deque[_Pending] = deque()
        self._lock = threading.Lock()
        self.failure: Optional[BaseException] = None
        self._thread: Optional[threading.Thread] = None
        self._stop = threading.Event()

    def addr(self, word: int) -> int:
        return int(self.words.data_ptr()) + 8 * word

    def gate_addrs(self) -> tuple[int, int]:
        """The gates' abort words (:mod:`.cuda_gates`): (write gates' ``skip``, wait gates' ``open``)."""
        return self.addr(SKIP), self.addr(OPEN)

    def add(self, epoch: int, name: str, ops: Sequence[StreamOp]) -> None:
        with self._lock:
            self._pending.append(_Pending(int(epoch), name, ops))
        if self._thread is None and self.autostart:
            self._thread = threading.Thread(
                target=self._loop, name=f"ultracomm-split-watchdog-r{self.rank}", daemon=True
            )
            self._thread.start()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def failed(self) -> bool:
        return self.failure is not None

    def running(self) -> int:
        """Ops in flight whose side stream reached them (their clock runs, or will at the next poll):
        each ends, done or failed, within the timeout.  What :func:`..copy_engine.watchdog.quiesce`
        waits for on the domain's other side streams once one failed."""
        started = int(self.words[STARTED])
        with self._lock:
            return sum(1 for p in self._pending if p.t0 is not None or started >= p.epoch)

    def poll(self) -> None:
        """One check of the oldest ops in flight (the thread's body; tests call it directly)."""
        started, progress, done = (int(x) for x in self.words.tolist()[: DONE + 1])
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
            bound = self.timeout_s
            if self.clock() - p.t0 <= bound:
                return
            k = progress & ((1 << _SHIFT) - 1) if progress >> _SHIFT == p.epoch else 0
            err = self._timeout(p, k, bound)
            self.failure = err
            self.words[DONE] = ABORT  # release the caller's stream (its join waits done >= epoch)
            self._pending.clear()
        self.on_failure(err)
        self.release()

    def abandon(self, err: BaseException) -> None:
        """An op failed while being enqueued, or this rank failed otherwise (the caller raises
        ``err``): give up on the side stream as a timeout would -- release any join already queued,
        forget what is pending, abort the group and open the gates (:meth:`release`) -- without
        calling ``on_failure`` (the error is raised where it happened)."""
        with self._lock:
            if self.failure is None:
                self.failure = err
            self.words[DONE] = ABORT
            self._pending.clear()
        self.release()

    def release(self) -> None:
        """Steps 2-4 of the module docstring, once: ``skip``, ``abort_group()`` in its own thread,
        then, when it returned or after ``grace_s``, ``open``.  Returns within ``grace_s`` whatever
        the abort call does."""
        with self._lock:
            if self._released:
                return
            self._released = True
        self.words[SKIP] = 1  # write gates not yet started write nothing (before any receive is released)
        if self.abort_group is not None:
            returned = threading.Event()

            def abort() -> None:
                try:
                    self.abort_group()
                except BaseException as e:  # noqa: BLE001 - logged; the gates open anyway
                    self.abort_error = e
                    log.warning(
                        "ultracomm split: rank %d: aborting the side stream's NCCL group failed: %s: %s",
                        self.rank,
                        type(e).__name__,
                        e,
                    )
                finally:
                    returned.set()

            self._aborter = threading.Thread(target=abort, name=f"ultracomm-split-abort-r{self.rank}", daemon=True)
            self._aborter.start()
            returned.wait(self.grace_s)
        self.words[OPEN] = 1  # wait gates leave their waits: the side stream drains

    def released(self) -> bool:
        """True once :meth:`release` opened the gates (its group abort may still be running)."""
        return bool(int(self.words[OPEN]))

    def _timeout(self, p: _Pending, k: int, bound: float) -> UltracommTimeout:
        msgs = messages_of(p.ops)
        where = f"ultracomm: rank {self.rank} {p.name} (epoch {p.epoch}, transport split, side stream)"
        if k >= len(msgs):
            return UltracommTimeout(
                f"{where} gave up after {bound:g} s: all {len(msgs)} messages moved but "
                f"the stream did not finish (timeout ULTRACOMM_TIMEOUT_S={self.timeout_s:g})"
            )
        m = msgs[k]
        verb = {SEND: "sending", RECV: "receiving", COPY: "copying"}[m.kind]
        return UltracommTimeout(
            f"{where} gave up after {bound:g} s {verb} message {k + 1} of {len(msgs)}: {m.what}"
            f"{f' (peer rank {m.peer})' if m.kind != COPY else ''}; the other end never took part (a stalled or "
            f"dead rank) or a kernel never produced the chunk (its own error, raised first, says which) "
            f"(timeout ULTRACOMM_TIMEOUT_S={self.timeout_s:g})"
        )

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.poll()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(5.0)
            self._thread = None
