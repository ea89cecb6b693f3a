"""Host executor: several ranks as Python threads in one process over torch uint8 windows.

Schedules here are hand-built (trees -> task lists) so the executor is tested on its own;
tests at the end use ultracomm.schedule.build_schedule when it is available.
"""

from __future__ import annotations

import re
import threading
import time

import numpy as np
import pytest
import torch

from ultracomm import _core
from ultracomm.records import MASTER, Op, TaskKind
from ultracomm.tools.reference import (
    tasks_from_trees as build_tasks,
    member_mask,
    reference_multicast,
    reference_reduce,
    slot_image,
)

FILL = 0xEE  # data regions start with this byte: padding must keep it
DT_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
ESIZE = {torch.float32: 4, torch.bfloat16: 2, torch.float16: 2}


def layout_members(nbytes, align=16):
    off, offs = 0, []
    for n in nbytes:
        off = (off + align - 1) // align * align
        offs.append(off)
        off += n
    return offs, list(nbytes), (off + align - 1) // align * align


# ------------------------------------------------------------------------------------------
# hand-built schedules from trees


def slots_of(world, slots, trees):
    my = [[-1] * slots for _ in range(world)]
    for expert, _home, children in trees:
        for kids in children.values():
            for r, s in kids:
                my[r][s] = expert
    return my


