"""The device control plane's quota planner (include/ultracomm/impl/quota_plan.h), host build:
validity over random loads, identical plans for any lane and probe-group count (host threads
standing in for the kernel's warps and their lanes; hypothesis over worlds 2-288, E <= 1024,
slots 1-4, with and without nodes), balance and copies beside the host ``quota`` planner on
the evaluation loads, capacities, and the CUDA build (compile-only here: both kernel variants
without local memory, the shared-memory one's footprint within the device limits; ``gpu``
tests compare the GPU's plans with the host build's bit for bit)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ultracomm import scenarios as workloads
from ultracomm.planners import Domain, get_planner, max_mean
from ultracomm.planners import device as dev_planner
from ultracomm.tools import planner_eval as ev

from test_planners import check_result

plan = get_planner("device")


@st.composite
def big_problems(draw):
    """world 2-288, E up to 1024, 1-4 slots, with and without nodes."""
    W = draw(st.sampled_from([2, 3, 4, 8, 16, 24, 64, 72, 128, 288]))
    epr = draw(st.integers(1, max(1, min(8, 1024 // W))))
    gpn = draw(st.sampled_from([g for g in (1, 2, 4, 8) if W % g == 0]))
    K = draw(st.integers(1, 4))
    seed = draw(st.integers(0, 2**31 - 1))
    rng = np.random.default_rng(seed)
    kind = draw(st.sampled_from(["zipf", "hot", "sparse", "uniform"]))
    E = W * epr
    if kind == "zipf":
        p = 1.0 / np.arange(1, E + 1) ** draw(st.floats(0.5, 2.0))
        rng.shuffle(p)
        load = rng.multinomial(64 * 4, p / p.sum(), size=W)
    elif kind == "hot":
        load = rng.integers(0, 3, size=(W, E))
        load[:, rng.integers(E, size=3)] += rng.integers(0, 300, size=(W, 3))
    elif kind == "sparse":
        load = rng.integers(0, 9, size=(W, E)) * (rng.random((W, E)) < 0.1)
    else:
        load = rng.integers(0, 40, size=(W, E))
    return (
        Domain.nodes(W // gpn, gpn, epr),
        np.asarray(load, np.int64),
        K,
        draw(st.booleans()),
        draw(st.sampled_from([1, 1, 2, 5])),
    )


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(big_problems())
def test_valid_plans_random(prob):
    domain, load, K, intra, min_tokens = prob
    res = plan(load, domain, K, intra_node_only=intra, min_tokens=min_tokens)
    check_result(res, load, domain, K)  # every token placed once, quotas sum to loads, slot limits
    T = res.info["threshold"]
    assert res.rank_load.max() <= max(T + min_tokens - 1, 0) or res.info["replicas"] == 0
    filled = res.slot_src >= 0
    assert res.info["replicas"] == int(filled.sum())
    quota = res.slot_moves.sum(0)  # tokens each replica slot computes
    assert (quota[filled] >= min_tokens).all() and (quota[~filled] == 0).all()
    home = domain.home_of[res.slot_src[filled]]
    if intra:
        ranks = np.nonzero(filled)[0]
        np.testing.assert_array_equal(domain.node_of[ranks], domain.node_of[home])
    # fixed homes: a rank that takes a replica is not above T at home (UltraEP's model)
    L = load.sum(0).reshape(domain.world, -1).sum(1)
    assert (L[np.nonzero(filled)[0]] <= T).all()


# (lanes, groups): 1, 2, 8 and 32 lanes of one probe group; 8 groups (the kernel's 8 warps,
# one threshold each), of 1 and 2 lanes; 3 groups (a round's thresholds split unevenly)
SHAPES = [(2, 1), (8, 1), (32, 1), (1, 8), (2, 8), (1, 3)]


def _same_plan(a, b):
    np.testing.assert_array_equal(a.slot_src, b.slot_src)
    np.testing.assert_array_equal(a.slot_moves, b.slot_moves)
    assert a.info == b.info
    assert a.slot_src.tobytes() == b.slot_src.tobytes()


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(big_problems())
def test_lanes_and_groups_give_byte_identical_plans(prob):
    domain, load, K, intra, min_tokens = prob
    ref = plan(load, domain, K, intra_node_only=intra, min_tokens=min_tokens)
    for lanes, groups in SHAPES:
        _same_plan(ref, plan(load, domain, K, intra_node_only=intra, min_tokens=min_tokens, lanes=lanes, groups=groups))


@pytest.mark.parametrize("lanes", [2, 3, 8, 32])
def test_lanes_give_the_same_plan(lanes):
    rng = np.random.default_rng(lanes)
    for W, epr, K, nodes in [(64, 4, 2, 1), (16, 8, 1, 2), (288, 2, 3, 36)]:
        load = workloads.zipf_load(W, W * epr, 4096, 8, 2.0, seed=int(rng.integers(1000)))
        domain = Domain.nodes(nodes, W // nodes, epr)
        for intra in (False, True):
            a = plan(load, domain, K, intra_node_only=intra)
            b = plan(load, domain, K, intra_node_only=intra, lanes=lanes)
            np.testing.assert_array_equal(a.slot_src, b.slot_src)
            np.testing.assert_array_equal(a.slot_moves, b.slot_moves)
            assert a.info == b.info


def test_balance_and_copies_beside_host_quota():
    """Issue 19's bar: max:mean <= 1.02 wherever host quota reaches it, copies within 10%."""
    quota = get_planner("quota")
    misses = []
    for case, lname, dom, load in ev.evaluation_loads():
        name = f"{case} {lname}"
        for K in (1, 2):
            q, d = quota(load, dom, K), plan(load, dom, K)
            check_result(d, load, dom, K)
            if max_mean(q.rank_load) <= 1.02 and max_mean(d.rank_load) > 1.02:
                misses.append(f"{name} K={K}: balance {max_mean(d.rank_load):.4f}")
            if sum(d.copies) > 1.10 * sum(q.copies):
                misses.append(f"{name} K={K}: copies {sum(d.copies)} vs quota {sum(q.copies)}")
    assert not misses, misses


