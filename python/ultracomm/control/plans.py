"""A plan checked against the Context it is given to, and the ranks' agreement on it.

Two ways ranks agree that they run the same plan: the ``agree`` check, one bounded collective
per plan (every rank's plan digest and schedule digest, compared here), or the ``window`` check
(``ULTRACOMM_PLAN_CHECK``), with no collective: each rank publishes its schedule digest beside its
ready flag and the executors compare; a rank whose own plan is invalid publishes a rejection.
"""

from __future__ import annotations

from typing import Any, Callable

from ..errors import ConfigError, PlanError, PlanMismatchError, UltracommError
from ..plan import ReplicaPlan
from ..resident_plan import ResidentPlan
from ..schedule_base import ScheduleBase

__all__ = ["check_plan", "verdict", "prepare", "window_check", "resident_route"]


def check_plan(plan: Any, world: int, slots_per_rank: int, num_experts: int, experts_per_rank: int) -> ReplicaPlan:
    """``plan``, if it is a valid ReplicaPlan for this Context's shape (else PlanError)."""
    if not isinstance(plan, ReplicaPlan):
        raise PlanError(
            f"ultracomm: plan must be a ReplicaPlan, got {type(plan).__name__}; "
            "build one with ReplicaPlan.make(...) or a converter"
        )
    if (plan.world, plan.slots_per_rank, plan.num_experts) != (world, slots_per_rank, num_experts):
        raise PlanError(
            f"ultracomm: plan is for world {plan.world}, {plan.slots_per_rank} slots per rank, "
            f"{plan.num_experts} experts; this Context has world {world}, {slots_per_rank} "
            f"slots per rank, {num_experts} experts"
        )
    plan.validate(experts_per_rank=experts_per_rank)
    return plan


def verdict(views: list) -> None:
    """Every rank's ``(error text or None, (plan digest, schedule digest))``: raise
    PlanMismatchError when a rank rejected its plan or the plans or schedules differ."""
    failed = [r for r, (err, _) in enumerate(views) if err is not None]
    if failed:
        raise PlanMismatchError(
            f"ultracomm: ranks {failed} rejected their plan ({views[failed[0]][0]}); every "
            "rank must pass the same valid plan"
        )
    for what, i in (("plan", 0), ("schedule", 1)):
        groups: dict = {}
        for r, (_, m) in enumerate(views):
            groups.setdefault(m[i], []).append(r)
        if len(groups) > 1:
            detail = "; ".join(f"ranks {rs}" for rs in groups.values())
            hint = (
                "every rank must pass the same plan"
                if what == "plan"
                else "ranks built different schedules from one plan: their configurations differ"
            )
            raise PlanMismatchError(f"ultracomm: {what} differs across ranks ({detail}); {hint}")


def prepare(
    plan: ReplicaPlan | BaseException,
    *,
    check: Callable[[Any], ReplicaPlan],
    schedule: Callable[[ReplicaPlan, bytes], ScheduleBase],
    window_check: bool,
    reject: Callable[[BaseException], None],
    collective: Callable[[Any], list],
) -> ScheduleBase:
    """Check ``plan`` here (``check``: the plan against the Context and the layer's masters),
    build its schedule, then agree with every rank.  ``plan`` may be the error that kept a
    resident plan from becoming a host plan: shared as an invalid plan, so every rank learns.

    Every rank raises when any rank's plan or masters are invalid or the plans or schedules
    differ, so no rank is left waiting in a later collective or flag.  With ``window_check``
    there is no collective: a rank whose plan is invalid calls ``reject`` (which raises)."""
    local_error: BaseException | None = plan if isinstance(plan, BaseException) else None
    mine = sched = None
    if local_error is None:
        try:
            plan = check(plan)
            key = plan.digest()
            sched = schedule(plan, key)
            mine = (key.hex(), sched.digest)
        except (TypeError, ValueError) as e:
            local_error = e
    if window_check:
        if local_error is not None:
            reject(local_error)
        return sched
    try:
        views = collective((None if local_error is None else f"{type(local_error).__name__}: {local_error}", mine))
    except UltracommError:
        if local_error is not None:
            raise local_error from None
        raise
    if local_error is not None:
        raise local_error
    verdict(views)
    return sched


def window_check(plan_check: str, transport: Any) -> bool:
    """Whether ranks check their plans through the digests in their windows (``ULTRACOMM_PLAN_CHECK``;
    see ultracomm.env "Plan checks"): ``window``, or ``auto`` wherever the transport has window flags
    (host, tma, copy_engine, split on CUDA); ``agree``: a collective per plan."""
    on = plan_check == "window" or (plan_check == "auto" and transport.window_flags)
    if on and not transport.window_flags:
        raise ConfigError(
            f"ultracomm: plan_check='window' (ULTRACOMM_PLAN_CHECK) needs a transport whose "
            f"window holds ready flags and digests; transport {transport.name!r} has none: "
            "use plan_check='agree' (or 'auto')"
        )
    return on


def resident_route(
    plan: ResidentPlan,
    world: int,
    slots_per_rank: int,
    experts_per_rank: int,
    build_on_device: bool,
    window_device: Any,
    window_checked: bool,
) -> ReplicaPlan | BaseException | None:
    """Where a resident plan is built: None on the device (the transport builds on the device and the
    plan is on the window's GPU), else the host copy of the plan for the portable builder -- or why it
    has none (failed inputs, an invalid plan: ``prepare`` shares it as an invalid plan)."""
    if (plan.world, plan.slots_per_rank) != (world, slots_per_rank):
        raise PlanError(
            f"ultracomm: plan is for world {plan.world}, {plan.slots_per_rank} slots per rank; this "
            f"Context has world {world}, {slots_per_rank} slots per rank"
        )
    if not (build_on_device and plan.slot_src.is_cuda):
        try:
            return plan.host_plan(experts_per_rank)
        except (UltracommError, ValueError, TypeError) as e:
            return e
    if plan.slot_src.device != window_device:
        raise PlanError(
            f"ultracomm: ResidentPlan.slot_src is on {plan.slot_src.device}, the Context's window "
            f"on {window_device}; make the plan on the window's device"
        )
    if not window_checked:
        raise ConfigError(
            "ultracomm: a resident plan is checked by digests in the window, not by a host "
            "collective; create the Context with plan_check='window' (ULTRACOMM_PLAN_CHECK) "
            "or pass a ReplicaPlan"
        )
    return None
