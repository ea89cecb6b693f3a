"""Resident plans on the tma transport's Python side (transports/tma/resident.py), with
``ultracomm._cuda`` replaced by the recording fake of test_tma_transport: a plan made on the GPU
is never uploaded -- its vid slot gets each op kind's template once (again only when the masters
change or a host-built plan used the slot), every weight_sync enqueues the device build of both
op kinds and then the launch of what the slot holds, restore and grad_reduce launch with no build;
a loopback domain's launch builds every rank's entry first; a failed build is what check_error
raises.  (The calls below the fake -- the templates' layout and the build into them -- are
tests/cuda/test_cuda_host_calls.py's and tests/control/test_slot_build.py's.)"""

from __future__ import annotations

import threading

import pytest
import torch

from ultracomm.errors import UltracommError
from ultracomm.records import Op
from ultracomm.resident_plan import DeviceSchedule, ResidentPlan

from test_tma_transport import FakeWindow, fake_cuda, masters_of, setup, transport  # noqa: F401 - fixture

LIO = [0, -1, -1, -1]  # rank 0's local_index_of, one expert per rank


def dsched(rank=0, world=4, slots=2):
    plan = ResidentPlan(torch.full((world, slots), -1, dtype=torch.int32))
    return DeviceSchedule(plan, torch.arange(world, dtype=torch.int32), None, rank, world, 8, 1024, 2048, 64, 740)


def test_resident_plan_builds_on_weight_sync_and_reuses_the_slot(fake_cuda):
    layout, _, wl, _ = setup()
    t = transport(0, 4, FakeWindow(4, wl["total_bytes"]), layout, wl, experts_per_rank=1, plan_slots=4)
    m = masters_of(layout)
    a, b = dsched(), dsched()
    t.run(Op.MULTICAST, a, 1, m, None, LIO, "weight_sync", stream=7, slot=2)
    t.run(Op.MULTICAST, a, 2, m, None, LIO, "restore", stream=7, slot=2)
    t.run(Op.REDUCE, a, 3, m, None, LIO, "grad_reduce", stream=7, slot=2)
    t.run(Op.MULTICAST, b, 4, m, None, LIO, "weight_sync", stream=7, slot=2)  # next plan: built, same templates
    runner = fake_cuda.runners[0]
    got = [l if l[0] in ("template", "build") else ("launch", l[5], l[6], l[1], l[0] is None) for l in runner.launches]
    assert got == [
        ("template", 2, [0], [0], 7),
        ("template", 2, [1], [0], 7),
        ("build", 2, 0, 0, 7),
        ("launch", 2, 0, 1, True),
        ("launch", 2, 0, 2, True),
        ("launch", 2, 1, 3, True),
        ("build", 2, 0, 0, 7),
        ("launch", 2, 0, 4, True),
    ]
    mc, rd = (r[0] for r in runner.templates)
    # the templates: no task, no replica, the masters of each op kind, the window's bases
    assert mc["tasks"].size == 0 and mc["my_slots"] == [-1, -1] and mc["slot_parent"] == [-1, -1]
    assert mc["master_ptrs"] == list(m.weight_ptrs) and rd["master_ptrs"] == list(m.grad_ptrs)
    assert mc["window_bases"] == t.window.peer_bases and mc["local_index_of"] == LIO
    assert not fake_cuda.plans  # nothing uploaded from the host


def test_masters_change_rewrites_the_templates_and_a_host_plan_clears_them(fake_cuda):
    layout, plan, wl, sched = setup()
    t = transport(0, 4, FakeWindow(4, wl["total_bytes"]), layout, wl, experts_per_rank=1, plan_slots=4)
    m, m2 = masters_of(layout), masters_of(layout)
    t.run(Op.MULTICAST, dsched(), 1, m, None, LIO, "weight_sync", stream=1, slot=0)
    a = dsched()
    t.run(Op.MULTICAST, a, 2, m2, None, LIO, "weight_sync", stream=1, slot=0)  # other masters: new templates
    with pytest.raises(
        UltracommError, match="the masters .or window. changed since this resident plan's weight_sync built its lists"
    ):
        t.run(Op.REDUCE, a, 3, m, None, LIO, "grad_reduce", stream=1, slot=0)
    my = plan.slot_src[0].tolist()
    t.run(Op.MULTICAST, sched, 4, m2, my, LIO, "weight_sync", stream=1, slot=0)  # a host plan in the slot
    t.run(Op.REDUCE, a, 5, m2, None, LIO, "grad_reduce", stream=1, slot=0)  # its reduce area still holds a's lists
    t.run(Op.REDUCE, sched, 6, m2, my, LIO, "grad_reduce", stream=1, slot=0)  # now it does not
    with pytest.raises(UltracommError, match="plan slot 0 no longer holds the resident plan this reduction"):
        t.run(Op.REDUCE, a, 5, m2, None, LIO, "grad_reduce", stream=1, slot=0)
    t.run(Op.MULTICAST, dsched(), 7, m2, None, LIO, "weight_sync", stream=1, slot=0)
    kinds = [l[0] if isinstance(l[0], str) else "launch" for l in fake_cuda.runners[0].launches]
    assert kinds == [
        "template",
        "template",
        "build",
        "launch",
        "template",
        "template",
        "build",
        "launch",
        "launch",
        "launch",
        "launch",
        "template",
        "template",
        "build",
        "launch",
    ]


