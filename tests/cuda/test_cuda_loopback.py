"""CUDA executor on one GPU (``gpu`` marker; skipped without a device): every rank of a
loopback domain in ONE persistent-kernel launch, compared BIT FOR BIT with the host executor
(``_core.run_host``, one thread per rank) on identical inputs: every window byte (data,
padding, flags, digests) and every master.  Direct, relay and deep trees, world 2..8,
fp32/bf16/fp16, odd member sizes (unaligned segments and tails), 1 and several CTAs per rank,
TMA and forced-vector paths, both reduce paths (reduce_path "hunk": register hunks; "tma": operands
staged in shared memory by bulk copies, sm_90+, its ring wrapped by long segments); a withheld rank
times out with the host executor's words; a CUDA graph replays with fresh epochs."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
import torch

from ultracomm import _core
from ultracomm.records import MASTER, Op, TaskKind
from ultracomm.tools.reference import slot_image, tasks_from_trees

from test_host_executor import layout_members

pytestmark = pytest.mark.gpu

FILL = 0xEE
ESIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}
DIGEST = 0x5EED_0001


def _require_cuda():
    """``ultracomm._cuda`` here; where torch sees a device (else the conftest skips), a missing or
    unusable ``_cuda`` fails (a broken device build must not read as skips; as test_gpu_context's)."""
    from ultracomm.cuda.support import cuda_runtime

    try:
        return cuda_runtime(torch.cuda.current_device(), "the CUDA loopback executor")
    except Exception as e:  # noqa: BLE001 - any missing piece fails a gpu run
        pytest.fail(str(e))


def _require_reduce_path(reduce_path):
    """Skip a reduce_path="tma" case before sm_90 (no bulk copies: the runner refuses it)."""
    if reduce_path == "tma" and torch.cuda.get_device_capability() < (9, 0):
        pytest.skip("reduce_path='tma' needs sm_90+ (bulk copies)")


def _placed(t, misalign, device="cpu"):
    """A copy of ``t`` whose data starts ``misalign`` bytes past an aligned allocation (masters
    at odd addresses drive the copy and reduction down their narrow-unit paths)."""
    nbytes = t.numel() * t.element_size()
    buf = torch.zeros(nbytes + 64, dtype=torch.uint8, device=device)
    out = buf[misalign : misalign + nbytes].view(t.dtype)
    out.copy_(t.to(device))
    return out


class Domain:
    """Initial state of a loopback domain (CPU), run once through the host executor and once
    through the CUDA executor from identical copies."""

    def __init__(
        self, world, slots, w_nbytes, g_elems, chunk, grad_dtype, num_experts, home_of, my_slots, seed=0, misalign=0
    ):
        self.world, self.slots, self.chunk, self.dtype = world, slots, chunk, grad_dtype
        # masters' byte offset from an aligned address: weights any, grads whole elements
        self.mis_w, self.mis_g = misalign, misalign and ESIZE[grad_dtype]
        self.w_off, self.w_bytes, self.wsb = layout_members(w_nbytes)
        self.g_off, self.g_bytes, self.gsb = layout_members([n * ESIZE[grad_dtype] for n in g_elems])
        self.L = _core.window_layout(slots, self.wsb, self.gsb, chunk)
        self.E, self.home_of, self.my_slots = num_experts, list(home_of), [list(s) for s in my_slots]
        g = torch.Generator().manual_seed(seed)
        self.win = []
        for r in range(world):
            w = torch.zeros(self.L["total_bytes"], dtype=torch.uint8)
            w[: self.L["ready_off"]] = FILL
            for s in range(slots):  # replica grads of held slots: random values, special bit patterns too
                if self.my_slots[r][s] >= 0:
                    members = [self._grad(n, g) for n in g_elems]
                    o = self.L["grads_off"] + s * self.L["grad_stride"]
                    w[o : o + self.gsb] = slot_image(members, self.g_off, self.gsb, fill=FILL)
            self.win.append(w)
        self.masters = {
            e: [_placed(torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g), self.mis_w) for n in w_nbytes]
            for e in range(num_experts)
        }
        self.master_grads = {e: [_placed(self._grad(n, g), self.mis_g) for n in g_elems] for e in range(num_experts)}

    def _grad(self, n, g):
        x = (torch.randn(n, generator=g) * 3).to(self.dtype)
        ib = torch.int32 if self.dtype == torch.float32 else torch.int16
        lo, hi = (-(2**31), 2**31) if ib == torch.int32 else (-32768, 32768)
        bits = torch.randint(lo, hi, (n,), dtype=ib, generator=g).view(self.dtype)
        return torch.where(torch.randint(0, 8, (n,), generator=g) == 0, bits, x)  # NaN/inf/subnormals too

    def local(self, r, op, masters, master_grads):
        """(master pointers [local * M + m], local_index_of) of rank r."""
        lidx, ptrs = [-1] * self.E, []
        for i, e in enumerate([e for e in range(self.E) if self.home_of[e] == r]):
            lidx[e] = i
            ptrs.extend(t.data_ptr() for t in (masters[e] if op == Op.MULTICAST else master_grads[e]))
        return ptrs, lidx

    def members(self, op):
        return (self.w_off, self.w_bytes) if op == Op.MULTICAST else (self.g_off, self.g_bytes)

    def run_host(self, op, tasks, refs, epoch, slot_parent, withhold=(), timeout_s=10.0):
        """Every rank in a thread; returns {rank: exception or None}."""
        off, nb = self.members(op)
        errs = {}

        def body(r):
            ptrs, lidx = self.local(r, op, self.masters, self.master_grads)
            try:
                _core.run_host(
                    op=int(op),
                    rank=r,
                    world=self.world,
                    epoch=epoch,
                    slots=self.slots,
                    weight_slot_bytes=self.wsb,
                    grad_slot_bytes=self.gsb,
                    chunk_bytes=self.chunk,
                    window_bases=[w.data_ptr() for w in self.win],
                    member_off=off,
                    member_bytes=nb,
                    master_ptrs=ptrs,
                    local_index_of=lidx,
                    grad_dtype={torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}[self.dtype],
                    my_slots=self.my_slots[r],
                    tasks=tasks[r][:0] if r in withhold else tasks[r],
                    refs=refs[r],
                    num_workers=2,
                    timeout_s=timeout_s,
                    slot_parent=slot_parent[r],
                    digest=DIGEST,
                )
                errs[r] = None
            except Exception as e:  # noqa: BLE001
                errs[r] = e

        th = [threading.Thread(target=body, args=(r,)) for r in range(self.world)]
        for t in th:
            t.start()
        for t in th:
            t.join(120)
        return errs


