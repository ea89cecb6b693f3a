"""The ``copy_engine`` transport's bounded waits: a host watchdog over its stream operations.

A stream wait (``cuStreamWaitValue64``) has no timeout, so one host thread per transport
watches the operations in flight.  Per operation it reads host words only (pinned, mapped
memory: no CUDA call): ``started`` (the caller's stream reached the operation: the clock starts
then, as the kernel's ``%globaltimer`` deadline does) and ``done[k]`` (internal stream ``k``
finished).  While one is unfinished it checks, every ``check_s``, the peers its waits depend
on (their ``ready`` and ``digest`` words, read from device memory by ``read_device``): a peer
that joined this epoch with another digest, or that rejected its plan, fails the operation at
once with ``PlanError``; past ``timeout_s`` it fails with ``UltracommTimeout``.  Both are
worded by the host executor's ``format_error`` (rank, operation, expert, chunk, flag, peer;
whether the awaited peer started the operation); the Context's ``StreamOrdered.check()`` replaces
that record's guess of who stopped by the evidence (issue 35, :mod:`ultracomm.blame`).

On a failure it *aborts*: writes :data:`ABORT` into every ``done`` word of this transport, so
the caller's stream passes its joins and later work on it runs, and sets this rank's ``abort``
word (:func:`.plan.abort_addr`), which releases every gate of its internal streams (the gate
kernel, :func:`.plan.gate_commands`): a gate released so skips its copies and flag writes, so
nothing reaches a peer's window after the abort and the internal streams drain at once (no wait
of theirs has a peer as its only releaser).  The error is raised by ``check_error()`` (at
``Work.wait()`` / ``Context.synchronize()``).  From then on it keeps the joins at ``ABORT`` (a
late ``done`` write of an internal stream cannot lower them for long).

Limits: detection is as fast as the polling (``check_s``), not the device's; the window stays
mapped after a failure (the Context keeps it, :func:`abandoned`), as a gate that passed its waits
just before the abort may still be copying.  The peers' words are read through the transport's
own high-priority stream, bounded (1 s): where that stream shares a hardware queue with a busy
one the read may not finish, and the operation then fails at the timeout with a message that
names no flag.
"""

from __future__ import annotations

import ctypes
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from ... import _core
from ...cuda.support import make_error_record, raise_record
from ...errors import UltracommTimeout
from ...records import Op
from .plan import EPOCH, MAIN, Cmd, flag_addr, geq

__all__ = ["ABORT", "Pending", "Watchdog", "pending_for", "read_host"]

ABORT = (1 << 63) - 1  # a GEQ join wait ((int64_t)(ABORT - epoch) >= 0) passes for every epoch < 2^63


# objects a blocked stream may still use (kernels' plans, shadows, host words), kept by transports
# closed after a failure: never freed (freeing is a device-wide wait that would not return)
KEPT: list = []


def device_watchdogs(window, name: str, dog, loopback: bool) -> list:
    """The watchdogs whose failure can leave streams blocked on this device in this process, with
    ``dog`` added: every rank's of a loopback domain (they share the device; one list per ``name``
    and window set), else this rank's alone."""
    dogs = window.shared.setdefault((name, tuple(int(b) for b in window.peer_bases)), []) if loopback else []
    dogs.append(dog)
    return dogs


def abandoned(dogs: Sequence) -> bool:
    """True once any of ``dogs`` failed: its streams may stay blocked for good."""
    return any(d.failure is not None for d in dogs)


def quiesce(dogs: Sequence, bound_s: Optional[float] = None) -> None:
    """Wait until none of ``dogs`` has an operation in flight (each ends done or failed within its
    timeout once its stream reached it): before a device-wide synchronize.  Once one failed, wait
    only for the others' operations whose stream reached them (their clocks run, so each ends
    within its timeout): a loopback rank on another plan then reports its own error, not None.

    An operation no stream reaches (the caller's stream is held by work queued before it) has no
    clock: ``bound_s`` (default twice the longest timeout of ``dogs``: time for the stream to reach
    it, then for it to end) bounds the wait, then ``UltracommTimeout`` says what was awaited --
    a device-wide synchronize would not return either."""
    if bound_s is None:
        bound_s = 2.0 * max((float(d.timeout_s) for d in dogs), default=0.0)
    deadline = time.monotonic() + bound_s
    while True:
        if abandoned(dogs):
            if not any(d.failure is None and d.running() for d in dogs):
                return
            left = [d for d in dogs if d.failure is None and d.running()]
        elif not any(d.pending() for d in dogs):
            return
        else:
            left = [d for d in dogs if d.pending()]
        if time.monotonic() >= deadline:
            ops = sum(d.pending() for d in left)
            ranks = sorted({int(d.rank) for d in left})
            raise UltracommTimeout(
                f"ultracomm: {ops} operation(s) of rank(s) {ranks} still in flight after {bound_s:g} s "
                "(twice ULTRACOMM_TIMEOUT_S) while waiting for them to end before a device-wide synchronize: "
                "the caller's stream has not reached them, so work queued before them on it has not finished "
                "(a synchronize would not return either); the device's streams are left as they are"
            )
        time.sleep(1e-3)