class Cluster:
    """`world` windows (torch uint8), per-rank masters, and a threaded runner."""

    def __init__(
        self,
        world,
        slots,
        member_nbytes,
        grad_member_nbytes=None,
        chunk=256,
        num_experts=None,
        home_of=None,
        grad_dtype=torch.float32,
        seed=0,
    ):
        self.world, self.slots, self.chunk = world, slots, chunk
        self.w_off, self.w_bytes, self.wsb = layout_members(member_nbytes)
        gm = grad_member_nbytes if grad_member_nbytes is not None else member_nbytes
        self.g_off, self.g_bytes, self.gsb = layout_members(gm)
        self.L = _core.window_layout(slots, self.wsb, self.gsb, chunk)
        self.win = [torch.zeros(self.L["total_bytes"], dtype=torch.uint8) for _ in range(world)]
        for w in self.win:
            w[: self.L["ready_off"]] = FILL
        self.E = num_experts if num_experts is not None else world
        self.home_of = home_of if home_of is not None else [e % world for e in range(self.E)]
        self.grad_dtype = grad_dtype
        g = torch.Generator().manual_seed(seed)
        self.masters = {
            e: [torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g) for n in member_nbytes]
            for e in range(self.E)
        }
        self.master_grads = {e: [self._rand_grad(n // ESIZE[grad_dtype], g) for n in gm] for e in range(self.E)}
        self.epoch = 0

    def _rand_grad(self, n, g):
        if self.grad_dtype == torch.float32:
            return torch.randn(n, generator=g)
        # mostly ordinary values (rounding of every sum matters), one in 8 a random bit pattern:
        # NaN, inf, subnormals, overflowing sums
        x = (torch.randn(n, generator=g) * 3).to(self.grad_dtype)
        bits = torch.randint(-32768, 32768, (n,), dtype=torch.int16, generator=g).view(self.grad_dtype)
        pick = torch.randint(0, 8, (n,), generator=g) == 0
        return torch.where(pick, bits, x)

    def random_replica_grads(self, my_slots, seed):
        """Random grads into every filled replica slot (padding = FILL); returns the slot images
        per rank and a copy of the master grads, the initial state of a reduce."""
        g = torch.Generator().manual_seed(seed)
        for r in range(self.world):
            for s in range(self.slots):
                if my_slots[r][s] >= 0:
                    members = [self._rand_grad(n // ESIZE[self.grad_dtype], g) for n in self.g_bytes]
                    self.grad_slot(r, s).copy_(slot_image(members, self.g_off, self.gsb, fill=FILL))
        return (
            [self.grad_slots(r).clone() for r in range(self.world)],
            {e: [t.clone() for t in ms] for e, ms in self.master_grads.items()},
        )

    def weight_slot(self, r, s):
        o = self.L["weights_off"] + s * self.L["weight_stride"]
        return self.win[r][o : o + self.wsb]

    def grad_slot(self, r, s):
        o = self.L["grads_off"] + s * self.L["grad_stride"]
        return self.win[r][o : o + self.gsb]

    def grad_slots(self, r):
        return torch.stack([self.grad_slot(r, s) for s in range(self.slots)])

    def local(self, r, op):
        mine = [e for e in range(self.E) if self.home_of[e] == r]
        lidx = [-1] * self.E
        ptrs = []
        for i, e in enumerate(mine):
            lidx[e] = i
            src = self.masters[e] if op == Op.MULTICAST else self.master_grads[e]
            ptrs.extend(t.data_ptr() for t in src)
        return ptrs, lidx

    def args(self, op, r, tasks, refs, my_slots, epoch, **kw):
        ptrs, lidx = self.local(r, op)
        mc = op == Op.MULTICAST
        a = dict(
            op=int(op),
            rank=r,
            world=self.world,
            epoch=epoch,
            slots=self.slots,
            weight_slot_bytes=self.wsb,
            grad_slot_bytes=self.gsb,
            chunk_bytes=self.chunk,
            window_bases=[w.data_ptr() for w in self.win],
            member_off=self.w_off if mc else self.g_off,
            member_bytes=self.w_bytes if mc else self.g_bytes,
            master_ptrs=ptrs,
            local_index_of=lidx,
            grad_dtype=DT_CODE[self.grad_dtype],
            my_slots=my_slots[r],
            tasks=tasks[r],
            refs=refs[r],
            num_workers=3,
            timeout_s=10.0,
        )
        a.update(kw)
        return a

    def run(self, op, tasks, refs, my_slots, ranks=None, epoch=None, per_rank=None, **kw):
        """Runs the given ranks as threads; returns {rank: exception or None}."""
        if epoch is None:
            self.epoch += 1
            epoch = self.epoch
        ranks = range(self.world) if ranks is None else ranks
        errs = {}

        def body(r):
            try:
                extra = dict(kw)
                if per_rank:
                    extra.update(per_rank(r))
                _core.run_host(**self.args(op, r, tasks, refs, my_slots, epoch, **extra))
                errs[r] = None
            except Exception as e:  # noqa: BLE001
                errs[r] = e

        th = [threading.Thread(target=body, args=(r,)) for r in ranks]
        for t in th:
            t.start()
        for t in th:
            t.join(60)
            assert not t.is_alive(), "run_host hung"
        return errs


def ok(errs):
    bad = {r: e for r, e in errs.items() if e is not None}
    assert not bad, bad


def check_multicast(cl, my_slots):
    expect = reference_multicast(my_slots, cl.masters, cl.w_off, cl.wsb)
    mask = member_mask(cl.w_off, cl.w_bytes, cl.wsb)
    for r in range(cl.world):
        for s in range(cl.slots):
            got = cl.weight_slot(r, s)
            if my_slots[r][s] >= 0:
                assert torch.equal(got[mask], expect[r][s][mask]), (r, s)
                assert bool((got[~mask] == FILL).all()), f"padding of rank {r} slot {s} written"
            else:
                assert bool((got == FILL).all()), f"empty slot {r}/{s} written"


# ------------------------------------------------------------------------------------------
# multicast


def test_window_layout_fields():
    L = _core.window_layout(3, 1000, 500, 256)
    for k in (
        "slots",
        "weight_slot_bytes",
        "grad_slot_bytes",
        "chunk_bytes",
        "weight_stride",
        "grad_stride",
        "weight_chunks",
        "grad_chunks",
        "weights_off",
        "grads_off",
        "ready_off",
        "arrival_off",
        "grad_ready_off",
        "consumed_off",
        "total_bytes",
    ):
        assert k in L
    assert L["weight_chunks"] == 4 and L["grad_chunks"] == 2 and L["weight_stride"] == 1024
    assert L["total_bytes"] >= L["consumed_off"] + 8 * 2 * 3


def test_direct_copy_to_three_ranks():
    cl = Cluster(4, 2, [1024], chunk=256)
    trees = [(0, 0, {(0, MASTER): [(1, 0), (2, 1), (3, 0)]})]
    my = slots_of(4, 2, trees)
    tasks, refs = build_tasks(4, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    ok(cl.run(Op.MULTICAST, tasks, refs, my))
    check_multicast(cl, my)


@pytest.mark.parametrize("workers", [1, 4])
def test_relay_chain_several_chunks(workers):
    # home 0 -> (1,0) -> (2,1) -> (3,0), and expert 2 (home 2) -> (0,1) -> (1,1)
    cl = Cluster(4, 2, [4000], chunk=512)
    trees = [
        (0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 1)], (2, 1): [(3, 0)]}),
        (2, 2, {(2, MASTER): [(0, 1)], (0, 1): [(1, 1)]}),
    ]
    my = slots_of(4, 2, trees)
    tasks, refs = build_tasks(4, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    assert cl.L["weight_chunks"] == 8
    ok(cl.run(Op.MULTICAST, tasks, refs, my, num_workers=workers, jitter_us=200, jitter_seed=7))
    check_multicast(cl, my)


def test_odd_sizes_multi_member_padding():
    # members of odd sizes with 16 B alignment padding, short last chunk, separate master pointers
    cl = Cluster(3, 3, [1000, 333, 7, 64], chunk=160, num_experts=3)
    assert cl.wsb % cl.chunk != 0 and len(set(cl.w_off)) == 4
    trees = [
        (0, 0, {(0, MASTER): [(1, 2), (2, 0)]}),
        (1, 1, {(1, MASTER): [(2, 2)], (2, 2): [(0, 1)]}),
        (2, 2, {(2, MASTER): [(0, 0), (1, 0)]}),
    ]
    my = slots_of(3, 3, trees)
    tasks, refs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    ok(cl.run(Op.MULTICAST, tasks, refs, my, jitter_us=100))
    check_multicast(cl, my)


def test_epochs_without_reset():
    cl = Cluster(3, 1, [777, 300], chunk=128)
    trees = [(0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 0)]})]
    my = slots_of(3, 1, trees)
    tasks, refs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    for it in range(3):
        for t in cl.masters[0]:
            t.random_(0, 256)
        ok(cl.run(Op.MULTICAST, tasks, refs, my, jitter_us=300, jitter_seed=it))
        check_multicast(cl, my)
    assert cl.epoch == 3


# ------------------------------------------------------------------------------------------
# reduce


def bits_equal(a: torch.Tensor, b: torch.Tensor, dtype) -> bool:
    """Bit equality of two byte images read as `dtype`, NaNs compared as NaN (torch's own
    CPU cast writes different NaN payloads on its vector and scalar paths)."""
    x, y = a.contiguous().view(dtype), b.contiguous().view(dtype)
    nx, ny = torch.isnan(x), torch.isnan(y)
    if not torch.equal(nx, ny):
        return False
    ib = torch.int32 if dtype == torch.float32 else torch.int16
    return torch.equal(x.view(ib)[~nx], y.view(ib)[~ny])


def reduce_setup(dtype, seed=0):
    # expert 0 (home 0): (1,0) is a relay pre-reducing (2,0) and (3,0); home sums (1,0), (2,1)
    # expert 1 (home 1): direct, sources (3,1), (0,0), (2,2)
    cl = Cluster(4, 3, [1000, 360, 64], chunk=128, num_experts=4, grad_dtype=dtype, seed=seed)
    trees = [
        (0, 0, {(0, MASTER): [(1, 0), (2, 1)], (1, 0): [(2, 0), (3, 0)]}),
        (1, 1, {(1, MASTER): [(3, 1), (0, 0), (2, 2)]}),
    ]
    my = slots_of(4, 3, trees)
    tasks, refs = build_tasks(4, trees, cl.gsb, cl.chunk, TaskKind.REDUCE)
    g = torch.Generator().manual_seed(seed + 1)
    init = []
    for r in range(4):
        for s in range(3):
            if my[r][s] >= 0:
                members = [cl._rand_grad(n // ESIZE[dtype], g) for n in cl.g_bytes]
                cl.grad_slot(r, s).copy_(slot_image(members, cl.g_off, cl.gsb, fill=FILL))
        init.append(cl.grad_slots(r).clone())
    master_init = {e: [t.clone() for t in ms] for e, ms in cl.master_grads.items()}
    return cl, trees, my, tasks, refs, init, master_init


def reset_reduce(cl, init, master_init):
    for r in range(cl.world):
        for s in range(cl.slots):
            cl.grad_slot(r, s).copy_(init[r][s])
    for e, ms in master_init.items():
        for t, t0 in zip(cl.master_grads[e], ms):
            t.copy_(t0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_reduce_bit_exact_with_relay(dtype):
    cl, trees, my, tasks, refs, init, master_init = reduce_setup(dtype)
    exp_grads, exp_masters = reference_reduce(tasks, refs, init, master_init, cl.g_off, cl.g_bytes, dtype)
    ok(cl.run(Op.REDUCE, tasks, refs, my, jitter_us=100))
    for e in (0, 1):
        for got, exp in zip(cl.master_grads[e], exp_masters[e]):
            assert bits_equal(got, exp, dtype), e
            if dtype == torch.float32:
                assert torch.equal(got, exp)
    for e in (2, 3):  # not reduced
        for got, exp in zip(cl.master_grads[e], master_init[e]):
            assert torch.equal(got.view(torch.uint8), exp.view(torch.uint8))
    mask = member_mask(cl.g_off, cl.g_bytes, cl.gsb)
    relay = cl.grad_slot(1, 0)
    assert bits_equal(relay[mask], exp_grads[1][0][mask], dtype)  # the relay's partial
    assert bool((relay[~mask] == FILL).all())
    # leaves untouched
    assert torch.equal(cl.grad_slot(2, 0), init[2][0]) and torch.equal(cl.grad_slot(3, 1), init[3][1])
    # the master is the ordered fp32 sum: check one element by hand
    if dtype == torch.float32:
        m0 = lambda t: t.view(torch.float32)[0]  # noqa: E731
        acc = master_init[0][0][0]
        partial = (m0(init[1][0]) + m0(init[2][0])) + m0(init[3][0])
        acc = (acc + partial) + m0(init[2][1])
        assert cl.master_grads[0][0][0].item() == acc.item()


def test_reduce_determinism_20_runs():
    dtype = torch.bfloat16
    cl, trees, my, tasks, refs, init, master_init = reduce_setup(dtype, seed=3)
    results = []
    for it in range(20):
        reset_reduce(cl, init, master_init)
        ok(cl.run(Op.REDUCE, tasks, refs, my, jitter_us=150, jitter_seed=it, num_workers=1 + it % 4))
        results.append(torch.cat([t.view(torch.uint8) for e in (0, 1) for t in cl.master_grads[e]]).clone())
    assert all(torch.equal(results[0], r) for r in results[1:])


# ------------------------------------------------------------------------------------------
# timeouts and validation


def test_timeout_rank_never_joins():
    cl = Cluster(3, 1, [1024], chunk=1024)  # one chunk: rank 1 is served before rank 2
    trees = [(0, 0, {(0, MASTER): [(1, 0), (2, 0)]})]
    my = slots_of(3, 1, trees)
    tasks, refs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    t0 = time.monotonic()
    errs = cl.run(Op.MULTICAST, tasks, refs, my, ranks=[0, 1], timeout_s=0.3)
    assert 0.3 <= time.monotonic() - t0 < 10  # waited the timeout, then failed promptly
    e = errs[0]
    assert isinstance(e, _core.TimeoutError) and isinstance(e, TimeoutError), errs
    msg = str(e)
    assert "rank 0" in msg and "multicast" in msg and "rank 2" in msg and "join" in msg
    assert "expert 0" in msg and "chunk 0" in msg and "epoch 1" in msg, msg
    assert errs[1] is None  # rank 1 got its bytes
    mask = member_mask(cl.w_off, cl.w_bytes, cl.wsb)
    assert torch.equal(cl.weight_slot(1, 0)[mask], slot_image(cl.masters[0], cl.w_off, cl.wsb)[mask])


def test_timeout_missing_sender_and_grad():
    cl = Cluster(3, 1, [1024], chunk=256)
    trees = [(0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 0)]})]
    my = slots_of(3, 1, trees)
    tasks, refs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    parent = {1: [0], 2: [1]}
    errs = cl.run(
        Op.MULTICAST, tasks, refs, my, ranks=[2], timeout_s=0.3, per_rank=lambda r: {"slot_parent": parent[r]}
    )
    msg = str(errs[2])
    assert isinstance(errs[2], TimeoutError) and "rank 1 to deliver expert 0 chunk 0 into slot 0" in msg, msg
    # reduce: the home waits for a grad that never comes
    cl = Cluster(3, 1, [1024], chunk=256)
    tasks, refs = build_tasks(3, trees, cl.gsb, cl.chunk, TaskKind.REDUCE)
    errs = cl.run(Op.REDUCE, tasks, refs, my, ranks=[0], timeout_s=0.3)
    msg = str(errs[0])
    assert isinstance(errs[0], TimeoutError) and "grad_reduce" in msg, msg
    assert re.search(r"rank 1's grad of expert 0 chunk \d in slot 0 \(grad_ready flag\)", msg), msg


def test_invalid_arguments_write_nothing():
    cl = Cluster(3, 2, [1000, 64], chunk=256)
    trees = [(0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 1)]})]
    my = slots_of(3, 2, trees)
    tasks, refs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    before = [w.clone() for w in cl.win]

    def t_with(r, **fields):
        t = [x.copy() for x in tasks]
        for k, v in fields.items():
            t[r][k][0] = v
        return t

    def r_with(r, **fields):
        rf = [x.copy() for x in refs]
        for k, v in fields.items():
            rf[r][k][0] = v
        return rf

    base = lambda r, **kw: {**cl.args(Op.MULTICAST, r, tasks, refs, my, 1), **kw}  # noqa: E731
    cases = {
        "self rank": base(0, tasks=t_with(0, self_rank=1)[0]),
        "ref rank": base(0, refs=r_with(0, rank=3)[0]),
        "ref slot": base(0, refs=r_with(0, slot=2)[0]),
        "self slot": base(1, tasks=t_with(1, self_slot=5)[1]),
        "chunk range": base(0, tasks=t_with(0, offset=cl.wsb)[0]),
        "chunk index": base(0, tasks=t_with(0, chunk=99)[0]),
        "kind": base(0, tasks=t_with(0, kind=int(TaskKind.REDUCE))[0]),
        "ref count": base(0, tasks=t_with(0, ref_count=50)[0]),
        "window bases": base(0, window_bases=[w.data_ptr() for w in cl.win[:2]]),
        "workers": base(0, num_workers=0),
        "master not local": base(0, local_index_of=[-1, -1, -1]),
        "member overlap": base(0, member_off=[0, 900]),
        "member too big": base(0, member_bytes=[1000, 400]),
        "my_slots size": base(0, my_slots=[0]),
        "rank": base(0, rank=3),
        "epoch": base(0, epoch=0),
        "grad dtype": dict(base(0, op=int(Op.REDUCE)), grad_dtype=7),
        "task buffer": base(0, tasks=np.zeros(5, dtype=np.int32)),
        "reduce alignment": dict(
            base(0, op=int(Op.REDUCE), tasks=build_tasks(3, trees, cl.gsb, 256, TaskKind.REDUCE)[0][0]),
            member_off=[0, 1002],
            member_bytes=[1000, 6],
        ),
    }
    for name, a in cases.items():
        with pytest.raises(ValueError):
            _core.run_host(**a)
            pytest.fail(name)
        for w, b in zip(cl.win, before):
            assert torch.equal(w, b), f"{name}: window written"
    # and the valid arguments work afterwards
    ok(cl.run(Op.MULTICAST, tasks, refs, my))
    check_multicast(cl, my)


