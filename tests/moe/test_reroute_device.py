"""Reroute on the device (include/ultracomm/impl/token_split.h): the table computed from the plan
in device form (slot_src, slot_quota, int32 loads) equals the host planners' RerouteTable, and
the rerouted maps and probs are identical; the CUDA build compiles (the ``gpu`` test runs the
kernel against the host build)."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ultracomm.moe.reroute import RerouteTable, reroute
from ultracomm.planners import Domain, get_planner


def _slot_quota(res):
    return np.where(res.slot_src >= 0, res.slot_moves.sum(0), 0).astype(np.int64)


def _routing(load_row, E, rng):
    """A [T, E] routing map with load_row[e] tokens on expert e (top-k style rows)."""
    T = int(load_row.max()) if load_row.size else 0
    m = torch.zeros((max(T, 1), E), dtype=torch.bool)
    for e in range(E):
        rows = rng.choice(max(T, 1), size=int(load_row[e]), replace=False)
        m[torch.as_tensor(rows, dtype=torch.long), e] = True
    return m


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(2, 12),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from(["quota", "device", "lpt"]),
    st.sampled_from(["echo", "physical"]),
    st.integers(0, 2**31 - 1),
)
def test_device_table_equals_host_table(W, epr, K, planner, layout, seed):
    rng = np.random.default_rng(seed)
    E = W * epr
    load = rng.integers(0, 6, size=(W, E))
    load[:, rng.integers(E)] += rng.integers(0, 20, size=W)
    domain = Domain.flat(W, epr)
    res = get_planner(planner)(load, domain, K)
    for rank in range(W):
        host = RerouteTable.from_result(res, rank, layout)
        dev = RerouteTable.from_plan(
            torch.as_tensor(load, dtype=torch.int32),
            torch.as_tensor(res.slot_src, dtype=torch.int32),
            torch.as_tensor(_slot_quota(res)),
            rank,
            epr,
            layout,
        )
        I = host.bounds.shape[1]
        assert dev.num_columns == host.num_columns
        torch.testing.assert_close(dev.bounds[:, :I], host.bounds, rtol=0, atol=0)
        torch.testing.assert_close(dev.bounds[:, I:], host.bounds[:, -1:].expand(-1, W - I), rtol=0, atol=0)
        # used instances' columns agree (unused ones are never selected)
        used = torch.cat([torch.ones((E, 1), dtype=torch.bool), host.bounds[:, 1:] > host.bounds[:, :-1]], 1)
        assert torch.equal(dev.columns[:, :I][used], host.columns[used])
        m = _routing(load[rank], E, rng)
        probs = torch.rand(m.shape, dtype=torch.float32)
        a_map, a_p = reroute(m, probs, host)
        b_map, b_p = reroute(m, probs, dev)
        assert torch.equal(a_map, b_map) and torch.equal(a_p, b_p)


def test_from_plan_errors():
    z = torch.zeros
    with pytest.raises(ValueError, match=r"loads must be torch.int32 \[2, 4\] on cpu, got torch.int64 \[2, 4\]"):
        RerouteTable.from_plan(
            z((2, 4), dtype=torch.int64), z((2, 1), dtype=torch.int32), z((2, 1), dtype=torch.int64), 0, 2
        )
    with pytest.raises(ValueError, match="reroute layout must be one of"):
        RerouteTable.from_plan(
            z((2, 4), dtype=torch.int32), z((2, 1), dtype=torch.int32), z((2, 1), dtype=torch.int64), 0, 2, layout="x"
        )


def test_cuda_build_has_the_reroute_kernel_without_local_memory():
    import cuda_build as cb

    for text in cb.kernel_texts("k_reroute", "k_reroute_table"):
        assert "LDL" not in text and "STL" not in text


@pytest.mark.gpu
def test_gpu_table_equals_host_build():
    rng = np.random.default_rng(1)
    for W, epr, K in [(8, 4, 2), (64, 4, 2), (16, 8, 1)]:
        E = W * epr
        load = rng.integers(0, 50, size=(W, E))
        load[:, rng.integers(E, size=2)] += rng.integers(0, 500, size=(W, 2))
        res = get_planner("device")(load, Domain.flat(W, epr), K)
        args = [
            torch.as_tensor(load, dtype=torch.int32),
            torch.as_tensor(res.slot_src, dtype=torch.int32),
            torch.as_tensor(_slot_quota(res)),
        ]
        for rank in (0, W - 1):
            for layout in ("echo", "physical"):
                host = RerouteTable.from_plan(*args, rank, epr, layout)
                dev = RerouteTable.from_plan(*[a.cuda() for a in args], rank, epr, layout)
                torch.cuda.synchronize()
                assert torch.equal(dev.bounds.cpu(), host.bounds) and torch.equal(dev.columns.cpu(), host.columns)


# ----------------------------------------------------------------------------- the kernel's lanes
# k_reroute runs token_split.h's expert_table_lanes with a warp per expert; _core.reroute_table's
# `lanes` runs the same source with one lane or with host threads standing in for the warp's
# lanes.  Every lane count must give expert_table's rows (lanes=0), byte for byte.


def _lane_tables(load, slot_src, slot_quota, epr, rank, layout, lanes_list=(1, 2, 8, 32)):
    from ultracomm import _core

    args = (
        np.ascontiguousarray(load, dtype=np.int32),
        np.ascontiguousarray(slot_src, dtype=np.int32),
        np.ascontiguousarray(slot_quota, dtype=np.int64),
        epr,
        rank,
        layout,
    )
    want = _core.reroute_table(*args)
    for lanes in lanes_list:
        got = _core.reroute_table(*args, lanes=lanes)
        assert np.array_equal(got[0], want[0]) and np.array_equal(got[1], want[1]), (lanes, rank, layout)


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    st.integers(2, 48),
    st.integers(1, 4),
    st.integers(1, 3),
    st.sampled_from(["quota", "device", "lpt"]),
    st.integers(0, 1),
    st.integers(0, 2**31 - 1),
)
def test_lane_tables_equal_the_loop(W, epr, K, planner, layout, seed):
    rng = np.random.default_rng(seed)
    E = W * epr
    load = rng.integers(0, 6, size=(W, E))
    load[:, rng.integers(E, size=2)] += rng.integers(0, 300, size=(W, 2))
    res = get_planner(planner)(load, Domain.flat(W, epr), K)
    for rank in sorted({0, W - 1, int(rng.integers(W))}):
        _lane_tables(load, res.slot_src, _slot_quota(res), epr, rank, layout)


def test_lane_tables_at_ep288():
    rng = np.random.default_rng(7)
    W, epr, K = 288, 2, 2
    E = W * epr
    load = rng.integers(0, 40, size=(W, E))
    load[:, rng.integers(E, size=3)] += rng.integers(0, 2000, size=(W, 3))
    res = get_planner("device")(load, Domain.flat(W, epr), K)
    assert (res.slot_src >= 0).any()
    for rank in (0, W - 1):
        _lane_tables(load, res.slot_src, _slot_quota(res), epr, rank, 0, lanes_list=(1, 8))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(2, 12), st.integers(1, 3), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_lane_tables_equal_the_loop_on_plans_no_planner_makes(W, epr, K, seed):
    """Negative loads or quotas, quotas above the expert's tokens, a replica on its home rank,
    two replicas of one expert on one rank: the lanes take the loop itself (same rows)."""
    rng = np.random.default_rng(seed)
    E = W * epr
    load = rng.integers(-2, 9, size=(W, E))
    slot_src = np.full((W, K), -1, np.int64)
    for r in range(W):
        for k in range(K):
            if rng.random() < 0.6:
                slot_src[r, k] = rng.integers(E)
    for e in range(E):  # at most world - 1 instances of an expert (expert_table's rows hold world)
        hits = np.argwhere(slot_src == e)
        for r, k in hits[W - 2 :]:
            slot_src[r, k] = -1
    quota = np.where(slot_src >= 0, rng.integers(-3, 40, size=(W, K)), 0)
    for rank in range(W):
        _lane_tables(load, slot_src, quota, epr, rank, int(rng.integers(2)), lanes_list=(1, 2, 8))


def test_cuda_build_reroute_is_a_warp_per_expert():
    """Warp shuffles (sums and scans over lanes) and shared memory for the instance list; rows
    written as 64-bit stores (STG.E.64), no local memory (above)."""
    import cuda_build as cb

    for text in cb.kernel_texts("k_reroute", "k_reroute_table"):
        assert "SHFL.UP" in text and "SHFL.BFLY" in text, "warp scan / sum"
        assert re.search(r"\bSTS\b", text) and re.search(r"\bLDS\b", text), "instances in shared memory"
        assert re.search(r"\bSTG\.E\.64\b", text)
