"""Executor protocol checks beyond data movement: plan digests in the window, rejected plans,
timeout messages that name the likely dead rank, the chunk-index bound, and size bounds
(64-bit arithmetic), all through _core.run_host with both movers where it matters."""

from __future__ import annotations

import re
import time

import pytest
import torch

from ultracomm import _core
from ultracomm.errors import LayoutError, PlanError, PlanMismatchError
from ultracomm.layout import MAX_MEMBERS, ExpertLayout, Member
from ultracomm.records import MASTER, Op, TaskKind
from ultracomm.tools.reference import tasks_from_trees as build_tasks

from test_host_executor import Cluster, slots_of

MOVERS = [{}, {"mover": "block", "threads_per_worker": 3}]


def _chain(world=2, op=Op.MULTICAST, chunk=256):
    """0 -> (1,0) [-> (2,0)]: the home sends expert 0 down a chain."""
    cl = Cluster(world, 1, [1024], chunk=chunk)
    tree = {(0, MASTER): [(1, 0)]}
    if world == 3:
        tree[(1, 0)] = [(2, 0)]
    trees = [(0, 0, tree)]
    kind = TaskKind.COPY if op == Op.MULTICAST else TaskKind.REDUCE
    tasks, refs = build_tasks(world, trees, cl.wsb if op == Op.MULTICAST else cl.gsb, cl.chunk, kind)
    parent = {0: [-1], 1: [0], 2: [1]}
    return cl, slots_of(world, 1, trees), tasks, refs, parent


@pytest.mark.parametrize("kw", MOVERS, ids=["host", "block"])
@pytest.mark.parametrize("op", [Op.MULTICAST, Op.REDUCE], ids=["multicast", "reduce"])
def test_digest_mismatch_raises_on_both_ranks_before_data_moves(op, kw):
    cl, my, tasks, refs, parent = _chain(2, op)
    before = [w[: cl.L["ready_off"]].clone() for w in cl.win]
    masters_before = [t.clone() for t in cl.master_grads[0]]
    digest = {0: 0x1111, 1: 0x2222}
    t0 = time.monotonic()
    errs = cl.run(
        op, tasks, refs, my, timeout_s=20, per_rank=lambda r: {"slot_parent": parent[r], "digest": digest[r], **kw}
    )
    assert time.monotonic() - t0 < 10  # raised on seeing the digest, not at the timeout
    for r, other in ((0, 1), (1, 0)):
        e = errs[r]
        assert isinstance(e, _core.PlanMismatchError) and isinstance(e, PlanError), errs
        assert type(e) is PlanMismatchError is _core.PlanMismatchError  # one class: Python's own
        msg = str(e)
        assert msg.startswith(
            f"ultracomm: rank {r} {'weight_sync (multicast)' if op == Op.MULTICAST else 'grad_reduce (reduce)'} epoch 1: rank {other} runs a different plan"
        ), msg
        assert f"schedule digest 0x{digest[other]:016x} in its window, 0x{digest[r]:016x} here" in msg, msg
    for w, b in zip(cl.win, before):  # no replica written, no grad consumed
        assert torch.equal(w[: cl.L["ready_off"]], b)
    for t, t0_ in zip(cl.master_grads[0], masters_before):
        assert torch.equal(t, t0_)


@pytest.mark.parametrize("kw", MOVERS, ids=["host", "block"])
def test_same_digest_runs(kw):
    cl, my, tasks, refs, parent = _chain(3)
    d = 0x0123456789ABCDEF ^ int(Op.MULTICAST)
    errs = cl.run(Op.MULTICAST, tasks, refs, my, per_rank=lambda r: {"slot_parent": parent[r], "digest": d, **kw})
    assert all(e is None for e in errs.values()), errs
    own = cl.win[1][cl.L["digest_off"] : cl.L["digest_off"] + 8].view(torch.int64).item() & (2**64 - 1)
    assert own == d  # published beside ready[op]
    with pytest.raises(ValueError, match="reserved"):
        _core.run_host(**cl.args(Op.MULTICAST, 0, tasks, refs, my, 9, digest=_core.REJECTED_DIGEST))


