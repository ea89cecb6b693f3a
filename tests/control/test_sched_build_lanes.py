"""The schedule builder as one CTA (include/ultracomm/impl/sched_build.h over a lane group; issue 33):
the host build run on 1, 2, 8 and 32 host threads standing in for the CTA's lanes (in warps of 1
to 32, one candidate tree per warp) writes the same bytes -- tasks, refs, trees, digest, and in a
plan-arena slot my_slots and slot_parent -- as the one-lane build and as the former one-thread
builder (``_core.build_schedule_portable_serial_ref``, kept as the oracle), over worlds 2-288,
up to 1024 experts, 1-4 slots, with and without node_of.  Also: the kernel's launch shape (no
one-thread builder left, the scratch in bounded shared memory) and its SASS (no local memory,
bounded static shared memory, block barriers, warp shuffles and atomic counts)."""

from __future__ import annotations

import os
import re

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ultracomm import _core

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LANES = [(1, 0), (2, 0), (8, 0), (32, 0), (32, 32), (8, 2)]  # (lanes, warp_lanes; 0: lanes / 8)


def problem(seed, world, slots, experts, nodes, skew, scatter_homes):
    """(slot_src, home_of, node_of, weight bytes, grad bytes): Zipf-hot experts replicated on
    up to every rank (deep trees, gateways), homes contiguous or scattered, a plan ~90% filled."""
    rng = np.random.default_rng(seed)
    home_of = rng.integers(0, world, experts) if scatter_homes else np.arange(experts) * world // experts
    home_of = home_of.astype(np.int32)
    w = 1.0 / np.arange(1, experts + 1) ** skew
    w = w[rng.permutation(experts)]
    w /= w.sum()
    slot_src = np.full((world, slots), -1, np.int32)
    for r in range(world):
        cand = rng.choice(experts, size=min(experts, 4 * slots + 4), replace=False, p=w)
        picks = [int(e) for e in cand if home_of[e] != r][:slots]
        for s, e in enumerate(picks):
            if rng.random() < 0.9:
                slot_src[r, s] = e
    node_of = None if nodes == 0 else (np.arange(world) * min(nodes, world) // world).astype(np.int32)
    return slot_src, home_of, node_of, int(rng.integers(0, 200)) * 16, int(rng.integers(1, 200)) * 16


def assert_same(got, want, where):
    for op in ("multicast", "reduce"):
        g, w = got[op], want[op]
        assert g["tasks"].tobytes() == w["tasks"].tobytes(), (where, op, "tasks")
        assert g["refs"].tobytes() == w["refs"].tobytes(), (where, op, "refs")
        for k in ("parent_rank", "parent_slot", "depth"):
            assert np.array_equal(g[k], w[k]), (where, op, k)
        for k in ("cap", "busiest", "depth_max"):
            assert g[k] == w[k], (where, op, k)
    for k in ("digest", "lower_bound", "candidates"):
        assert got[k] == want[k], (where, k)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(
    seed=st.integers(0, 10**6),
    world=st.integers(2, 288),
    slots=st.integers(1, 4),
    data=st.data(),
    nodes=st.sampled_from([0, 0, 2, 4, 8]),
    skew=st.sampled_from([0.6, 1.2, 2.5]),
    scatter=st.booleans(),
    chunk=st.sampled_from([16, 64, 4096]),
    max_depth=st.sampled_from([1, 2, 3, 8]),
)
def test_lanes_give_the_one_thread_builders_bytes(seed, world, slots, data, nodes, skew, scatter, chunk, max_depth):
    experts = data.draw(st.integers(1, 1024 // world) if world <= 1024 else st.just(1), label="epr") * world
    slot_src, home_of, node_of, wb, gb = problem(seed, world, slots, min(experts, 1024), nodes, skew, scatter)
    ranks = sorted({0, world - 1, int(np.random.default_rng(seed).integers(0, world))})
    for r in ranks:
        args = (slot_src, home_of, node_of, wb, gb, chunk, r, max_depth, 64)
        want = _core.build_schedule_portable_serial_ref(*args)
        for lanes, wl in LANES:
            assert_same(_core.build_schedule_portable(*args, lanes=lanes, warp_lanes=wl), want, (r, lanes, wl))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    world=st.integers(2, 96),
    slots=st.integers(1, 4),
    epr=st.integers(1, 4),
    nodes=st.sampled_from([0, 2, 4]),
    chunk=st.sampled_from([16, 4096]),
    max_depth=st.sampled_from([1, 2, 8]),
)
def test_views_on_lanes_hold_the_one_lane_views(seed, world, slots, epr, nodes, chunk, max_depth):
    """build_into_views (what k_build_slot runs): tasks, refs, counts, my_slots, slot_parent and
    the digest of every lane count are the one-lane build's."""
    slot_src, home_of, node_of, wb, gb = problem(seed, world, slots, world * epr, nodes, 1.2, False)
    caps = ([(epr + slots) * max(1, -(-b // chunk)) for b in (wb, gb)], [world * slots] * 2)
    r = seed % world
    args = (slot_src, home_of, node_of, wb, gb, chunk, r, max_depth, 64)
    want = _core.build_into_views(*args, *caps)
    assert want["status"] == 0
    for lanes, wl in LANES[1:]:
        got = _core.build_into_views(*args, *caps, lanes=lanes, warp_lanes=wl)
        assert got["status"] == 0 and got["digest"] == want["digest"]
        for op in ("multicast", "reduce"):
            g, w = got[op], want[op]
            assert g["tasks"].tobytes() == w["tasks"].tobytes() and g["refs"].tobytes() == w["refs"].tobytes()
            for k in ("num_tasks", "num_refs", "my_slots", "slot_parent", "digest"):
                assert g[k] == w[k], (lanes, wl, op, k)


@pytest.mark.parametrize("lanes,warp_lanes,warps", [(8, 1, 3), (32, 4, 1), (16, 2, 5), (64, 8, 0)])
def test_fewer_candidate_warps_than_warps(lanes, warp_lanes, warps):
    """The kernel takes fewer candidate warps when the scratch must fit shared memory: idle warps
    and rounds of any size give the same bytes (a hot expert on most ranks: several candidates)."""
    for seed, world, nodes in ((1, 64, 0), (2, 64, 4), (3, 40, 2)):
        slot_src, home_of, node_of, wb, gb = problem(seed, world, 2, world * 2, nodes, 2.5, False)
        args = (slot_src, home_of, node_of, wb, gb, 64, 0, 8, 1 << 20)
        want = _core.build_schedule_portable_serial_ref(*args)
        got = _core.build_schedule_portable(*args, lanes=lanes, warp_lanes=warp_lanes, warps=warps)
        assert_same(got, want, (seed, lanes, warp_lanes, warps))


def test_hot_expert_on_every_rank():
    """One expert replicated on 63 ranks (deep trees, several candidates), with and without nodes."""
    world = 64
    slot_src = np.full((world, 1), -1, np.int32)
    slot_src[1:, 0] = 0
    home_of = np.arange(world, dtype=np.int32)
    for node_of in (None, (np.arange(world) // 8).astype(np.int32)):
        for r in (0, 1, 63):
            args = (slot_src, home_of, node_of, 1 << 20, 1 << 20, 1 << 16, r, 8, 1 << 10)
            want = _core.build_schedule_portable_serial_ref(*args)
            assert want["candidates"] >= 1
            for lanes, wl in LANES:
                assert_same(_core.build_schedule_portable(*args, lanes=lanes, warp_lanes=wl), want, (r, lanes))


@pytest.mark.parametrize("lanes", [1, 8, 32])
def test_rejections_on_lanes(lanes):
    """Statuses do not depend on the lanes: overflow, a bad plan, upstream failures."""
    slot_src = np.array([[5, 9], [1, 13], [2, -1], [5, 6]], np.int32)
    home_of = (np.arange(16) // 4).astype(np.int32)
    base = (slot_src, home_of, None, 4096, 8192, 1024, 0, 8, 64)
    assert _core.build_into_views(*base, [1, 1000], [100, 100], lanes=lanes)["status"] == 5
    assert _core.build_into_views(*base, [100, 100], [100, 100], upstream=7, lanes=lanes)["status"] == 7
    bad = slot_src.copy()
    bad[1, 0] = 4  # expert 4 is homed on rank 1
    got = _core.build_into_views(bad, *base[1:], [100, 100], [100, 100], lanes=lanes)
    assert got["status"] == 2 and got["multicast"]["my_slots"] == [-1, -1]
    nodes = np.array([0, 0, 9, 1], np.int32)  # a node outside [0, world): kBadNode before kBadPlan
    got = _core.build_into_views(bad, home_of, nodes, *base[3:], [100, 100], [100, 100], lanes=lanes)
    assert got["status"] == 4


def test_lane_options_are_checked():
    slot_src = np.array([[1], [0]], np.int32)
    home_of = np.array([0, 1], np.int32)
    args = (slot_src, home_of, None, 64, 64, 16, 0, 8, 0)
    with pytest.raises(ValueError, match="warp_lanes must divide lanes"):
        _core.build_schedule_portable(*args, lanes=8, warp_lanes=3)
    with pytest.raises(ValueError, match="lanes must be in"):
        _core.build_schedule_portable(*args, lanes=0)


# ---------------------------------------------------------------------------- the launch


def test_launch_shape_is_a_cta_with_shared_memory_scratch():
    """k_build_slot launches one CTA of SCHEDULE_BUILD_BLOCK_THREADS (no one-thread builder left);
    the scratch sits in dynamic shared memory within the budget (no opt-in above 48 KB) whenever it
    fits, with as many candidate warps as fit (EP8 and EP64 with 2 slots: all 8; 4 slots: 4)."""
    threads = _core.SCHEDULE_BUILD_BLOCK_THREADS
    budget = _core.SCHEDULE_BUILD_SMEM_BUDGET
    assert threads >= 128 and threads % 32 == 0 and budget <= 48 * 1024 - 1024
    for W, S, E, warps in ((8, 2, 64, 8), (64, 2, 256, 8), (64, 4, 256, 4)):
        ls = _core.schedule_build_launch(W, S, E)
        assert ls["threads"] == threads and ls["warps"] >= warps, (W, S, E, ls)
        assert 0 < ls["smem_bytes"] == ls["scratch_bytes"] <= budget
    for W, S, E in ((64, 4, 1024), (128, 2, 1024), (288, 2, 2304), (1024, 8, 65536)):
        ls = _core.schedule_build_launch(W, S, E)
        assert ls["threads"] == threads and ls["smem_bytes"] <= budget
        if ls["smem_bytes"] == 0:  # global scratch: the arena's buffer, sized for 8 warps
            assert ls["warps"] == 8 and ls["scratch_bytes"] == _core.schedule_portable_scratch_bytes(W, S, E)
        else:
            assert ls["warps"] in (1, 2, 4, 8) and ls["smem_bytes"] == ls["scratch_bytes"]
    src = open(os.path.join(ROOT, "csrc", "cuda", "k_build.cu")).read()
    launches = re.findall(r"<<<(.*?)>>>", src, re.S)  # k_build_schedule
    assert len(launches) == 1 and launches[0].split(",")[1].strip() == "ls.threads", launches
    # k_build_slot: the control plane's launch, with PDL where the device has it (pdl.h)
    pdl = re.findall(r"launch_programmatic\((.*?)\);", src, re.S)
    assert len(pdl) == 1 and "k_build_slot, dim3(1), dim3(static_cast<unsigned>(ls.threads))" in pdl[0], pdl
    assert "threadIdx.x != 0) return;\n  const psched::OpOut" not in src  # the former one-lane prologue
    assert src.count("__launch_bounds__(psched::kBlockThreads, 1)") == 2


def test_sass_cta_builder_no_local_memory_bounded_shared_memory():
    """k_build_schedule / k_build_slot under nvcc, every listed architecture: no stack frame,
    spills or local loads/stores; static shared memory <= 1 KB (the block reductions' words; the
    scratch is dynamic, launch_shape-bounded); the SASS holds block barriers, warp shuffles and
    atomic counts (the CTA build, not one thread)."""
    import cuda_build as cb

    if cb.find_nvcc() is None:
        pytest.skip("nvcc not found (CUDA compile checks need it)")
    c = cb.compile_all()["k_build"]
    assert "warning" not in c.log.lower(), c.log
    funcs = {k: v for k, v in cb.ptxas_functions(c.log).items() if "k_build_" in k[1]}
    assert len(funcs) == 2 * len(cb.real_archs()), funcs
    for key, props in funcs.items():
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in props, (key, props)
        m = re.search(r"(\d+) bytes smem", props)
        assert m and int(m.group(1)) <= 1024, (key, props)
    if cb.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    for arch in cb.real_archs():
        kernels = {f: t for f, t in cb.kernel_sass(cb.sass(c, arch)).items() if "k_build_" in f}
        assert len(kernels) == 2
        for fn, text in kernels.items():
            assert not re.search(r"\b(LDL|STL)\b", text), f"local memory in {fn} sm_{arch}"
            assert "BAR.SYNC" in text, fn  # __syncthreads: block steps
            assert "SHFL." in text, fn  # warp reductions and scans
            assert "ATOM.E.ADD" in text, fn  # the counts: generic atomics (the scratch is shared or global)
