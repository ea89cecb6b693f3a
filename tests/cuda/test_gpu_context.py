"""Context end to end with transport="tma" on a one-GPU loopback domain (cuda_local), against the
host transport on the same plan and inputs; CUDA graph capture and replay; a timeout at wait().

Device-only (``gpu`` marker).  With tma, operations take no collective, so one thread drives
every loopback rank on one stream (``for ctx in ctxs: ctx.weight_sync(...)``); the transport
launches all loopback ranks together once the last rank has enqueued.  The host reference
runs the same plan on ``local`` windows with ranks as threads.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ultracomm
from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.cuda.support import cuda_module_reason
from ultracomm.schedule import build_schedule

from conftest import expected_master_grads, expert_weights, random_slot_src

pytestmark = pytest.mark.gpu

DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}


@pytest.fixture(autouse=True)
def need_tma():
    why = cuda_module_reason()
    if why:  # a GPU machine must have built _cuda: this is a failure, not a skip
        pytest.fail(why)


def layout_of(dtype) -> ExpertLayout:
    # per-expert rows of 16-byte multiples (tma registration); fc2 has a tail inside its chunk
    return ExpertLayout((Member("fc1", (40, 24), dtype), Member("fc2", (56,), dtype)), grad_dtype=dtype)


def masters(layout, rank: int, epr: int, device):
    per = [expert_weights(layout, e) for e in range(rank * epr, (rank + 1) * epr)]
    w = [torch.stack([p[m] for p in per]).contiguous().to(device) for m in range(len(layout.members))]
    g = [torch.zeros((epr, *m.shape), dtype=layout.grad_dtype, device=device) for m in layout.members]
    return w, g


def make(world, layout, epr, slots, transport, **kw):
    opts = dict(relay_mode="off", chunk_bytes=1024, tile_bytes=256, timeout_s=20.0)
    opts.update(kw)
    if transport == "tma":
        opts.update(transport="tma", window="cuda_local", device="cuda:0")
    else:
        opts.update(transport="host", window="local", num_workers=2)
    ctxs = LoopbackDomain(world).run(lambda g: Context(g, layout, epr, slots, num_layers=1, **opts))
    dev = "cuda:0" if transport == "tma" else "cpu"
    regs = [masters(layout, c.rank, epr, dev) for c in ctxs]
    for c, (w, g) in zip(ctxs, regs):
        c.register_masters(0, w, g)
    return ctxs, regs


def seeded_grads(layout, world, epr, slots, seed):
    gen = torch.Generator().manual_seed(seed)
    master = [
        [torch.randn((epr, *m.shape), generator=gen).to(layout.grad_dtype) for m in layout.members]
        for _ in range(world)
    ]
    replica = [
        [torch.randn((slots, *m.shape), generator=gen).to(layout.grad_dtype) for m in layout.members]
        for _ in range(world)
    ]
    return master, replica


def load_grads(ctxs, regs, master, replica):
    for c, (_, g) in zip(ctxs, regs):
        for m in range(len(g)):
            g[m].copy_(master[c.rank][m])
            c.replica_grads[m].copy_(replica[c.rank][m])


def fresh_inputs(ctxs, regs, layout, epr, slots, k, seed):
    """Before replay ``k``: master weights ``10 k + rank + member + 1``, replica slots zeroed, seeded
    grads loaded; returns ``(master, replica)`` grads as seeded_grads."""
    for c, (w, _) in zip(ctxs, regs):
        for m in range(len(w)):
            w[m].copy_(torch.full_like(w[m], float(10 * k + c.rank + m + 1)))
        for t in c.replica_weights:
            t.zero_()
    master, replica = seeded_grads(layout, len(ctxs), epr, slots, seed=seed)
    load_grads(ctxs, regs, master, replica)
    return master, replica


def bits(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().cpu()
    return t.view(torch.int16) if t.element_size() == 2 else t.view(torch.int32)


@pytest.mark.parametrize("dtype", sorted(DTYPES))
@pytest.mark.parametrize("mode", ["off", "force"])
def test_tma_matches_host_bit_for_bit(dtype, mode):
    world, epr, slots = 4, 2, 2
    layout = layout_of(DTYPES[dtype])
    plan = ReplicaPlan.make(
        random_slot_src(np.random.default_rng(5), world, slots, epr, fill=1.0), experts_per_rank=epr
    )
    master, replica = seeded_grads(layout, world, epr, slots, seed=9)

    hosts, hregs = make(world, layout, epr, slots, "host", relay_mode=mode)

    def host_body(group):
        c = hosts[group.rank]
        vid = c.begin(0)
        c.weight_sync(vid, plan)
        w = [t.clone() for t in c.replica_weights]
        load_grads([c], [hregs[group.rank]], master, replica)
        group.barrier()
        c.grad_reduce(vid)
        return w, [t.clone() for t in hregs[group.rank][1]], [t.clone() for t in c.replica_grads]

    host = LoopbackDomain(world).run(host_body)
    for c in hosts:
        c.close()

    ctxs, regs = make(world, layout, epr, slots, "tma", relay_mode=mode)
    vids = [c.begin(0) for c in ctxs]
    for c, v in zip(ctxs, vids):
        assert c.weight_sync(v, plan) is None  # enqueued on the current stream
    for c in ctxs:
        c.synchronize()
    for c in ctxs:
        for m, t in enumerate(c.replica_weights):
            assert torch.equal(bits(t), bits(host[c.rank][0][m])), f"weight_sync rank {c.rank} member {m}"
        for t in c.replica_weights:
            t.zero_()
    works = [c.restore(v, async_op=True) for c, v in zip(ctxs, vids)]
    for w in works:
        assert isinstance(w, ultracomm.Work)
        w.wait()
    for c in ctxs:
        for m, t in enumerate(c.replica_weights):
            assert torch.equal(bits(t), bits(host[c.rank][0][m])), f"restore rank {c.rank} member {m}"
    load_grads(ctxs, regs, master, replica)
    for c, v in zip(ctxs, vids):
        c.grad_reduce(v)
    for c in ctxs:
        c.synchronize()
    for c, (_, g) in zip(ctxs, regs):
        for m in range(len(g)):
            assert torch.equal(bits(g[m]), bits(host[c.rank][1][m])), f"master grad rank {c.rank} member {m}"
            assert torch.equal(bits(c.replica_grads[m]), bits(host[c.rank][2][m])), f"relay partials rank {c.rank}"
    for c in ctxs:
        c.close()


def test_cuda_graph_capture_and_replay():
    world, epr, slots = 3, 1, 2
    layout = layout_of(torch.float32)
    plan = ReplicaPlan.make(np.array([[1, 2], [0, 2], [0, 1]], np.int32), experts_per_rank=epr)
    full = build_schedule(plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=1024, relay_mode="off")
    ctxs, regs = make(world, layout, epr, slots, "tma")
    warm = [c.begin(0) for c in ctxs]  # first run of the plan: task lists are uploaded here, not in capture
    for c, v in zip(ctxs, warm):
        c.weight_sync(v, plan)
    for c, v in zip(ctxs, warm):
        c.grad_reduce(v)
    for c in ctxs:
        c.synchronize()

    graph = torch.cuda.CUDAGraph()
    vids = [c.begin(0) for c in ctxs]
    with torch.cuda.graph(graph):
        for c, v in zip(ctxs, vids):
            c.weight_sync(v, plan)
        for c, v in zip(ctxs, vids):
            c.restore(v)
        for c, v in zip(ctxs, vids):
            c.grad_reduce(v)

    for replay in range(2):  # fresh inputs each time: a replay that reused an old epoch would see stale flags
        master, replica = fresh_inputs(ctxs, regs, layout, epr, slots, replay, seed=100 + replay)
        want = expected_master_grads(full, layout, plan, master, replica)
        graph.replay()
        for c in ctxs:
            c.synchronize()
        for c in ctxs:
            for s, e in enumerate(plan.slot_src[c.rank].tolist()):
                home = e // epr
                for m, t in enumerate(c.replica_weights):
                    assert torch.equal(t[s].cpu(), regs[home][0][m][e % epr].cpu()), f"replay {replay} rank {c.rank}"
            for m, g in enumerate(regs[c.rank][1]):
                assert torch.equal(bits(g), bits(want[c.rank][m])), f"replay {replay} rank {c.rank} grads"
    for c in ctxs:
        c.close()


def test_a_captured_weight_sync_replays_the_plan_its_vid_slot_holds():
    # plan arena (issue 19 item 5): the kernel reads its vid slot's plan at a fixed address, so a
    # replay runs whatever was written into the slot last -- here an eager weight_sync of the next
    # vid in the slot, with another plan, after the capture
    world, epr, slots = 3, 1, 2
    layout = layout_of(torch.float32)
    plan_a = ReplicaPlan.make(np.array([[1, 2], [0, 2], [0, 1]], np.int32), experts_per_rank=epr)
    plan_b = ReplicaPlan.make(np.array([[2, 1], [2, 0], [1, -1]], np.int32), experts_per_rank=epr)
    ctxs, regs = make(world, layout, epr, slots, "tma")
    assert len({c.plan_arena_bytes() for c in ctxs}) == 1 and ctxs[0].plan_arena_bytes() > 0
    warm = [c.begin(0) for c in ctxs]
    for c, v in zip(ctxs, warm):
        c.weight_sync(v, plan_a)  # slot 0 holds plan A: the capture below uploads nothing
    for c, v in zip(ctxs, warm):
        c.end(v)
    graph = torch.cuda.CUDAGraph()
    vids = [c.begin(0) for c in ctxs]
    with torch.cuda.graph(graph):
        for c, v in zip(ctxs, vids):
            c.weight_sync(v, plan_a)
    for c, v in zip(ctxs, vids):
        c.end(v)
    nxt = [c.begin(0) for c in ctxs]
    for c, v in zip(ctxs, nxt):
        c.weight_sync(v, plan_b)  # eager: writes plan B into slot 0
    for c in ctxs:
        c.synchronize()
        for t in c.replica_weights:
            t.zero_()
    graph.replay()
    for c in ctxs:
        c.synchronize()
    for c in ctxs:
        for s, e in enumerate(plan_b.slot_src[c.rank].tolist()):
            for m, t in enumerate(c.replica_weights):
                want = regs[e // epr][0][m][e % epr] if e >= 0 else torch.zeros_like(t[s])
                assert torch.equal(t[s].cpu(), want.cpu()), f"rank {c.rank} slot {s} member {m}"
    for c in ctxs:
        c.close()


def test_async_op_refused_while_capturing():
    layout = layout_of(torch.float32)
    plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)
    ctxs, _ = make(2, layout, 1, 1, "tma")
    vids = [c.begin(0) for c in ctxs]
    for c, v in zip(ctxs, vids):
        c.weight_sync(v, plan)
    for c in ctxs:
        c.synchronize()
    graph = torch.cuda.CUDAGraph()
    with pytest.raises(ultracomm.UltracommError, match="async_op=True inside CUDA graph capture"):
        with torch.cuda.graph(graph):
            ctxs[0].restore(vids[0], async_op=True)
    for c in ctxs:
        c.close()


class WithheldTasks:
    """A schedule whose task lists are empty (same digest, trees and refs): the rank joins and drains
    but moves nothing."""

    def __init__(self, schedule):
        self._schedule = schedule

    def __getattr__(self, name):
        return getattr(self._schedule, name)

    def tasks(self, op, rank):
        return self._schedule.tasks(op, rank)[:0]


def withhold_tasks(ctx) -> None:
    """``ctx``'s rank joins its operations but moves nothing: the schedules its operations run have
    empty task lists.  Patched where weight_sync builds them (the Context's schedule cache, which
    ``Context.schedule_for`` only looks up: patching that method withholds nothing)."""
    get = ctx._schedules.get
    ctx._schedules.get = lambda plan, key=None, builder=None: WithheldTasks(get(plan, key, builder))


def test_timeout_surfaces_at_wait():
    check_timeout_surfaces_at_wait("tma")


def check_timeout_surfaces_at_wait(transport: str) -> None:
    """A withheld home: the waiting rank's Work raises UltracommTimeout, its Context refuses later
    operations.  ``transport``: "tma" here; tests/cuda/test_gpu_paths_cpu.py runs it on "host"."""
    layout = layout_of(torch.float32)
    plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)
    ctxs, _ = make(2, layout, 1, 1, transport, timeout_s=1.0)
    vids = [c.begin(0) for c in ctxs]
    # the home (rank 0) joins but its copy tasks are withheld: rank 1 waits for chunks that never come
    withhold_tasks(ctxs[0])
    works = [c.weight_sync(v, plan, async_op=True) for c, v in zip(ctxs, vids)]
    failed = []
    for r, w in enumerate(works):
        try:
            w.wait()
        except TimeoutError as e:
            failed.append((r, e))
    assert failed, "no rank timed out"
    r, err = failed[0]
    assert isinstance(err, ultracomm.UltracommTimeout)
    assert "weight_sync" in str(err) and "rank" in str(err)
    # the home joined and is alive: named by evidence (issue 35; on tma by StreamOrdered, on the host
    # transport by the executor's caller), never called stopped, and no guess of who stopped
    assert "; by evidence, stopped: ranks [];" in str(err) and "likely" not in str(err), str(err)
    with pytest.raises(ultracomm.UltracommError, match="failed earlier"):
        ctxs[r].restore(vids[r])  # a failed Context refuses further operations
    for c in ctxs:
        c.close()


def test_register_masters_checks_device_and_alignment():
    layout = layout_of(torch.bfloat16)
    ctxs, _ = make(1, layout, 1, 1, "tma")
    c = ctxs[0]
    w = [torch.zeros((1, *m.shape), dtype=m.dtype) for m in layout.members]
    g = [torch.zeros((1, *m.shape), dtype=layout.grad_dtype) for m in layout.members]
    with pytest.raises(ultracomm.RegistrationError, match=r"is on cpu, but this Context's window is on cuda:0"):
        c.register_masters(0, w, g)
    big = torch.zeros(1 + 40 * 24, dtype=torch.bfloat16, device="cuda:0")
    shifted = [big[1:].view(1, 40, 24), torch.zeros((1, 56), dtype=torch.bfloat16, device="cuda:0")]
    gg = [t.to("cuda:0") for t in g]
    with pytest.raises(ultracomm.RegistrationError, match="16-byte aligned|aligned to 16 bytes"):
        c.register_masters(0, shifted, gg)
    c.close()