def test_hand_case():
    """Home loads 90 (experts of 60 and 30), 10, 30, 0; one slot; eps 0 (tol 1).
    T = 33: spares 23, 3, 33 -- expert 1 (30) fits whole on rank 3; expert 0's 27 fits
    nowhere whole, so 23 go to the largest spare (rank 1) and the last 4 find no free slot.
    T = 34: spares 24, 4, 34 -- expert 1 -> rank 3, expert 0: 24 -> rank 1 (split), then
    its last 2 fit whole on rank 2.  Round 0 schedules 33, 34, 36, 40, 48, 64 (96 is above the
    largest home load, 90): the plan is T = 34's, kept from its probe (no seventh, final probe)."""
    domain = Domain.flat(4, 2)
    load = np.zeros((4, 8), np.int64)
    load[0, [0, 1, 2, 4]] = [60, 30, 10, 30]
    res = plan(load, domain, 1, eps=0)
    assert res.info["threshold"] == 34 and res.info["rounds"] == 1 and res.info["probes"] == 6
    np.testing.assert_array_equal(res.slot_src[:, 0], [-1, 0, 0, 1])
    np.testing.assert_array_equal(res.slot_moves.sum(0)[:, 0], [0, 24, 2, 30])
    assert res.rank_load.tolist() == [34, 34, 32, 30]


