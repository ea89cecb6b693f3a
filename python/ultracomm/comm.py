"""The few collectives the control plane needs, over a torch process group or a loopback domain.

ultracomm's data plane never goes through these: they carry window names, digests and
configuration at setup and plan checks.  ``as_comm`` accepts what users pass as ``group``:
``None`` (the default process group), a ``torch.distributed.ProcessGroup``, or a
``LoopbackGroup`` (several ranks as threads of one process, for tests).

Every collective is bounded: a rank that does not arrive within ``timeout_s``
(``ULTRACOMM_TIMEOUT_S`` for a Context) makes the others raise
:class:`~ultracomm.errors.UltracommTimeout` naming this rank, the operation, what was
exchanged and the ranks that did not arrive.  An exchange is a key per (sequence number,
rank) on a board every rank can read -- the process group's c10d Store, or a dict for
loopback ranks -- so it works for gloo and NCCL groups alike and never leaves a backend
collective half done.  A rank that gives up leaves a tombstone under its key, so a rank
that arrives late raises too instead of going on alone.
"""

from __future__ import annotations

import abc
import atexit
import copy
import datetime
import queue
import threading
import time
import weakref
from typing import Any, Callable, Sequence, TypeVar

import torch.distributed as dist

from . import wire
from .errors import ClosedError, ConfigError, InputError, PeerError, PlanMismatchError, UltracommError, UltracommTimeout

T = TypeVar("T")

_ARRIVED, _GAVE_UP = "arrived", "gave_up"
DEFAULT_TIMEOUT_S = 120.0  # a group used outside a Context (a Context passes ULTRACOMM_TIMEOUT_S)


class _Board(abc.ABC):
    """Keys every rank of a group can read: the exchange's rendezvous."""

    @abc.abstractmethod
    def post(self, key: str, value: Any) -> None: ...

    @abc.abstractmethod
    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        """True once every key is posted, False after ``timeout_s``."""

    @abc.abstractmethod
    def present(self, keys: Sequence[str]) -> list[bool]: ...

    @abc.abstractmethod
    def read(self, keys: Sequence[str]) -> list[Any]: ...

    @abc.abstractmethod
    def remove(self, key: str) -> None: ...


class _BoardUnreachable(Exception):
    """The board itself failed (e.g. the store's host process died)."""


