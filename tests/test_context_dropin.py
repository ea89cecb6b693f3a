"""Context behaviour the drop-in layer relies on: micro-batches in flight counted per layer,
stale replica slots caught before grad_reduce, per-expert master lists, staged replica grads,
and discoverable public names."""

from __future__ import annotations

import pytest
import torch

import ultracomm
from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan, UltracommError
from ultracomm.errors import RegistrationError

from conftest import expert_weights

WORLD, EPR, SLOTS = 2, 2, 1
LAYOUT = ExpertLayout((Member("fc1", (4, 3), torch.float32), Member("fc2", (5,), torch.float32)))
PLAN = ReplicaPlan.make([[2], [0]], experts_per_rank=EPR)  # expert 2 -> rank 0, expert 0 -> rank 1


def masters(rank: int, per_expert: bool = False):
    per = [expert_weights(LAYOUT, e) for e in range(rank * EPR, (rank + 1) * EPR)]
    if per_expert:
        return [[p[m].clone() for p in per] for m in range(2)], [
            [torch.zeros(m.shape) for _ in per] for m in LAYOUT.members
        ]
    return [torch.stack([p[m] for p in per]) for m in range(2)], [torch.zeros(EPR, *m.shape) for m in LAYOUT.members]


def on_ranks(fn, layers: int = 1, max_microbatches: int = 1):
    def body(group):
        with Context(
            group, LAYOUT, EPR, SLOTS, num_layers=layers, max_microbatches=max_microbatches, timeout_s=20
        ) as ctx:
            return fn(ctx)

    return LoopbackDomain(WORLD).run(body)


def test_max_microbatches_counts_per_layer():
    # the README's setting: many layers, a few micro-batches in flight each
    def fn(ctx):
        for layer in range(48):
            ctx.register_masters(layer, *masters(ctx.rank))
        vids = [[ctx.begin(layer) for _ in range(4)] for layer in range(48)]  # 4 per layer, all in flight
        assert len({v for vs in vids for v in vs}) == 48 * 4
        with pytest.raises(UltracommError, match="layer 7 already has 4 micro-batches in flight"):
            ctx.begin(7)
        ctx.end(vids[7][0])
        ctx.begin(7)  # a slot of that layer is free again
        return True

    assert all(on_ranks(fn, layers=48, max_microbatches=4))


def test_grad_reduce_after_another_layers_multicast_raises_unless_restored():
    def fn(ctx):
        for layer in range(2):
            ctx.register_masters(layer, *masters(ctx.rank))
        a = ctx.begin(0)
        ctx.weight_sync(a, PLAN)
        b = ctx.begin(1)
        ctx.weight_sync(b, PLAN)  # layer 1 reuses the slots: layer 0's replicas are gone
        with pytest.raises(UltracommError, match=rf"grad_reduce\(vid {a}, layer 0\): layer 1's multicast overwrote"):
            ctx.grad_reduce(a)
        ctx.grad_reduce(b)  # layer 1's own replicas are still in place
        ctx.restore(a)
        ctx.grad_reduce(a)  # restored: fine
        c = ctx.begin(0)
        ctx.weight_sync(c, PLAN)
        ctx.weights_copied(c)  # an ECHO-style caller copied the replicas out
        d = ctx.begin(1)
        ctx.weight_sync(d, PLAN)
        ctx.grad_reduce(c)
        ctx.grad_reduce(d)
        return True

    assert all(on_ranks(fn, layers=2, max_microbatches=1))


def test_per_expert_master_lists_reduce_like_stacked_tensors():
    def fn(per_expert):
        def body(ctx):
            w, g = masters(ctx.rank, per_expert)
            ctx.register_masters(0, w, g)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, PLAN)
            e = PLAN.slot_src[ctx.rank, 0].item()
            for m, want in enumerate(expert_weights(LAYOUT, e)):
                assert torch.equal(ctx.replica_weights[m][0], want)
            staged = [torch.full((SLOTS, *m.shape), 0.25 + ctx.rank) for m in LAYOUT.members]
            ctx.grad_reduce(vid, grads=staged)  # copied into the replica grad slots in order
            return [torch.stack(x) if isinstance(x, list) else x for x in g]

        return on_ranks(body)

    stacked, lists = fn(False), fn(True)
    for r in range(WORLD):
        for m in range(2):
            assert torch.equal(stacked[r][m], lists[r][m])
    # rank 0's expert 0 got rank 1's replica grad (1.25); rank 1's expert 2 got rank 0's (0.25)
    assert stacked[0][0][0].eq(1.25).all() and stacked[0][0][1].eq(0).all()
    assert stacked[1][1][0].eq(0.25).all()


def test_register_masters_rejects_bad_per_expert_lists():
    def fn(ctx):
        w, g = masters(ctx.rank, per_expert=True)
        with pytest.raises(RegistrationError, match=r"weights\['fc1'\]: a per-expert list needs experts_per_rank = 2"):
            ctx.register_masters(0, [w[0][:1], w[1]], g)
        with pytest.raises(RegistrationError, match=r"grads\['fc2'\]\[1\]: expected shape \[5\]"):
            ctx.register_masters(0, w, [g[0], [g[1][0], torch.zeros(4)]])
        return True

    assert all(on_ranks(fn))


def test_public_names_are_discoverable():
    names = dir(ultracomm)
    for name in (
        "Context",
        "ReplicaPlan",
        "ResidentPlan",
        "ExpertLayout",
        "ReplicaManager",
        "UltracommTimeout",
        "moe",
        "integrations",
        "planners",
    ):
        assert name in names, name
    assert ultracomm.ReplicaManager is ultracomm.moe.ReplicaManager
    assert ultracomm.ResidentPlan is ultracomm.resident_plan.ResidentPlan