def test_capacity_and_option_errors():
    with pytest.raises(ValueError, match=r"world <= 1024, experts <= 65536, slots <= 8; got world 1025"):
        plan(np.zeros((1025, 1025), np.int64), Domain.flat(1025, 1), 1)
    with pytest.raises(ValueError, match=r"slots <= 8; got world 4, experts 4, slots 9"):
        plan(np.zeros((4, 4), np.int64), Domain.flat(4, 1), 9)
    with pytest.raises(ValueError, match=r"min_tokens must be an int >= 1, got 0"):
        plan(np.zeros((4, 4), np.int64), Domain.flat(4, 1), 1, min_tokens=0)
    with pytest.raises(ValueError, match=r"eps must be a float in \[0, 1\], got 2"):
        plan(np.zeros((4, 4), np.int64), Domain.flat(4, 1), 1, eps=2)
    from ultracomm import _core

    with pytest.raises(ValueError, match="an expert load is negative, or the total is above 2\\*\\*48"):
        _core.quota_device(np.array([-1, 0], np.int64), None, 2, 1, 1, 1, 0, 100)
    with pytest.raises(ValueError, match="node_of has a negative node"):
        _core.quota_device(np.array([1, 0], np.int64), np.array([0, -1], np.int32), 2, 1, 1, 1, 0, 100)
    with pytest.raises(ValueError, match="total is above 2\\*\\*48"):
        _core.quota_device(np.array([2**47, 2**47, 2**47], np.int64), None, 3, 1, 1, 1, 0, 100)


def test_balanced_load_needs_no_replica():
    load = np.full((8, 16), 5, np.int64)
    for lanes, groups in [(1, 1), *SHAPES]:
        res = plan(load, Domain.flat(8, 2), 2, lanes=lanes, groups=groups)
        assert res.info["replicas"] == 0 and res.info["threshold"] == 80  # 8 sources x 5 x 2 experts
        assert res.info["probes"] == 0 and (res.slot_src == -1).all()  # the empty plan, no probe


def test_first_probe_at_the_lower_bound_times_one_plus_eps():
    """Round 0's first threshold is ceil(mean) - 1 + tol, the lower bound x (1 + eps): on every
    evaluation load the search ends in that one round, at that threshold -- or, with one slot
    on the two tightest EP64 loads, at the second gallop step (+ tol)."""
    second = {("EP64", "zipf 3.03", 1), ("EP64", "hot 30%", 1)}
    for case, lname, dom, load in ev.evaluation_loads():
        W, total = dom.world, int(load.sum())
        first, tol = -(-total // W) - 1 + max(1, (total // W) * 100 // 10000), max(1, (total // W) * 100 // 10000)
        for K in (1, 2):
            res = plan(load, dom, K)
            want = first + tol if (case, lname, K) in second else first
            assert res.info["rounds"] == 1 and res.info["threshold"] == want, (case, lname, K, res.info, first)


def test_shapes_and_options_errors():
    from ultracomm import _core

    el = np.ones(4, np.int64)
    with pytest.raises(ValueError, match=r"groups must be in \[1, 8\]"):
        _core.quota_device(el, None, 4, 1, 1, 1, 0, 100, 1, 9)
    with pytest.raises(ValueError, match=r"lanes must be in \[1, 64\]"):
        _core.quota_device(el, None, 4, 1, 1, 1, 0, 100, 0, 1)
    assert _core.QUOTA_DEVICE_PROBES == 8


# ----------------------------------------------------------------------------- CUDA build


def test_cuda_build_has_the_planner_kernel_with_warp_reductions():
    import cuda_build as cb

    for variant in ("k_quota_planILb1", "k_quota_planILb0"):  # state in shared memory / global scratch
        for text in cb.kernel_texts("k_quota", variant):
            assert "SHFL.BFLY" in text  # the receiver choice is a warp min-reduction
            assert "BAR.SYNC" in text  # rounds: CTA barriers between probes
            assert "LDL" not in text and "STL" not in text  # no local memory


# 48 KB: a block's shared memory without opt-in; opt-in limits per block (CUDA C++ guide,
# "Features and Technical Specifications"): A100 163 KB, H100/H200 and B200 227 KB
DEFAULT_SMEM = 48 * 1024
OPTIN_SMEM = {80: 163 * 1024, 90: 227 * 1024, 100: 227 * 1024}


def test_sass_quota_state_in_shared_memory_within_the_limit():
    """k_quota_plan<true> keeps its state in shared memory: SASS with LDS/STS and no local
    memory (no LDL/STL, 0-byte stack); its footprint -- ptxas's static smem plus the dynamic
    quota_device_smem_bytes -- fits the default 48 KB at EP8/EP64 (no opt-in needed) and the
    opt-in limit at EP288 on sm_90/sm_100 (sm_80's 163 KB: global scratch).  Prints the sizes."""
    import re

    from ultracomm import _core

    import cuda_build as cb

    if cb.find_nvcc() is None:
        pytest.skip("nvcc not found")
    texts = cb.kernel_texts("k_quota", "k_quota_planILb1")  # skips without cuobjdump
    log = cb.compile_all()["k_quota"].log
    static = {}
    for (arch, fn), props in cb.ptxas_functions(log).items():
        if "k_quota_planILb1" in fn:
            assert "0 bytes stack frame" in props, (arch, props)
            static[int(arch[3:])] = int(re.search(r"(\d+) bytes smem", props).group(1))
    assert set(static) == set(cb.real_archs()), static
    for text in texts:
        ops = set(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text, re.M))
        assert {o for o in ops if o.startswith("LDS")} and {o for o in ops if o.startswith("STS")}, ops
        assert not {o for o in ops if o.startswith(("LDL", "STL"))}, ops
        assert not {o for o in ops if re.fullmatch(r"LD(\.E)?(\.\w+)*", o)}, ops  # no generic loads of the state
    shapes = {"EP8": (8, 32, 2), "EP64": (64, 256, 2), "EP64 K4": (64, 256, 4), "EP288": (288, 864, 4)}
    dyn = {k: _core.quota_device_smem_bytes(*v) for k, v in shapes.items()}
    assert dyn["EP64"] == 8 * (256 + 32 + (64 + 32 + 128) + 8 * 576)  # a probe's state: 576 words = 4.6 KB
    for arch, smem in sorted(static.items()):
        print(f"k_quota sm_{arch}: static {smem} B + dynamic " + ", ".join(f"{k} {v} B" for k, v in dyn.items()))
        assert smem <= 1024, smem
        assert smem + dyn["EP8"] <= DEFAULT_SMEM and smem + dyn["EP64"] <= DEFAULT_SMEM
        assert smem + dyn["EP64 K4"] <= OPTIN_SMEM[arch]
        assert (smem + dyn["EP288"] <= OPTIN_SMEM[arch]) == (arch >= 90)