class Comm(abc.ABC):
    """Rank, world size, bounded ``all_gather_object`` / ``agree`` / ``barrier`` of one group."""

    rank: int
    world: int
    kind: str
    timeout_s: float = DEFAULT_TIMEOUT_S

    @abc.abstractmethod
    def _board(self) -> _Board: ...

    @abc.abstractmethod
    def _next_sequence(self) -> int:
        """This rank's next exchange number in this group (every rank counts alike)."""

    def with_timeout(self, timeout_s: float) -> "Comm":
        """The same group (same board and sequence) whose collectives wait at most ``timeout_s``."""
        other = copy.copy(self)
        other.timeout_s = float(timeout_s)
        return other

    def all_gather_object(self, obj: Any, *, op: str, what: str) -> list[Any]:
        """Every rank's ``obj``, in rank order (torch groups: in :mod:`ultracomm.wire` format; loopback shares it).

        ``op`` names the user-facing operation (``"Context setup"``, ``"weight_sync"``),
        ``what`` the exchange within it (``"plan agreement"``); both appear in errors.

        Raises:
            UltracommTimeout: some rank did not arrive within ``timeout_s`` (named), or gave
                up waiting for this one before it arrived.
            PlanMismatchError: the ranks are in different exchanges (they called different
                operations, e.g. ``step`` for different layers): ranks out of step.
        """
        board, seq = self._board(), self._next_sequence()
        keys = [f"ultracomm/{seq}/{r}" for r in range(self.world)]
        where = f"rank {self.rank} {op} ({what})"
        try:
            board.post(keys[self.rank], (_ARRIVED, op, what, obj))
            arrived = board.wait(keys, self.timeout_s)
            missing = [] if arrived else [r for r, here in enumerate(board.present(keys)) if not here]
            if missing:
                board.post(keys[self.rank], (_GAVE_UP, op, what, None))
                witness = getattr(self, "witness", None)
                # who stopped: by evidence where the Context has a witness (ultracomm.blame), else a guess
                why = (
                    "they are likely stalled or dead, or called a different operation"
                    if witness is None
                    else witness.explain(witness.epoch(), f"{op} ({what}) timed out", missing)
                )
                raise UltracommTimeout(
                    f"ultracomm: {where} timed out after {self.timeout_s:g} s: ranks {missing} did not arrive "
                    f"(timeout ULTRACOMM_TIMEOUT_S={self.timeout_s:g}); {why}: every rank must call the same "
                    "collective operations in the same order"
                )
            entries = board.read(keys)
            if seq > 0:  # every rank has posted `seq`, so every rank has read `seq - 1`
                board.remove(f"ultracomm/{seq - 1}/{self.rank}")
        except _BoardUnreachable as e:
            raise UltracommTimeout(
                f"ultracomm: {where}: the process group's store is unreachable ({e}); the process hosting "
                "it (torchrun's agent, or the rank that created it, often rank 0) is likely dead or stalled"
            ) from None
        gave_up = [r for r, e in enumerate(entries) if e[0] == _GAVE_UP]
        if gave_up:
            raise UltracommTimeout(
                f"ultracomm: {where}: ranks {gave_up} had already timed out waiting for this rank "
                f"(timeout {self.timeout_s:g} s); this rank arrived too late: it was likely stalled"
            )
        tags: dict[tuple[str, str], list[int]] = {}
        for r, e in enumerate(entries):
            tags.setdefault((e[1], e[2]), []).append(r)
        if len(tags) > 1:  # name what the others posted, as the load boards do (ultracomm.moe.loads)
            detail = "; ".join(
                f"{f'rank {rs[0]}' if len(rs) == 1 else f'ranks {rs}'} posted {o} ({w})"
                for (o, w), rs in tags.items()
                if (o, w) != (op, what)
            )
            raise PlanMismatchError(
                f"ultracomm: {where}: ranks called different operations ({detail}); every rank must call "
                "the same collective operations in the same order"
            )
        return [e[3] for e in entries]

    def agree(self, fn: Callable[[], T], *, op: str, what: str) -> list[T]:
        """Run ``fn()`` here, then exchange its result or its error with every rank.

        Returns every rank's result in rank order when all succeeded.  If any rank failed,
        every rank raises: the failed rank its own error, the others :class:`PeerError`
        naming the failed ranks, the step and the first error -- so no rank waits for a
        rank that has stopped.
        """
        error: Exception | None = None
        value: Any = None
        try:
            value = fn()
        except Exception as e:  # noqa: BLE001 - reported to every rank below
            error = e
        message = None if error is None else f"{type(error).__name__}: {error}"
        try:
            views = self.all_gather_object((message, None if error else value), op=op, what=what)
        except UltracommError:
            if error is not None:
                raise error from None  # this rank's own failure is the one to report here
            raise
        if error is not None:
            raise error
        failed = [r for r, (m, _) in enumerate(views) if m is not None]
        if failed:
            raise PeerError(
                f"ultracomm: rank {self.rank} {op} ({what}): ranks {failed} failed: rank {failed[0]}: "
                f"{views[failed[0]][0]}"
            )
        return [v for _, v in views]

    def barrier(self, *, op: str = "barrier", what: str = "barrier") -> None:
        """Bounded barrier (an exchange of nothing)."""
        self.all_gather_object(None, op=op, what=what)


# ------------------------------------------------------------------ torch process groups

_QUICK_S = 2.0  # bound of a store call that does not wait for other ranks


class _Reply:
    def __init__(self) -> None:
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None


def _serve_store_calls(requests: queue.SimpleQueue) -> None:
    """The board's store calls, one at a time on one connection (the caller waits, bounded)."""
    while True:
        item = requests.get()
        if item is None:
            return
        fn, reply = item
        del item
        try:
            reply.value = fn()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            reply.error = e
            del e
        reply.done.set()
        del fn, reply


def _wait_unless_stalled(done: threading.Event, bound_s: float) -> bool:
    """``done.wait(bound_s)``, except that time this process itself did not run does not count
    against the store.  A process stopped (SIGSTOP, a debugger, a frozen container) past the
    bound wakes with the bound spent and the store's answer, which came while it was stopped,
    not yet read by the serving thread: waiting as long again as it overslept, up to
    ``_QUICK_S``, lets that thread hand it over instead of the store being declared dead.  A
    wait that returns on time (a store that is really silent) costs nothing more."""
    t0 = time.monotonic()
    if done.wait(bound_s):
        return True
    overslept = time.monotonic() - t0 - bound_s
    return overslept > 0 and done.wait(min(overslept, _QUICK_S))