class GpuCopy:
    """The domain's initial state copied to the GPU, and a CudaLoopback over it."""

    def __init__(self, d: Domain, timeout_s=10.0):
        from ultracomm.cuda.loopback import CudaLoopback

        self.d = d
        self.win = [w.cuda() for w in d.win]
        self.masters = {e: [_placed(t, d.mis_w, "cuda") for t in ts] for e, ts in d.masters.items()}
        self.master_grads = {e: [_placed(t, d.mis_g, "cuda") for t in ts] for e, ts in d.master_grads.items()}
        self.lb = CudaLoopback(d.world, d.L, self.win, timeout_s=timeout_s)

    def plan(self, op, tasks, refs, slot_parent, withhold=()):
        off, nb = self.d.members(op)
        loc = [self.d.local(r, op, self.masters, self.master_grads) for r in range(self.d.world)]
        return self.lb.plan(
            op,
            tasks=tasks,
            refs=refs,
            member_off=off,
            member_bytes=nb,
            master_ptrs=[p for p, _ in loc],
            local_index_of=[li for _, li in loc],
            my_slots=self.d.my_slots,
            grad_dtype=self.d.dtype,
            slot_parent=slot_parent,
            digest=DIGEST,
            withhold=withhold,
        )

    def wait(self, limit_s=60.0):
        """Wait for the stream without hanging the test run if a kernel never finishes."""
        ev = torch.cuda.Event()
        ev.record()
        t0 = time.monotonic()
        while not ev.query():
            assert time.monotonic() - t0 < limit_s, "the persistent kernel did not finish"
            time.sleep(0.001)


def assert_same_bytes(d: Domain, gpu: GpuCopy):
    for r in range(d.world):
        got, want = gpu.win[r].cpu(), d.win[r]
        bad = (got != want).nonzero()
        assert bad.numel() == 0, f"rank {r}: {bad.numel()} window bytes differ, first at {int(bad[0])}"
    for name, host, dev in (("weights", d.masters, gpu.masters), ("grads", d.master_grads, gpu.master_grads)):
        for e in host:
            for m, (h, g) in enumerate(zip(host[e], dev[e])):
                assert torch.equal(h.view(torch.uint8), g.cpu().view(torch.uint8)), f"master {name} {e}/{m} differ"


