"""Blame by evidence (issue 35): which ranks a failing rank may call *stopped*, and how ranks that
already raised say so.

A timed-out rank knows what it waited for, not why it did not come: the rank it waited for may
be alive and waiting in turn, or may have raised and left.  So a rank is named stopped only
when its own state shows it, and otherwise the message lists it as of unknown state.  What
counts as evidence:

* **its heartbeat** (host windows this process maps: ``host_shm``, ``local``, and on the
  ``split`` transport the ranks of this rank's memory domain): every process writes
  ``CLOCK_MONOTONIC`` into a word of its window every :data:`HEARTBEAT_S` from a thread of its
  own, so a SIGSTOPped or killed process's word goes stale while a live one's stays fresh
  wherever it waits;
* **its failure word / record**: a rank that raises publishes ``failed at epoch e`` -- in its
  window (a word beside its ready flags) and in the group's store (a key written only on the
  failure path: a healthy operation makes no store call), with what it waited for.  A rank
  that published is alive and failed, never "stopped"; what it waited for is followed in turn,
  so a cascade names the first failure, not the latest closed socket;
* **its process**, where it runs on this host (same boot, pid namespace and user, known from
  Context setup): ``/proc`` shows it exited (gone, a zombie, or its pid reused) or stopped
  (SIGSTOP, a debugger) -- any transport, also for ranks nothing here waited for;
* **a connection it closed without publishing**: its process ended without raising (p2p, the
  split transport's messages);
* **silence**: a rank this rank waited for (directly, or through published records) that
  neither answered nor published a failure within the timeout plus :func:`grace_s` (the
  ``p2p`` transport and other memory domains, where no window shows a heartbeat).

The words live in the unused tail of the 64-byte line that holds ``ready[op]`` and
``digest[op]`` (``include/ultracomm/records/window_layout.h``): ``failed`` at ``digest_off + 16``,
``heartbeat`` at ``digest_off + 24``; the line ends before ``arrival_off``.

Messages end with ``by evidence, stopped: ranks [..] (why); already failed: ...; alive: ...;
state unknown: ranks [..]`` (perf/fault_matrix.py reads them).  The host, p2p and CPU split
transports add it where they raise; the stream-ordered GPU transports (``tma``, ``copy_engine``,
the CUDA ``split``), whose timeouts come from a kernel's error record or a watchdog and surface
at ``Work.wait()`` / ``synchronize()``, get it there (``StreamOrdered.check()``,
:meth:`Witness.timeout_text` with ``wait=False``: a live peer's host thread publishes its failure
only when it next synchronizes, so silence is no evidence on that path).
"""

from __future__ import annotations

import ctypes
import dataclasses
import os
import re
import threading
import time
import weakref
from typing import Any, Optional, Sequence

from .host_id import UNKNOWN_BOOT, host_key

__all__ = [
    "Witness",
    "Evidence",
    "status_offsets",
    "grace_s",
    "HEARTBEAT_S",
    "strip_blame",
    "awaited_ranks",
    "process_identity",
    "process_state",
]

HEARTBEAT_S = 0.1  # how often a process writes its heartbeat
_FAILED_BIT = 1 << 63
_CLOSED = (1 << 64) - 1  # heartbeat word of a rank that closed its Context: it left, it did not stop
_KEY = "ultracomm/failed/{scope}/{rank}"


def status_offsets(wlayout: dict) -> tuple[int, int]:
    """(failed word, heartbeat word) offsets in a window of ``wlayout``."""
    failed = int(wlayout["digest_off"]) + 16
    if failed + 16 > int(wlayout["arrival_off"]):
        raise AssertionError("ultracomm: no room for the failure and heartbeat words before arrival_off")
    return failed, failed + 8


def grace_s(timeout_s: float) -> float:
    """How long past its own timeout a rank waits for the ranks it waited for to publish a
    failure, where no window shows their heartbeat, before calling them stopped."""
    return min(10.0, max(0.5, 0.5 * float(timeout_s)))


