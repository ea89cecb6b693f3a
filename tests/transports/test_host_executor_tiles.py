"""Tiles (issue 34): a chunk moved as tiles that any worker claims from the per-operation counter,
the chunk still the unit a receiver waits for -- the worker retiring a chunk's last tile releases
it.  Small tiles and many workers split every chunk across workers; every byte and every sum
must be what whole chunks give (interp.h run_tasks / run_copy / run_reduce, both host movers).
The receiver's side -- nobody sees a chunk's flag before all its tiles are written -- is
tests/transports/test_interp_harness.py's observer under ThreadSanitizer, with a mutant that releases on
every tile.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import _core
from ultracomm.records import MASTER, Op, TaskKind
from ultracomm.tools.reference import tasks_from_trees as build_tasks, member_mask, reference_reduce

from test_host_executor import ESIZE, FILL, Cluster, bits_equal, check_multicast, ok, slots_of, _random_plan

MOVERS = [dict(mover="host"), dict(mover="block", threads_per_worker=3)]
MOVER_IDS = ["host", "block"]


def test_default_tile_is_64k_and_must_be_a_multiple_of_16():
    cl = Cluster(2, 1, [4096], chunk=1024)
    trees = [(0, 0, {(0, MASTER): [(1, 0)]})]
    my = slots_of(2, 1, trees)
    tasks, refs = build_tasks(2, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    assert "tile_bytes: the work unit" in _core.run_host.__doc__ and "default 64 KiB" in _core.run_host.__doc__
    with pytest.raises(ValueError, match="tile_bytes must be a multiple of 16"):
        _core.run_host(**cl.args(Op.MULTICAST, 0, tasks, refs, my, 1, tile_bytes=100))
    assert bool((cl.weight_slot(1, 0) == FILL).all())  # nothing written
    with pytest.raises(ValueError, match="more than 2\\^31 - 1 tiles"):
        cl2 = Cluster(2, 1, [16], chunk=1 << 40)
        t2, r2 = build_tasks(2, trees, cl2.wsb, cl2.chunk, TaskKind.COPY)
        _core.run_host(**cl2.args(Op.MULTICAST, 0, t2, r2, my, 1, tile_bytes=16))


@pytest.mark.parametrize("mover", MOVERS, ids=MOVER_IDS)
@pytest.mark.parametrize("tile", [64, 208, 4096, 0])  # 16 tiles / chunk, a short last tile, one tile, tiles off
def test_multicast_tiles_relay_and_fanout_exact_bytes(mover, tile):
    # chunks of 1 KiB split into tiles; a relay chain (each hop waits for the chunk the last tile
    # of its parent's task released) and a 3-way fan-out; members of odd sizes, so tiles cross
    # member boundaries and padding must keep FILL
    cl = Cluster(4, 2, [2500, 333, 7, 600], chunk=1024, num_experts=4)
    trees = [
        (0, 0, {(0, MASTER): [(1, 0)], (1, 0): [(2, 1)], (2, 1): [(3, 0)]}),
        (2, 2, {(2, MASTER): [(0, 1), (1, 1), (3, 1)]}),
    ]
    my = slots_of(4, 2, trees)
    tasks, refs = build_tasks(4, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    assert cl.L["weight_chunks"] == 4
    for it in range(3):  # epochs: the per-task counters are zero again after each run
        for e in (0, 2):
            for t in cl.masters[e]:
                t.random_(0, 256)
        ok(cl.run(Op.MULTICAST, tasks, refs, my, num_workers=8, tile_bytes=tile, jitter_us=40, jitter_seed=it, **mover))
        check_multicast(cl, my)


def _reduce_case(dtype, seed):
    # expert 0 (home 0): (1,0) pre-reduces (2,0) and (3,0); the home sums (1,0) and (2,1);
    # expert 1 (home 1): direct, sources (3,1), (0,0), (2,2).  1 KiB chunks.
    cl = Cluster(4, 3, [4000, 1440, 256], chunk=1024, num_experts=4, grad_dtype=dtype, seed=seed)
    trees = [
        (0, 0, {(0, MASTER): [(1, 0), (2, 1)], (1, 0): [(2, 0), (3, 0)]}),
        (1, 1, {(1, MASTER): [(3, 1), (0, 0), (2, 2)]}),
    ]
    my = slots_of(4, 3, trees)
    tasks, refs = build_tasks(4, trees, cl.gsb, cl.chunk, TaskKind.REDUCE)
    init, master_init = cl.random_replica_grads(my, seed + 1)
    return cl, my, tasks, refs, init, master_init


def _reset(cl, init, master_init):
    for r in range(cl.world):
        for s in range(cl.slots):
            cl.grad_slot(r, s).copy_(init[r][s])
    for e, ms in master_init.items():
        for t, t0 in zip(cl.master_grads[e], ms):
            t.copy_(t0)


@pytest.mark.parametrize("mover", MOVERS, ids=MOVER_IDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=["fp32", "bf16", "fp16"])
def test_reduce_tiles_exact_ordered_sums(mover, dtype):
    """Every element is summed in the schedule's source order by the one worker holding its tile:
    the ordered reference bit for bit, and the same bytes as whole chunks, for tiles that split
    each chunk in 16 (64 B), unevenly (208 B) or not at all."""
    cl, my, tasks, refs, init, master_init = _reduce_case(dtype, seed=5)
    exp_grads, exp_masters = reference_reduce(tasks, refs, init, master_init, cl.g_off, cl.g_bytes, dtype)
    mask = member_mask(cl.g_off, cl.g_bytes, cl.gsb)
    images = []
    for tile in (64, 208, 0):
        _reset(cl, init, master_init)
        ok(cl.run(Op.REDUCE, tasks, refs, my, num_workers=8, tile_bytes=tile, jitter_us=40, jitter_seed=tile, **mover))
        for e in (0, 1):
            for got, want in zip(cl.master_grads[e], exp_masters[e]):
                assert bits_equal(got, want, dtype), (tile, e)
        relay = cl.grad_slot(1, 0)  # the relay's partial, padding kept
        assert bits_equal(relay[mask], exp_grads[1][0][mask], dtype) and bool((relay[~mask] == FILL).all())
        images.append(torch.cat([t.view(torch.uint8) for e in (0, 1) for t in cl.master_grads[e]] + [relay]).clone())
    assert all(torch.equal(images[0], x) for x in images[1:])


@pytest.mark.parametrize("seed,relay_mode,dtype", [(10, "force", torch.float32), (11, "auto", torch.bfloat16)])
def test_random_plans_tiles_match_whole_chunks(seed, relay_mode, dtype):
    from ultracomm import schedule as sched_mod

    rng = np.random.default_rng(seed)
    world, slots = 5, 3
    experts = 2 * world
    plan = _random_plan(world, slots, experts, rng)
    cl = Cluster(
        world,
        slots,
        [3001, 90, 13],
        [k * ESIZE[dtype] for k in (700, 45, 6)],
        chunk=512,
        num_experts=experts,
        home_of=[int(h) for h in plan.home_of],
        grad_dtype=dtype,
        seed=seed,
    )
    sch = sched_mod.build_schedule(plan, cl.wsb, cl.gsb, chunk_bytes=cl.chunk, relay_mode=relay_mode)
    my = plan.slot_src.tolist()
    init, master_init = cl.random_replica_grads(my, seed)
    out = {}
    for tile in (0, 48):
        _reset(cl, init, master_init)
        for op in (Op.MULTICAST, Op.REDUCE):
            tasks = [sch.tasks(op, r) for r in range(world)]
            refs = [sch.refs(op, r) for r in range(world)]
            parent = sch.tree(op)[0]
            ok(
                cl.run(
                    op,
                    tasks,
                    refs,
                    my,
                    num_workers=6,
                    tile_bytes=tile,
                    jitter_us=30,
                    jitter_seed=seed,
                    per_rank=lambda r: {"slot_parent": [int(p) for p in parent[r]]},
                )
            )
            if op == Op.MULTICAST:
                check_multicast(cl, my)
        out[tile] = [t.clone() for e in range(experts) for t in cl.master_grads[e]]
        out[tile] += [cl.grad_slots(r).clone() for r in range(world)]
    assert all(torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for a, b in zip(out[0], out[48]))


def test_tiles_of_a_failed_run_do_not_leak_into_the_next():
    """A run that stops (a destination never joins) leaves tiles half retired; the next run of the
    same lists (its own counters) still moves every byte."""
    cl = Cluster(3, 1, [4096], chunk=2048)
    trees = [(0, 0, {(0, MASTER): [(1, 0), (2, 0)]})]
    my = slots_of(3, 1, trees)
    tasks, refs = build_tasks(3, trees, cl.wsb, cl.chunk, TaskKind.COPY)
    errs = cl.run(Op.MULTICAST, tasks, refs, my, ranks=[0, 1], num_workers=4, tile_bytes=256, timeout_s=0.3)
    assert errs[0] is not None and "rank 2" in str(errs[0])
    ok(cl.run(Op.MULTICAST, tasks, refs, my, num_workers=4, tile_bytes=256))
    check_multicast(cl, my)