def run_both(d: Domain, op, tasks, refs, slot_parent, epoch=1, ctas=2, force_vector=False, reduce_path="hunk"):
    gpu = GpuCopy(d)
    plan = gpu.plan(op, tasks, refs, slot_parent)
    gpu.lb.launch(plan, epoch, ctas_per_rank=ctas, force_vector=force_vector, reduce_path=reduce_path)
    gpu.wait()
    gpu.lb.check_error()
    errs = d.run_host(op, tasks, refs, epoch, slot_parent)
    assert all(e is None for e in errs.values()), errs
    assert_same_bytes(d, gpu)
    return gpu


def _parents(world, slots, trees):
    p = [[-1] * slots for _ in range(world)]
    for _e, _home, kids in trees:
        for node, cs in kids.items():
            for r, s in cs:
                p[r][s] = node[0]
    return p


def _slots_of(world, slots, trees):
    my = [[-1] * slots for _ in range(world)]
    for e, _home, kids in trees:
        for cs in kids.values():
            for r, s in cs:
                my[r][s] = e
    return my


# ------------------------------------------------------------------------------------------
# hand-built trees: direct fan-out, relay chains, deep trees, odd member sizes

TREES = {
    "direct": (4, 2, [(0, 0, {(0, MASTER): [(1, 0), (2, 1), (3, 0)]}), (3, 3, {(3, MASTER): [(0, 1), (1, 1)]})]),
    "relay": (
        4,
        2,
        [(0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 1), (3, 0)]}), (2, 2, {(2, MASTER): [(0, 1)], (0, 1): [(1, 1)]})],
    ),
    "deep": (
        8,
        1,
        [
            (
                0,
                0,
                {
                    (0, MASTER): [(1, 0)],
                    (1, 0): [(2, 0)],
                    (2, 0): [(3, 0)],
                    (3, 0): [(4, 0)],
                    (4, 0): [(5, 0), (6, 0)],
                    (6, 0): [(7, 0)],
                },
            )
        ],
    ),
    "two": (2, 1, [(0, 0, {(0, MASTER): [(1, 0)]})]),
}


