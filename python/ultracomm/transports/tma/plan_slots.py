"""Where a GPU transport's plans live: the slots of ONE plan arena (``_cuda.PlanArena``,
csrc/cuda/plan_arena.h) allocated when the transport is set up -- no ``cudaMalloc``,
``cudaFree``, pageable copy or host wait per plan afterwards.

Slots ``0 .. vid_slots - 1``: one per micro-batch slot of the Context (``vid % (num_layers x
max_microbatches)``).  ``weight_sync`` writes its vid's plan there (an async copy from pinned
staging on the launch stream, ordered after every earlier launch of its op kind); ``restore``
and ``grad_reduce`` of the vid run what the slot holds, with no upload.  The kernel reads a
slot at a fixed address, so a captured CUDA graph replays whatever the slot holds when it runs:
a later vid in the same slot (the next step) replaces what a replay runs, which is what a
captured step with new routings needs.  Nothing in the arena is ever freed while the transport
lives.

Slots ``vid_slots ..`` (:data:`SCRATCH` of them): calls without a vid (tests, benchmarks, the
split transport).  Each distinct plan takes one, least recently used first reused -- except one
used while the caller's stream captures a CUDA graph: that one is pinned (the replay reads it)
and never reused; a capture needing more than :data:`SCRATCH` pinned plans without a vid raises.

Arena size (:func:`arena_bounds`): per rank entry of a launch, the schedule builder emits at
most ``(experts_per_rank + slots) x chunks`` tasks and ``world x slots`` refs per operation;
``Context.plan_arena_bytes()`` reports the exact bytes.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Hashable

from ...errors import InputError, UltracommError

__all__ = ["PlanSlots", "SCRATCH", "arena_bounds", "arena_bytes"]

log = logging.getLogger("ultracomm")

SCRATCH = 8


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


def arena_bounds(*, nranks: int, world: int, experts_per_rank: int, members: int, wlayout: dict) -> dict:
    """The keyword bounds of ``_cuda.PlanArena`` / ``plan_arena_bytes`` (without device and slots)."""
    S = int(wlayout["slots"])
    chunks = (int(wlayout["weight_chunks"]), int(wlayout["grad_chunks"]))
    return dict(
        nranks=nranks,
        world=world,
        num_experts=world * experts_per_rank,
        masters=experts_per_rank * members,
        slots=S,
        tasks=tuple((experts_per_rank + S) * c for c in chunks),
        refs=(world * S, world * S),
    )


def arena_bytes(cuda: Any, vid_slots: int, **shape: Any) -> int:
    """Device bytes (and as many pinned host bytes) of the arena of ``vid_slots`` vid slots."""
    return int(cuda.plan_arena_bytes(vid_slots + SCRATCH, **arena_bounds(**shape)))


class PlanSlots:
    """Which arena slot a plan goes to, and whether it must be written there (see module doc)."""

    def __init__(self, vid_slots: int, capturing: Callable[[], bool] = _capturing):
        if vid_slots < 0:
            raise InputError(f"ultracomm: vid_slots must be >= 0, got {vid_slots}")
        self.vid_slots = int(vid_slots)
        self.num_slots = self.vid_slots + SCRATCH
        self._capturing = capturing
        self._held: dict[tuple[int, int], Hashable] = {}  # (slot, op) -> key of the plan written there
        # (slot, op) -> key of the resident-plan template there (resident.py); a host plan clears it
        self._templates: dict[tuple[int, int], Hashable] = {}
        self._scratch: "OrderedDict[Hashable, int]" = OrderedDict()  # key -> scratch slot, LRU first
        self.pinned: set[int] = set()

    def place(self, op: int, key: Hashable, vid_slot: int | None) -> tuple[int, bool]:
        """(slot, upload): the slot for ``key``'s plan of ``op`` and whether it must be written
        (the slot holds another plan).  Call :meth:`written` once the launch is enqueued."""
        if vid_slot is not None:
            if not 0 <= vid_slot < self.vid_slots:
                raise InputError(
                    f"ultracomm: plan slot {vid_slot} is out of range 0..{self.vid_slots - 1} (the "
                    "transport's vid slots: num_layers x max_microbatches)"
                )
            slot = int(vid_slot)
        else:
            slot = self._scratch_slot(key)
            if self._capturing() and slot not in self.pinned:
                self.pinned.add(slot)
                log.debug("ultracomm: plan slot %d pinned: a CUDA graph captured it", slot)
        return slot, self._held.get((slot, int(op))) != key

    def _scratch_slot(self, key: Hashable) -> int:
        slot = self._scratch.get(key)
        if slot is not None:
            self._scratch.move_to_end(key)
            return slot
        used = set(self._scratch.values())
        free = [s for s in range(self.vid_slots, self.num_slots) if s not in used]
        if free:
            slot = free[0]
        else:
            victim = next((k for k, s in self._scratch.items() if s not in self.pinned), None)
            if victim is None:
                raise UltracommError(
                    f"ultracomm: {SCRATCH} plans without a vid slot are pinned by captured CUDA "
                    "graphs; capture through Context operations (their plans live in their vid's "
                    "slot) or fewer distinct plans per capture"
                )
            slot = self._scratch.pop(victim)
        self._scratch[key] = slot
        return slot

    def written(self, slot: int, op: int, key: Hashable) -> None:
        """A host-built plan ``key`` was written into (slot, op): its image replaced any template."""
        self._held[(slot, int(op))] = key
        self._templates.pop((slot, int(op)), None)

    def held(self, slot: int, op: int) -> Hashable:
        """The key of the plan (slot, op) holds, or None."""
        return self._held.get((slot, int(op)))

    # resident plans (resident.py): a template, then device builds into it
    def template(self, slot: int, op: int) -> Hashable:
        return self._templates.get((slot, int(op)))

    def templated(self, slot: int, op: int, key: Hashable) -> None:
        self._templates[(slot, int(op))] = key
        self._held.pop((slot, int(op)), None)  # the template's lists are empty until a build

    def built(self, slot: int, op: int, key: Hashable) -> None:
        self._held[(slot, int(op))] = key