@pytest.mark.parametrize("op", [Op.MULTICAST, Op.REDUCE], ids=["multicast", "reduce"])
def test_rejected_plan_is_reported_by_the_peer_at_once(op):
    cl, my, tasks, refs, parent = _chain(2, op)
    epoch = 1
    L = cl.L
    _core.publish_rejection(
        int(op),
        1,
        epoch,
        cl.win[1].data_ptr(),
        L["slots"],
        L["weight_slot_bytes"],
        L["grad_slot_bytes"],
        L["chunk_bytes"],
    )
    t0 = time.monotonic()
    errs = cl.run(
        op, tasks, refs, my, ranks=[0], epoch=epoch, timeout_s=20, per_rank=lambda r: {"slot_parent": parent[r]}
    )
    assert time.monotonic() - t0 < 10
    assert isinstance(errs[0], _core.PlanMismatchError), errs
    assert "rank 1 rejected its plan for this operation" in str(errs[0]), str(errs[0])


def test_timeout_names_the_likely_dead_rank_only_when_it_never_started():
    """Chain 0 -> 1 -> 2, rank 0 never runs, rank 1 joins but has no tasks: rank 1 times out
    waiting for rank 0 (never started: likely dead); rank 2 waits for rank 1, which started."""
    cl, my, tasks, refs, parent = _chain(3)
    empty = [tasks[0], tasks[1][:0], tasks[2]]
    errs = cl.run(
        Op.MULTICAST, empty, refs, my, ranks=[1, 2], timeout_s=0.5, per_rank=lambda r: {"slot_parent": parent[r]}
    )
    m1, m2 = str(errs[1]), str(errs[2])
    assert isinstance(errs[1], _core.TimeoutError) and isinstance(errs[2], _core.TimeoutError), errs
    assert re.search(
        r"waiting for rank 0 to deliver expert 0 chunk 0 into slot 0 \(arrival flag\); rank 0 has not "
        r"started this operation \(its ready flag is at epoch 0\): it is likely the stalled or dead rank$",
        m1,
    ), m1
    assert "waiting for rank 1 to deliver expert 0 chunk 0 into slot 0 (arrival flag)" in m2, m2
    assert "likely" not in m2, m2
    # without slot_parent the peer is unknown: no rank named, no hint
    errs = cl.run(Op.MULTICAST, empty, refs, my, ranks=[2], timeout_s=0.2)
    assert str(errs[2]).endswith("waiting for its parent rank to deliver expert 0 chunk 0 into slot 0 (arrival flag)")


@pytest.mark.parametrize("op", [Op.MULTICAST, Op.REDUCE], ids=["copy", "reduce"])
@pytest.mark.parametrize("nbytes", ["chunk_bytes", "zero"])
def test_chunk_one_past_the_last_is_rejected_before_anything_moves(op, nbytes):
    cl = Cluster(3, 2, [1000, 64], [480, 64], chunk=256)  # weight slot 1072 B: 5 chunks; grad 544 B: 3
    trees = [(0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 1)]})]
    my = slots_of(3, 2, trees)
    mc = op == Op.MULTICAST
    n = cl.L["weight_chunks" if mc else "grad_chunks"]
    tasks, refs = build_tasks(3, trees, cl.wsb if mc else cl.gsb, cl.chunk, TaskKind.COPY if mc else TaskKind.REDUCE)
    assert int(tasks[0]["chunk"].max()) == n - 1
    t = tasks[0].copy()
    t["chunk"][0] = n  # exactly one past the last, with the byte range that index implies
    t["offset"][0] = n * cl.chunk
    t["bytes"][0] = cl.chunk if nbytes == "chunk_bytes" else 0
    before = [w.clone() for w in cl.win]
    for kw in MOVERS:
        with pytest.raises(ValueError, match=rf"task 0: chunk {n} out of range \({n} chunks\)"):
            _core.run_host(**cl.args(op, 0, [t, *tasks[1:]], refs, my, 1, **kw))
        for w, b in zip(cl.win, before):
            assert torch.equal(w, b), "window written"


