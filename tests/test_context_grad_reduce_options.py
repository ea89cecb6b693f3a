"""Context.grad_reduce's ``zero_replica_grads`` and ``release`` options (what the UltraEP adapter
needs: UltraEP's reduce zeroes the placed replica grads, and a placement outlives its reduce)."""

from __future__ import annotations

import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.errors import UltracommError

from test_stream_ordered import fake, make_ctx, masters  # noqa: F401 - fake is a fixture

WORLD, EPR, SLOTS = 2, 2, 2
# rank 0's slot 0 holds expert 2 (home rank 1), rank 1's slot 1 holds expert 0; the other slots are empty
SLOT_SRC = [[2, -1], [-1, 0]]


def _layout() -> ExpertLayout:
    return ExpertLayout((Member("fc1", (3, 2), torch.float32), Member("fc2", (5,), torch.float32)))


def _run(body):
    plan = ReplicaPlan.make(SLOT_SRC, experts_per_rank=EPR)

    def wrapped(group):
        layout = _layout()
        with Context(group, layout, EPR, SLOTS, num_layers=2, timeout_s=20) as ctx:
            r = ctx.rank
            grads = []
            for layer in range(2):
                w = [torch.full((EPR, *m.shape), float(r), dtype=m.dtype) for m in layout.members]
                g = [torch.zeros((EPR, *m.shape)) for m in layout.members]
                ctx.register_masters(layer, w, g)
                grads.append(g)
            return body(ctx, plan, grads)

    return LoopbackDomain(WORLD).run(wrapped)


def _fill(ctx: Context, value: float) -> None:
    """This rank's replica grads: ``value`` in every slot (filled or empty), every member."""
    for g in ctx.replica_grads:
        g.fill_(value)


@pytest.mark.parametrize("async_op", [False, True])
def test_zero_replica_grads_zeroes_the_filled_slots_only(async_op):
    def body(ctx, plan, grads):
        vid = ctx.begin(0)
        ctx.weight_sync(vid, plan)
        _fill(ctx, 1.5)
        ctx.comm.barrier()
        work = ctx.grad_reduce(vid, async_op=async_op, zero_replica_grads=True)
        if work is not None:
            work.wait()
        filled = SLOT_SRC[ctx.rank]
        for g in ctx.replica_grads:
            for s, e in enumerate(filled):
                assert bool((g[s] == (0.0 if e >= 0 else 1.5)).all()), (ctx.rank, s)
        # each rank's local expert 0 (experts 0 and 2) got its one replica's 1.5 per element
        return [bool((g[0] == 1.5).all()) and bool((g[1] == 0).all()) for g in grads[0]]

    assert _run(body) == [[True, True], [True, True]]


def test_without_zeroing_the_slots_keep_their_grads():
    def body(ctx, plan, grads):
        vid = ctx.begin(0)
        ctx.weight_sync(vid, plan)
        _fill(ctx, 1.5)
        ctx.comm.barrier()
        ctx.grad_reduce(vid)
        return [float(g[s].flatten()[0]) for g in ctx.replica_grads for s in range(SLOTS) if SLOT_SRC[ctx.rank][s] >= 0]

    assert _run(body) == [[1.5, 1.5], [1.5, 1.5]]


def test_release_false_keeps_the_plan_for_another_reduce():
    def body(ctx, plan, grads):
        vid = ctx.begin(0)
        ctx.weight_sync(vid, plan)
        _fill(ctx, 1.0)
        ctx.comm.barrier()
        ctx.grad_reduce(vid, release=False, zero_replica_grads=True)
        ctx.comm.barrier()  # every rank's zeroing is done before anyone writes again
        _fill(ctx, 2.0)
        ctx.comm.barrier()
        ctx.grad_reduce(vid, release=False, zero_replica_grads=True)  # the same vid, its plan kept
        first = float(grads[0][0][0].flatten()[0])
        # another layer's multicast overwrites the slots: reducing vid again needs a restore first
        other = ctx.begin(1)
        ctx.weight_sync(other, plan)
        with pytest.raises(UltracommError, match=r"layer 1's multicast overwrote the replica slots"):
            ctx.grad_reduce(vid, release=False)
        ctx.restore(vid)
        ctx.grad_reduce(vid)  # released now
        with pytest.raises(ValueError, match=r"was released"):
            ctx.grad_reduce(vid)
        ctx.end(other)
        return first

    # expert 0 (rank 0, local 0) and expert 2 (rank 1, local 0) each have one replica: 1.0 then 2.0
    assert _run(body) == [3.0, 3.0]


def test_stream_ordered_zeroing_is_enqueued_behind_the_reduce_and_before_its_event(fake):
    """The stream path (tma's): the zeroing follows the reduce on the caller's stream and
    precedes the event that the Work waits for (fake streams, as in test_stream_ordered)."""
    plan = ReplicaPlan.make(SLOT_SRC, experts_per_rank=EPR)

    def body(group):
        with make_ctx(group, SLOTS, EPR) as ctx:
            weights, grads = masters(group.rank, EPR)
            ctx.register_masters(0, weights, grads)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            _fill(ctx, 1.5)
            group.barrier()
            streams = ctx._streams.streams
            seen = []
            record = streams.record

            def snapshot():  # what the slots hold when the Work's event is recorded
                seen.append([float(g[s].abs().sum()) for g in ctx.replica_grads for s in range(SLOTS)])
                return record()

            streams.record = snapshot
            work = ctx.grad_reduce(vid, async_op=True, zero_replica_grads=True)
            work.wait()
            return seen, float(grads[0][0].sum())

    (seen0, g0), (seen1, g1) = LoopbackDomain(WORLD).run(body)
    # rank 0: slot 0 filled (zeroed), slot 1 empty (its 1.5 x 15 fc1 and 1.5 x 7 fc2 elements kept)
    assert seen0 == [[0.0, 22.5, 0.0, 10.5]] and seen1 == [[22.5, 0.0, 10.5, 0.0]]
    assert g0 == g1 == 22.5  # each rank's local expert 0 got 1.5 per element of fc1 [5, 3]