def test_task_byte_range_must_be_its_chunks():
    """offset == chunk * chunk_bytes and bytes == min(chunk_bytes, slot - offset), with the
    weight slot for copy tasks and the grad slot for reduce tasks: a task whose chunk number and
    byte range disagree (each in range on its own) is rejected before anything is written."""
    cl = Cluster(3, 2, [1000, 64], [480, 64], chunk=256)  # weight slot 1072 (5 chunks), grad 544 (3)
    assert (cl.wsb, cl.gsb) == (1072, 544)
    trees = [(0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 1)]})]
    my = slots_of(3, 2, trees)
    before = [w.clone() for w in cl.win]
    cases = []
    for op, kind, sb in ((Op.MULTICAST, TaskKind.COPY, cl.wsb), (Op.REDUCE, TaskKind.REDUCE, cl.gsb)):
        tasks, refs = build_tasks(3, trees, sb, cl.chunk, kind)
        t0 = tasks[0]
        last = int(np.flatnonzero(t0["chunk"] == t0["chunk"].max())[0])
        first = int(np.flatnonzero(t0["chunk"] == 0)[0])
        assert t0["bytes"][last] == sb - t0["offset"][last] < cl.chunk  # short last chunk

        def bad(i, **fields):
            t = t0.copy()
            for k, v in fields.items():
                t[k][i] = v
            return cl.args(op, 0, [t, *tasks[1:]], refs, my, 1)

        cases += [
            (op, "chunk of another range", bad(first, chunk=1)),  # offset 0 is chunk 0's
            (op, "offset of another chunk", bad(first, offset=cl.chunk)),  # in range, wrong flag
            (op, "short bytes", bad(first, bytes=128)),
            (op, "full chunk at the end", bad(last, bytes=cl.chunk, offset=sb - cl.chunk)),
            (op, "last chunk too short", bad(last, bytes=int(t0["bytes"][last]) - 16)),
        ]
    # a reduce task sized by the weight slot (1072 B, 5 chunks) instead of the grad slot (544 B)
    wtasks, wrefs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.REDUCE)
    keep = wtasks[0]["chunk"] < 3  # grad chunk indices, weight-slot byte ranges: chunk 2 is 256 B, not 32
    cases.append(
        (
            Op.REDUCE,
            "weight slot bytes for a reduce",
            cl.args(Op.REDUCE, 0, [wtasks[0][keep], *wtasks[1:]], wrefs, my, 1),
        )
    )
    for op, name, a in cases:
        with pytest.raises(ValueError, match=r"task \d+: byte range \[\d+, \+\d+\) is not chunk \d+'s") as ei:
            _core.run_host(**a)
        assert ("weight slot" if op == Op.MULTICAST else "grad slot") in str(ei.value), (name, str(ei.value))
        for w, b in zip(cl.win, before):
            assert torch.equal(w, b), f"{name}: window written"


