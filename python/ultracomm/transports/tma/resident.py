"""The tma transport's side of resident plans (:mod:`ultracomm.resident_plan`): a plan made on
the GPU is built on the GPU into its vid's plan-arena slot and run from there, with no host copy.

Per vid slot and op kind, the area's static part -- each rank entry's window bases, master
pointers, ``local_index_of``, members, timeout -- is a template written once (an async copy from
pinned staging, ``Runner.write_template``) and again only when it changes (masters registered
anew) or after a host-built plan used the slot.  Each ``weight_sync`` of a resident plan enqueues
``Runner.build_slot`` per rank entry (kernel ``k_build_slot``: both op kinds' lists, my_slots,
slot_parent, counts, digest), then the persistent kernel runs the slot; ``restore`` and
``grad_reduce`` of the vid run what the slot holds.  Under CUDA graph capture all of it is
captured: a replay rebuilds from whatever the planner's output buffer holds then.

A failed build made the rank publish a rejection; it reports in mapped host memory
(``PlanArena.build_result(slot, entry)``: the count of failed builds and the last one's status,
behind a sequence lock), and :meth:`ResidentSlots.take_failure` raises each new failure once --
also of builds a CUDA graph replay ran, which the host never enqueued itself.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ...errors import InputError, UltracommError
from ...records import Op
from ..device_schedule import BUILD_ERROR, BUILD_STATUS
from .plan_slots import PlanSlots

__all__ = ["Share", "ResidentSlots"]


@dataclasses.dataclass
class Share:
    """One rank entry of a resident launch: its plan's token, its template per op kind (and the
    key saying when it changed), and its ``Runner.build_slot`` arguments."""

    token: int
    template: Callable[[int], dict]
    template_key: Callable[[int], tuple]
    build_args: dict


class ResidentSlots:
    """Builds and launches of resident plans over one arena's :class:`PlanSlots`."""

    def __init__(self, slots: PlanSlots):
        self.slots = slots
        self._entries: dict[int, int] = {}  # slot -> rank entries its builds write (slots ever built)
        self._seen: dict[tuple[int, int], int] = {}  # (slot, entry) -> failed builds already reported

    def launch(
        self,
        runner: Any,
        arena: Any,
        slot: int | None,
        op: int,
        shares: Sequence[Share],
        epoch: int,
        ctas: int,
        stream: int,
        reduce_path: str = "hunk",
    ) -> None:
        """Enqueue ``op`` of the resident plan ``shares`` (one per rank entry, in rank order) from
        vid slot ``slot``: on the plan's first operation (its ``weight_sync``) the templates that
        changed and the build first.  ``reduce_path``: the launch's (``Runner.launch_slot``)."""
        if slot is None:
            raise InputError(
                "ultracomm: a resident plan runs from its vid's plan slot; pass it through "
                "Context.weight_sync(vid, ResidentPlan(...))"
            )
        key = ("resident", *(s.token for s in shares))
        if self.slots.held(slot, op) != key:
            if op != int(Op.MULTICAST):
                raise UltracommError(
                    f"ultracomm: plan slot {slot} no longer holds the resident plan this "
                    f"{'reduction' if op else 'multicast'} belongs to (another plan was written "
                    "there since its weight_sync)"
                )
            for o in (int(Op.MULTICAST), int(Op.REDUCE)):
                tkey = tuple(s.template_key(o) for s in shares)
                if self.slots.template(slot, o) != tkey:
                    runner.write_template(arena, slot, [s.template(o) for s in shares], stream)
                    self.slots.templated(slot, o, tkey)
            for entry, s in enumerate(shares):
                runner.build_slot(arena, slot, entry, stream=stream, **s.build_args)
            for o in (int(Op.MULTICAST), int(Op.REDUCE)):
                self.slots.built(slot, o, key)
            self._entries[slot] = len(shares)
        elif self.slots.template(slot, op) != tuple(s.template_key(op) for s in shares):
            raise UltracommError(
                f"ultracomm: plan slot {slot}: the masters (or window) changed since this resident "
                "plan's weight_sync built its lists; call weight_sync again after register_masters"
            )
        runner.launch_slot(arena, slot, op, None, epoch, ctas, stream, False, reduce_path=reduce_path)

    def take_failure(self, arena: Any, rank: int) -> UltracommError | None:
        """The error of a device build that failed since the last call, or None.  Each rank
        entry's report counts its failed builds and keeps the last one (mapped host memory, read
        without a copy or a wait), so failures of builds the host never enqueued (graph replays)
        and of builds followed by good ones before anyone looked are raised too, each once."""
        failure = None
        for slot, entries in sorted(self._entries.items()):
            for entry in range(entries):
                r = arena.build_result(slot, entry)
                failed = int(r["failures"])
                if failed < 0 or failed == self._seen.get((slot, entry), 0):  # -1: being written, ask again
                    continue
                n = failed - self._seen.get((slot, entry), 0)
                self._seen[(slot, entry)] = failed
                if failure is None:
                    who = f"rank {rank}" if entries == 1 else f"rank entry {entry} (checked by rank {rank})"
                    status = int(r["failed_status"])
                    why = BUILD_STATUS.get(status, f"status {status}")
                    more = f" ({n} failed builds since the last check; the last one's reason)" if n > 1 else ""
                    failure = BUILD_ERROR.get(status, UltracommError)(
                        f"ultracomm: {who}: the device schedule build of plan slot {slot} failed: {why}{more}; the "
                        "rank published a rejection (peers raise PlanError) and ran no task of it"
                    )
        return failure
