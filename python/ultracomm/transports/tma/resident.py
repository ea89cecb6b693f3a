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

A failed build (status in mapped host memory, ``PlanArena.build_result``) made the rank publish
a rejection; :meth:`ResidentSlots.take_failure` turns it into the error its ``check_error``
raises.
"""
from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

from ...errors import UltracommError
from ...records import Op
from ...resident_plan import BUILD_STATUS
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
        self._built: set[int] = set()  # slots built since the last take_failure

    def launch(self, runner: Any, arena: Any, slot: int | None, op: int, shares: Sequence[Share], epoch: int,
               ctas: int, stream: int) -> None:
        """Enqueue ``op`` of the resident plan ``shares`` (one per rank entry, in rank order) from
        vid slot ``slot``: on the plan's first operation (its ``weight_sync``) the templates that
        changed and the build first."""
        if slot is None:
            raise ValueError("ultracomm: a resident plan runs from its vid's plan slot; pass it through "
                             "Context.weight_sync(vid, ResidentPlan(...))")
        key = ("resident", *(s.token for s in shares))
        if self.slots.held(slot, op) != key:
            if op != int(Op.MULTICAST):
                raise UltracommError(f"ultracomm: plan slot {slot} no longer holds the resident plan this "
                                     f"{'reduction' if op else 'multicast'} belongs to (another plan was written "
                                     "there since its weight_sync)")
            for o in (int(Op.MULTICAST), int(Op.REDUCE)):
                tkey = tuple(s.template_key(o) for s in shares)
                if self.slots.template(slot, o) != tkey:
                    runner.write_template(arena, slot, [s.template(o) for s in shares], stream)
                    self.slots.templated(slot, o, tkey)
            for entry, s in enumerate(shares):
                runner.build_slot(arena, slot, entry, stream=stream, **s.build_args)
            for o in (int(Op.MULTICAST), int(Op.REDUCE)):
                self.slots.built(slot, o, key)
            self._built.add(slot)
        elif self.slots.template(slot, op) != tuple(s.template_key(op) for s in shares):
            raise UltracommError(f"ultracomm: plan slot {slot}: the masters (or window) changed since this resident "
                                 "plan's weight_sync built its lists; call weight_sync again after register_masters")
        runner.launch_slot(arena, slot, op, None, epoch, ctas, stream, False)

    def take_failure(self, arena: Any, rank: int) -> UltracommError | None:
        """The error of a failed device build since the last call (read after the stream reached
        the builds: their status is in mapped host memory, no copy), or None."""
        built, self._built = self._built, set()
        for slot in sorted(built):
            r = arena.build_result(slot)
            if r["status"] != 0:
                why = BUILD_STATUS.get(int(r["status"]), f"status {r['status']}")
                return UltracommError(f"ultracomm: rank {rank}: the device schedule build of plan slot {slot} failed: "
                                      f"{why}; the rank published a rejection (peers raise PlanError)")
        return None