def _timeout_message(op, **kw):
    cl = Cluster(2, 1, [1024], chunk=1024)
    trees = [(0, 0, {(0, MASTER): [(1, 0)]})]
    my = slots_of(2, 1, trees)
    kind = TaskKind.COPY if op == Op.MULTICAST else TaskKind.REDUCE
    tasks, refs = build_tasks(2, trees, cl.wsb, cl.chunk, kind)
    errs = cl.run(op, tasks, refs, my, ranks=[0], timeout_s=0.05, **kw)  # rank 1 never comes
    assert isinstance(errs[0], _core.TimeoutError), errs
    return str(errs[0])


def test_timeout_names_the_operation():
    assert _timeout_message(Op.MULTICAST).startswith("ultracomm: rank 0 weight_sync (multicast) epoch 1 timed out")
    assert _timeout_message(Op.REDUCE).startswith("ultracomm: rank 0 grad_reduce (reduce) epoch 1 timed out")
    msg = _timeout_message(Op.MULTICAST, op_name="restore")
    assert msg.startswith("ultracomm: rank 0 restore (multicast) epoch 1 timed out"), msg
    assert "weight_sync" not in msg and "rank 1 to join" in msg, msg
    # explicit None is the default
    assert "grad_reduce (reduce)" in _timeout_message(Op.REDUCE, op_name=None)