def test_resident_plan_needs_a_vid_slot(fake_cuda):
    layout, _, wl, _ = setup()
    t = transport(0, 4, FakeWindow(4, wl["total_bytes"]), layout, wl, experts_per_rank=1, plan_slots=4)
    with pytest.raises(ValueError, match="a resident plan runs from its vid's plan slot"):
        t.run(Op.MULTICAST, dsched(), 1, masters_of(layout), None, LIO, "weight_sync", stream=1)


def test_failed_build_is_what_check_error_raises(fake_cuda):
    layout, _, wl, _ = setup()
    t = transport(0, 4, FakeWindow(4, wl["total_bytes"]), layout, wl, experts_per_rank=1, plan_slots=4)
    t.run(Op.MULTICAST, dsched(), 1, masters_of(layout), None, LIO, "weight_sync", stream=1, slot=3)
    arena = fake_cuda.arenas[0]
    arena.report(3, 0)
    t.check_error()  # built fine
    arena.report(3, 2)  # kBadPlan (e.g. at a graph replay: no call of the host enqueued it)
    with pytest.raises(
        UltracommError,
        match=r"^ultracomm: rank 0: the device schedule build of plan slot 3 failed: "
        r"the plan is invalid \(an expert id out of range, a replica on its home "
        r"rank, or an expert twice on a rank\); the rank published a rejection",
    ):
        t.check_error()
    t.check_error()  # each failed generation once
    arena.report(3, 6)  # the next build: its loads never all arrived ...
    arena.report(3, 0)  # ... and a good build after it before anyone looked: the failure stays
    with pytest.raises(UltracommError, match="the expert loads' exchange timed out"):
        t.check_error()
    t.check_error()
    arena.report(3, 7)
    arena.report(3, 2)  # two failures between checks: both counted, the last one's reason
    with pytest.raises(
        UltracommError,
        match=r"the plan is invalid .*\(2 failed builds since the last check; the "
        r"last one's reason\)",
    ):
        t.check_error()


def test_loopback_builds_every_ranks_entry_then_launches_once(fake_cuda):
    layout, _, wl, _ = setup()
    shared: dict = {}
    ts = [
        transport(
            r,
            4,
            FakeWindow(4, wl["total_bytes"], loopback=True, shared=shared),
            layout,
            wl,
            experts_per_rank=1,
            plan_slots=4,
        )
        for r in range(4)
    ]
    lios = [[0 if e == r else -1 for e in range(4)] for r in range(4)]
    scheds = [dsched(rank=r) for r in range(4)]
    out = [None] * 4

    def go(r):
        out[r] = ts[r].run(
            Op.MULTICAST, scheds[r], 1, masters_of(layout), None, lios[r], "weight_sync", stream=5, slot=1
        )

    threads = [threading.Thread(target=go, args=(r,)) for r in range(4)]
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    (runner,) = fake_cuda.runners
    got = [l if l[0] in ("template", "build") else ("launch", l[5], l[6], l[0] is None) for l in runner.launches]
    assert got == [
        ("template", 1, [0] * 4, [0, 1, 2, 3], 5),
        ("template", 1, [1] * 4, [0, 1, 2, 3], 5),
        *[("build", 1, r, r, 5) for r in range(4)],
        ("launch", 1, 0, True),
    ]
    assert sorted(out, key=str) == [False, False, False, True]
    fake_cuda.arenas[0].report(1, 5, entries=4)  # kOverflow: every rank raises it once
    for r in range(4):
        with pytest.raises(
            UltracommError,
            match=r"rank entry 0 \(checked by rank \d\): the device schedule build "
            r"of plan slot 1 failed: the lists exceed",
        ):
            ts[r].check_error()
        ts[r].check_error()