def pinned_words(n: int) -> torch.Tensor:
    """``n`` zeroed int64 words of pinned host memory (``cudaHostAlloc``: mapped, so the pointer is
    also the device address with unified addressing): the host words stream waits and writes use."""
    return torch.zeros(n, dtype=torch.int64, pin_memory=True)


_TIMEOUT, _MISMATCH, _REJECTED = 1, 2, 3


def read_host(addrs: Sequence[int]) -> list[int]:
    """uint64 words of host memory (also simulated device memory in the tests)."""
    return [ctypes.c_uint64.from_address(a).value for a in addrs]


def write_host(addr: int, value: int) -> None:
    ctypes.c_uint64.from_address(addr).value = value


@dataclass
class Pending:
    """One operation of this rank in flight.  ``waits``: its stream waits (``wait``/``wait_eq``
    commands of internal streams, in order); ``peers``: rank -> (ready, digest) addresses."""

    epoch: int
    op: int
    op_name: Optional[str]
    digest: int
    started: int
    joins: list[int]
    waits: list[Cmd]
    peers: dict[int, tuple[int, int]]
    t0: Optional[float] = None
    checked: float = 0.0
    abort: int = 0  # this rank's abort word (0: none), set on a failure
    extra: dict = field(default_factory=dict)


def pending_for(
    cmds: Sequence[Cmd],
    epoch: int,
    digest: int,
    op_name: Optional[str],
    wl: dict,
    bases: Sequence[int],
    started: int,
    abort: int = 0,
) -> Pending:
    """What the watchdog watches of one rank's multicast commands (:func:`multicast_commands`):
    its internal streams' waits, the peers they name, the caller's joins."""
    waits = [c for c in cmds if c.kind in ("wait", "wait_eq") and c.stream != MAIN]
    peers = {
        c.peer: (flag_addr(wl, bases[c.peer], "ready"), flag_addr(wl, bases[c.peer], "digest"))
        for c in waits
        if c.peer >= 0
    }
    joins = [c.addr for c in cmds if c.kind == "wait" and c.stream == MAIN]
    return Pending(epoch, int(Op.MULTICAST), op_name, digest, started, joins, waits, peers, abort=abort)