def test_positional_arguments_and_record_buffers():
    """The positional signature is unchanged (op_name is the last, optional, argument), and the
    records may come as any C-contiguous buffer: read in place when aligned, copied when not."""
    cl = Cluster(3, 1, [700, 300], chunk=256)
    trees = [(0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 0)]})]
    my = slots_of(3, 1, trees)
    tasks, refs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.COPY)

    def misaligned(arr):  # the same records at an odd address
        raw = np.zeros(arr.nbytes + 1, dtype=np.uint8)
        raw[1:] = arr.view(np.uint8)
        assert arr.nbytes == 0 or raw[1:].ctypes.data % 8
        return raw[1:]

    forms = {
        "structured": (tasks, refs),
        "read-only": ([t.copy() for t in tasks], [r.copy() for r in refs]),
        "bytes": ([t.tobytes() for t in tasks], [r.tobytes() for r in refs]),
        "misaligned uint8": ([misaligned(t) for t in tasks], [misaligned(r) for r in refs]),
    }
    for t in forms["read-only"][0] + forms["read-only"][1]:
        t.flags.writeable = False
    for name, (ts, rs) in forms.items():
        for w in cl.win:
            w[: cl.L["ready_off"]] = FILL
        cl.epoch += 1

        def body(r, ts=ts, rs=rs, epoch=cl.epoch):
            a = cl.args(Op.MULTICAST, r, ts, rs, my, epoch)
            pos = [
                a[k]
                for k in (
                    "op",
                    "rank",
                    "world",
                    "epoch",
                    "slots",
                    "weight_slot_bytes",
                    "grad_slot_bytes",
                    "chunk_bytes",
                    "window_bases",
                    "member_off",
                    "member_bytes",
                    "master_ptrs",
                    "local_index_of",
                    "grad_dtype",
                    "my_slots",
                    "tasks",
                    "refs",
                    "num_workers",
                    "timeout_s",
                )
            ]
            pos += [0, 0, [-1] if r == 0 else [0 if r == 1 else 1], False, "restore"]
            _core.run_host(*pos)

        errs = {}

        def run(r):
            try:
                body(r)
                errs[r] = None
            except Exception as e:  # noqa: BLE001
                errs[r] = e

        th = [threading.Thread(target=run, args=(r,)) for r in range(3)]
        for t in th:
            t.start()
        for t in th:
            t.join(60)
        ok(errs)
        check_multicast(cl, my)
    with pytest.raises(ValueError, match="C-contiguous"):
        _core.run_host(**cl.args(Op.MULTICAST, 0, [np.repeat(tasks[0], 2)[::2]], refs, my, 1))


