"""Reroute on the device (include/ultracomm/token_split.h): the table computed from the plan
in device form (slot_src, slot_quota, int32 loads) equals the host planners' RerouteTable, and
the rerouted maps and probs are identical; the CUDA build compiles (the ``gpu`` test runs the
kernel against the host build)."""
from __future__ import annotations

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
@given(st.integers(2, 12), st.integers(1, 4), st.integers(1, 3), st.sampled_from(["quota", "device", "lpt"]),
       st.sampled_from(["echo", "physical"]), st.integers(0, 2**31 - 1))
def test_device_table_equals_host_table(W, epr, K, planner, layout, seed):
    rng = np.random.default_rng(seed)
    E = W * epr
    load = rng.integers(0, 6, size=(W, E))
    load[:, rng.integers(E)] += rng.integers(0, 20, size=W)
    domain = Domain.flat(W, epr)
    res = get_planner(planner)(load, domain, K)
    for rank in range(W):
        host = RerouteTable.from_result(res, rank, layout)
        dev = RerouteTable.from_plan(torch.as_tensor(load, dtype=torch.int32),
                                     torch.as_tensor(res.slot_src, dtype=torch.int32),
                                     torch.as_tensor(_slot_quota(res)), rank, epr, layout)
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
        RerouteTable.from_plan(z((2, 4), dtype=torch.int64), z((2, 1), dtype=torch.int32),
                               z((2, 1), dtype=torch.int64), 0, 2)
    with pytest.raises(ValueError, match="reroute layout must be one of"):
        RerouteTable.from_plan(z((2, 4), dtype=torch.int32), z((2, 1), dtype=torch.int32),
                               z((2, 1), dtype=torch.int64), 0, 2, layout="x")


def test_cuda_build_has_the_reroute_kernel_without_local_memory():
    cb = pytest.importorskip("cuda_build")
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
        args = [torch.as_tensor(load, dtype=torch.int32), torch.as_tensor(res.slot_src, dtype=torch.int32),
                torch.as_tensor(_slot_quota(res))]
        for rank in (0, W - 1):
            for layout in ("echo", "physical"):
                host = RerouteTable.from_plan(*args, rank, epr, layout)
                dev = RerouteTable.from_plan(*[a.cuda() for a in args], rank, epr, layout)
                torch.cuda.synchronize()
                assert torch.equal(dev.bounds.cpu(), host.bounds) and torch.equal(dev.columns.cpu(), host.columns)
