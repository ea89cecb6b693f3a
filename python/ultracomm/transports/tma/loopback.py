"""The tma transport's side of a one-GPU loopback domain (``cuda_local`` windows): what its
ranks share so that ONE launch of the persistent kernel runs them all (every rank's CTAs must
be resident together; launched one rank at a time on a stream they would wait on each other
until the timeout).

Pairing the ranks' calls into launches is :mod:`ultracomm.cuda.loopback_launch`'s (each rank's n-th
call joins the n-th launch, all on one stream); this module holds the domain's one ``Runner``,
its one plan arena (:mod:`.plan_slots`; a launch's plan, every rank's entry, goes into the vid
slot the ranks name, written only when it changed) and its failures: a failure of the
shared launch is raised by every rank's ``check_error()``, once each; so is a rank's rejection
of its plan, and a launch that could not start (bad plan, grid too large), which the launching
rank gets at once from its ``run()``.
"""

from __future__ import annotations

import threading
from typing import Any, Callable, Sequence

from ...cuda.support import make_error_record, raise_record, record_epoch
from ...cuda.loopback_launch import Deposit
from .plan_slots import PlanSlots, arena_bounds
from .resident import ResidentSlots
from ...errors import InputError

__all__ = ["LoopbackRunner", "runner_for"]
_REJECTED = 3  # ErrorCode kRejected (include/ultracomm/records/error_record.h)


class LoopbackRunner:
    """One per loopback window set, shared by its ranks' transports."""

    def __init__(self, cuda: Any, world: int, device: int, timeout_s: float, plan_slots: int = 0):
        self.world, self.device, self.timeout_s, self.cuda = world, device, timeout_s, cuda
        self.runner = cuda.Runner(device)
        self._lock = threading.Lock()
        self._slots = PlanSlots(plan_slots)
        self._resident = ResidentSlots(self._slots)
        self.arena: Any = None
        # every failure, in order: (raise it as rank r would, op name)
        self._errors: list[tuple[Callable[[int, str | None, float], None], str | None]] = []
        self._seen: dict[int, int] = {}  # rank -> failures it raised
        self._names: dict[int, str | None] = {}

    def ensure_arena(self, shape: dict) -> None:
        """Allocate the domain's plan arena (the first rank to set up; the others find it)."""
        with self._lock:
            if self.arena is None:
                self.arena = self.cuda.PlanArena(self.device, self._slots.num_slots, **arena_bounds(**shape))

    def launch(self, deposits: Sequence[Deposit], launcher: int, reduce_path: str = "hunk") -> None:
        """Launch every rank's share (``item = (plan key, args builder, ctas, op name[, vid slot])``,
        in rank order) once; ``launcher`` is the rank whose call completed the set, and its
        transport's ``reduce_path`` the launch's (one configuration for the domain's ranks)."""
        op, stream = int(deposits[0].op), deposits[0].stream
        epoch = max(d.epoch for d in deposits)  # the kernel runs max(epoch, last + 1) anyway
        name = deposits[0].item[3]
        with self._lock:
            try:
                vids = {d.item[4] if len(d.item) > 4 else None for d in deposits}
                if len(vids) > 1:
                    raise InputError(
                        f"ultracomm: loopback ranks ran one operation on different vid slots "
                        f"{sorted(vids, key=str)}; every rank must begin its micro-batches in the same "
                        "order"
                    )
                shares = [d.item[5] if len(d.item) > 5 else None for d in deposits]
                ctas = max(d.item[2] for d in deposits)
                if any(s is not None for s in shares):  # a resident plan: built on the device (resident.py)
                    if any(s is None for s in shares):
                        raise InputError(
                            "ultracomm: loopback ranks ran one operation with resident and host-built "
                            "plans; every rank must pass the same kind of plan"
                        )
                    self._resident.launch(
                        self.runner, self.arena, vids.pop(), op, shares, epoch, ctas, stream, reduce_path
                    )
                else:
                    key = (op, tuple(d.item[0] for d in deposits))
                    slot, upload = self._slots.place(op, key, vids.pop())
                    ranks = [d.item[1]() for d in deposits] if upload else None
                    self.runner.launch_slot(
                        self.arena, slot, op, ranks, epoch, ctas, stream, False, reduce_path=reduce_path
                    )
                    self._slots.written(slot, op, key)
            except Exception as e:
                # the other ranks' parts never run: their check_error says why
                self._errors.append((raiser(e), name))
                self._seen[launcher] = len(self._errors)
                raise
            if len(self._names) > 1024:
                self._names.clear()
            self._names[epoch] = name

    def reject(self, rank: int, op: int, epoch: int, wlayout: dict, window_base: int, stream: int) -> None:
        """Rank ``rank`` rejected its plan for (op, epoch): publish it in its window (as on any
        window) and, since the shared launch will not run, record for every other rank the
        error a peer touching it would raise ("rank r rejected its plan")."""
        L = wlayout
        self.cuda.publish_rejection(
            op, epoch, window_base, L["slots"], L["weight_slot_bytes"], L["grad_slot_bytes"], L["chunk_bytes"], stream
        )
        with self._lock:

            def throw(me: int, name: str | None, t: float) -> None:
                raise_record(make_error_record(_REJECTED, me, op, epoch, peer=rank), name, t)

            self._errors.append((throw, self._names.get(epoch)))
            self._seen[rank] = len(self._errors)  # the rejecting rank raised its own error already

    def record_failure(
        self, throw: Callable[[int, str | None, float], None], name: str | None, raised_by: int | None = None
    ) -> None:
        """A failure found on the host before a launch (``throw(rank, op name, timeout_s)`` raises it
        as that rank would): every rank's ``check_error`` raises it once, except ``raised_by``,
        whose own call raised it already."""
        with self._lock:
            self._errors.append((throw, name))
            if raised_by is not None:
                self._seen[raised_by] = len(self._errors)

    def check_error(self, rank: int) -> None:
        with self._lock:
            rec = self.runner.take_error()
            if rec is not None:
                self._errors.append(
                    (lambda me, name, t, rec=rec: raise_record(rec, name, t), self._names.get(record_epoch(rec)))
                )
            if self.arena is not None:
                self.arena.retire()
            failure = self._resident.take_failure(self.arena, rank) if self.arena is not None else None
            if failure is not None:  # a rank's device build failed: the cause, raised by every rank once
                self._errors.append((raiser(failure), None))  # last: raised before the rejections it caused
            seen = self._seen.get(rank, 0)
            if seen >= len(self._errors):
                return
            self._seen[rank] = len(self._errors)
            throw, name = self._errors[-1]
        throw(rank, name, self.timeout_s)


def raiser(e: BaseException) -> Callable[[int, str | None, float], None]:
    """A ``throw(rank, op name, timeout_s)`` for :meth:`LoopbackRunner.record_failure` that raises ``e``."""

    def throw(rank: int, name: str | None, timeout_s: float) -> None:
        raise e

    return throw


_LOCK = threading.Lock()


def runner_for(window: Any, cuda: Any, device: int, timeout_s: float, plan_slots: int = 0) -> LoopbackRunner:
    """The loopback runner of ``window``'s domain and window set (created by the first rank)."""
    key = ("ultracomm.tma_loopback_runner", tuple(int(b) for b in window.peer_bases))
    with _LOCK:
        got = window.shared.get(key)
        if got is None:
            got = window.shared[key] = LoopbackRunner(cuda, window.world, device, timeout_s, plan_slots)
    return got