def test_infinite_timeout():
    cl = Cluster(3, 1, [1024], chunk=256)
    trees = [(0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 0)]})]
    my = slots_of(3, 1, trees)
    tasks, refs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    ok(cl.run(Op.MULTICAST, tasks, refs, my, timeout_s=float("inf"), jitter_us=100))
    check_multicast(cl, my)


# ------------------------------------------------------------------------------------------
# with the real schedule builder (when present)


def _build_schedule():
    try:
        from ultracomm.schedule import build_schedule  # noqa: F401
    except Exception:  # noqa: BLE001
        return None
    return build_schedule


def _special_values(dtype):
    ib = torch.int32 if dtype == torch.float32 else torch.int16
    if dtype == torch.float32:
        raw = [
            0x7FC00000,
            0x7FC12345,
            0x7F800001,
            0xFFC00001,
            0x7F800000,
            0xFF800000,
            0x7F7FFFFF,
            0x00000001,
            0x80000001,
            0x00800000,
            0x3F800000,
            0x33800000,
            0x80000000,
        ]
    elif dtype == torch.bfloat16:
        raw = [0x7FC0, 0x7FC1, 0x7F81, 0xFFC1, 0x7F80, 0xFF80, 0x7F7F, 0x0001, 0x8001, 0x0080, 0x3F80, 0x3B80, 0x8000]
    else:
        raw = [0x7E00, 0x7E15, 0x7C01, 0xFE01, 0x7C00, 0xFC00, 0x7BFF, 0x0001, 0x8001, 0x0400, 0x3C00, 0x1400, 0x8000]
    return torch.tensor(
        [
            v - (1 << (32 if ib == torch.int32 else 16)) if v >= (1 << (31 if ib == torch.int32 else 15)) else v
            for v in raw
        ],
        dtype=ib,
    ).view(dtype)


