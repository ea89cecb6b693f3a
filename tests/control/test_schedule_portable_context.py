"""Context with ``schedule_builder="portable"`` (ULTRACOMM_SCHEDULE_BUILDER) on the host executor,
side by side with the host builder on the same plan: replica weights exact; master grads
bit-identical to the host builder's run where the two builders' reduce trees are the same, and
in any case equal to the documented fp32 order of the portable schedule's own tree
(``expected_master_grads`` replays its task lists)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import Context, LoopbackDomain, ReplicaPlan

from conftest import expected_master_grads, random_slot_src
from test_context import check_replicas, make_layout, masters_for


class AllRanks:
    """Every rank's lists of one builder, as expected_master_grads reads them."""

    def __init__(self, scheds):
        self.scheds = scheds

    def tasks(self, op, r):
        return self.scheds[r].tasks(op, r)

    def refs(self, op, r):
        return self.scheds[r].refs(op, r)


def run(builder, plan, layout, epr, slots, init_master, init_replica, sync_plan=None, **kw):
    """Every rank's master grads and schedule after weight_sync and grad_reduce of ``plan`` (or of
    ``sync_plan``, another form of it, e.g. a ResidentPlan), replica weights checked."""

    def body(group):
        r = group.rank
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            chunk_bytes=32,
            tile_bytes=16,
            num_workers=2,
            timeout_s=30.0,
            schedule_builder=builder,
            **kw,
        ) as ctx:
            weights, grads = masters_for(layout, r, epr)
            ctx.register_masters(0, weights, grads)
            for m in range(len(layout.members)):
                grads[m].copy_(init_master[r][m])
                ctx.replica_grads[m].copy_(init_replica[r][m])
            group.barrier()
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan if sync_plan is None else sync_plan)
            check_replicas(ctx, plan)
            assert ctx.replicas(vid) == plan.slot_src[r].tolist()
            sched = ctx._get(vid).schedule  # the schedule the operations ran
            ctx.grad_reduce(vid)
            return [g.clone() for g in grads], sched

    return LoopbackDomain(plan.world).run(body)


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(
    "seed, intra_bw, same",
    [(5, 370e9, True), (5, 1e6, True), (1, 1e6, False)],
    ids=["direct", "relayed-same-trees", "relayed-other-trees"],
)
def test_portable_builder_matches_host_builder(grad_dtype, seed, intra_bw, same):
    world, slots, epr = 6, 2, 2
    slot_src = random_slot_src(np.random.default_rng(seed), world, slots, epr, fill=1.0)
    slot_src[1:, 0] = 0  # expert 0 (home 0) on every other rank: relays pay off when hops are cheap
    slot_src[0, 0] = -1
    slot_src[:, 1][slot_src[:, 1] == 0] = -1  # one replica of an expert per rank
    plan = ReplicaPlan.make(slot_src, experts_per_rank=epr)
    layout = make_layout(9, 21, grad_dtype=grad_dtype)
    gen = torch.Generator().manual_seed(11)
    init_master = [
        [torch.randn((epr, *m.shape), generator=gen).to(grad_dtype) for m in layout.members] for _ in range(world)
    ]
    init_replica = [
        [torch.randn((slots, *m.shape), generator=gen).to(grad_dtype) for m in layout.members] for _ in range(world)
    ]
    host = run("host", plan, layout, epr, slots, init_master, init_replica, intra_bw=intra_bw)
    port = run("portable", plan, layout, epr, slots, init_master, init_replica, intra_bw=intra_bw)
    scheds = [s for _, s in port]
    assert type(scheds[0]).__name__ == "PortableSchedule"
    assert len({s.digest for s in scheds}) == 1 and scheds[0].digest != host[0][1].digest
    want = expected_master_grads(AllRanks(scheds), layout, plan, init_master, init_replica)
    same_tree = all(np.array_equal(a, b) for a, b in zip(scheds[0].tree("reduce"), host[0][1].tree("reduce")))
    for r in range(world):
        for m in range(len(layout.members)):
            assert torch.equal(port[r][0][m], want[r][m]), (r, m)
            if same_tree:
                assert torch.equal(port[r][0][m].view(torch.uint8), host[r][0][m].view(torch.uint8)), (r, m)
    assert same_tree == same  # both paths exercised: bit-identical runs, and the documented order
    assert scheds[0].stats("reduce")["relayed"] == (intra_bw == 1e6)  # cheap hops: the hot expert relays


def test_ranks_must_agree_on_the_builder():
    layout = make_layout(4, 4)

    def body(group):
        with Context(group, layout, 1, 1, num_layers=1, schedule_builder="portable" if group.rank else "host"):
            pass

    with pytest.raises(ValueError, match=r"Context configuration differs across ranks.*'host'.*'portable'"):
        LoopbackDomain(2).run(body)