class _StoreBoard(_Board):
    """A group's c10d Store, through a clone served by one daemon thread.

    A TCPStore client blocks without bound when the store's host is alive but silent (a
    SIGSTOPped rank 0 under ``init_method=tcp://``), so the caller waits for each call with a
    timeout: ``wait`` for the exchange's timeout, every other call for ``_QUICK_S``.  A call
    that does not answer in time marks the board unreachable for good (its connection is
    mid-request); later exchanges of the group raise at once.

    ``rank``: this rank's number in the group.  Its keys then live under ``ultracomm/<n>/``, ``n``
    counting the boards this rank has used on the store (the first call asks the store): a group
    re-created under the same name (``destroy_process_group`` then ``init_process_group``, which
    restarts torch's group names; a torchrun agent's store outlives both) shares the old one's
    prefix, and its exchanges would read the keys the old group's last exchanges, tombstones and
    failure records left there.
    """

    def __init__(self, store: dist.Store, rank: int | None = None):
        self._origin = store
        self._rank = rank
        self._store: dist.Store | None = None
        self._requests: queue.SimpleQueue = queue.SimpleQueue()
        self._dead: str | None = None
        self._busy_until = 0.0  # monotonic time by which every call queued so far has returned
        self.lock = threading.Lock()
        self.sequence = 0
        self._thread = threading.Thread(
            target=_serve_store_calls, args=(self._requests,), name="ultracomm-store", daemon=True
        )
        self._thread.start()
        weakref.finalize(self, self._requests.put, None)  # the thread ends with the group
        _LIVE_BOARDS.add(self)

    def _client(self) -> dist.Store:
        if self._store is None:  # cloned on the serving thread: connecting may block too
            store = self._origin.clone()
            store.set_timeout(datetime.timedelta(seconds=_QUICK_S))
            if self._rank is not None:  # every rank of the group counts alike: they use it together
                store = dist.PrefixStore(f"ultracomm/{store.add(f'ultracomm/boards/{self._rank}', 1)}", store)
            self._store = store
        return self._store

    def _call(self, fn: Callable[[dist.Store], T], timeout_s: float = _QUICK_S) -> T:
        if self._dead is not None:
            raise _BoardUnreachable(self._dead)
        reply = _Reply()
        bound = timeout_s + _QUICK_S
        self._busy_until = max(self._busy_until, time.monotonic()) + bound
        self._requests.put((lambda: fn(self._client()), reply))
        if not _wait_unless_stalled(reply.done, bound):
            self._dead = f"a store call got no answer within {bound:g} s"
            raise _BoardUnreachable(self._dead)
        if isinstance(reply.error, dist.DistStoreError) and "timeout" in str(reply.error).lower():
            raise reply.error  # the store answered: the keys are not there (yet)
        if reply.error is not None:  # connection refused or reset: the store's host is gone
            self._dead = f"{type(reply.error).__name__}: {reply.error}"
            raise _BoardUnreachable(self._dead)
        return reply.value

    def stop(self) -> None:
        """Stop serving: calls still queued or running end within their own bounds, then the
        thread ends and the store clone is dropped (later calls raise at once).

        Run at interpreter exit: a thread still inside a c10d call once Python finalizes
        aborts the process when the call returns (re-taking the GIL then ends the thread by
        unwinding through C++ frames: std::terminate, "terminate called without an active
        exception").  A caller that gave up on a silent store leaves such a call behind.
        """
        self._dead = self._dead or "ultracomm stopped its store thread (interpreter exit)"
        self._requests.put(None)
        self._thread.join(max(0.0, self._busy_until - time.monotonic()) + _QUICK_S)
        if not self._thread.is_alive():
            self._store = None

    def _quick(self, fn: Callable[[dist.Store], T]) -> T:
        try:
            return self._call(fn)
        except dist.DistStoreError as e:
            self._dead = f"{type(e).__name__}: {e}"
            raise _BoardUnreachable(self._dead) from None

    def post(self, key: str, value: Any) -> None:
        data = wire.encode(value)  # parsed strictly by read(), never unpickled
        self._quick(lambda st: st.set(key, data))

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        try:
            self._call(lambda st: st.wait(list(keys), datetime.timedelta(seconds=timeout_s)), timeout_s)
            return True
        except dist.DistStoreError:
            return False

    def present(self, keys: Sequence[str]) -> list[bool]:
        return self._quick(lambda st: [st.check([k]) for k in keys])

    def read(self, keys: Sequence[str]) -> list[Any]:
        out = []
        for key, v in zip(keys, self._quick(lambda st: st.multi_get(list(keys)))):
            try:
                out.append(wire.decode(v))
            except wire.WireError as e:
                raise UltracommError(
                    f"ultracomm: the store value under {key!r} is not one ultracomm wrote ({e}); "
                    "another process wrote into this process group's store"
                ) from None
        return out

    def remove(self, key: str) -> None:
        def delete(st: dist.Store) -> None:
            try:
                st.delete_key(key)
            except (RuntimeError, NotImplementedError):  # FileStore cannot delete: a few stale keys
                pass

        self._quick(delete)