@pytest.mark.parametrize(
    "dtype,portable",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False), (torch.float16, True)],
    ids=["fp32", "bf16", "fp16", "fp16-portable"],
)
def test_reduce_special_values_bit_exact_nan_included(dtype, portable):
    """NaN payloads, infinities, overflow, subnormals and rounding ties: the executor writes
    exactly torch's bits (compared as integers, NaNs included).  One NaN per element at most
    (NaN + NaN keeps either payload, as IEEE allows)."""
    g = torch.Generator().manual_seed(5)
    sp = _special_values(dtype)
    n = 8 * 1024 + 13  # odd: vector body and scalar tail
    cl = Cluster(3, 1, [n * ESIZE[dtype]], chunk=4096, num_experts=1, home_of=[0], grad_dtype=dtype)
    trees = [(0, 0, {(0, MASTER): [(1, 0), (2, 0)]})]
    my = slots_of(3, 1, trees)
    tasks, refs = build_tasks(3, trees, cl.gsb, cl.chunk, TaskKind.REDUCE)
    vals = [(torch.randn(n, generator=g) * 4).to(dtype) for _ in range(3)]
    big = torch.finfo(dtype).max
    vals[1][: n // 4] = big  # overflow to inf / exact ties on the way
    vals[2][: n // 8] = big
    # put a special value in one of the three addends of every element
    idx = torch.randint(0, len(sp), (n,), generator=g)
    who = torch.randint(0, 3, (n,), generator=g)
    for k in range(3):
        vals[k] = torch.where(who == k, sp[idx], vals[k])
    # rounding ties: a + b exactly halfway between two representable values
    one = torch.tensor(1.0, dtype=dtype)
    eps = torch.finfo(dtype).eps
    vals[0][-8:] = one
    vals[1][-8:] = torch.tensor(eps / 2, dtype=dtype)
    vals[2][-8:] = 0
    cl.master_grads[0][0].copy_(vals[0])
    nb = n * ESIZE[dtype]
    cl.grad_slot(1, 0)[:nb].copy_(vals[1].view(torch.uint8))
    cl.grad_slot(2, 0)[:nb].copy_(vals[2].view(torch.uint8))
    init = [cl.grad_slots(r).clone() for r in range(3)]
    _, exp = reference_reduce(tasks, refs, init, {0: [vals[0].clone()]}, cl.g_off, cl.g_bytes, dtype)
    ok(cl.run(Op.REDUCE, tasks, refs, my, portable_f16=portable))
    ib = torch.int32 if dtype == torch.float32 else torch.int16
    got, want = cl.master_grads[0][0].view(ib), exp[0][0].view(ib)
    bad = (got != want).nonzero().flatten()[:5].tolist()
    assert not bad, [(i, hex(got[i].item() & 0xFFFFFFFF), hex(want[i].item() & 0xFFFFFFFF)) for i in bad]
    assert torch.isnan(cl.master_grads[0][0].float()).any() and torch.isinf(cl.master_grads[0][0].float()).any()


def _nan_rule_cases(dtype):
    """(acc, src1, src2, expected) bit patterns of the documented NaN rule (half.h sum_rn: x86's
    addss with the accumulator first, written out so that the GPU kernel gives the same bits)."""
    if dtype == torch.float32:
        A, B, C, one, inf, ninf = 0x7F812345, 0xFFC0BEEF, 0x7FC00077, 0x3F800000, 0x7F800000, 0xFF800000
        q = 0x00400000
        return [
            (A, B, one, A | q),  # both NaN: the accumulator's, quieted
            (one, B, C, B | q),  # the first NaN in summation order
            (one, one, C, C | q),
            (inf, ninf, one, 0xFFC00000),  # inf + -inf: the default NaN
            (0x7F800001, one, one, 0x7FC00001),
        ]
    if dtype == torch.bfloat16:  # bf16 stores every NaN as 0xFFFF (ATen's vector cast)
        A, B, C, one, inf, ninf = 0x7F81, 0xFFC1, 0x7FC7, 0x3F80, 0x7F80, 0xFF80
        return [(A, B, one, 0xFFFF), (one, B, C, 0xFFFF), (one, one, C, 0xFFFF), (inf, ninf, one, 0xFFFF)]
    A, B, C, one, inf, ninf = 0x7C15, 0xFE01, 0x7E33, 0x3C00, 0x7C00, 0xFC00  # fp16: payload kept, quieted
    return [(A, B, one, A | 0x0200), (one, B, C, B | 0x0200), (one, one, C, C | 0x0200), (inf, ninf, one, 0xFE00)]


@pytest.mark.parametrize(
    "dtype,portable",
    [(torch.float32, False), (torch.bfloat16, False), (torch.float16, False), (torch.float16, True)],
    ids=["fp32", "bf16", "fp16", "fp16-portable"],
)
def test_reduce_nan_rule_is_the_documented_one(dtype, portable):
    """Several NaNs in one element's sum: the first in summation order (master, then the
    sources in list order) comes back quieted, inf + -inf is 0xFFC00000 -- exact bits on the
    vector body and the scalar tail, the rule the CUDA kernel implements too (tests/
    test_cuda_loopback.py compares the two executors on random bits, NaNs included)."""
    cases = _nan_rule_cases(dtype)
    n = 8 * 64 + 3  # the vector path's blocks and a scalar tail
    ib = torch.int32 if dtype == torch.float32 else torch.int16
    bits = 32 if dtype == torch.float32 else 16

    def col(k):
        return torch.tensor(
            [(v - (1 << bits) if v >= 1 << (bits - 1) else v) for v in (cases[i % len(cases)][k] for i in range(n))],
            dtype=ib,
        )

    cl = Cluster(3, 1, [n * ESIZE[dtype]], chunk=4096, num_experts=1, home_of=[0], grad_dtype=dtype)
    trees = [(0, 0, {(0, MASTER): [(1, 0), (2, 0)]})]
    tasks, refs = build_tasks(3, trees, cl.gsb, cl.chunk, TaskKind.REDUCE)
    assert [tuple(r) for r in refs[0][:2]] == [(1, 0), (2, 0)]  # summation order: master, rank 1, rank 2
    cl.master_grads[0][0].view(ib).copy_(col(0))
    nb = n * ESIZE[dtype]
    cl.grad_slot(1, 0)[:nb].copy_(col(1).view(torch.uint8))
    cl.grad_slot(2, 0)[:nb].copy_(col(2).view(torch.uint8))
    ok(cl.run(Op.REDUCE, tasks, refs, slots_of(3, 1, trees), portable_f16=portable))
    got, want = cl.master_grads[0][0].view(ib), col(3)
    bad = (got != want).nonzero().flatten()[:5].tolist()
    assert not bad, [(i, hex(got[i].item() & ((1 << bits) - 1)), hex(want[i].item() & ((1 << bits) - 1))) for i in bad]


# ------------------------------------------------------------------------------------------
# with the schedule builder (ultracomm.schedule.build_schedule), random plans


def _random_plan(world, slots, experts, rng):
    home_of = [e * world // experts for e in range(experts)]
    slot_src = np.full((world, slots), -1, dtype=np.int32)
    hot = rng.choice(experts, size=max(1, experts // 3), replace=False)
    for r in range(world):
        for s in range(slots):
            if rng.random() < 0.85:
                cands = [e for e in hot if home_of[e] != r and e not in slot_src[r]]
                cands += [e for e in range(experts) if home_of[e] != r and e not in slot_src[r] and rng.random() < 0.2]
                if cands:
                    slot_src[r, s] = rng.choice(cands)
    from types import SimpleNamespace

    return SimpleNamespace(
        world=world,
        slots_per_rank=slots,
        num_experts=experts,
        slot_src=slot_src,
        home_of=np.array(home_of, dtype=np.int32),
    )


@pytest.mark.parametrize(
    "seed,relay_mode,dtype",
    [(0, "force", torch.bfloat16), (1, "auto", torch.float32), (2, "force", torch.float16), (3, "off", torch.bfloat16)],
)
def test_random_plans_with_schedule_builder(seed, relay_mode, dtype):
    from ultracomm import schedule as sched_mod

    rng = np.random.default_rng(seed)
    world, slots = int(rng.integers(4, 7)), int(rng.integers(2, 4))
    experts = 2 * world
    plan = _random_plan(world, slots, experts, rng)
    cl = Cluster(
        world,
        slots,
        [701, 90, 13],
        [k * ESIZE[dtype] for k in (175, 45, 6)],
        chunk=128,
        num_experts=experts,
        home_of=[int(h) for h in plan.home_of],
        grad_dtype=dtype,
        seed=seed,
    )
    sch = sched_mod.build_schedule(plan, cl.wsb, cl.gsb, chunk_bytes=cl.chunk, relay_mode=relay_mode)
    my = plan.slot_src.tolist()
    for op in (Op.MULTICAST, Op.REDUCE):
        if op == Op.REDUCE:
            init, master_init = cl.random_replica_grads(my, seed)
        tasks = [sch.tasks(op, r) for r in range(world)]
        refs = [sch.refs(op, r) for r in range(world)]
        parent = sch.tree(op)[0]
        if op == Op.REDUCE:
            _, exp = reference_reduce(tasks, refs, init, master_init, cl.g_off, cl.g_bytes, dtype)
        ok(
            cl.run(
                op,
                tasks,
                refs,
                my,
                jitter_us=50,
                jitter_seed=seed,
                per_rank=lambda r: {"slot_parent": [int(p) for p in parent[r]]},
            )
        )
        if op == Op.MULTICAST:
            check_multicast(cl, my)
        else:
            for e in range(experts):
                for got, want in zip(cl.master_grads[e], exp[e]):
                    assert bits_equal(got, want, dtype), e
