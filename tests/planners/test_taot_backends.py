"""TAOT's C++ path gives bit-identical plans to the numpy reference (backend="numpy") on a
family of seeded loads (the eval's EP64 shapes, EP16/EP72, Zipf / rank-blocked / hot-rank)
and option sets; the pruned C++ auction picks what a scan of every rank picks, on random
inputs over several blocks of ranks and price steps (the matching's cached proposals:
test_planners.test_matching_cpp_matches_numpy)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_planners import _auction_inputs
from test_taot_fast_path import _load
from ultracomm.planners import Domain, taot

needs_cpp = pytest.mark.skipif(not taot._HAVE_CPP, reason="_core built without the TAOT loops")

# (nodes, ranks per node, experts per rank)
GEOMETRIES = [(8, 8, 4), (1, 64, 4), (2, 8, 8), (9, 8, 4)]
LOADS = [("zipf", 1.5), ("zipf", 3.0), ("blocked", 2.0), ("blocked", 3.0), ("hot", 0.7)]
OPTIONS = [
    {},
    {"intra_first": False},
    {"consolidate": False, "mutual": False},
    {"spill": "paper", "auction_iters": 3},
    {"tol": 0.02, "price_step": 0.2},
]


def _assert_same(a, b, what: str) -> None:
    for f in ("slot_src", "quota", "slot_moves"):
        x, y = getattr(a, f), getattr(b, f)
        assert x.dtype == y.dtype and np.array_equal(x, y), (what, f)
    assert a.info.keys() == b.info.keys(), what
    for k in a.info:
        assert np.array_equal(a.info[k], b.info[k]), (what, k)


@needs_cpp
@pytest.mark.parametrize("nodes,gpn,epr", GEOMETRIES)
def test_plans_identical_to_numpy_reference(nodes, gpn, epr):
    d = Domain.nodes(nodes, gpn, epr)
    for kind, skew in LOADS:
        for seed in (1, 2):
            load = _load(nodes * gpn, epr, kind, skew, seed)
            for i, opts in enumerate(OPTIONS):
                if seed == 2 and i > 1:
                    continue
                ref = taot.plan(load, d, 2, backend="numpy", **opts)
                got = taot.plan(load, d, 2, backend="cpp", **opts)
                _assert_same(ref, got, f"{nodes}x{gpn} {kind} {skew} seed {seed} {opts}")
                assert got.slot_src.max() >= 0  # every case replicates something


@needs_cpp
@settings(max_examples=80, deadline=None)
@given(
    st.integers(0, 2**31 - 1),
    st.integers(1, 40),
    st.integers(1, 6),
    st.integers(1, 24),
    st.sampled_from([0.05, 0.0, 0.5, -0.05]),
    st.booleans(),
)
def test_auction_pruned_scan_matches_numpy(seed, R, E, S, step, structured):
    """Slots' bids over up to 5 blocks of 8 ranks: the block and rank pruning of the C++ bid
    keeps the numpy argmax (ties: lowest rank), with node-structured or arbitrary bonuses."""
    rng = np.random.default_rng(seed)
    n, se, demand, _ = _auction_inputs(rng, R, E, S, 30, sparse=True)
    sr = rng.integers(0, R, size=S)
    if structured:  # taot's bonus: 1 within a node of 8, 0.5 across, tie-broken by slot rank
        bonus = np.where((np.arange(R)[:, None] // 8) == (sr[None, :] // 8), 1.0, 0.5)
    else:  # arbitrary, with exact ties
        bonus = rng.choice([0.0, 0.25, 0.5, 0.7, 1.0], size=(R, S))
    for cap in (None, 3):
        a = taot.lagrangian_auction(n, se, demand, bonus, step, cap, sr, backend="numpy")
        b = taot.lagrangian_auction(n, se, demand, bonus, step, cap, sr, backend="cpp")
        np.testing.assert_array_equal(a[0], b[0])
        assert a[1] == b[1]
        c = taot.lagrangian_auction(n, se, demand, bonus, step, cap, None, backend="numpy")
        d = taot.lagrangian_auction(n, se, demand, bonus, step, cap, None, backend="cpp")
        np.testing.assert_array_equal(c[0], d[0])
        assert c[1] == d[1]


@needs_cpp
def test_taot_run_rejects_bad_inputs():
    """_core.taot_run checks shapes and ranges before it runs: each bad input is a ValueError
    naming it; a load with nothing to shed places nothing."""
    from ultracomm import _core

    W, epr = 4, 2
    E = W * epr
    load = np.ones((W, E), np.int64)
    el, L = load.sum(0), load.sum(0).reshape(W, epr).sum(1)
    args = dict(
        load=load,
        el=el,
        L=L,
        home=np.arange(E) // epr,
        excess=np.zeros(W, np.int64),
        spare=np.zeros(W, np.int64),
        flow=np.zeros((W, W)),
        Brr=np.ones((W, W)),
        bid=np.ones((W, W)),
        same=np.ones((W, W), np.uint8),
        experts_per_rank=epr,
        K=2,
        target=8,
        min_gain=1,
        alpha=1.0,
        dynamic_spill=True,
        mutual=True,
        two_pass=False,
        consolidate=True,
        price_step=0.05,
        auction_cap=None,
    )
    n, src, quota, *_ = _core.taot_run(**args)
    assert n == 0 and (src == -1).all()
    for bad, match in (
        (dict(experts_per_rank=3), "experts_per_rank"),
        (dict(home=np.full(E, W)), r"home in \[0, W\)"),
        (dict(flow=np.zeros((W, W + 1))), "flow / Brr / bid"),
        (dict(spare=np.zeros(W + 1, np.int64)), "L / excess / spare"),
        (dict(min_gain=0), "min_gain >= 1"),
    ):
        with pytest.raises(ValueError, match=match):
            _core.taot_run(**{**args, **bad})
