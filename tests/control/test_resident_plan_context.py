"""``Context.weight_sync(vid, ResidentPlan(...))`` on the host executor: the plan (an int32
tensor, as the device planner leaves it) is copied to the host and built by the portable builder
whatever ``schedule_builder`` says -- the same lists, digest and summation order as the device
build (tests/control/test_slot_build.py) -- so replica weights are exact and master grads bit-identical
to a portable-builder run of the same plan as a ReplicaPlan; bad tensors are refused before
anything moves."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import Context, LoopbackDomain, ReplicaPlan
from ultracomm.errors import PlanMismatchError, UltracommTimeout
from ultracomm.resident_plan import ResidentPlan

from conftest import random_slot_src
from test_context import make_layout, masters_for
from test_schedule_portable_context import run


def test_resident_plan_runs_the_portable_builders_schedule():
    world, slots, epr = 4, 2, 2
    slot_src = random_slot_src(np.random.default_rng(3), world, slots, epr, fill=1.0)
    plan = ReplicaPlan.make(slot_src, experts_per_rank=epr)
    layout = make_layout(9, 21, grad_dtype=torch.float32)
    gen = torch.Generator().manual_seed(5)
    init_master = [[torch.randn((epr, *m.shape), generator=gen) for m in layout.members] for _ in range(world)]
    init_replica = [[torch.randn((slots, *m.shape), generator=gen) for m in layout.members] for _ in range(world)]
    want = run("portable", plan, layout, epr, slots, init_master, init_replica)
    resident = ResidentPlan(torch.from_numpy(np.ascontiguousarray(slot_src, np.int32)))
    got = run("host", plan, layout, epr, slots, init_master, init_replica, sync_plan=resident)
    assert {type(s).__name__ for _, s in got} == {"PortableSchedule"}
    for r in range(world):
        assert got[r][1].digest == want[r][1].digest
        for m in range(len(layout.members)):
            assert torch.equal(got[r][0][m].view(torch.uint8), want[r][0][m].view(torch.uint8)), (r, m)


@pytest.mark.parametrize(
    "bad, msg",
    [
        (
            torch.zeros((4, 2), dtype=torch.int64),
            r"ResidentPlan.slot_src must be a contiguous int32 \[world, slots\] "
            r"tensor, got torch.int64 \[4, 2\]",
        ),
        (torch.zeros((4, 2, 1), dtype=torch.int32), r"got torch.int32 \[4, 2, 1\]"),
        (torch.zeros((2, 4), dtype=torch.int32).t(), r"contiguous"),
    ],
)
def test_bad_resident_plan_tensors_are_refused(bad, msg):
    with pytest.raises(ValueError, match=msg):
        ResidentPlan(bad)


def test_resident_plan_of_another_shape_is_refused_before_anything_moves():
    layout = make_layout(9, 21, grad_dtype=torch.float32)

    def body(group):
        with Context(
            group, layout, 2, 2, num_layers=1, chunk_bytes=32, tile_bytes=16, num_workers=2, timeout_s=30.0
        ) as ctx:
            weights, grads = masters_for(layout, group.rank, 2)
            ctx.register_masters(0, weights, grads)
            vid = ctx.begin(0)
            with pytest.raises(
                ValueError, match="plan is for world 2, 3 slots per rank; this Context has world 2, 2 slots per rank"
            ):
                ctx.weight_sync(vid, ResidentPlan(torch.full((2, 3), -1, dtype=torch.int32)))
            ctx.end(vid)
            return True

    assert LoopbackDomain(2).run(body) == [True, True]


def test_manager_default_runs_the_device_control_planes_host_build():
    """ReplicaManager's default planner on the host executor: the device planner's host build
    hands the plan over as a ResidentPlan, so the schedule is the portable builder's (the one a
    GPU builds); a host planner keeps the configured builder."""
    import moe_harness as mh
    from ultracomm.moe import ReplicaManager
    from ultracomm.schedule_portable import PortableSchedule

    def body(group):
        kinds = {}
        for planner in ("device", "quota"):
            mgr = ReplicaManager(group, mh.layout(), 2, 2, 1, timeout_s=20, planner=planner)
            mgr.register_layer(0, mh.make_params(group.rank, 2, 1, torch.float32, "stacked", False, False)[0])
            with torch.no_grad():
                _, rmap, probs, _ = mh.batch(group.rank, 0, 0, 8)
                mgr.step(0, rmap, probs)
            kinds[planner] = (mgr.control_plane, {type(s).__name__ for s in mgr.ctx._schedules.cached()})
            mgr.close()
        return kinds

    for kinds in LoopbackDomain(4).run(body):
        assert kinds == {"device": ("host", {PortableSchedule.__name__}), "quota": (None, {"Schedule"})}


def test_failed_inputs_are_refused_on_the_host_path_too():
    """The status words a device build checks first (tests/control/test_slot_build.py) are checked on the
    host path as well: a plan made from loads that never all arrived, or a refused plan, is not run."""
    from ultracomm.errors import UltracommError

    src = torch.full((2, 1), -1, dtype=torch.int32)
    ok = ResidentPlan(
        src, exchange_status=torch.zeros(4, dtype=torch.int32), planner_result=torch.zeros(3, dtype=torch.int64)
    )
    assert ok.host_plan(1).slot_src.tolist() == [[-1], [-1]]
    # the exchange's status word keeps its cause's kind (issue 35): 1 a timeout, 2 ranks out of step
    with pytest.raises(UltracommTimeout, match="the expert loads' exchange timed out"):
        ResidentPlan(src, exchange_status=torch.tensor([1, 3, 0, 0], dtype=torch.int32)).host_plan(1)
    with pytest.raises(PlanMismatchError, match="the expert loads' exchange found ranks out of step"):
        ResidentPlan(src, exchange_status=torch.tensor([2, 1, 0, 0], dtype=torch.int32)).host_plan(1)
    with pytest.raises(UltracommError, match="the planner refused the loads") as err:
        ResidentPlan(src, planner_result=torch.tensor([2 | (5 << 32), 0, 0], dtype=torch.int64)).host_plan(1)
    assert type(err.value) is UltracommError
    with pytest.raises(ValueError, match=r"ResidentPlan.planner_result must be a torch.int64 tensor"):
        ResidentPlan(src, planner_result=torch.zeros(3, dtype=torch.int32))


@pytest.mark.parametrize("plan_check", ["agree", "window"])
def test_a_rank_whose_inputs_failed_makes_every_rank_raise(plan_check):
    """Rank 0's loads never all arrived (its exchange status says so): it raises why, and rank 1
    -- whose own plan is fine -- raises at once too instead of waiting for the timeout (through the
    plan agreement, or the rejection rank 0 publishes in its window)."""
    from ultracomm.errors import PlanError, UltracommError

    layout = make_layout(9, 21, grad_dtype=torch.float32)

    def body(group):
        with Context(
            group,
            layout,
            1,
            1,
            num_layers=1,
            chunk_bytes=32,
            tile_bytes=16,
            num_workers=2,
            timeout_s=30.0,
            plan_check=plan_check,
        ) as ctx:
            weights, grads = masters_for(layout, group.rank, 1)
            ctx.register_masters(0, weights, grads)
            vid = ctx.begin(0)
            status = torch.tensor([1 if group.rank == 0 else 0, 1, 0, 0], dtype=torch.int32)
            plan = ResidentPlan(torch.tensor([[1], [0]], dtype=torch.int32), exchange_status=status)
            try:
                ctx.weight_sync(vid, plan)
                if plan_check == "window":
                    ctx.synchronize()
            except (UltracommError, ValueError) as e:
                return type(e), str(e)
            return None

    got = LoopbackDomain(2).run(body, timeout=120)
    assert got[0][0] is UltracommTimeout and "the expert loads' exchange timed out" in got[0][1]
    if plan_check == "agree":
        assert got[1][0] is PlanMismatchError and "ranks [0] rejected their plan" in got[1][1]
    else:
        assert issubclass(got[1][0], PlanError) and "rank 0 rejected its plan" in got[1][1], got[1]