@pytest.mark.parametrize("shape", sorted(TREES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "ctas,force_vector,misalign,reduce_path",
    [
        (1, False, 0, "hunk"),
        (3, False, 0, "hunk"),
        (2, True, 0, "hunk"),
        (2, False, 3, "hunk"),
        # the TMA-staged reduce: 1 and several CTAs; misaligned masters fall back to the hunks
        (1, False, 0, "tma"),
        (3, False, 0, "tma"),
        (2, False, 3, "tma"),
    ],
)
def test_trees_bit_exact_with_host_executor(shape, dtype, ctas, force_vector, misalign, reduce_path):
    _require_cuda()
    _require_reduce_path(reduce_path)
    world, slots, trees = TREES[shape]
    E = world
    # odd members: bulk bodies with byte tails (1000, 333), vector-only (7), several chunks (40000);
    # misaligned masters: no bulk copy, 1-byte units / scalar reduction
    d = Domain(
        world,
        slots,
        [1000, 333, 7, 64, 40000],
        [250, 83, 3, 9000],
        chunk=4096,
        grad_dtype=dtype,
        num_experts=E,
        home_of=list(range(E)),
        my_slots=_slots_of(world, slots, trees),
        seed=sorted(TREES).index(shape),
        misalign=misalign,
    )
    parent = _parents(world, slots, trees)
    for op, kind in ((Op.MULTICAST, TaskKind.COPY), (Op.REDUCE, TaskKind.REDUCE)):
        slot_bytes = d.wsb if op == Op.MULTICAST else d.gsb
        tasks, refs = tasks_from_trees(world, trees, slot_bytes, d.chunk, kind)
        run_both(
            d, op, tasks, refs, parent, epoch=1 + int(op), ctas=ctas, force_vector=force_vector, reduce_path=reduce_path
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("k,ctas", [(2, 1), (5, 3), (7, 2)])
@pytest.mark.parametrize("reduce_path", ["hunk", "tma"])
def test_long_reduce_segments_bit_exact(dtype, k, ctas, reduce_path):
    """A home reducing k replicas (direct fan-in) over 64 KiB tiles of 256 KiB chunks: the staged
    reduce's 8 KiB sub-tiles x (k + 1) operands run many fills through its ring, wrapping it (six
    stages, three where two CTAs share an SM), fills straddling sub-tiles when k + 1 is odd; odd
    member sizes leave short last sub-tiles and element tails; NaN/inf/subnormal inputs."""
    _require_cuda()
    _require_reduce_path(reduce_path)
    world = k + 1
    trees = [(0, 0, {(0, MASTER): [(r, 0) for r in range(1, world)]})]
    d = Domain(
        world,
        1,
        [64],
        [70001 * 4 // ESIZE[dtype], 16411],
        chunk=256 * 1024,
        grad_dtype=dtype,
        num_experts=1,
        home_of=[0],
        my_slots=_slots_of(world, 1, trees),
        seed=k,
    )
    parent = _parents(world, 1, trees)
    tasks, refs = tasks_from_trees(world, trees, d.gsb, d.chunk, TaskKind.REDUCE)
    run_both(d, Op.REDUCE, tasks, refs, parent, epoch=1, ctas=ctas, reduce_path=reduce_path)


# ------------------------------------------------------------------------------------------
# schedules from the builder: random plans, world 2..8, direct / auto / forced relay trees


def _random_plan(world, slots, experts, rng):
    from types import SimpleNamespace

    home_of = [e % world for e in range(experts)]
    slot_src = np.full((world, slots), -1, np.int32)
    hot = [0, 1]
    for r in range(world):
        for s in range(slots):
            cands = [e for e in hot if home_of[e] != r and e not in slot_src[r]]
            cands += [e for e in range(experts) if home_of[e] != r and e not in slot_src[r] and rng.random() < 0.3]
            if cands and rng.random() < 0.9:
                slot_src[r, s] = rng.choice(cands)
    return SimpleNamespace(
        world=world,
        slots_per_rank=slots,
        num_experts=experts,
        slot_src=slot_src,
        home_of=np.array(home_of, dtype=np.int32),
    )


@pytest.mark.parametrize(
    "world,relay_mode,dtype,reduce_path",
    [
        (2, "off", torch.float32, "hunk"),
        (3, "auto", torch.bfloat16, "hunk"),
        (5, "force", torch.float16, "hunk"),
        (8, "force", torch.bfloat16, "hunk"),
        (8, "off", torch.float32, "hunk"),
        (6, "auto", torch.float32, "hunk"),
        (3, "auto", torch.bfloat16, "tma"),
        (5, "force", torch.float16, "tma"),
        (8, "off", torch.float32, "tma"),
    ],
)
def test_builder_schedules_bit_exact(world, relay_mode, dtype, reduce_path):
    _require_cuda()
    _require_reduce_path(reduce_path)
    from ultracomm.schedule import build_schedule

    rng = np.random.default_rng(world * 7 + len(relay_mode))
    slots, experts = 3, 2 * world
    plan = _random_plan(world, slots, experts, rng)
    d = Domain(
        world,
        slots,
        [70001, 913, 13],
        [17501, 45, 6],
        chunk=8192,
        grad_dtype=dtype,
        num_experts=experts,
        home_of=[int(h) for h in plan.home_of],
        my_slots=plan.slot_src.tolist(),
        seed=world,
    )
    sch = build_schedule(plan, d.wsb, d.gsb, chunk_bytes=d.chunk, relay_mode=relay_mode)
    for op in (Op.MULTICAST, Op.REDUCE):
        tasks = [sch.tasks(op, r) for r in range(world)]
        refs = [sch.refs(op, r) for r in range(world)]
        parent = [[int(p) for p in row] for row in sch.tree(op)[0]]
        run_both(d, op, tasks, refs, parent, epoch=1 + int(op), ctas=2, reduce_path=reduce_path)


# ------------------------------------------------------------------------------------------
# failures and CUDA graphs


def test_withheld_rank_times_out_then_next_epoch_runs():
    _require_cuda()
    world, slots, trees = TREES["relay"]
    d = Domain(
        world,
        slots,
        [5000],
        [1000],
        chunk=1024,
        grad_dtype=torch.float32,
        num_experts=world,
        home_of=list(range(world)),
        my_slots=_slots_of(world, slots, trees),
    )
    parent = _parents(world, slots, trees)
    tasks, refs = tasks_from_trees(world, trees, d.wsb, d.chunk, TaskKind.COPY)
    gpu = GpuCopy(d, timeout_s=0.5)
    # rank 1 relays expert 0 to ranks 2 and 3: without its tasks they never get the data
    held = gpu.plan(Op.MULTICAST, tasks, refs, parent, withhold=(1,))
    t0 = time.monotonic()
    gpu.lb.launch(held, 1, ctas_per_rank=2, op_name="restore")
    gpu.wait(limit_s=30)
    assert time.monotonic() - t0 < 20, "every CTA must stop soon after the first timeout"
    with pytest.raises(TimeoutError) as ei:  # UltracommTimeout
        gpu.lb.check_error()
    import ultracomm

    assert isinstance(ei.value, ultracomm.UltracommTimeout)
    msg = str(ei.value)
    assert "restore (multicast) epoch 1 timed out after 0.5 s waiting for" in msg, msg
    assert "rank 1" in msg, msg  # the rank that never delivered
    gpu.lb.check_error()  # reported once
    # the host executor words the same wait the same way
    errs = d.run_host(Op.MULTICAST, tasks, refs, 1, parent, withhold=(1,), timeout_s=0.5)
    host_msgs = {str(e) for e in errs.values() if e is not None}
    assert host_msgs and all("rank 1" in m for m in host_msgs), host_msgs
    # the next launch (larger epoch) runs normally over the same state
    full = gpu.plan(Op.MULTICAST, tasks, refs, parent)
    gpu.lb.launch(full, 2, ctas_per_rank=2)
    gpu.wait()
    gpu.lb.check_error()
    for r in range(world):
        for s in range(slots):
            e = d.my_slots[r][s]
            if e >= 0:
                o = d.L["weights_off"] + s * d.L["weight_stride"]
                assert torch.equal(gpu.win[r][o : o + 5000].cpu(), d.masters[e][0]), (r, s)


def test_cuda_graph_capture_and_replay_runs_fresh_epochs():
    _require_cuda()
    world, slots, trees = TREES["relay"]
    d = Domain(
        world,
        slots,
        [3000, 77],
        [500],
        chunk=1024,
        grad_dtype=torch.float32,
        num_experts=world,
        home_of=list(range(world)),
        my_slots=_slots_of(world, slots, trees),
    )
    parent = _parents(world, slots, trees)
    tasks, refs = tasks_from_trees(world, trees, d.wsb, d.chunk, TaskKind.COPY)
    gpu = GpuCopy(d)
    plan = gpu.plan(Op.MULTICAST, tasks, refs, parent)  # uploaded before capture
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.stream(side):
        with torch.cuda.graph(graph, stream=side):
            gpu.lb.launch(plan, 1, ctas_per_rank=2, stream=side.cuda_stream)
    torch.cuda.synchronize()
    ready = d.L["ready_off"] + 8 * int(Op.MULTICAST)
    for it in range(1, 4):
        for e in gpu.masters:
            for t in gpu.masters[e]:
                t.random_(0, 256)
        graph.replay()
        torch.cuda.synchronize()
        gpu.lb.check_error()
        for r in range(world):  # the replay ran epoch it on every rank
            assert int(gpu.win[r][ready : ready + 8].cpu().view(torch.int64)) == it
            for s in range(slots):
                e = d.my_slots[r][s]
                if e >= 0:
                    for m, (off, nb) in enumerate(zip(d.w_off, d.w_bytes)):
                        o = d.L["weights_off"] + s * d.L["weight_stride"] + off
                        assert torch.equal(gpu.win[r][o : o + nb], gpu.masters[e][m]), (it, r, s, m)


def _two_ranks(nbytes, chunk):
    """A two-rank domain (expert 0 copied to rank 1), its multicast tasks and parents."""
    world, slots, trees = TREES["two"]
    d = Domain(
        world,
        slots,
        [nbytes],
        [nbytes // 4],
        chunk=chunk,
        grad_dtype=torch.float32,
        num_experts=world,
        home_of=list(range(world)),
        my_slots=_slots_of(world, slots, trees),
    )
    tasks, refs = tasks_from_trees(world, trees, d.wsb, d.chunk, TaskKind.COPY)
    return d, tasks, refs, _parents(world, slots, trees)


def test_loopback_refuses_a_grid_that_cannot_be_coresident():
    # the multicast has tasks on rank 0 only: rank 1 gets one CTA, rank 0 all the others
    _require_cuda()
    d, tasks, refs, parent = _two_ranks(64, 64)
    gpu = GpuCopy(d)
    plan = gpu.plan(Op.MULTICAST, tasks, refs, parent)
    top = gpu.lb.max_ctas_per_rank(plan)
    assert top == gpu.lb.runner.max_coresident(0) - 1 and gpu.lb.launch_ctas(plan, top) == [top, 1]
    with pytest.raises(
        ValueError, match=r"2 ranks \(1 with tasks x \d+ CTAs, 1 without x 1 CTA\).*cannot be co-resident"
    ):
        gpu.lb.launch(plan, 1, ctas_per_rank=top + 1)


@pytest.mark.parametrize(  # reduce_path only changes reductions: multicast runs once
    ("op", "reduce_path"), [(Op.MULTICAST, "hunk"), (Op.REDUCE, "hunk"), (Op.REDUCE, "tma")]
)
@pytest.mark.parametrize("grid", ["sms", "past_sms", "coresident"])
def test_busy_rank_with_many_ctas_idle_ranks_with_one_bit_exact(op, grid, reduce_path):
    """A home pushing to / pulling from k = 3 replicas (tasks on rank 0 only): rank 0 runs many CTAs,
    each replica one (join and drain), so the last of rank 0's CTAs out of run_tasks must count
    rank 0's own CTAs before it drains.  Grids: exactly the SM count (deep TMA ring), one past it
    (the shared ring), every co-resident CTA; bit-exact with the host executor."""
    _require_cuda()
    _require_reduce_path(reduce_path)
    world, dtype = 4, torch.float32
    trees = [(0, 0, {(0, MASTER): [(r, 0) for r in range(1, world)]})]
    d = Domain(
        world,
        1,
        [300001, 16411],
        [70001, 16411],
        chunk=256 * 1024,
        grad_dtype=dtype,
        num_experts=1,
        home_of=[0],
        my_slots=_slots_of(world, 1, trees),
        seed=7,
    )
    parent = _parents(world, 1, trees)
    kind = TaskKind.COPY if op == Op.MULTICAST else TaskKind.REDUCE
    tasks, refs = tasks_from_trees(world, trees, d.wsb if op == Op.MULTICAST else d.gsb, d.chunk, kind)
    assert [len(t) > 0 for t in tasks] == [True, False, False, False]
    gpu = GpuCopy(d)
    plan = gpu.plan(op, tasks, refs, parent)
    sms = gpu.lb.runner.sm_count
    ctas = {"sms": sms - (world - 1), "past_sms": sms - (world - 1) + 1, "coresident": gpu.lb.max_ctas_per_rank(plan)}[
        grid
    ]
    assert gpu.lb.launch_ctas(plan, ctas) == [ctas, 1, 1, 1]
    gpu.lb.launch(plan, 1, ctas_per_rank=ctas, reduce_path=reduce_path)
    gpu.wait()
    gpu.lb.check_error()
    errs = d.run_host(op, tasks, refs, 1, parent)
    assert all(e is None for e in errs.values()), errs
    assert_same_bytes(d, gpu)


def test_plan_validation_rejects_bad_tasks_before_anything_moves():
    _require_cuda()
    d, tasks, refs, parent = _two_ranks(256, 128)
    tasks[0] = tasks[0].copy()
    tasks[0]["chunk"][0] = 99  # one past any chunk
    gpu = GpuCopy(d)
    before = [w.cpu() for w in gpu.win]
    with pytest.raises(ValueError, match="chunk 99 out of range"):
        gpu.plan(Op.MULTICAST, tasks, refs, parent)
    for w, b in zip(gpu.win, before):
        assert torch.equal(w.cpu(), b)


def test_flag_pingpong_and_empty_launch():
    _cuda = _require_cuda()
    flags = torch.zeros(64, dtype=torch.int64, device="cuda")
    out = torch.zeros(2, dtype=torch.int64, device="cuda")
    s = torch.cuda.current_stream().cuda_stream
    _cuda.launch_empty(s)
    _cuda.flag_pingpong(flags.data_ptr(), flags.data_ptr() + 256, 0, 1000, int(5e9), out.data_ptr(), s)
    torch.cuda.synchronize()
    assert int(out[1]) == 0 and int(out[0]) > 0
    assert int(flags[0]) == 1000 and int(flags[32]) == 1000
