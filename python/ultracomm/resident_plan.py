"""Plans that stay where they were made: the device control plane's hand-off to ``Context``.

``ResidentPlan(slot_src)`` is a replica plan as a tensor -- int32 ``[world, slots]``, the expert
each replica slot holds (-1 empty), e.g. the device planner's output
(:func:`ultracomm.planners.device.plan_on_gpu`) -- passed to :meth:`Context.weight_sync`
without a host copy.  What the Context does with it depends on where it runs:

* the ``tma`` transport, ``slot_src`` on the window's GPU: nothing goes to the host.  The
  schedule is built on the GPU (``include/ultracomm/impl/slot_build.h``, kernel ``k_build_slot``)
  straight into the vid's plan-arena slot, and the persistent kernel runs it; ``restore`` and
  ``grad_reduce`` of the vid run what the slot holds.  No host validation either: a plan the
  builder refuses (an expert on its own home, an expert twice on a rank, ids out of range)
  makes the rank publish a rejection -- peers raise ``PlanError`` "rank r rejected its plan"
  -- and this rank's next ``synchronize()`` / ``Work.wait()`` raises why.
* any other transport (or a CPU tensor): the plan is copied to the host (on a GPU that copy
  waits for the stream), validated as a :class:`~ultracomm.plan.ReplicaPlan`, and built by the
  host build of the same portable builder (``ultracomm.schedule_portable``), so both paths run
  the same trees, the same summation order and the same digest.

:class:`DeviceSchedule` is what the Context hands the ``tma`` transport for such a plan: the
builder's inputs, which the transport turns into ``Runner.build_slot`` calls.
"""

from __future__ import annotations

import dataclasses

import torch

from .transports.device_schedule import BUILD_ERROR, BUILD_STATUS, DeviceSchedule
from .errors import InputError, UltracommError
from .plan import ReplicaPlan, SlotShape

__all__ = ["ResidentPlan", "DeviceSchedule", "BUILD_STATUS", "BUILD_ERROR"]


@dataclasses.dataclass(frozen=True, eq=False)
class ResidentPlan(SlotShape):
    """A replica plan as a tensor, wherever it was made (see the module docstring).

    Attributes:
        slot_src: int32 ``[world, slots]``: expert held by each replica slot (-1: empty);
            on the GPU of the Context's window (built there, no host copy) or on the CPU.
        exchange_status: optional int32 tensor on the same device whose first word is nonzero
            when the loads the plan was made from failed to arrive (``GpuLoadBoard.status``);
        planner_result: optional int64 ``[3]`` tensor, ``plan_on_gpu``'s ``result`` (its status
            in the low 32 bits of word 0).  The device build checks both first: a failed input
            is rejected, not built from (on the host path they are checked on the host).
    """

    slot_src: torch.Tensor
    exchange_status: torch.Tensor | None = None
    planner_result: torch.Tensor | None = None

    def __post_init__(self) -> None:
        t = self.slot_src
        if not isinstance(t, torch.Tensor) or t.dtype != torch.int32 or t.dim() != 2 or not t.is_contiguous():
            got = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
            raise InputError(
                f"ultracomm: ResidentPlan.slot_src must be a contiguous int32 [world, slots] tensor, got {got}"
            )
        for name, w, dt in (
            ("exchange_status", self.exchange_status, torch.int32),
            ("planner_result", self.planner_result, torch.int64),
        ):
            if w is not None and (
                not isinstance(w, torch.Tensor) or w.dtype != dt or w.numel() < 1 or w.device != t.device
            ):
                raise InputError(
                    f"ultracomm: ResidentPlan.{name} must be a {dt} tensor on the plan's device {t.device}, or None"
                )

    def host_plan(self, experts_per_rank: int) -> ReplicaPlan:
        """The plan on the host (a copy: on a GPU it waits for the stream that makes it); raises
        ``UltracommTimeout`` / ``PlanMismatchError`` when ``exchange_status`` says the loads' exchange
        timed out / found ranks out of step, ``UltracommError`` when ``planner_result`` says the
        planner refused the loads."""
        for word, status in ((self.exchange_status, 6), (self.planner_result, 7)):
            value = 0 if word is None else int(word.reshape(-1)[0].item()) & 0xFFFFFFFF
            if value:  # the exchange's status word: 1 timed out, 2 ranks out of step
                status = 8 if status == 6 and value == 2 else status
                raise BUILD_ERROR.get(status, UltracommError)(f"ultracomm: {BUILD_STATUS[status]}")
        return ReplicaPlan.make(self.slot_src.cpu().numpy(), experts_per_rank=experts_per_rank)
