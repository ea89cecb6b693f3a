"""The alpha-beta choice of message transports (ultracomm.alpha_beta): direct one-message sends
where a relay cannot pay for its hop and messages, relay trees with pipelined chunks where the
hot rank's link is the bottleneck; the p2p Context runs the choice with the documented
reduction order; the simulator uses the same function."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from conftest import expert_weights, hot_slot_src
from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.alpha_beta import COSTS, AlphaBeta, best_chunk, choose_schedule, predicted_s, split_chunk_bytes
from ultracomm.tools.reference import reference_reduce_tree
from ultracomm.sim import model as sim_model
from ultracomm.sim.fabric import get_fabric

MiB = 1 << 20
HOT = ReplicaPlan.make(hot_slot_src(8, 2, 1, expert=0), experts_per_rank=1)  # expert 0 on the 7 other ranks


def depths(choice):
    return [choice.schedule.stats(op)["depth"] for op in ("multicast", "reduce")]


def test_one_host_gloo_sends_directly_in_one_message_per_member():
    shared = AlphaBeta(COSTS["gloo"].alpha_s, COSTS["gloo"].beta_Bps, shared=True)
    c = choose_schedule(HOT, 8 * MiB, 16 * MiB, shared)
    assert depths(c) == [1, 1] and c.relay_mode == "off"
    assert c.chunk_bytes == 16 * MiB and c.schedule.stats("multicast")["chunks"] == 1
    # on one medium a relay moves the same bytes and adds its hop: predicted slower
    relay = choose_schedule(HOT, 8 * MiB, 16 * MiB, shared, relay_mode="force")
    assert sum(relay.predicted_s) > sum(c.predicted_s)


def test_independent_links_relay_a_hot_expert_with_pipelined_chunks():
    c = choose_schedule(HOT, 8 * MiB, 16 * MiB, COSTS["nccl"])
    assert min(depths(c)) >= 2 and c.relay_mode == "auto"
    assert c.chunk_bytes < 8 * MiB  # chunks stream down the tree
    direct = choose_schedule(HOT, 8 * MiB, 16 * MiB, COSTS["nccl"], relay_mode="off")
    assert depths(direct) == [1, 1] and sum(c.predicted_s) < sum(direct.predicted_s)
    # the same inputs give the same schedule (every rank decides alike)
    assert choose_schedule(HOT, 8 * MiB, 16 * MiB, COSTS["nccl"]).schedule.digest == c.schedule.digest


def test_predicted_time_counts_messages_bytes_and_fill():
    costs = AlphaBeta(1e-3, 1e9)
    c = choose_schedule(HOT, 8 * MiB, 8 * MiB, costs, relay_mode="off")
    st = c.schedule.stats("multicast")
    # direct: the home sends 7 copies, one message each
    assert st["max_link_bytes"] == 7 * 8 * MiB
    assert predicted_s(c.schedule, "multicast", costs) == pytest.approx(7 * (8 * MiB / 1e9 + 1e-3))


def test_pipeline_and_split_chunks():
    g = COSTS["gloo"]
    assert g.pipeline_chunk(8 * MiB, 2) % 16 == 0 and 64 * 1024 <= g.pipeline_chunk(8 * MiB, 2) <= 8 * MiB
    assert g.pipeline_chunk(1000, 1) == 1008  # at most the bytes, rounded up to 16
    assert split_chunk_bytes(256 * 1024, 32768, 8 * MiB, g) % 32768 == 0
    assert split_chunk_bytes(256 * 1024, 32768, 8 * MiB, g) > 256 * 1024
    assert split_chunk_bytes(64 * MiB, 32768, 8 * MiB, g) == 64 * MiB  # a larger configured chunk is kept
    # whole numbers of chunks: at 2 MiB over gloo a second message (1 ms) costs more than the fill it
    # saves (2 levels x 0.66 ms): one chunk for one level, two for two
    assert g.pipeline_chunk(2 * MiB, 1) == 2 * MiB and g.pipeline_chunk(2 * MiB, 2) == MiB
    # split: one gloo crossing per path, then 2 shared-memory levels (20 us, 6 GB/s) -- one chunk up to
    # 4 MiB, 2 of 8 MiB at 16 MiB, 5 at 64 MiB
    assert [split_chunk_bytes(MiB, 32768, n * MiB, g) for n in (2, 4, 16)] == [2 * MiB, 4 * MiB, 8 * MiB]
    assert -(-64 * MiB // split_chunk_bytes(MiB, 32768, 64 * MiB, g)) == 5


@pytest.mark.parametrize(
    "alpha,beta,levels,granule",
    [(1e-3, 1.6e9, 2, 16), (10e-6, 50e9, 1, 16), (20e-6, 6e9, 3, 4096), (5e-4, 1e9, 1, 32768)],
)
def test_best_chunk_is_the_best_whole_number_of_chunks(alpha, beta, levels, granule):
    """best_chunk checks only a few chunk counts (the time is convex in them); every count agrees."""
    link, inside = AlphaBeta(alpha, beta), COSTS["host_shm"]
    for n in (1000, 65536, 3 * MiB + 5, 16 * MiB, 100 * MiB):
        got = best_chunk(n, link, ((inside, levels),), granule=granule)

        def t(c):
            return -(-n // c) * alpha + n / beta + levels * (c / inside.beta_Bps + inside.alpha_s)

        whole = -(-n // granule) * granule
        lo = min(whole, -(-65536 // granule) * granule)
        cands = sorted({min(whole, max(lo, -(-(-(-n // k)) // granule) * granule)) for k in range(1, n // lo + 2)})
        assert got % granule == 0 and lo <= got <= whole
        assert t(got) <= min(t(c) for c in cands) * (1 + 1e-12), (n, got)
    with pytest.raises(ValueError, match="beta_Bps must be a positive finite number, got 0"):
        AlphaBeta(1e-6, 0)


def test_simulator_uses_the_same_choice():
    fab = get_fabric("h200x8")
    plan = ReplicaPlan.make(hot_slot_src(8, 2, 1, expert=0), experts_per_rank=1)
    got = sim_model.schedule_for(plan, 8 * MiB, 16 * MiB, fab, costs=COSTS["nccl"])
    assert got.digest == choose_schedule(plan, 8 * MiB, 16 * MiB, COSTS["nccl"]).schedule.digest


def test_p2p_context_runs_its_choice_with_the_documented_reduction_order():
    world, epr, slots = 4, 1, 2
    layout = ExpertLayout((Member("w", (1000,), torch.bfloat16),), grad_dtype=torch.float32)
    plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=0), experts_per_rank=epr)
    gen = torch.Generator().manual_seed(5)
    grads = {(r, s): torch.randn(1000, generator=gen) for r in range(world) for s in range(slots)}
    master0 = torch.randn(1000, generator=gen)

    def body(group):
        with Context(group, layout, epr, slots, num_layers=1, transport="p2p", timeout_s=30.0) as ctx:
            r = ctx.rank
            w = [expert_weights(layout, r)[0][None].contiguous()]
            g = [(master0.clone() if r == 0 else torch.zeros(1000))[None].contiguous()]
            ctx.register_masters(0, w, g)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            got_w = ctx.replica_weights[0].clone()
            for s in range(slots):
                ctx.replica_grads[0][s].copy_(grads[(r, s)])
            ctx.grad_reduce(vid)
            return got_w, g[0][0].clone(), ctx.schedule_for(plan)

    res = LoopbackDomain(world).run(body)
    sched = res[0][2]
    assert sched.stats("multicast")["chunks"] == 1  # loopback ranks share a host: direct, one message
    for r, (w, _, _) in enumerate(res):
        for s, e in enumerate(plan.slot_src[r].tolist()):
            if e >= 0:
                assert torch.equal(w[s], expert_weights(layout, e)[0])
    filled = {k: v.numpy() for k, v in grads.items() if plan.slot_src[k[0]][k[1]] >= 0}
    want = reference_reduce_tree(sched, filled, {0: master0.numpy()})
    assert np.array_equal(res[0][1].numpy(), want[0])


def test_split_raises_its_crossing_chunk_and_still_streams_large_slots():
    """A split Context on the CPU: its window chunk is raised to what a gloo message pays for,
    which for a 16 MiB slot still leaves two chunks; weights and the reduction in the
    schedule's documented order come out exact."""
    world, epr, slots, n = 4, 1, 1, 1 << 22  # 16 MiB slots: two chunks over gloo (4 MiB would be one)
    layout = ExpertLayout((Member("w", (n,), torch.float32),), grad_dtype=torch.float32)
    plan = ReplicaPlan.make(np.array([[-1], [0], [0], [0]], np.int32), experts_per_rank=epr)
    gen = torch.Generator().manual_seed(7)
    grads = {(r, 0): torch.randn(n, generator=gen) for r in range(world)}
    master0 = torch.randn(n, generator=gen)
    w0 = torch.randn(n, generator=gen)

    def body(group):
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            transport="split",
            window="local",
            domain="a,a,b,b",
            chunk_bytes=1 << 16,
            tile_bytes=1 << 12,
            timeout_s=60.0,
        ) as ctx:
            r = ctx.rank
            w = [(w0 if r == 0 else torch.zeros(n))[None].clone()]
            g = [(master0 if r == 0 else torch.zeros(n))[None].clone()]
            ctx.register_masters(0, w, g)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            got_w = ctx.replica_weights[0][0].clone()
            ctx.replica_grads[0][0].copy_(grads[(r, 0)])
            ctx.grad_reduce(vid)
            return got_w, g[0][0].clone(), ctx.wlayout["chunk_bytes"], ctx.schedule_for(plan)

    res = LoopbackDomain(world).run(body)
    chunk, sched = res[0][2], res[0][3]
    assert chunk == split_chunk_bytes(1 << 16, 1 << 12, 4 * n, COSTS["gloo"]) and 1 << 16 < chunk < 4 * n
    assert sched.stats("multicast")["chunks"] > 1
    for r in (1, 2, 3):
        assert torch.equal(res[r][0], w0)
    want = reference_reduce_tree(sched, {(r, 0): grads[(r, 0)].numpy() for r in (1, 2, 3)}, {0: master0.numpy()})
    assert np.array_equal(res[0][1].numpy(), want[0])


