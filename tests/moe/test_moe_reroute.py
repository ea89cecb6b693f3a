"""Token rerouting by the planners' integer quotas (ultracomm.moe.reroute)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ultracomm.moe import RerouteTable, num_columns, reroute
from ultracomm.planners import Domain, get_planner


def routing(rng: np.random.Generator, world: int, tokens: int, E: int, top_k: int, hot: float):
    maps, probs = [], []
    for _ in range(world):
        logits = torch.from_numpy(rng.standard_normal((tokens, E)))
        logits[:, : max(1, E // 8)] += hot
        top = logits.topk(top_k, dim=1).indices
        m = torch.zeros(tokens, E, dtype=torch.bool).scatter_(1, top, True)
        maps.append(m)
        probs.append(torch.softmax(logits, 1).masked_fill(~m, 0))
    return maps, probs


def column_owner(layout: str, world: int, epr: int, K: int, slot_src: np.ndarray) -> list[tuple[int, int, int]]:
    """(expert, rank, slot or -1 for home) of every column."""
    E = world * epr
    out = []
    if layout == "echo":
        out += [(e, e // epr, -1) for e in range(E)]
        out += [(int(slot_src[r, k]), r, k) for r in range(world) for k in range(K)]
    else:
        for r in range(world):
            out += [(r * epr + j, r, -1) for j in range(epr)]
            out += [(int(slot_src[r, k]), r, k) for k in range(K)]
    return out


@settings(max_examples=30, deadline=None)
@given(
    world=st.integers(2, 6),
    epr=st.integers(1, 4),
    K=st.integers(0, 3),
    tokens=st.integers(0, 40),
    top_k=st.integers(1, 3),
    hot=st.sampled_from([0.0, 2.0, 6.0]),
    seed=st.integers(0, 2**31),
    layout=st.sampled_from(["echo", "physical"]),
    planner=st.sampled_from(["quota", "greedy", "lpt", "taot"]),
)
def test_reroute_follows_the_planners_token_moves(world, epr, K, tokens, top_k, hot, seed, layout, planner):
    E = world * epr
    top_k = min(top_k, E)
    rng = np.random.default_rng(seed)
    maps, probs = routing(rng, world, tokens, E, top_k, hot)
    load = torch.stack([m.sum(0) for m in maps]).numpy()
    res = get_planner(planner)(load, Domain.flat(world, epr), K)
    owner = column_owner(layout, world, epr, K, res.slot_src)
    P = num_columns(layout, E, world, K)
    assert len(owner) == P
    for s in range(world):
        cmap, cprobs = reroute(maps[s], probs[s], RerouteTable.from_result(res, s, layout))
        assert cmap.shape == (tokens, P) and cprobs.shape == (tokens, P) and cprobs.dtype == probs[s].dtype
        # every routed (token, expert) lands in exactly one column of one of the expert's instances
        assert int(cmap.sum()) == int(maps[s].sum())
        for c in cmap.any(0).nonzero().squeeze(1).tolist():
            e, r, k = owner[c]
            t = cmap[:, c]
            assert maps[s][t, e].all(), f"column {c} holds tokens not routed to expert {e}"
            assert torch.equal(cprobs[t, c], probs[s][t, e])
            want = res.slot_moves[s, r, k] if k >= 0 else None
            if want is not None:
                assert int(t.sum()) == int(want), f"source {s} -> slot ({r},{k}): {int(t.sum())} != {want}"
        assert torch.equal(cprobs[~cmap], torch.zeros(int((~cmap).sum()), dtype=cprobs.dtype))
        # per expert: tokens kept home + sent to replicas == tokens routed
        per_expert = torch.zeros(E, dtype=torch.int64)
        for c, (e, _, _) in enumerate(owner):
            if e >= 0:
                per_expert[e] += cmap[:, c].sum()
        assert torch.equal(per_expert, maps[s].sum(0))


def test_reroute_keeps_token_order_home_first_and_is_differentiable():
    # 2 ranks, 1 expert each, 1 slot: expert 0 is hot on rank 0
    world, epr, K = 2, 1, 1
    rmap = torch.tensor([[1, 0], [1, 0], [1, 0], [0, 1], [1, 0], [1, 0]], dtype=torch.bool)
    load = np.array([[5, 1], [0, 0]])
    res = get_planner("quota")(load, Domain.flat(world, epr), K)
    assert res.slot_src.tolist() == [[-1], [0]]  # expert 0 replicated onto rank 1
    moved = int(res.slot_moves[0, 1, 0])
    assert moved == 2  # 6 tokens over 2 ranks: 3 and 3
    probs = torch.rand(6, 2, dtype=torch.float64).masked_fill(~rmap, 0).requires_grad_()
    cmap, cprobs = reroute(rmap, probs, RerouteTable.from_result(res, 0, "echo"))
    # echo columns: expert 0, expert 1, slot (rank 0, 0), slot (rank 1, 0)
    home_tokens = cmap[:, 0].nonzero().squeeze(1).tolist()
    replica_tokens = cmap[:, 3].nonzero().squeeze(1).tolist()
    assert home_tokens == [0, 1, 2] and replica_tokens == [4, 5]  # first tokens stay home
    w = torch.arange(24, dtype=torch.float64).reshape(6, 4)
    (cprobs * w).sum().backward()
    want = torch.zeros(6, 2, dtype=torch.float64)
    for t in range(6):
        for e in range(2):
            if rmap[t, e]:
                col = int(cmap[t].nonzero()[0]) if e == 0 else 1
                want[t, e] = w[t, col]
    assert torch.equal(probs.grad, want)
    # physical layout: rank 0 [expert 0, slot 0], rank 1 [expert 1, slot 0]
    pmap, _ = reroute(rmap, None, RerouteTable.from_result(res, 0, "physical"))
    assert pmap[:, 0].nonzero().squeeze(1).tolist() == [0, 1, 2]
    assert pmap[:, 3].nonzero().squeeze(1).tolist() == [4, 5]
    assert pmap[:, 2].nonzero().squeeze(1).tolist() == [3]


def test_reroute_rejects_bad_input():
    res = get_planner("quota")(np.zeros((2, 2), np.int64), Domain.flat(2, 1), 1)
    table = RerouteTable.from_result(res, 0)
    with pytest.raises(ValueError, match="bool"):
        reroute(torch.zeros(3, 2), None, table)
    with pytest.raises(ValueError, match="2 experts"):
        reroute(torch.zeros(3, 3, dtype=torch.bool), None, table)
    with pytest.raises(ValueError, match="probs"):
        reroute(torch.zeros(3, 2, dtype=torch.bool), torch.zeros(3, 3), table)
    with pytest.raises(ValueError, match="layout"):
        RerouteTable.from_result(res, 0, "dense")