# One board (store clone + sequence) per process group, shared by every Comm of the group in
# this process; it goes with the group.
_BOARDS: "weakref.WeakKeyDictionary[Any, _StoreBoard]" = weakref.WeakKeyDictionary()
_BOARDS_LOCK = threading.Lock()
_LIVE_BOARDS: "weakref.WeakSet[_StoreBoard]" = weakref.WeakSet()  # also those whose group is gone


@atexit.register
def _stop_store_threads() -> None:
    """Before Python finalizes, no store thread may still be inside a c10d call (see stop)."""
    for board in list(_LIVE_BOARDS):
        board.stop()


class TorchComm(Comm):
    """A ``torch.distributed`` process group (any backend: only its Store is used)."""

    kind = "torch"

    def __init__(self, group: dist.ProcessGroup | None, timeout_s: float = DEFAULT_TIMEOUT_S):
        if not dist.is_available() or not dist.is_initialized():
            raise UltracommError(
                "ultracomm: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first, or pass a LoopbackGroup"
            )
        from torch.distributed import distributed_c10d as c10d

        pg = c10d._get_default_group() if group is None else group
        # weak: a Context (closed, or kept in a cycle) must not keep the group alive past
        # destroy_process_group: a gloo group alive at interpreter exit can abort the process (its
        # worker threads re-take the GIL while Python finalizes)
        self._pg_ref = weakref.ref(pg)
        self._default = group is None
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)
        if self.rank < 0:
            raise InputError("ultracomm: this process is not a member of the process group passed as group")
        self.timeout_s = float(timeout_s)
        with _BOARDS_LOCK:
            board = _BOARDS.get(pg)
            if board is None:
                board = _BOARDS[pg] = _StoreBoard(c10d._get_process_group_store(pg), self.rank)
        self._store_board = board

    @property
    def pg(self) -> dist.ProcessGroup:
        """The process group (the default one when ``group`` was None)."""
        return live_group(self._pg_ref, self.rank)

    @property
    def group(self) -> dist.ProcessGroup | None:
        """What the user passed as ``group``: None for the default group."""
        return None if self._default else self.pg

    def _board(self) -> _Board:
        return self._store_board

    def _next_sequence(self) -> int:
        b = self._store_board
        with b.lock:
            b.sequence += 1
            return b.sequence - 1


def live_group(ref: "weakref.ref[dist.ProcessGroup]", rank: int) -> dist.ProcessGroup:
    """The process group behind ``ref``, which ultracomm holds weakly; ClosedError once destroyed."""
    pg = ref()
    if pg is None:
        raise ClosedError(
            f"ultracomm: rank {rank}: the process group was destroyed (torch.distributed.destroy_process_group) "
            "while an ultracomm Context still uses it; close Contexts before destroying their group, and create "
            "a new Context on a new group"
        )
    return pg


# ------------------------------------------------------------------ loopback domains


