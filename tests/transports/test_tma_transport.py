"""The tma transport's Python side on a CPU machine, with ``ultracomm._cuda`` replaced by a
recording fake: what one rank uploads (run_host's arguments for its rank), that a plan is
written into its plan-arena slot only when the slot holds another (restore / grad_reduce of a
vid reuse its slot), the arena's bounds, the launch arguments, that a loopback
domain's ranks meet and launch ONCE after the last rank enqueued, and that a kernel's error
record comes back as the host executor's exception and text on every rank, once."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

import ultracomm
from ultracomm import ExpertLayout, Member, ReplicaPlan, _core
from ultracomm.cuda.support import make_error_record
from ultracomm.records import Op
from ultracomm.schedule import build_schedule
from ultracomm.transports import tma as tma_mod
from ultracomm.transports.host import Masters


class FakePlan:
    def __init__(self, ranks, device):
        self.ranks, self.device = ranks, device


class FakeArena:
    def __init__(self, device, num_slots, bounds):
        self.device, self.num_slots, self.bounds = device, num_slots, bounds
        # (slot, entry) -> (generation, status, failures, failed_status)
        self.reports: dict[tuple[int, int], tuple[int, int, int, int]] = {}
        self.retired = 0

    def build_result(self, slot, entry=0):
        gen, status, failures, failed_status = self.reports.get((slot, entry), (0, 0, 0, 0))
        return dict(generation=gen, status=status, failures=failures, failed_status=failed_status)

    def report(self, slot, status, entries=1):
        """What the device would report after another build of every entry of ``slot``."""
        for e in range(entries):
            gen, _, failures, failed_status = self.reports.get((slot, e), (0, 0, 0, 0))
            if status:
                failures, failed_status = failures + 1, status
            self.reports[(slot, e)] = (gen + 1, status, failures, failed_status)

    def retire(self):
        self.retired += 1


class FakeRunner:
    sm_count, mover = 132, "tma"

    def __init__(self, device, cuda):
        self.device, self.launches, self.errors, self.cuda = device, [], [], cuda
        self.reduce_paths = []  # each launch's reduce_path

    def launch_slot(self, arena, slot, op, ranks, epoch, ctas, stream, force_vector, reduce_path="hunk"):
        plan = None
        if ranks is not None:  # written into the slot
            plan = FakePlan(ranks, arena.device)
            self.cuda.plans.append(plan)
        self.launches.append((plan, epoch, ctas, stream, force_vector, slot, op))
        self.reduce_paths.append(reduce_path)

    def take_error(self):
        return self.errors.pop(0) if self.errors else None

    # resident plans (transports/tma/resident.py)
    def write_template(self, arena, slot, ranks, stream):
        self.launches.append(("template", slot, [r["op"] for r in ranks], [r["rank"] for r in ranks], stream))
        self.templates = getattr(self, "templates", []) + [ranks]

    def build_slot(self, arena, slot, entry, *, stream, **args):
        self.launches.append(("build", slot, entry, args["rank"], stream))


class FakeCuda:
    def __init__(self):
        self.plans, self.runners, self.rejections, self.arenas = [], [], [], []

    def publish_rejection(self, *args):
        self.rejections.append(args)

    def PlanArena(self, device, num_slots, **bounds):  # noqa: N802 - the binding's name
        a = FakeArena(device, num_slots, bounds)
        self.arenas.append(a)
        return a

    def plan_arena_bytes(self, num_slots, **bounds):
        return num_slots * 1000 + bounds["tasks"][0]

    def Runner(self, device):  # noqa: N802
        r = FakeRunner(device, self)
        self.runners.append(r)
        return r


class FakeWindow:
    def __init__(self, world, nbytes, loopback=False, shared=None):
        self.provider = "cuda_local" if loopback else "cuda_ipc"
        self.world, self.loopback, self.shared = world, loopback, shared if shared is not None else {}
        self.local = type("Local", (), {"device": torch.device("cuda", 0)})()
        self.peer_bases = [0x7000_0000_0000 + r * (1 << 32) for r in range(world)]


@pytest.fixture
def fake_cuda(monkeypatch):
    fake = FakeCuda()
    monkeypatch.setattr(tma_mod, "cuda_runtime", lambda device, what="": fake)
    return fake


def setup(world=4, epr=1, slots=2):
    layout = ExpertLayout(
        (Member("fc1", (8, 6), torch.bfloat16), Member("fc2", (10,), torch.bfloat16)), grad_dtype=torch.float32
    )
    slot_src = np.full((world, slots), -1, np.int32)
    for r in range(1, world):
        slot_src[r, 0] = 0  # expert 0 everywhere
    slot_src[0, 1] = world - 1  # expert world-1 on rank 0
    plan = ReplicaPlan.make(slot_src, experts_per_rank=epr)
    wl = _core.window_layout(slots, layout.weight_bytes, layout.grad_bytes, 64)
    sched = build_schedule(plan, wl["weight_slot_bytes"], wl["grad_slot_bytes"], chunk_bytes=64)
    return layout, plan, wl, sched


def masters_of(layout, epr=1):
    w = tuple(torch.zeros((epr, *m.shape), dtype=m.dtype) for m in layout.members)
    g = tuple(torch.zeros((epr, *m.shape), dtype=layout.grad_dtype) for m in layout.members)
    return Masters.of(w, g, epr, [m.name for m in layout.members])


def transport(rank, world, window, layout, wl, **kw):
    return tma_mod.TmaTransport(
        rank=rank,
        world=world,
        window=window,
        wlayout=wl,
        layout=layout,
        num_workers=2,
        timeout_s=3.0,
        multicast_sms=kw.pop("multicast_sms", 5),
        reduce_sms=7,
        **kw,
    )


def test_one_rank_uploads_its_arguments_once_and_launches(fake_cuda):
    layout, plan, wl, sched = setup()
    t = transport(2, 4, FakeWindow(4, wl["total_bytes"]), layout, wl)
    m = masters_of(layout)
    my, lio = plan.slot_src[2].tolist(), plan.local_index_of.tolist()
    for epoch in (1, 2, 3):
        t.run(Op.MULTICAST, sched, epoch, m, my, lio, "weight_sync", stream=1234)
    t.run(Op.REDUCE, sched, 4, m, my, lio, "grad_reduce", stream=99)
    assert len(fake_cuda.plans) == 2  # one upload per (schedule, op, masters, slots)
    mc, rd = fake_cuda.plans
    (a,) = mc.ranks
    assert a["op"] == 0 and a["rank"] == 2 and a["world"] == 4 and a["digest"] == sched.digest
    assert a["window_bases"] == t.window.peer_bases and a["master_ptrs"] == list(m.weight_ptrs)
    assert a["member_off"] == list(layout.weight_offsets) and a["member_bytes"] == list(layout.weight_sizes)
    assert a["tasks"].tobytes() == sched.tasks(Op.MULTICAST, 2).tobytes()
    assert a["refs"].tobytes() == sched.refs(Op.MULTICAST, 2).tobytes()
    assert a["slot_parent"] == sched.tree(Op.MULTICAST)[0][2].tolist() and a["timeout_s"] == 3.0
    assert rd.ranks[0]["op"] == 1 and rd.ranks[0]["master_ptrs"] == list(m.grad_ptrs) and rd.ranks[0]["grad_dtype"] == 0
    runner = fake_cuda.runners[0]
    # no vid slot: scratch slots (the first two after the 0 vid slots), the plan written once
    assert [(l[0], l[1], l[2], l[3], l[5]) for l in runner.launches] == [
        (mc, 1, 5, 1234, 0),
        (None, 2, 5, 1234, 0),
        (None, 3, 5, 1234, 0),
        (rd, 4, 7, 99, 1),
    ]


@pytest.mark.parametrize("loopback", [False, True])
def test_reduce_path_reaches_every_launch(fake_cuda, loopback):
    # ULTRACOMM_REDUCE_PATH / the reduce_path option: the kernels a launch runs (hunk: register
    # hunks, the default; tma: TMA-staged), for host-built plans, one rank or a loopback domain
    layout, plan, wl, sched = setup()
    shared = {}
    world = 4 if loopback else 1
    wins = [FakeWindow(4, wl["total_bytes"], loopback=loopback, shared=shared) for _ in range(world)]
    ranks = range(4) if loopback else [2]
    ts = {r: transport(r, 4, wins[i], layout, wl, reduce_path="tma") for i, r in enumerate(ranks)}
    assert all(t.reduce_path == "tma" for t in ts.values())
    lio = plan.local_index_of.tolist()
    for op, epoch in ((Op.MULTICAST, 1), (Op.REDUCE, 2)):
        for r, t in ts.items():
            t.run(op, sched, epoch, masters_of(layout), plan.slot_src[r].tolist(), lio, "op", stream=5)
    assert fake_cuda.runners[0].reduce_paths == ["tma", "tma"]
    assert transport(1, 4, FakeWindow(4, wl["total_bytes"]), layout, wl).reduce_path == "hunk"


def test_reduce_path_is_checked_and_needs_the_tma_mover(fake_cuda, monkeypatch):
    layout, plan, wl, sched = setup()
    with pytest.raises(ValueError, match="reduce_path must be one of hunk, tma, got 'staged'"):
        transport(2, 4, FakeWindow(4, wl["total_bytes"]), layout, wl, reduce_path="staged")
    monkeypatch.setattr(FakeRunner, "mover", "vector")  # an sm_80 device: no bulk copies
    with pytest.raises(ValueError, match=r"reduce_path='tma' .* need sm_90 or newer; device 0 runs the vector mover"):
        transport(2, 4, FakeWindow(4, wl["total_bytes"]), layout, wl, reduce_path="tma")
    assert transport(2, 4, FakeWindow(4, wl["total_bytes"]), layout, wl).reduce_path == "hunk"


def test_reduce_path_is_a_declared_option_fed_from_the_config():
    from ultracomm.dataplane import transport_kwargs
    from ultracomm.env import Config
    from ultracomm.transports.base import OPTIONS

    assert "reduce_path" in OPTIONS and "reduce_path" in tma_mod.TmaTransport.options
    kw = transport_kwargs(tma_mod.TmaTransport, Config(reduce_path="tma", multicast_sms=3, reduce_sms=4), None)
    assert kw["reduce_path"] == "tma" and kw["reduce_sms"] == 4
    kw = transport_kwargs(tma_mod.TmaTransport, Config.from_env({"ULTRACOMM_REDUCE_PATH": "tma"}), None)
    assert kw["reduce_path"] == "tma"
    assert transport_kwargs(tma_mod.TmaTransport, Config(), None)["reduce_path"] == "hunk"


def test_vid_slots_keep_their_plans_and_the_arena_is_sized_at_setup(fake_cuda):
    layout, plan, wl, sched = setup()
    t = transport(2, 4, FakeWindow(4, wl["total_bytes"]), layout, wl, experts_per_rank=1, plan_slots=6)
    # allocated in the constructor, with the bounds the schedule builder keeps to:
    # (experts_per_rank + slots) x chunks tasks, world x slots refs, per op
    (arena,) = fake_cuda.arenas
    assert arena.num_slots == 6 + 8  # vid slots + scratch
    assert arena.bounds == dict(
        nranks=1,
        world=4,
        num_experts=4,
        masters=2,
        slots=2,
        tasks=(3 * wl["weight_chunks"], 3 * wl["grad_chunks"]),
        refs=(8, 8),
    )
    assert t.plan_arena_bytes == 14 * 1000 + 3 * wl["weight_chunks"]
    m = masters_of(layout)
    my, lio = plan.slot_src[2].tolist(), plan.local_index_of.tolist()
    t.run(Op.MULTICAST, sched, 1, m, my, lio, "weight_sync", stream=1, slot=5)
    t.run(Op.MULTICAST, sched, 2, m, my, lio, "restore", stream=1, slot=5)  # the vid's plan: no upload
    t.run(Op.REDUCE, sched, 3, m, my, lio, "grad_reduce", stream=1, slot=5)  # its reduce area: written once
    t.run(Op.MULTICAST, sched, 4, m, my, lio, "weight_sync", stream=1, slot=4)  # another vid: its own slot
    t.run(Op.MULTICAST, sched, 5, m, my, lio, "restore", stream=1, slot=5)  # slot 5 still holds it
    src = np.asarray(plan.slot_src).copy()
    src[0, 1] = -1  # another plan: rank 0 holds no replica
    other = build_schedule(
        ReplicaPlan.make(src, experts_per_rank=1), wl["weight_slot_bytes"], wl["grad_slot_bytes"], chunk_bytes=64
    )
    assert other.digest != sched.digest
    t.run(Op.MULTICAST, other, 6, m, my, lio, "weight_sync", stream=1, slot=5)  # the slot's next vid: rewritten
    got = [(l[5], l[6], l[0] is not None) for l in fake_cuda.runners[0].launches]
    assert got == [(5, 0, True), (5, 0, False), (5, 1, True), (4, 0, True), (5, 0, False), (5, 0, True)]
    with pytest.raises(ValueError, match=r"^ultracomm: plan slot 6 is out of range 0\.\.5 "):
        t.run(Op.MULTICAST, sched, 7, m, my, lio, "weight_sync", stream=1, slot=6)


def record(code, rank, op, epoch, expert=0, chunk=1, slot=0, peer=1, flag_kind=2, observed=0, peer_ready=0):
    return make_error_record(
        code,
        rank,
        op,
        epoch,
        flag_kind=flag_kind,
        expert=expert,
        chunk=chunk,
        slot=slot,
        peer=peer,
        observed=observed,
        peer_ready=peer_ready,
    )


def test_error_record_raises_the_host_executors_exception(fake_cuda):
    layout, plan, wl, sched = setup()
    assert len(record(1, 0, 0, 1)) == _core.ERROR_RECORD_BYTES
    t = transport(1, 4, FakeWindow(4, wl["total_bytes"]), layout, wl)
    m = masters_of(layout)
    t.run(Op.MULTICAST, sched, 7, m, plan.slot_src[1].tolist(), plan.local_index_of.tolist(), "restore", stream=0)
    t.check_error()  # nothing recorded
    raw = record(1, 1, 0, 7)
    fake_cuda.runners[0].errors.append(raw)
    with pytest.raises(ultracomm.UltracommTimeout) as ei:
        t.check_error()
    assert str(ei.value) == _core.format_error(raw, "restore", 3.0)
    assert "rank 1 restore (multicast) epoch 7" in str(ei.value)
    t.check_error()  # raised once
    fake_cuda.runners[0].errors.append(record(4, 1, 0, 8))  # kBadTask: not a timeout
    with pytest.raises(ultracomm.UltracommError) as ei:
        t.check_error()
    assert not isinstance(ei.value, TimeoutError)


def test_loopback_ranks_launch_once_after_the_last_rank(fake_cuda):
    layout, plan, wl, sched = setup()
    shared = {}
    wins = [FakeWindow(4, wl["total_bytes"], loopback=True, shared=shared) for _ in range(4)]
    ts = [transport(r, 4, wins[r], layout, wl, multicast_sms=3 + r) for r in range(4)]
    assert len(fake_cuda.runners) == 1  # one runner for the domain
    ms = [masters_of(layout) for _ in range(4)]
    lio = plan.local_index_of.tolist()
    runner = fake_cuda.runners[0]
    for epoch in (5, 6):
        for i, r in enumerate((2, 0, 3, 1)):  # any order; the last one launches
            assert len(runner.launches) == epoch - 5
            ts[r].run(Op.MULTICAST, sched, epoch, ms[r], plan.slot_src[r].tolist(), lio, "weight_sync", stream=11)
        assert len(runner.launches) == epoch - 4
        p, e, ctas, stream = runner.launches[-1][:4]
        assert e == epoch and ctas == 6 and stream == 11  # the most CTAs any rank asked for
    p = runner.launches[0][0]
    assert [a["rank"] for a in p.ranks] == [0, 1, 2, 3]
    assert [a["master_ptrs"] for a in p.ranks] == [list(m.weight_ptrs) for m in ms]
    assert len(fake_cuda.plans) == 1 and runner.launches[1][0] is None  # the domain's plan written once
    assert len(fake_cuda.arenas) == 1 and fake_cuda.arenas[0].bounds["nranks"] == 4  # one arena, every rank
    # a failure of the shared launch is raised by every rank, once each
    raw = record(1, 2, 0, 6, peer=0)
    runner.errors.append(raw)
    for r in range(4):
        with pytest.raises(ultracomm.UltracommTimeout, match="rank 2 weight_sync"):
            ts[r].check_error()
        ts[r].check_error()


def test_loopback_ranks_from_threads(fake_cuda):
    layout, plan, wl, sched = setup()
    shared = {}
    ts = [None] * 4

    def make(r):
        ts[r] = transport(r, 4, FakeWindow(4, wl["total_bytes"], loopback=True, shared=shared), layout, wl)

    th = [threading.Thread(target=make, args=(r,)) for r in range(4)]
    for x in th:
        x.start()
    for x in th:
        x.join()
    assert len(fake_cuda.runners) == 1 and len({id(t._loopback) for t in ts}) == 1
    assert ts[0]._loopback.runner is fake_cuda.runners[0]
    lio = plan.local_index_of.tolist()
    th = [
        threading.Thread(
            target=ts[r].run,
            args=(Op.REDUCE, sched, 3, masters_of(layout), plan.slot_src[r].tolist(), lio, "grad_reduce", 0),
        )
        for r in range(4)
    ]
    for x in th:
        x.start()
    for x in th:
        x.join()
    assert len(fake_cuda.runners[0].launches) == 1


def test_reject_publishes_in_the_window_and_fails_loopback_peers(fake_cuda):
    layout, plan, wl, sched = setup()
    t = transport(1, 4, FakeWindow(4, wl["total_bytes"]), layout, wl)
    t.reject(Op.MULTICAST, 5, stream=77)
    L = wl
    assert fake_cuda.rejections == [
        (0, 5, t.window.peer_bases[1], L["slots"], L["weight_slot_bytes"], L["grad_slot_bytes"], L["chunk_bytes"], 77)
    ]
    shared = {}
    ts = [transport(r, 4, FakeWindow(4, wl["total_bytes"], loopback=True, shared=shared), layout, wl) for r in range(4)]
    lio = plan.local_index_of.tolist()
    for r in (0, 2):  # submitted before rank 3 rejected: never launched
        ts[r].run(Op.MULTICAST, sched, 6, masters_of(layout), plan.slot_src[r].tolist(), lio, "weight_sync", 0)
    ts[3].reject(Op.MULTICAST, 6, stream=5)
    assert fake_cuda.rejections[-1][:3] == (0, 6, ts[3].window.peer_bases[3])
    assert not fake_cuda.runners[-1].launches
    for r in (0, 1, 2):
        with pytest.raises(ultracomm.PlanError, match="rank 3 rejected its plan"):
            ts[r].check_error()
    ts[3].check_error()  # the rejecting rank raised its own error when it rejected


def test_loopback_launch_failure_reaches_every_rank(fake_cuda):
    layout, plan, wl, sched = setup()
    shared = {}
    ts = [transport(r, 4, FakeWindow(4, wl["total_bytes"], loopback=True, shared=shared), layout, wl) for r in range(4)]

    def refuse(*a, **kw):
        raise ValueError("a loopback launch of 4 ranks x 5 CTAs cannot be co-resident")

    fake_cuda.runners[-1].launch_slot = refuse
    lio = plan.local_index_of.tolist()
    for r in range(3):
        ts[r].run(Op.MULTICAST, sched, 1, masters_of(layout), plan.slot_src[r].tolist(), lio, "weight_sync", 0)
    with pytest.raises(ValueError, match="co-resident"):
        ts[3].run(Op.MULTICAST, sched, 1, masters_of(layout), plan.slot_src[3].tolist(), lio, "weight_sync", 0)
    ts[3].check_error()  # it got the error from run()
    for r in range(3):
        with pytest.raises(ValueError, match="co-resident"):
            ts[r].check_error()
        ts[r].check_error()
