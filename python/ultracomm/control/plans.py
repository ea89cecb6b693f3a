"""A plan checked against the Context it is given to, and the ranks' agreement on it.

Two ways ranks agree that they run the same plan: the ``agree`` check, one bounded collective
per plan (every rank's plan digest and schedule digest, compared here), or the ``window`` check
(``ULTRACOMM_PLAN_CHECK``), with no collective: each rank publishes its schedule digest beside its
ready flag and the executors compare; a rank whose own plan is invalid publishes a rejection.
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import PlanMismatchError, UltracommError
from ..plan import ReplicaPlan
from ..schedule_base import ScheduleBase

__all__ = ["check_plan", "verdict", "prepare"]


def check_plan(plan: Any, world: int, slots_per_rank: int, num_experts: int, experts_per_rank: int) -> ReplicaPlan:
    """``plan``, if it is a valid ReplicaPlan for this Context's shape (else TypeError/ValueError)."""
    if not isinstance(plan, ReplicaPlan):
        raise TypeError(f"ultracomm: plan must be a ReplicaPlan, got {type(plan).__name__}; "
                        "build one with ReplicaPlan.make(...) or a converter")
    if (plan.world, plan.slots_per_rank, plan.num_experts) != (world, slots_per_rank, num_experts):
        raise ValueError(
            f"ultracomm: plan is for world {plan.world}, {plan.slots_per_rank} slots per rank, "
            f"{plan.num_experts} experts; this Context has world {world}, {slots_per_rank} "
            f"slots per rank, {num_experts} experts")
    plan.validate(experts_per_rank=experts_per_rank)
    return plan


def verdict(views: list) -> None:
    """Every rank's ``(error text or None, (plan digest, schedule digest))``: raise
    PlanMismatchError when a rank rejected its plan or the plans or schedules differ."""
    failed = [r for r, (err, _) in enumerate(views) if err is not None]
    if failed:
        raise PlanMismatchError(f"ultracomm: ranks {failed} rejected their plan ({views[failed[0]][0]}); every "
                                "rank must pass the same valid plan")
    for what, i in (("plan", 0), ("schedule", 1)):
        groups: dict = {}
        for r, (_, m) in enumerate(views):
            groups.setdefault(m[i], []).append(r)
        if len(groups) > 1:
            detail = "; ".join(f"ranks {rs}" for rs in groups.values())
            hint = ("every rank must pass the same plan" if what == "plan" else
                    "ranks built different schedules from one plan: their configurations differ")
            raise PlanMismatchError(f"ultracomm: {what} differs across ranks ({detail}); {hint}")


def prepare(plan: ReplicaPlan | BaseException, *, check: Callable[[Any], ReplicaPlan],
            schedule: Callable[[ReplicaPlan, bytes], ScheduleBase], window_check: bool,
            reject: Callable[[BaseException], None], collective: Callable[[Any], list]) -> ScheduleBase:
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
