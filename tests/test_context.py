"""Context end to end on loopback domains (ranks as threads over `local` windows)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ultracomm
from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.errors import PlanError, RegistrationError, UltracommError
from ultracomm.schedule import build_schedule

from conftest import expected_master_grads, expert_weights, hot_slot_src, random_slot_src, window_bytes


def make_layout(n1: int, n2: int, dtype=torch.bfloat16, grad_dtype=torch.float32) -> ExpertLayout:
    return ExpertLayout((Member("fc1", (n1, 3), dtype), Member("fc2", (n2,), dtype)), grad_dtype=grad_dtype)


def masters_for(layout: ExpertLayout, rank: int, epr: int):
    experts = range(rank * epr, (rank + 1) * epr)
    per = [expert_weights(layout, e) for e in experts]
    weights = [torch.stack([p[m] for p in per]).contiguous() for m in range(len(layout.members))]
    grads = [torch.zeros((epr, *m.shape), dtype=layout.grad_dtype) for m in layout.members]
    return weights, grads


def check_replicas(ctx: Context, plan: ReplicaPlan) -> None:
    for s, e in enumerate(plan.slot_src[ctx.rank].tolist()):
        if e < 0:
            continue
        want = expert_weights(ctx.layout, e)
        for m, w in enumerate(want):
            got = ctx.replica_weights[m][s]
            assert torch.equal(got.view(torch.uint8) if got.dtype == torch.bool else got, w), (
                f"rank {ctx.rank} slot {s} expert {e} member {m} differs"
            )


def run_multicast(world, slots, epr, slot_src, layout, relay_mode, chunk_bytes, restore=True):
    plan = ReplicaPlan.make(slot_src, experts_per_rank=epr)
    domain = LoopbackDomain(world)

    def body(group):
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=2,
            max_microbatches=2,
            relay_mode=relay_mode,
            chunk_bytes=chunk_bytes,
            tile_bytes=16,
            num_workers=2,
            timeout_s=30.0,
        ) as ctx:
            for layer in range(2):
                ctx.register_masters(layer, *masters_for(layout, ctx.rank, epr))
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            check_replicas(ctx, plan)
            if restore:
                for t in ctx.replica_weights:  # clobber the slots as another layer would
                    t.zero_()
                group.barrier()
                work = ctx.restore(vid, async_op=True)
                assert isinstance(work, ultracomm.Work)
                work.wait()
                check_replicas(ctx, plan)
            ctx.end(vid)
            return ctx.schedule_for(plan).stats()

    return domain.run(body)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    world=st.integers(2, 8),
    slots=st.integers(1, 3),
    epr=st.integers(1, 3),
    seed=st.integers(0, 2**31),
    mode=st.sampled_from(["off", "auto", "force"]),
    fill=st.sampled_from([0.0, 0.5, 1.0]),
    n1=st.integers(1, 40),
    n2=st.integers(1, 33),
    chunk=st.sampled_from([16, 48, 256]),
)
def test_multicast_random_plans(world, slots, epr, seed, mode, fill, n1, n2, chunk):
    rng = np.random.default_rng(seed)
    slot_src = random_slot_src(rng, world, slots, epr, fill)
    run_multicast(world, slots, epr, slot_src, make_layout(n1, n2), mode, chunk, restore=False)


@pytest.mark.parametrize("mode", ["off", "auto", "force"])
def test_multicast_one_expert_to_every_rank(mode):
    world, epr = 8, 2
    slot_src = hot_slot_src(world, 2, epr, expert=3)
    stats = run_multicast(world, 2, epr, slot_src, make_layout(37, 5), mode, chunk_bytes=64)
    depths = {st["multicast"]["depth"] for st in stats}
    assert len(depths) == 1  # every rank built the same trees
    depth = depths.pop()
    if mode == "off":
        assert depth == 1
    elif mode == "force":
        assert depth >= 2


def test_multicast_slots_at_limit_odd_sizes():
    # every slot of every rank filled, expert bytes not a multiple of the chunk
    world, slots, epr = 4, 3, 1
    slot_src = np.array([[(r + k) % world for k in range(1, slots + 1)] for r in range(world)], dtype=np.int32)
    run_multicast(world, slots, epr, slot_src, make_layout(13, 7, dtype=torch.float16), "auto", 48)


def test_empty_plan_moves_nothing():
    world, slots, epr = 3, 2, 1
    layout = make_layout(4, 4)
    plan = ReplicaPlan.make(np.full((world, slots), -1, np.int32), experts_per_rank=epr)

    def body(group):
        with Context(group, layout, epr, slots, num_layers=1) as ctx:
            ctx.register_masters(0, *masters_for(layout, ctx.rank, epr))
            data_end = ctx.wlayout["ready_off"]  # slots only: flags are allowed to move
            before = ctx.window.local[:data_end].clone()
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            ctx.grad_reduce(vid)
            assert torch.equal(ctx.window.local[:data_end], before)
        return True

    assert LoopbackDomain(world).run(body) == [True] * world


# ---------------------------------------------------------------- reduction


def _reduce_case(world, slots, epr, slot_src, grad_dtype, mode, chunk, runs=1, jitter_us=0, node_of=None):
    layout = make_layout(9, 21, grad_dtype=grad_dtype)
    plan = ReplicaPlan.make(slot_src, experts_per_rank=epr)
    full = build_schedule(
        plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=chunk, relay_mode=mode, node_of=node_of
    )
    gen = torch.Generator().manual_seed(7)
    init_master = [
        [torch.randn((epr, *m.shape), generator=gen).to(grad_dtype) for m in layout.members] for _ in range(world)
    ]
    init_replica = [
        [torch.randn((slots, *m.shape), generator=gen).to(grad_dtype) for m in layout.members] for _ in range(world)
    ]
    want, want_slots = expected_master_grads(full, layout, plan, init_master, init_replica, with_slots=True)
    domain = LoopbackDomain(world)

    def body(group):
        r = group.rank
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            relay_mode=mode,
            chunk_bytes=chunk,
            tile_bytes=16,
            num_workers=2,
            jitter_us=jitter_us,
            timeout_s=30.0,
            node_of=node_of,
        ) as ctx:
            weights, grads = masters_for(layout, r, epr)
            ctx.register_masters(0, weights, grads)
            results = []
            for _ in range(runs):
                for m in range(len(layout.members)):
                    grads[m].copy_(init_master[r][m])
                    ctx.replica_grads[m].copy_(init_replica[r][m])
                group.barrier()
                vid = ctx.begin(0)
                ctx.weight_sync(vid, plan)
                ctx.grad_reduce(vid)
                results.append([g.clone() for g in grads])
                # replica grads are consumed: relays now hold their partial sums, leaves are untouched
                for m in range(len(layout.members)):
                    assert torch.equal(ctx.replica_grads[m], want_slots[r][m]), f"rank {r} member {m} slots"
            return results

    got = domain.run(body)
    for r in range(world):
        for run in got[r]:
            for m in range(len(layout.members)):
                assert torch.equal(run[m], want[r][m]), f"rank {r} member {m} differs from the ordered fp32 sum"
    return full


@pytest.mark.parametrize("grad_dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", ["off", "force"])
def test_grad_reduce_bit_exact(grad_dtype, mode):
    world, slots, epr = 6, 2, 2
    slot_src = random_slot_src(np.random.default_rng(3), world, slots, epr, fill=1.0)
    slot_src[1:, 0] = [0, 0, 0, 0, 0]  # expert 0 (home rank 0) replicated on every other rank
    slot_src[0, 0] = -1
    full = _reduce_case(world, slots, epr, slot_src, grad_dtype, mode, chunk=32)
    if mode == "force":
        assert full.stats("reduce")["depth"] >= 2


def test_grad_reduce_deterministic_under_jitter():
    world, slots, epr = 5, 2, 1
    slot_src = hot_slot_src(world, slots, epr, expert=0)
    slot_src[:, 1] = [1, 2, 3, 4, 2]
    _reduce_case(world, slots, epr, slot_src, torch.bfloat16, "force", chunk=16, runs=20, jitter_us=300)


# ---------------------------------------------------------------- bad input


def test_plan_mismatch_across_ranks_moves_nothing():
    world, slots, epr = 3, 1, 1
    layout = make_layout(4, 4)
    plans = [
        ReplicaPlan.make(np.array([[1], [0], [-1]], np.int32), experts_per_rank=1),
        ReplicaPlan.make(np.array([[2], [0], [-1]], np.int32), experts_per_rank=1),
    ]

    def body(group):  # the plan agreement's check (the window's: test_window_plan_check.py)
        with Context(group, layout, epr, slots, num_layers=1, plan_check="agree") as ctx:
            ctx.register_masters(0, *masters_for(layout, ctx.rank, epr))
            vid = ctx.begin(0)
            before = window_bytes(ctx)
            with pytest.raises(ValueError, match="plan differs across ranks"):
                ctx.weight_sync(vid, plans[0] if group.rank != 1 else plans[1])
            assert torch.equal(window_bytes(ctx), before)
        return True

    assert LoopbackDomain(world).run(body) == [True] * world


def test_bad_registration_and_usage_errors():
    layout = make_layout(4, 4)

    def body(group):
        with Context(group, layout, 1, 1, num_layers=2) as ctx:
            w, g = masters_for(layout, ctx.rank, 1)
            with pytest.raises(RegistrationError):
                ctx.register_masters(0, [w[0]], g)  # one member missing
            with pytest.raises(RegistrationError):
                ctx.register_masters(0, [w[0].float(), w[1]], g)  # wrong dtype
            with pytest.raises(RegistrationError, match="out of range"):
                ctx.register_masters(5, w, g)
            with pytest.raises(RegistrationError, match="register_masters"):
                ctx.begin(1)
            ctx.register_masters(0, w, g)
            vid = ctx.begin(0)
            with pytest.raises(UltracommError, match="layer 0 already has 1 micro-batches in flight"):
                ctx.begin(0)
            with pytest.raises(UltracommError, match="weight_sync"):
                ctx.grad_reduce(vid)
            with pytest.raises(ValueError, match="not in flight"):
                ctx.restore(7)
            with pytest.raises(ValueError, match="slots per rank"):
                ctx.weight_sync(vid, ReplicaPlan.make(np.full((2, 2), -1, np.int32), experts_per_rank=1))
        return True

    LoopbackDomain(2).run(body)


def test_invalid_plan_rejected():
    with pytest.raises(PlanError, match="own home rank"):
        ReplicaPlan.make(np.array([[0], [-1]], np.int32), experts_per_rank=1)


def test_mismatched_context_configuration():
    def body(group):
        n = 4 if group.rank == 0 else 5
        with pytest.raises(ValueError, match="Context configuration differs"):
            Context(group, make_layout(n, 4), 1, 1, num_layers=1)
        return True

    LoopbackDomain(2).run(body)


def test_unknown_transport_and_window_rejected_before_setup():
    from ultracomm.cuda.support import cuda_module_reason, torch_cuda_reason

    def body(group):
        if torch_cuda_reason() or cuda_module_reason():  # a machine that cannot run tma says why
            with pytest.raises(ValueError, match="transport 'tma' is not available"):
                Context(group, make_layout(4, 4), 1, 1, num_layers=1, transport="tma")
        # every provider is built now: a GPU transport or nvshmem itself says why it cannot run here
        with pytest.raises(ValueError, match="(transport 'tma'|window 'nvshmem') is not available: "):
            Context(group, make_layout(4, 4), 1, 1, num_layers=1, window="nvshmem")
        return True

    LoopbackDomain(2).run(body)


def test_grad_reduce_two_nodes():
    world, slots, epr = 4, 2, 1
    slot_src = np.array([[1, 2], [0, 3], [0, 1], [0, 2]], np.int32)
    full = _reduce_case(world, slots, epr, slot_src, torch.float32, "auto", chunk=64, node_of=[0, 0, 1, 1])
    pr, _, _ = full.tree("multicast")
    # expert 0 (home rank 0, node 0) crosses to node 1 once: only one of ranks 2, 3 is fed from node 0
    assert sorted(int(pr[r, 0]) in (0, 1) for r in (2, 3)) == [False, True]


def test_one_rank_with_an_invalid_plan_fails_every_rank():
    layout = make_layout(4, 4)
    good = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)
    bad = ReplicaPlan.make(np.full((2, 2), -1, np.int32), experts_per_rank=1)  # wrong slots per rank

    def body(group):  # the plan agreement's check (the window's: test_window_plan_check.py)
        with Context(group, layout, 1, 1, num_layers=1, plan_check="agree") as ctx:
            ctx.register_masters(0, *masters_for(layout, ctx.rank, 1))
            vid = ctx.begin(0)
            before = window_bytes(ctx)
            if group.rank == 0:
                with pytest.raises(ValueError, match=r"ranks \[1\] rejected their plan"):
                    ctx.weight_sync(vid, good)
            else:
                with pytest.raises(ValueError, match="slots per rank"):
                    ctx.weight_sync(vid, bad)
            assert torch.equal(window_bytes(ctx), before)
        return True

    assert LoopbackDomain(2).run(body) == [True, True]


def test_cost_model_must_agree_across_ranks():
    def body(group):
        with pytest.raises(ValueError, match="Context configuration differs"):
            Context(group, make_layout(4, 4), 1, 1, num_layers=1, intra_bw=370e9 if group.rank else 900e9)
        return True

    LoopbackDomain(2).run(body)


def test_async_ops_queue_in_order_and_synchronize():
    world, slots, epr = 3, 2, 2
    layout = make_layout(5, 3)
    plans = [
        ReplicaPlan.make(random_slot_src(np.random.default_rng(s), world, slots, epr, 1.0), experts_per_rank=epr)
        for s in range(2)
    ]

    def body(group):
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=2,
            max_microbatches=2,
            chunk_bytes=32,
            tile_bytes=16,
            relay_mode="force",
        ) as ctx:
            for layer in range(2):
                ctx.register_masters(layer, *masters_for(layout, ctx.rank, epr))
            v0, v1 = ctx.begin(0), ctx.begin(1)
            works = [
                ctx.weight_sync(v0, plans[0], async_op=True),
                ctx.weight_sync(v1, plans[1], async_op=True),
                ctx.restore(v0, async_op=True),
            ]
            ctx.synchronize()
            assert all(w.is_completed() and w.exception() is None for w in works)
            check_replicas(ctx, plans[0])  # the last one queued wins the shared slots
            ctx.end(v0)
            ctx.end(v1)
        return True

    assert LoopbackDomain(world).run(body) == [True] * world


def _two_ranks_one_swap(fn, **ctx_kw):
    """Two loopback ranks that replicate each other's expert; ``fn(group, ctx, vid, plan)`` runs on
    each after registration and ``begin``."""
    layout = make_layout(4, 4)
    plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)

    def body(group):
        with Context(group, layout, 1, 1, num_layers=1, **ctx_kw) as ctx:
            ctx.register_masters(0, *masters_for(layout, ctx.rank, 1))
            fn(group, ctx, ctx.begin(0), plan)
        return True

    assert LoopbackDomain(2).run(body) == [True, True]


def test_failed_operation_stops_queued_ones():
    def fn(group, ctx, vid, plan):
        if group.rank == 1:  # agrees on the plan, then never joins the data movement
            ctx._prepare_plan(plan)
            return
        first = ctx.weight_sync(vid, plan, async_op=True)
        second = ctx.restore(vid, async_op=True)
        with pytest.raises(ultracomm.UltracommTimeout, match="rank 1"):
            first.wait()
        with pytest.raises(UltracommError, match="not started: an earlier operation"):
            second.wait()
        ready = ctx.window.local[ctx.wlayout["ready_off"] : ctx.wlayout["ready_off"] + 8].view(torch.int64)
        assert int(ready) == 1  # epoch 2 never raised its ready flag
        with pytest.raises(UltracommError, match="failed earlier"):
            ctx.restore(vid)

    _two_ranks_one_swap(fn, timeout_s=0.3)


def test_wait_with_a_timeout_raises_ultracomm_timeout_and_the_operation_goes_on():
    rank0_gave_up = threading.Event()

    def fn(group, ctx, vid, plan):
        if group.rank == 1:  # runs its part of the swap only once rank 0's wait has given up
            run = ctx.transport.run
            ctx.transport.run = lambda *a, **k: (rank0_gave_up.wait(30), run(*a, **k))
        work = ctx.weight_sync(vid, plan, async_op=True)
        if group.rank == 0:
            try:
                with pytest.raises(ultracomm.UltracommTimeout) as ei:
                    work.wait(timeout=0.05)
            finally:
                rank0_gave_up.set()
            assert isinstance(ei.value, TimeoutError)  # callers catching the built-in still catch it
            assert str(ei.value) == (
                "ultracomm: weight_sync (rank 0, epoch 1) did not finish within wait(timeout=0.05 s); awaited: its "
                "turn on this rank's ordered worker thread, then its run there (peers' flags and data). The "
                "operation goes on (bounded by ULTRACOMM_TIMEOUT_S) and the Context stays usable: call wait() again "
                "to keep waiting"
            )
            assert not work.is_completed()
        assert work.wait() is True
        check_replicas(ctx, plan)
        ctx.restore(vid)  # still usable
        check_replicas(ctx, plan)

    _two_ranks_one_swap(fn, timeout_s=30)


def test_restore_timeout_names_restore():
    def fn(group, ctx, vid, plan):
        ctx.weight_sync(vid, plan)
        group.barrier()
        if group.rank == 0:  # rank 1 has left: its restore never starts
            with pytest.raises(ultracomm.UltracommTimeout, match=r"rank 0 restore .*rank 1"):
                ctx.restore(vid)

    _two_ranks_one_swap(fn, timeout_s=0.3)


def test_set_relay_mode_rebuilds_schedules_and_checks_the_mode():
    """Context.set_relay_mode: schedules built afterwards use the new mode (the cached one is
    dropped), a bad mode is refused; stream_ordered is False on the host executor."""
    layout = make_layout(64, 32)
    plan = ReplicaPlan.make(hot_slot_src(4, 2, 1), experts_per_rank=1)

    def body(group):
        from ultracomm.errors import ConfigError

        with Context(
            group, layout, 1, 2, num_layers=1, relay_mode="force", chunk_bytes=16, tile_bytes=16, timeout_s=30.0
        ) as ctx:
            forced = ctx.schedule_for(plan).stats()
            ctx.set_relay_mode("off")
            direct = ctx.schedule_for(plan).stats()
            with pytest.raises(ConfigError):
                ctx.set_relay_mode("sometimes")
            assert ctx.config.relay_mode == "off" and not ctx.stream_ordered
            return forced, direct

    for forced, direct in LoopbackDomain(4).run(body):
        assert forced != direct
        assert direct["multicast"]["depth"] == 1 and forced["multicast"]["depth"] >= 2


def test_set_plan_gives_grad_reduce_a_plan_without_a_multicast():
    """set_plan: the plan checked and agreed as weight_sync does, no byte moved (the replica
    weights came another way); grad_reduce then adds the caller's replica grads into the masters
    exactly as after a weight_sync."""
    world, slots, epr = 3, 1, 1
    layout = make_layout(4, 4)
    plan = ReplicaPlan.make(np.array([[1], [0], [0]], np.int32), experts_per_rank=1)

    def body(group):
        with Context(group, layout, epr, slots, num_layers=1) as ctx:
            weights, grads = masters_for(layout, ctx.rank, epr)
            ctx.register_masters(0, weights, grads)
            vid = ctx.begin(0)
            before = [t.clone() for t in ctx.replica_weights]
            ctx.set_plan(vid, plan)
            assert all(torch.equal(a, b) for a, b in zip(before, ctx.replica_weights))  # nothing moved
            for m, g in enumerate(ctx.replica_grads):
                g.fill_(float(1 + ctx.rank + 10 * m))
            ctx.grad_reduce(vid)
            return [g.clone() for g in grads]

    got = LoopbackDomain(world).run(body)

    def filled(t, v):
        return torch.equal(t, torch.full_like(t, v))

    # rank 0's expert 0 is replicated on ranks 1 and 2: grads 2 + 3 (member 0), 12 + 13 (member 1)
    assert filled(got[0][0], 5.0) and filled(got[0][1], 25.0)
    assert filled(got[1][0], 1.0) and filled(got[1][1], 11.0)  # rank 1's expert 1 on rank 0: 1 and 11
    assert not got[2][0].any() and not got[2][1].any()
