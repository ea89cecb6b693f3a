"""What the Context hands the ``tma`` transport for a resident plan: the device build's inputs
(:class:`DeviceSchedule`), and what the build's status words mean (:data:`BUILD_STATUS`,
:data:`BUILD_ERROR`).  Data-plane vocabulary: the transport reads it, the control plane
(:mod:`ultracomm.resident_plan`) makes it and re-exports it."""

from __future__ import annotations

import dataclasses
import itertools
from typing import Any

import torch

from ..errors import PlanMismatchError, UltracommTimeout

__all__ = ["DeviceSchedule", "BUILD_STATUS", "BUILD_ERROR"]

#: psched::Status of a device build (include/ultracomm/impl/sched_build.h), as the host raises it
BUILD_STATUS = {
    1: "world, slots or experts beyond the device builder's capacities (world <= 1024, slots <= 8, experts <= 65536)",
    2: "the plan is invalid (an expert id out of range, a replica on its home rank, or an expert twice on a rank)",
    3: "the build options are invalid (chunk bytes, bytes per expert, depth limit or rank)",
    4: "node_of names a node outside [0, world)",
    5: "the lists exceed the plan arena's bounds",
    6: "the expert loads' exchange timed out (a rank never posted its loads), so nothing was built from them",
    7: "the planner refused the loads, so nothing was built from its output",
    8: "the expert loads' exchange found ranks out of step (a rank posted another layer or micro-batch: "
    "GpuLoadBoard.status word 0 is 2), so nothing was built from them",
}

#: the error class a failed device build raises, by its status: its cause keeps its kind (issue 35)
BUILD_ERROR = {6: UltracommTimeout, 8: PlanMismatchError}


_TOKENS = itertools.count(1)


@dataclasses.dataclass(eq=False)
class DeviceSchedule:
    """A resident plan's schedule, to be built on the device: the inputs of
    ``_cuda.Runner.build_slot`` (``slot_src`` / ``home_of`` / ``node_of`` are device tensors).

    ``token`` names this weight_sync's plan: a vid slot holding it needs no new build
    (``restore``, ``grad_reduce``); ``digest`` is unknown on the host (``None``)."""

    plan: Any  # the ResidentPlan (ultracomm.resident_plan): slot_src, exchange_status, planner_result
    home_of: torch.Tensor
    node_of: torch.Tensor | None
    rank: int
    num_experts: int
    max_depth: int
    weight_bytes: int
    grad_bytes: int
    chunk_bytes: int
    hop_bytes: int
    token: int = dataclasses.field(default_factory=lambda: next(_TOKENS))
    digest: Any = None

    def build_args(self) -> dict:
        """Keyword arguments of ``Runner.build_slot`` beside arena, slot, entry and stream."""
        src, p = self.plan.slot_src, self.plan
        return dict(
            slot_src=src.data_ptr(),
            home_of=self.home_of.data_ptr(),
            exchange_status=0 if p.exchange_status is None else p.exchange_status.data_ptr(),
            plan_result=0 if p.planner_result is None else p.planner_result.data_ptr(),
            node_of=0 if self.node_of is None else self.node_of.data_ptr(),
            world=int(src.shape[0]),
            slots=int(src.shape[1]),
            num_experts=self.num_experts,
            rank=self.rank,
            max_depth=self.max_depth,
            weight_bytes=self.weight_bytes,
            grad_bytes=self.grad_bytes,
            chunk_bytes=self.chunk_bytes,
            hop_bytes=self.hop_bytes,
        )
