"""The few collectives the control plane needs, over a torch process group or a loopback domain.

ultracomm's data plane never goes through these: they carry window names, digests and
configuration at setup and plan checks.  ``as_comm`` accepts what users pass as ``group``:
``None`` (the default process group), a ``torch.distributed.ProcessGroup``, or a
``LoopbackGroup`` (several ranks as threads of one process, for tests).
"""
from __future__ import annotations

import abc
import threading
from typing import Any, Callable, TypeVar

import torch.distributed as dist

T = TypeVar("T")


class Comm(abc.ABC):
    """Rank, world size, ``all_gather_object`` and ``barrier`` of one group."""

    rank: int
    world: int
    kind: str

    @abc.abstractmethod
    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's ``obj``, in rank order."""

    def barrier(self) -> None:
        self.all_gather_object(None)


class TorchComm(Comm):
    """A ``torch.distributed`` process group (any backend that supports object collectives)."""

    kind = "torch"

    def __init__(self, group: dist.ProcessGroup | None):
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "ultracomm: torch.distributed is not initialised; call "
                "torch.distributed.init_process_group(...) first, or pass a LoopbackGroup"
            )
        self.group = group
        self.rank = dist.get_rank(group)
        self.world = dist.get_world_size(group)

    def all_gather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj, group=self.group)
        return out


class LoopbackDomain:
    """Several ranks as threads of one process, sharing one address space.

    ``domain.group(r)`` is rank ``r``'s handle, passed as ``group=`` where a process group
    would go.  Collectives are generation-counted barriers, so they can be reused freely.
    """

    def __init__(self, world: int):
        if world < 1:
            raise ValueError(f"LoopbackDomain needs world >= 1, got {world}")
        self.world = world
        self._cv = threading.Condition()
        self._slots: list[Any] = [None] * world
        self._arrived = 0
        self._generation = 0
        self._result: list[Any] = []
        self.shared: dict[Any, Any] = {}  # for window providers: buffers kept alive by the domain

    def group(self, rank: int) -> "LoopbackGroup":
        if not 0 <= rank < self.world:
            raise ValueError(f"rank {rank} out of range for a loopback domain of {self.world}")
        return LoopbackGroup(self, rank)

    def _all_gather(self, rank: int, obj: Any, timeout: float) -> list[Any]:
        with self._cv:
            gen = self._generation
            self._slots[rank] = obj
            self._arrived += 1
            if self._arrived == self.world:
                self._result = list(self._slots)
                self._slots = [None] * self.world
                self._arrived = 0
                self._generation += 1
                self._cv.notify_all()
                return self._result
            if not self._cv.wait_for(lambda: self._generation != gen, timeout=timeout):
                raise TimeoutError(
                    f"ultracomm loopback: rank {rank} waited {timeout} s in a collective; "
                    f"only {self._arrived} of {self.world} ranks arrived"
                )
            return self._result

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
        for t in threads:
            t.join(timeout)
            if t.is_alive():
                raise TimeoutError(f"ultracomm loopback: {t.name} still running after {timeout} s")
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

    def __init__(self, domain: LoopbackDomain, rank: int, timeout: float = 120.0):
        self.domain = domain
        self.rank = rank
        self.world = domain.world
        self.timeout = timeout

    def all_gather_object(self, obj: Any) -> list[Any]:
        return self.domain._all_gather(self.rank, obj, self.timeout)


def as_comm(group: Any) -> Comm:
    """Wrap what a user passed as ``group`` (None, ProcessGroup, LoopbackGroup, Comm)."""
    if isinstance(group, Comm):
        return group
    return TorchComm(group)


def run_loopback(world: int, fn: Callable[[LoopbackGroup], T], timeout: float = 300.0) -> list[T]:
    """Shorthand: ``LoopbackDomain(world).run(fn)``."""
    return LoopbackDomain(world).run(fn, timeout)


def check_same(comm: Comm, what: str, value: Any) -> None:
    """Raise ``ValueError`` on every rank if ``value`` differs across ranks, naming the ranks."""
    values = comm.all_gather_object(value)
    if all(v == values[0] for v in values):
        return
    groups: dict[str, list[int]] = {}
    for r, v in enumerate(values):
        groups.setdefault(repr(v), []).append(r)
    detail = "; ".join(f"ranks {rs}: {k}" for k, rs in groups.items())
    raise ValueError(f"ultracomm: {what} differs across ranks ({detail}); every rank must pass the same {what}")