class Watchdog:
    """Watches one rank's copy_engine operations (see the module docstring).

    ``read_device(addrs) -> list[int] | None``: device words (``None``: could not be read in
    time); ``clock``: seconds.  ``poll()`` does one pass; :meth:`start` runs it on a daemon
    thread every ``poll_s`` while operations are in flight.
    """

    def __init__(
        self,
        rank: int,
        timeout_s: float,
        read_device: Callable[[Sequence[int]], Optional[list[int]]],
        *,
        check_s: Optional[float] = None,
        poll_s: float = 2e-3,
        clock: Callable[[], float] = time.monotonic,
        rejected_digest: int = int(_core.REJECTED_DIGEST),
    ):
        self.rank, self.timeout_s = rank, float(timeout_s)
        self.check_s = float(check_s) if check_s is not None else min(0.05, self.timeout_s / 4)
        self.poll_s, self.clock, self.read_device = float(poll_s), clock, read_device
        self.rejected = rejected_digest
        self.failure: Optional[BaseException] = None  # the first failure; later operations are refused
        self._handed = False
        self._pending: list[Pending] = []
        self._all_joins: set[int] = set()
        self._aborts: set[int] = set()  # abort words of every operation added
        self._lock = threading.Lock()
        self._wake = threading.Condition(self._lock)
        self._thread: Optional[threading.Thread] = None
        self._stop = False

    # -- bookkeeping -------------------------------------------------------------------------
    def add(self, p: Pending) -> None:
        with self._lock:
            self._pending.append(p)
            self._all_joins.update(p.joins)
            if p.abort:
                self._aborts.add(p.abort)
            self._wake.notify()

    def pending(self) -> int:
        with self._lock:
            return len(self._pending)

    def running(self) -> int:
        """Operations in flight whose caller's stream reached them (their clock runs or will at
        the next poll): each ends, done or failed, within the timeout."""
        with self._lock:
            ops = list(self._pending)
        return sum(1 for p in ops if p.t0 is not None or read_host([p.started])[0] >= p.epoch)

    def take_error(self) -> Optional[BaseException]:
        """The failure, once (``check_error`` semantics: each failure is handed out once)."""
        with self._lock:
            if self.failure is None or self._handed:
                return None
            self._handed = True
            return self.failure

    # -- one pass ------------------------------------------------------------------------------
    def poll(self) -> None:
        now = self.clock()
        with self._lock:
            ops = list(self._pending)
        for p in ops:
            if all(geq(v, p.epoch) for v in read_host(p.joins)):
                self._retire(p)
                continue
            if self.failure is not None:
                continue
            if p.t0 is None:
                if read_host([p.started])[0] < p.epoch:
                    continue  # the caller's stream has not reached it: no clock yet
                p.t0 = p.checked = now
            expired = now - p.t0 >= self.timeout_s
            if expired or now - p.checked >= self.check_s:
                p.checked = now
                err = self.diagnose(p, expired)
                if err is not None:
                    self.fail(err)
        if self.failure is not None:
            self._abort()

    def _retire(self, p: Pending) -> None:
        with self._lock:
            if p in self._pending:
                self._pending.remove(p)

    def fail(self, err: BaseException) -> None:
        """Record ``err`` (first one wins) and release every join of this transport."""
        with self._lock:
            if self.failure is None:
                self.failure = err
        self._abort()

    def _abort(self) -> None:
        with self._lock:
            joins = list(self._all_joins)
            aborts = list(self._aborts)
            self._pending.clear()
        for a in aborts:  # first: the gates skip before the joins let the caller go on
            if read_host([a])[0] == 0:
                write_host(a, 1)
        for a in joins:
            if read_host([a])[0] != ABORT:
                write_host(a, ABORT)

    # -- what went wrong ------------------------------------------------------------------------
    def diagnose(self, p: Pending, expired: bool) -> Optional[BaseException]:
        """A peer on another plan (any time), else at expiry the first blocked wait's timeout."""
        peers = sorted(p.peers)
        words = self.read_device([c.addr for c in p.waits] + [a for r in peers for a in p.peers[r]])
        if words is None:
            return self._untraced(p) if expired else None
        flags, pw = words[: len(p.waits)], words[len(p.waits) :]
        state = {r: (pw[2 * i], pw[2 * i + 1]) for i, r in enumerate(peers)}
        blocked, seen = [], set()
        for c, v in zip(p.waits, flags):
            want = p.epoch if c.value == EPOCH else c.value
            ok = v == want if c.kind == "wait_eq" else geq(v, want)
            if not ok and c.stream not in seen:  # the first unsatisfied wait of each stream
                seen.add(c.stream)
                blocked.append((c, v))
        for c, v in blocked:
            ready, digest = state.get(c.peer, (None, None))
            if ready == p.epoch and digest != p.digest:
                # the peer may have raised a flag of ours and moved on to its next operation
                # between the reads (interp.h's `settled`): read the flag once more
                again = self.read_device([c.addr])
                if c.kind == "wait" and again is not None and geq(again[0], p.epoch):
                    continue
                code = _REJECTED if digest == self.rejected else _MISMATCH
                return self._error(p, c, code, observed=digest, expected=p.digest, peer_ready=ready)
        if not expired:
            return None
        if not blocked:
            return self._untraced(p)
        # prefer a wait on a peer that never started this operation: its ready flag says so
        c, v = min(blocked, key=lambda cv: not (state.get(cv[0].peer, (p.epoch,))[0] < p.epoch))
        ready = state.get(c.peer, (None,))[0]
        return self._error(p, c, _TIMEOUT, observed=v, peer_ready=ready if ready is not None else (1 << 64) - 1)

    def _error(self, p: Pending, c: Cmd, code: int, **kw) -> BaseException:
        rec = make_error_record(
            code,
            self.rank,
            p.op,
            p.epoch,
            flag_kind=c.flag,
            task=c.task,
            expert=c.expert,
            chunk=c.chunk,
            slot=c.slot,
            peer=c.peer,
            **kw,
        )
        try:
            raise_record(rec, p.op_name, self.timeout_s)
        except Exception as e:  # noqa: BLE001 - kept, raised by check_error
            return e
        raise AssertionError("raise_record returned")  # pragma: no cover

    def _untraced(self, p: Pending) -> BaseException:
        return UltracommTimeout(
            f"ultracomm: rank {self.rank} {p.op_name or 'weight_sync'} (multicast) epoch {p.epoch} timed out after "
            f"{self.timeout_s:g} s waiting for its copies to complete (no flag it waits for is missing, or the "
            f"flags could not be read; timeout ULTRACOMM_TIMEOUT_S)"
        )

    # -- the thread ----------------------------------------------------------------------------
    def start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._loop, name=f"ultracomm-ce-watchdog-{self.rank}", daemon=True
                )
                self._thread.start()

    def _loop(self) -> None:
        while True:
            with self._lock:
                while not self._stop and not self._pending and self.failure is None:
                    self._wake.wait()
                if self._stop:
                    return
                idle = self.failure is not None and not self._pending
            try:
                self.poll()
            except Exception as e:  # noqa: BLE001 - a broken watchdog must not leave waits unbounded
                self.fail(e)
            time.sleep(0.01 if idle else self.poll_s)

    def stop(self) -> None:
        with self._lock:
            self._stop = True
            self._wake.notify()
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout=5)
