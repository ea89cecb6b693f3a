"""taot.plan's fast path (cached per-domain tables, marked distinct experts, pre-tie-broken
auction bonus, rank loads from the plan's integers) gives exactly what the public phase
functions give when called the plain way, on seeded EP16 / EP64 loads."""

from __future__ import annotations

import numpy as np
import pytest

from ultracomm import scenarios as workloads
from ultracomm.planners import Domain, taot
from ultracomm.planners.base import home_rank_load

# (world, nodes, experts per rank, generator, skew); EP64 flat is the eval's UltraEP case
CASES = [
    (16, 2, 8, "zipf", 1.5),
    (16, 2, 8, "blocked", 3.0),
    (64, 1, 4, "zipf", 3.03),
    (64, 1, 4, "blocked", 2.0),
    (64, 1, 4, "hot", 0.7),
    (64, 8, 4, "zipf", 2.0),
]


def _load(world, epr, kind, skew, seed):
    E = world * epr
    if kind == "zipf":
        return workloads.zipf_load(world, E, 8192, 8, skew, seed=seed)
    if kind == "blocked":
        return workloads.rank_blocked_load(world, E, 8192, 8, skew, seed=seed)
    return workloads.hot_rank_load(world, E, 8192, 8, skew, seed=seed)


@pytest.mark.parametrize("world,nodes,epr,kind,skew", CASES)
@pytest.mark.parametrize("backend", [None, "numpy"])
def test_fast_path_matches_plain_phases(world, nodes, epr, kind, skew, backend):
    if backend is None and not taot._HAVE_CPP:
        pytest.skip("_core built without the TAOT loops")
    d = Domain.nodes(nodes, world // nodes, epr)
    for seed in (1, 2):
        load = _load(world, epr, kind, skew, seed)
        res = taot.plan(load, d, 2, backend=backend)
        tgt, mg = res.info["target"], res.info["min_gain"]
        # phase 1: the cached kernel gives the bit-identical flow of sinkhorn(cost)
        _, L = home_rank_load(load, d)
        excess = np.maximum(L - (tgt - mg + 1), 0)
        spare = np.maximum(tgt - L, 0)
        flow = taot.sinkhorn(excess, spare, taot.topology_cost(d, 3.0), 3.0, 100)
        assert np.array_equal(res.info["flow"], flow)
        # phase 3: the plan's slot moves are lagrangian_auction's on the plan's slots (in
        # rank, slot order), with the plain bonus and slot-rank tie-break, on both backends
        r_m, k_m = np.nonzero(res.slot_src >= 0)
        assert r_m.size > 0
        e_m = res.slot_src[r_m, k_m].astype(np.int64)
        demand = res.slot_moves.sum(0)[r_m, k_m]
        bonus = np.where(d.same_node, 1.0, 0.5)[:, r_m]
        for b in ["numpy", "cpp"] if taot._HAVE_CPP else ["numpy"]:
            X, rounds = taot.lagrangian_auction(load, e_m, demand, bonus, 0.05, None, slot_rank=r_m, backend=b)
            assert np.array_equal(res.slot_moves[:, r_m, k_m], X), b
            assert rounds == res.info["auction_rounds"], b
        # the intra-first decision used the plan's most loaded rank
        worst = int(res.rank_load.max())
        state = res.info["intra_first"]
        assert (state == "off") == (nodes == 1)
        if state == "met":
            assert worst <= tgt
        elif state == "fallback":
            assert tgt < res.info["intra_first_max"] and worst < res.info["intra_first_max"]
        elif state == "kept":
            assert worst > tgt


def test_tables_cached_per_domain_and_options():
    d = Domain.nodes(2, 4, 2)
    k1, b1, bid1 = taot._tables(d, 3.0, 3.0, 0.5)
    assert taot._tables(d, 3.0, 3.0, 0.5)[0] is k1  # built once
    np.testing.assert_array_equal(k1, np.exp(-taot.topology_cost(d, 3.0) / 3.0))
    off = (np.arange(8)[:, None] - np.arange(8)[None, :]) % 8
    np.testing.assert_array_equal(bid1, b1 - 1e-9 * off)
    k2, b2, _ = taot._tables(d, 2.0, 1.0, 0.25)  # other options: other tables
    np.testing.assert_array_equal(k2, np.exp(-taot.topology_cost(d, 2.0) / 1.0))
    assert b2[0, 7] == 0.25 and b2[0, 1] == 1.0
    assert not k1.flags.writeable