def stale_s(timeout_s: float) -> float:
    """A heartbeat older than this shows a stopped process (at least several missed beats)."""
    return min(1.0, max(5 * HEARTBEAT_S, 0.5 * float(timeout_s)))


# ------------------------------------------------------------------ heartbeat
class _Heartbeat:
    """One thread per process writes the monotonic clock into every registered window word."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.words: dict[int, int] = {}
        self.next = 0
        self.thread: Optional[threading.Thread] = None

    def register(self, addr: int) -> int:
        with self.lock:
            self.next += 1
            self.words[self.next] = addr
            ctypes.c_uint64.from_address(addr).value = time.monotonic_ns()
            if self.thread is None or not self.thread.is_alive():
                self.thread = threading.Thread(target=self._loop, name="ultracomm-heartbeat", daemon=True)
                self.thread.start()
            return self.next

    def unregister(self, token: int) -> None:
        with self.lock:  # after this returns no write to that word is in progress or to come
            self.words.pop(token, None)

    def _loop(self) -> None:
        while True:
            time.sleep(HEARTBEAT_S)
            with self.lock:
                if not self.words:
                    self.thread = None
                    return
                now = time.monotonic_ns()
                for addr in self.words.values():
                    ctypes.c_uint64.from_address(addr).value = now


_HEARTBEAT = _Heartbeat()


def _at_fork() -> None:  # a forked child has no heartbeat thread and none of its parent's windows
    global _HEARTBEAT
    _HEARTBEAT = _Heartbeat()


if hasattr(__import__("os"), "register_at_fork"):
    __import__("os").register_at_fork(after_in_child=_at_fork)


# ------------------------------------------------------------------ process state
def _stat(pid: int) -> Optional[tuple[str, int]]:
    """(state letter, start time in clock ticks after boot) of ``pid`` from ``/proc``; None when
    the pid has no entry (the process is gone and reaped).  Other OS errors propagate."""
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            raw = f.read()
    except (FileNotFoundError, ProcessLookupError):
        return None
    fields = raw[raw.rindex(b")") + 2 :].split()  # the name (field 2) may hold spaces and parentheses
    return fields[0].decode(), int(fields[19])  # fields 3 (state) and 22 (starttime)


def _pid_exists(pid: int) -> bool:
    """Whether ``pid`` names a process in this pid namespace (``kill(pid, 0)``, whatever ``/proc`` shows)."""
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except OSError:  # EPERM: it exists
        return True
    return True


def process_identity() -> Optional[tuple]:
    """This process as a peer on the same host can check it: ``(host, pid namespace, uid, pid,
    start time)``, the host as :func:`ultracomm.host_id.host_key` names it; None without a
    readable ``/proc`` (or boot id)."""
    boot = host_key()
    if boot.endswith("/" + UNKNOWN_BOOT):  # hosts of one name would look alike
        return None
    try:
        ns = os.readlink("/proc/self/ns/pid")
        pid = os.getpid()
        if os.readlink("/proc/self") != str(pid):  # a /proc of another pid namespace: its pids are not ours
            return None
        st = _stat(pid)
    except (OSError, ValueError, IndexError):
        return None
    return None if st is None else (boot, ns, os.getuid(), pid, st[1])


def process_state(ident: Any, mine: Any = None) -> Optional[str]:
    """First-hand evidence from the process ``ident`` (a peer's :func:`process_identity`) when
    this process can see it -- the same boot, pid namespace and user (``mine``: default this
    process's identity) and not this process itself: why it is stopped ("has exited" -- no
    entry, a zombie, or its pid now another process's -- or "is stopped" -- SIGSTOP, a
    debugger), or None (running, or nothing can be told from here)."""
    mine = process_identity() if mine is None else mine
    try:
        boot, ns, uid, pid, start = ident
        if mine is None or (boot, ns, uid) != tuple(mine[:3]) or pid == mine[3]:
            return None
        st = _stat(pid)
    except (OSError, TypeError, ValueError, IndexError):
        return None
    where = f"its process (pid {pid} on this host)"
    if st is None and _pid_exists(pid):  # hidden from this /proc (hidepid, not dumpable): nothing to tell
        return None
    if st is None or st[1] != start or st[0] in ("Z", "X", "x"):
        return f"{where} has exited"
    if st[0] in ("T", "t"):
        return f"{where} is stopped (state {st[0]}: SIGSTOP or a debugger)"
    return None


# ------------------------------------------------------------------ evidence
@dataclasses.dataclass
class Evidence:
    """What this rank knows about every other rank when it fails."""

    stopped: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> why
    failed: dict[int, str] = dataclasses.field(default_factory=dict)  # rank -> "epoch e (what)"
    alive: list[int] = dataclasses.field(default_factory=list)
    behind: dict[int, int] = dataclasses.field(default_factory=dict)  # alive rank -> latest epoch it started
    unknown: list[int] = dataclasses.field(default_factory=list)
    left: dict[int, int] = dataclasses.field(default_factory=dict)  # rank that closed its Context -> latest epoch

    def sentence(self) -> str:
        st = sorted(self.stopped)
        parts = [
            f"by evidence, stopped: ranks {st}"
            + (" (" + "; ".join(f"rank {r}: {self.stopped[r]}" for r in st) + ")" if st else "")
        ]
        if self.failed:
            fr = sorted(self.failed)
            parts.append(f"already failed: ranks {fr} (" + "; ".join(f"rank {r} {self.failed[r]}" for r in fr) + ")")
        if self.alive:
            behind = "".join(
                f"; rank {r} has not started this operation (ready flag at epoch {e}): it waits "
                "elsewhere, or stopped calling"
                for r, e in sorted(self.behind.items())
            )
            note = f" ({behind[2:]})" if behind else ""
            parts.append(f"alive (heartbeat fresh): ranks {sorted(self.alive)}{note}")
        if self.left:
            parts.append(
                "closed their Context: ranks "
                + str(sorted(self.left))
                + " ("
                + "; ".join(f"rank {r} after epoch {e}" for r, e in sorted(self.left.items()))
                + ")"
            )
        if self.unknown:
            parts.append(f"state unknown: ranks {sorted(self.unknown)}")
        return "; ".join(parts)


def _scope_of(comm: Any) -> int:
    """A number every rank of a group has alike when it creates a Context: the group's exchange count."""
    board = getattr(comm, "_store_board", None)
    if board is not None:
        return int(getattr(board, "sequence", 0))
    domain = getattr(comm, "domain", None)
    if domain is not None:
        try:
            return int(domain._sequence[comm.rank])
        except Exception:  # noqa: BLE001
            return 0
    return 0


class Witness:
    """One Context's view of its peers' state on a failure, and its own failure published."""

    def __init__(self, comm: Any, rank: int, world: int, timeout_s: float):
        self._comm_ref = weakref.ref(comm) if comm is not None else None
        self.rank, self.world = rank, world
        self.timeout_s = float(timeout_s)
        self.scope = _scope_of(comm) if comm is not None else 0
        self.bases: list[int] = []
        self.readable: list[bool] = [False] * world
        self.failed_off = self.heartbeat_off = self.ready_off = 0
        self._token: Optional[int] = None
        self._published: Optional[tuple] = None
        self._lock = threading.Lock()
        #: the owner's current operation epoch (a Context sets it), for failures outside an operation
        self.epoch_fn = lambda: 0
        #: every rank's :func:`process_identity` (Context setup hands them over; None: unknown)
        self.processes: list[Any] = [None] * world

    def epoch(self) -> int:
        try:
            return int(self.epoch_fn())
        except Exception:  # noqa: BLE001
            return 0

    # -------------------------------------------------------------- setup and teardown
    def attach_window(self, window: Any, wlayout: dict) -> None:
        """Start this rank's heartbeat in ``window`` (a host window every rank of its domain maps)."""
        try:
            if getattr(window, "provider", None) not in ("host_shm", "local") or window.local.device.type != "cpu":
                return
            bases = [int(b or 0) for b in window.peer_bases]
        except Exception:  # noqa: BLE001 - no window to read: no heartbeat
            return
        self.failed_off, self.heartbeat_off = status_offsets(wlayout)
        self.ready_off = int(wlayout["ready_off"])
        self.bases = bases
        self.readable = [b != 0 for b in bases]
        if bases[self.rank]:
            self._token = _HEARTBEAT.register(bases[self.rank] + self.heartbeat_off)

    def detach(self) -> None:
        """Stop writing into the window (before it is unmapped); nothing is read from it after."""
        token, self._token = self._token, None
        if token is not None:
            _HEARTBEAT.unregister(token)
            if self.bases and self.bases[self.rank]:  # a stale beat would read as a stop to peers still waiting
                ctypes.c_uint64.from_address(self.bases[self.rank] + self.heartbeat_off).value = _CLOSED
        self.readable = [False] * self.world

    def _board(self) -> Any:
        comm = self._comm_ref() if self._comm_ref is not None else None
        return None if comm is None else comm._board()

    # -------------------------------------------------------------- publishing
    def publish_once(self, epoch: int, what: str) -> None:
        """This rank failed (any error): publish it unless a failure with more detail was already."""
        if self._published is None:
            self.publish(epoch, what)

    def publish(
        self,
        epoch: int,
        what: str,
        awaited: Sequence[int] = (),
        dead: Sequence[int] = (),
        stopped: Optional[dict] = None,
    ) -> None:
        """This rank failed at ``epoch`` waiting for ``awaited`` (``dead``: ranks whose connection
        closed without a record; ``stopped``: rank -> why, once its evidence is in): the window
        word (first failure only) and the store record ``(epoch, what, awaited, dead, stopped)``."""
        with self._lock:
            record = (
                int(epoch),
                str(what)[:200],
                sorted({int(a) for a in awaited} - {self.rank}),
                sorted({int(d) for d in dead}),
                None if stopped is None else {int(k): str(v)[:200] for k, v in stopped.items()},
            )
            if self._published is not None and (
                self._published[2:] == record[2:] or (stopped is None and self._published[4] is not None)
            ):
                return
            first = self._published is None
            self._published = record
        if first and self._token is not None and self.bases:
            ctypes.c_uint64.from_address(self.bases[self.rank] + self.failed_off).value = _FAILED_BIT | int(epoch)
        board = self._board()
        if board is not None:
            try:
                board.post(_KEY.format(scope=self.scope, rank=self.rank), record)
            except Exception:  # noqa: BLE001 - an unreachable store: the window word still says it
                pass

    # -------------------------------------------------------------- reading
    def _records(self, ranks: Sequence[int]) -> dict[int, tuple]:
        board = self._board()
        if board is None or not ranks:
            return {}
        keys = [_KEY.format(scope=self.scope, rank=q) for q in ranks]
        try:
            here = board.present(keys)
            got = [(q, k) for q, k, h in zip(ranks, keys, here) if h]
            if not got:
                return {}
            values = board.read([k for _, k in got])
        except Exception:  # noqa: BLE001 - the store went with its host: what the windows say
            return {}
        return {q: tuple(v) for (q, _), v in zip(got, values)}

    def _window(self, q: int) -> Optional[tuple[int, float, int]]:
        """(failed word, heartbeat age in s, latest ready epoch) of rank ``q``, or None if unreadable."""
        if not (self._token is not None and q < len(self.readable) and self.readable[q]):
            return None
        base = self.bases[q]
        failed = ctypes.c_uint64.from_address(base + self.failed_off).value
        beat = ctypes.c_uint64.from_address(base + self.heartbeat_off).value
        ready = max(ctypes.c_uint64.from_address(base + self.ready_off + 8 * i).value for i in range(2))
        age = -1.0 if beat == _CLOSED else (time.monotonic_ns() - beat) / 1e9 if beat else float("inf")
        return failed, age, ready

    def evidence(
        self,
        epoch: int,
        awaited: Sequence[int],
        dead: Sequence[int] = (),
        wait: bool = True,
        since: Optional[float] = None,
    ) -> Evidence:
        """What this rank can show about every other rank, having waited for ``awaited`` at
        ``epoch`` since ``since`` (``time.monotonic()``; default: one timeout ago); ``dead``: ranks
        whose connection closed.  Waits until ``since`` + timeout + :func:`grace_s` for the records
        of the ranks it waited for (directly or through others' records) that no window shows --
        a live rank stuck behind the same fault raises within its own timeout -- then calls those
        still silent stopped."""
        ev = Evidence()
        others = [q for q in range(self.world) if q != self.rank]
        mine = process_identity()

        def proc(q: int) -> Optional[str]:
            return process_state(self.processes[q], mine) if q < len(self.processes) else None

        stale = stale_s(self.timeout_s)
        win = {q: self._window(q) for q in others}
        records = self._records(others)
        # a closed connection is not death by itself (gloo closes a pair on a protocol error too, e.g. a
        # message of another operation): such a rank is awaited like the others, for its record
        dead = set(dead)
        reported_dead: dict[int, int] = {}
        reported: dict[int, tuple[int, str]] = {}  # rank -> (reporter, why): stopped by another rank's evidence
        chase = (set(awaited) | dead) - {self.rank}
        now = time.monotonic()
        since = now - self.timeout_s if since is None else min(float(since), now)
        deadline = max(now, since + self.timeout_s) + grace_s(self.timeout_s) if wait else now
        while True:
            for q, rec in records.items():  # what ranks that failed waited for is followed in turn
                chase |= set(rec[2]) - {self.rank}
                for d in rec[3]:
                    reported_dead.setdefault(d, q)
                for d, why in (rec[4] or {}).items():
                    if not str(why).startswith("by rank"):  # first-hand evidence only
                        reported.setdefault(int(d), (q, why))
            pending = [
                q
                for q in sorted(chase)
                if q not in records
                and q not in reported_dead
                and q not in reported
                and win.get(q) is None
                and proc(q) is None  # its process shows it: its record can never come
            ]
            # records without their evidence yet: the ranks that can see what this rank cannot
            unfinished = [q for q, rec in records.items() if rec[4] is None]
            if (not pending and not unfinished) or time.monotonic() >= deadline:
                break
            time.sleep(0.05)
            records.update(self._records(pending + unfinished))
            win = {q: self._window(q) for q in others}
        # a rank's process seen ended or stopped has published all it ever will: read its record after
        # that sight (the loop above re-reads only the ranks it waits for; one that failed, published and
        # exited meanwhile would otherwise read as a process that exited without a word)
        procs = {q: proc(q) for q in others if q not in records}
        seen = [q for q, how in procs.items() if how is not None]
        records.update(self._records(seen))
        win.update({q: self._window(q) for q in seen})  # its failure word or closed Context, likewise
        for q in others:
            w = win.get(q)
            if q in records:
                ev.failed[q] = f"at epoch {records[q][0]} ({records[q][1]})"
            elif w is not None and w[0] & _FAILED_BIT:
                ev.failed[q] = f"at epoch {w[0] & ~_FAILED_BIT} (its failure word)"
            elif w is not None and w[1] < 0:
                ev.left[q] = w[2]
            elif procs.get(q) is not None:  # before the heartbeat: a beat is fresh for a while after a stop
                ev.stopped[q] = procs[q]
            elif w is not None:
                if w[1] > stale:
                    how = "killed or stopped" if w[1] != float("inf") else "never beat"
                    ev.stopped[q] = f"heartbeat stale for {w[1]:.1f} s ({how}), latest epoch started {w[2]}"
                else:
                    ev.alive.append(q)
                    if w[2] < epoch:  # a fact, not a stop: it may wait in an earlier operation in turn
                        ev.behind[q] = w[2]
            elif q in dead and wait:
                ev.stopped[q] = (
                    f"its connection closed and it published no failure within the timeout and "
                    f"{grace_s(self.timeout_s):g} s more (its process ended)"
                )
            elif q in reported_dead:
                ev.stopped[q] = f"rank {reported_dead[q]} saw its connection close with no failure published"
            elif q in reported:
                ev.stopped[q] = f"by rank {reported[q][0]}'s evidence: {reported[q][1]}"
            elif q in chase and wait:
                ev.stopped[q] = (
                    f"awaited, silent for the timeout and {grace_s(self.timeout_s):g} s more with no failure published"
                )
            else:
                ev.unknown.append(q)
        return ev

    def explain(
        self,
        epoch: int,
        what: str,
        awaited: Sequence[int],
        dead: Sequence[int] = (),
        wait: bool = True,
        since: Optional[float] = None,
    ) -> str:
        """Publish this rank's failure, gather the evidence (:meth:`evidence`), return its sentence."""
        self.publish(epoch, what, awaited, dead)
        try:
            ev = self.evidence(epoch, awaited, dead, wait, since)
        except Exception as e:  # noqa: BLE001 - the error being raised matters more than its note
            return f"by evidence, stopped: ranks [] (evidence unavailable: {type(e).__name__}: {e})"
        self.publish(epoch, what, awaited, dead, ev.stopped)  # for the ranks that cannot see what this one saw
        return ev.sentence()

    def timeout_text(
        self, text: str, epoch: Optional[int] = None, what: Optional[str] = None, wait: bool = True
    ) -> str:
        """A timeout's ``text`` (the C++ executor's, a kernel's error record, a watchdog's) naming
        ranks by evidence: the older guess stripped (:func:`strip_blame`), the ranks it waited for
        read from it (:func:`awaited_ranks`), then :meth:`explain`'s sentence appended.  ``epoch``
        and ``what`` default to the text's own ("rank 0 weight_sync ... epoch 7" -> 7, "weight_sync
        timed out"; else :meth:`epoch`).  ``wait=False`` where a live peer publishes its failure
        only later (the stream-ordered GPU transports: its host thread learns of it at its next
        synchronize), so that silence calls no rank stopped."""
        text = strip_blame(str(text))
        if epoch is None:
            m = _EPOCH.search(text)
            epoch = int(m.group(1)) if m else self.epoch()
        if what is None:
            m = _OP.search(text)
            what = f"{m.group(1) if m else 'operation'} timed out"
        return f"{text}; {self.explain(epoch, what, awaited_ranks(text), wait=wait)}"


# ------------------------------------------------------------------ older wordings
_BLAME_TAILS = (
    # the C++ executor's: a fact (the ready flag) and a guess; the guess goes
    (": it is likely the stalled or dead rank", ""),
)


def strip_blame(text: str) -> str:
    """``text`` without the guesses of who stopped that predate the evidence sentence."""
    for old, new in _BLAME_TAILS:
        text = text.replace(old, new)
    return text


# what a timeout's text says it waited for: the executor's and the kernels' "waiting for rank 2 ...",
# the GPU split side stream's "... message 3 of 8: ... (peer rank 2)"
_AWAITED = re.compile(r"waiting for rank (\d+)|\(peer rank (\d+)\)")
_EPOCH = re.compile(r"\bepoch (\d+)")  # the first: the operation's ("... (multicast) epoch 7 timed out")
_OP = re.compile(r"^ultracomm: rank \d+ (\w+)")


def awaited_ranks(text: str) -> list[int]:
    """The ranks a timeout's ``text`` says this rank waited for, in order of mention, each once."""
    out: list[int] = []
    for m in _AWAITED.finditer(text):
        r = int(m.group(1) or m.group(2))
        if r not in out:
            out.append(r)
    return out
