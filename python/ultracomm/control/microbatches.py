"""The micro-batch slots of a Context: ``max_microbatches`` per layer, each a ``vid`` in flight."""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator

from ..errors import InputError, UltracommError

__all__ = ["MicroBatch", "MicroBatches"]


@dataclasses.dataclass
class MicroBatch:
    layer: int
    vid: int
    plan: Any = None  # ReplicaPlan | ResidentPlan
    schedule: Any = None  # a ScheduleBase | DeviceSchedule
    my_slots: list[int] | None = None  # this rank's row of plan.slot_src
    local_index_of: list[int] | None = None  # plan.local_index_of, as a list for the executor
    restored: bool = False  # restore() (or weights_copied) since weight_sync
    overwritten_by: int | None = None  # layer whose multicast overwrote the slots before any restore

    def keep(self, rank: int, plan: Any, schedule: Any, local_index_of: list[int] | None = None) -> None:
        """Hold ``plan`` and its ``schedule``; a resident plan (on the device) has no host row, and
        its experts' local indices are the fixed-home model's (``local_index_of``)."""
        self.plan, self.schedule = plan, schedule
        if local_index_of is not None:
            self.my_slots, self.local_index_of = None, local_index_of
        else:
            self.my_slots, self.local_index_of = plan.slot_src[rank].tolist(), plan.local_index_of.tolist()

    def check_not_overwritten(self) -> None:
        """Its replicas are still in the slots (or were restored): a grad_reduce may read what its
        backward wrote, computed on its own weights."""
        if self.overwritten_by is not None:
            raise UltracommError(
                f"ultracomm: grad_reduce(vid {self.vid}, layer {self.layer}): layer {self.overwritten_by}'s multicast "
                f"overwrote the replica slots after this micro-batch's weight_sync and restore(vid) was never called, "
                f"so its backward ran on another layer's weights; call restore({self.vid}) before the expert Dgrad"
            )


class MicroBatches:
    """``vid = begun * len(table) + layer * max_microbatches + k``: a vid carries how many were
    begun before it, so a released vid is never taken for a new micro-batch."""

    def __init__(self, num_layers: int, max_microbatches: int):
        self.max_microbatches = max_microbatches
        self._table: list[MicroBatch | None] = [None] * (num_layers * max_microbatches)
        self._begun = 0

    def __len__(self) -> int:
        return len(self._table)

    def __iter__(self) -> Iterator[MicroBatch]:
        return (mb for mb in self._table if mb is not None)

    def in_flight(self) -> int:
        """Micro-batches begun and not released."""
        return sum(mb is not None for mb in self._table)

    def begin(self, layer: int) -> int:
        for slot in range(layer * self.max_microbatches, (layer + 1) * self.max_microbatches):
            if self._table[slot] is None:
                vid = self._begun * len(self._table) + slot
                self._begun += 1
                self._table[slot] = MicroBatch(layer, vid)
                return vid
        raise UltracommError(
            f"ultracomm: layer {layer} already has {self.max_microbatches} micro-batches in flight; call "
            "grad_reduce(vid) or end(vid) for finished ones, or create the Context with a larger max_microbatches "
            "(micro-batches in flight per layer)"
        )

    def get(self, vid: int, need_plan: bool = False) -> MicroBatch:
        if isinstance(vid, bool) or not isinstance(vid, int) or vid < 0:
            raise InputError(f"ultracomm: vid {vid!r} is not in flight; get one from begin(layer)")
        mb = self._table[vid % len(self._table)]
        if mb is None or mb.vid != vid:
            state = (
                "was released (by grad_reduce or end)"
                if vid < self._begun * len(self._table)
                else "was never returned by begin"
            )
            raise InputError(f"ultracomm: vid {vid} is not in flight: it {state}; get one from begin(layer)")
        if need_plan and mb.schedule is None:
            raise UltracommError(f"ultracomm: vid {vid} has no plan yet; call weight_sync(vid, plan) first")
        return mb

    def release(self, vid: int) -> None:
        self._table[vid % len(self._table)] = None

    def slot(self, vid: int) -> int:
        """The plan-arena slot of ``vid`` (one per layer and micro-batch)."""
        return vid % len(self._table)

    def wrote_slots(self, writer: MicroBatch) -> None:
        """``writer``'s plan now fills the replica slots (calls are queued in order, so this is
        the order the slots are written in): every other micro-batch in flight that was never
        restored has lost its replicas, and its backward must ``restore`` before the Dgrad."""
        for mb in self:
            if mb is not writer and mb.plan is not None and not mb.restored and mb.overwritten_by is None:
                mb.overwritten_by = writer.layer