class _DictBoard(_Board):
    """Keys in a dict shared by the threads of a loopback domain; objects are shared, not copied."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.items: dict[str, Any] = {}

    def post(self, key: str, value: Any) -> None:
        with self.cv:
            self.items[key] = value
            self.cv.notify_all()

    def wait(self, keys: Sequence[str], timeout_s: float) -> bool:
        with self.cv:
            return self.cv.wait_for(lambda: all(k in self.items for k in keys), timeout=timeout_s)

    def present(self, keys: Sequence[str]) -> list[bool]:
        with self.cv:
            return [k in self.items for k in keys]

    def read(self, keys: Sequence[str]) -> list[Any]:
        with self.cv:
            return [self.items[k] for k in keys]

    def remove(self, key: str) -> None:
        with self.cv:
            self.items.pop(key, None)


class LoopbackDomain:
    """Several ranks as threads of one process, sharing one address space.

    ``domain.group(r)`` is rank ``r``'s handle, passed as ``group=`` where a process group
    would go.  Collectives are bounded exchanges like a process group's (same errors).
    """

    def __init__(self, world: int):
        if isinstance(world, bool) or not isinstance(world, int) or world < 1:
            raise InputError(f"LoopbackDomain needs an int world >= 1, got {world!r}")
        self.world = world
        self.board = _DictBoard()
        self._sequence = [0] * world
        self._lock = threading.Lock()
        self.shared: dict[Any, Any] = {}  # for window providers: buffers kept alive by the domain

    def group(self, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> "LoopbackGroup":
        if not 0 <= rank < self.world:
            raise InputError(f"rank {rank} out of range for a loopback domain of {self.world}")
        return LoopbackGroup(self, rank, timeout_s)

    def run(self, fn: Callable[["LoopbackGroup"], T], timeout: float = 300.0) -> list[T]:
        """Run ``fn(group)`` on every rank in its own thread; return results in rank order.

        Re-raises the first rank's exception (others' are attached as ``__notes__``).
        """
        results: list[Any] = [None] * self.world
        errors: list[BaseException | None] = [None] * self.world

        def body(r: int) -> None:
            try:
                results[r] = fn(self.group(r))
            except BaseException as e:  # noqa: BLE001 - reported below
                errors[r] = e

        threads = [threading.Thread(target=body, args=(r,), name=f"loopback-rank{r}") for r in range(self.world)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + timeout
        for t in threads:
            t.join(max(0.0, deadline - time.monotonic()))
            if t.is_alive():
                raise UltracommTimeout(f"ultracomm loopback: {t.name} still running after {timeout} s")
        failed = [(r, e) for r, e in enumerate(errors) if e is not None]
        if failed:
            r0, e0 = failed[0]
            if hasattr(e0, "add_note"):  # Python >= 3.11
                for r, e in failed[1:]:
                    e0.add_note(f"rank {r} also failed: {type(e).__name__}: {e}")
            raise e0
        return results


class LoopbackGroup(Comm):
    """One rank of a :class:`LoopbackDomain`."""

    kind = "loopback"

    def __init__(self, domain: LoopbackDomain, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S):
        self.domain = domain
        self.rank = rank
        self.world = domain.world
        self.timeout_s = float(timeout_s)

    def _board(self) -> _Board:
        return self.domain.board

    def _next_sequence(self) -> int:
        d = self.domain
        with d._lock:
            d._sequence[self.rank] += 1
            return d._sequence[self.rank] - 1


def as_comm(group: Any, timeout_s: float | None = None) -> Comm:
    """Wrap what a user passed as ``group`` (None, ProcessGroup, LoopbackGroup, Comm);
    ``timeout_s`` (when given) bounds its collectives."""
    comm = group if isinstance(group, Comm) else TorchComm(group)
    return comm if timeout_s is None else comm.with_timeout(timeout_s)


def run_loopback(world: int, fn: Callable[[LoopbackGroup], T], timeout: float = 300.0) -> list[T]:
    """Shorthand: ``LoopbackDomain(world).run(fn)``."""
    return LoopbackDomain(world).run(fn, timeout)


def require_same(values: Sequence[Any], what: str) -> None:
    """Raise :class:`~ultracomm.errors.ConfigError` (a ``ValueError``) if ``values`` (one per
    rank) differ, naming the ranks."""
    if all(v == values[0] for v in values):
        return
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(repr(v), []).append(r)
    detail = "; ".join(f"ranks {rs}: {k}" for k, rs in groups.items())
    raise ConfigError(f"ultracomm: {what} differs across ranks ({detail}); every rank must pass the same {what}")


def check_same(comm: Comm, what: str, value: Any, *, op: str = "check") -> None:
    """Raise ``ConfigError`` on every rank if ``value`` differs across ranks, naming the ranks."""
    require_same(comm.all_gather_object(value, op=op, what=what), what)