def test_sizes_that_would_overflow_64_bits_are_rejected():
    huge_chunk = 2**64 - 32768  # once accepted: the chunk count overflowed to 0, nothing moved
    for bad, match in (
        ((1, 1000, 1000, huge_chunk), r"chunk_bytes must be <= 2\^48"),
        ((1, 2**49, 64, 256), r"weight or grad bytes must be <= 2\^48"),
        ((2**21, 64, 64, 64), r"slots must be <= 2\^20"),
        ((2**20, 2**47, 2**47, 2**20), r"window would exceed 2\^62 bytes"),
        ((1, 64, 64, 0), "chunk_bytes must be > 0"),
    ):
        with pytest.raises(ValueError, match=match):
            _core.window_layout(*bad)
    L = _core.window_layout(1, 1000, 1000, 2**48)  # the largest chunk: one chunk per slot
    assert L["weight_chunks"] == 1 and L["grad_chunks"] == 1
    cl, my, tasks, refs, _ = _chain(2)
    with pytest.raises(ValueError, match=r"chunk_bytes must be <= 2\^48"):
        _core.run_host(**cl.args(Op.MULTICAST, 0, tasks, refs, my, 1, chunk_bytes=huge_chunk))
    assert torch.equal(cl.win[1][: cl.L["ready_off"]], torch.full_like(cl.win[1][: cl.L["ready_off"]], 0xEE))


def test_member_count_bound_agrees_with_the_executor():
    assert MAX_MEMBERS == _core.MAX_MEMBERS
    ExpertLayout(tuple(Member(f"m{i}", (4,), torch.float32) for i in range(MAX_MEMBERS)))
    with pytest.raises(LayoutError, match=f"at most {MAX_MEMBERS} members"):
        ExpertLayout(tuple(Member(f"m{i}", (4,), torch.float32) for i in range(MAX_MEMBERS + 1)))
    cl, my, tasks, refs, _ = _chain(2)
    with pytest.raises(ValueError, match="at most 8"):
        _core.run_host(
            **cl.args(Op.MULTICAST, 0, tasks, refs, my, 1, member_off=list(range(0, 9 * 16, 16)), member_bytes=[16] * 9)
        )


def test_error_records_format_like_the_executor():
    """A raw record (what a kernel copies back) formats to the executor's text and raises its type."""
    import struct  # noqa: PLC0415

    rec = struct.pack("<Ii B3x I q iiii QQQQ", 1, 2, 0, 2, 5, 7, 3, 0, 1, 9, 9, 2**64 - 1, 4)
    assert len(rec) == _core.ERROR_RECORD_BYTES
    msg = _core.format_error(rec, "restore", 1.5)
    assert msg == (
        "ultracomm: rank 2 restore (multicast) epoch 9 timed out after 1.5 s waiting for rank 1 to "
        "deliver expert 7 chunk 3 into slot 0 (arrival flag; this rank relays it); rank 1 has not started "
        "this operation (its ready flag is at epoch 4): it is likely the stalled or dead rank"
    )
    with pytest.raises(_core.TimeoutError, match=re.escape(msg)):
        _core.raise_error_record(rec, "restore", 1.5)
    assert _core.raise_error_record(bytes(_core.ERROR_RECORD_BYTES)) is None
    with pytest.raises(ValueError, match="72 bytes"):
        _core.format_error(b"\0" * 8)


def test_context_publishes_each_ops_schedule_digest_in_its_window():
    """Through Context and the host transport: after weight_sync and grad_reduce each rank's
    window holds, beside ready[op], the schedule's digest xor the op."""
    from test_context import _two_ranks_one_swap  # noqa: PLC0415
    from ultracomm.transports.host import op_digest  # noqa: PLC0415

    def fn(group, ctx, vid, plan):
        ctx.weight_sync(vid, plan)
        sched = ctx.schedule_for(plan)
        ctx.grad_reduce(vid)
        ctx.synchronize()
        words = ctx.window.local[ctx.wlayout["digest_off"] : ctx.wlayout["digest_off"] + 16].view(torch.int64)
        got = [int(w) & (2**64 - 1) for w in words]
        assert got == [op_digest(sched.digest, Op.MULTICAST), op_digest(sched.digest, Op.REDUCE)], got
        assert got[0] != got[1]

    _two_ranks_one_swap(fn)


def test_op_digest_never_marks_a_rejection():
    from ultracomm.transports.host import op_digest  # noqa: PLC0415

    assert op_digest(0x1234, Op.REDUCE) == 0x1235
    assert op_digest(_core.REJECTED_DIGEST ^ 1, Op.REDUCE) != _core.REJECTED_DIGEST