# ---------------------------------------------------------------------------------------------- split route
def _fan_out_schedule(weight_bytes: int):
    """World 4, domains {0, 1} and {2, 3}; expert 0 (home rank 0) in a slot of ranks 1, 2 and 3, direct:
    rank 0 sends it three times, twice across (to 2 and 3), once inside its domain (to 1)."""
    from ultracomm.schedule import build_schedule

    src = np.array([[-1], [0], [0], [0]], np.int32)
    plan = ReplicaPlan.make(src, experts_per_rank=1)
    return build_schedule(
        plan, weight_bytes, 2 * weight_bytes, node_of=[0, 0, 1, 1], chunk_bytes=1 << 20, relay_mode="off"
    )


def test_split_route_weighs_the_bytes_kept_off_messages_against_the_fixed_cost():
    from ultracomm.alpha_beta import split_route

    gloo, shm = COSTS["gloo"], COSTS["host_shm"]
    assert (shm.op_alpha_s, gloo.beta_Bps) == (1.25e-3, 1.6e9)
    for mib, op, want in (
        (1, "multicast", "messages"),
        (1, "reduce", "messages"),
        (2, "multicast", "messages"),
        (2, "reduce", "messages"),
        (4, "multicast", "split"),
        (4, "reduce", "split"),
        (8, "multicast", "split"),
    ):
        sched = _fan_out_schedule(mib << 20)
        r = split_route(sched, op, [0, 0, 1, 1])
        kept = (mib << 20) * (1 if op == "multicast" else 2)  # the edge 0 <- / -> 1 inside domain 0
        assert r.saved_bytes == kept and r.saved_s == kept / 1.6e9
        # per rank of the largest domain (2 ranks), twice for a reduction (two hand-offs per edge)
        assert r.fixed_s == 2 * 1.25e-3 * (1 if op == "multicast" else 2)
        assert r.route == want, (mib, op, r)
    # the same bytes where a domain holds four ranks: twice the fixed cost, so 8 MiB of grads kept off
    # gloo (5.2 ms) no longer pay for shared memory (10 ms)
    sched = _fan_out_schedule(4 << 20)
    assert split_route(sched, "reduce", [0, 0, 1, 1]).route == "split"
    r = split_route(sched, "reduce", [0, 0, 0, 0, 1, 1, 1, 1])
    assert (r.route, r.fixed_s, r.saved_bytes) == ("messages", 4 * 1.25e-3 * 2, 8 << 20)
    with pytest.raises(ValueError, match="op_alpha_s must be a finite number >= 0"):
        AlphaBeta(1e-3, 1e9, op_alpha_s=-1.0)