# ----------------------------------------------------------------------------- GPU


@pytest.mark.gpu
def test_gpu_plans_equal_host_build_and_replay_in_a_graph():
    import torch

    rng = np.random.default_rng(0)
    # state in shared memory under 48 KB (EP8/16/64), above it with the opt-in attribute (EP288,
    # 213 KB: sm_90/sm_100; global scratch on sm_80), and on global scratch (EP512, E 8192)
    cases = [(64, 4, 2, 1), (16, 8, 1, 2), (8, 2, 3, 1), (288, 3, 4, 36), (512, 16, 2, 8)]
    for W, epr, K, nodes in cases:
        domain = Domain.nodes(nodes, W // nodes, epr)
        top_k = min(8, epr)  # a rank holds epr experts: more choices per token cap its share below 3x the mean
        loads = [workloads.zipf_load(W, W * epr, 4096, top_k, t, seed=int(rng.integers(1000))) for t in (1.5, 2.0, 3.0)]
        static = torch.zeros((W, W * epr), dtype=torch.int32, device="cuda")
        out = dev_planner.plan_on_gpu(static, domain, K)  # warm-up: buffers allocated here
        torch.cuda.synchronize()
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g):
            dev_planner.plan_on_gpu(static, domain, K, out=out)
        for load in loads:
            static.copy_(torch.as_tensor(load, dtype=torch.int32))
            g.replay()
            torch.cuda.synchronize()
            host = plan(load, domain, K)
            np.testing.assert_array_equal(out["slot_src"].cpu().numpy(), host.slot_src)
            np.testing.assert_array_equal(
                out["slot_quota"].cpu().numpy(), np.where(host.slot_src >= 0, host.slot_moves.sum(0), 0)
            )
            info = dev_planner.decode_result(out["result"].cpu())
            assert info == {k: host.info[k] for k in ("threshold", "probes", "rounds", "replicas")}
