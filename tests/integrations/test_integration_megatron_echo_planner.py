"""Contract tests of ``gen_offloading_plan`` against upstream's planner, as read in its source.

Upstream:

* ``balanced_moe``: Victarry/Megatron-LM, ``megatron/core/transformer/moe/offloading_planner.py``
  at commit 0bd925e471eb7b92cc0e4451fdd0207d3afa0fee (eager path ``gen_offloading_plan_eager``),
  called by ``balanced_moe_layer.py`` at ae807d3f3473beffa83099c1b489d1a360383acb as
  ``gen_offloading_plan(routing_map, probs, tokens, ep_rank=, num_ep_ranks=,
  num_spare_experts_per_ep_rank=, threshold_multiplier=, assignment_algorithm=)``.
* ``pr2368``: NVIDIA/Megatron-LM PR #2368 head a2b16b8733, the same path (Triton kernels).

Every expected plan below was worked out by hand from those sources (the steps are in the
comments), not produced by running this code.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ultracomm.integrations.echo_planner import effective_column, gen_offloading_plan
from ultracomm.integrations.megatron_echo import gen_offloading_plan as reexported


def rank0_map() -> torch.Tensor:
    """Rank 0 of a 2-rank, 4-expert group: 10 tokens to expert 0 (not contiguous), 2 to
    expert 1, 1 to 2, 1 to 3."""
    m = torch.zeros(14, 4, dtype=torch.bool)
    m[[0, 1, 3, 4, 6, 7, 9, 10, 12, 13], 0] = True
    m[[2, 5], 1] = True
    m[8, 2] = m[11, 3] = True
    return m


COUNTS = torch.tensor([[10, 2, 1, 1], [20, 2, 3, 1]], dtype=torch.int32)


def test_reexported_from_the_adapter_module():
    assert reexported is gen_offloading_plan


@pytest.mark.parametrize("upstream", ["balanced_moe", "pr2368"])
@pytest.mark.parametrize("algorithm", ["approx_bin_packing", "one_shot_greedy"])
def test_worked_example_column_order_and_proportional_split(upstream, algorithm):
    """Expert totals [30, 4, 4, 2]; rank loads 34 and 6; avg = 40 // 2 = 20; rank 1 has 14
    spare.  Rank 0's experts ascending [4, 30], cumsum - 20 clamped [0, 14]: expert 0
    spills 14, which every algorithm puts in rank 1's one spare (global spare 1).
    Split by source: 10/30 * 14 = 4.67 -> 4 from rank 0, 20/30 * 14 = 9.33 -> 9 from
    rank 1; the 1 left comes depth-first from the lowest source rank: rank 0 sends 5.
    Rank 0 moves its first 5 tokens of expert 0 (tokens 0 1 3 4 6).  Columns, per rank
    homes then spares (M=2, K=1): expert e -> (e // 2) * 3 + e % 2, spare 1 -> 1*3 + 2 = 5."""
    m = rank0_map()
    probs = torch.rand(14, 4, dtype=torch.float64) * m
    rmap, rprobs, omap = gen_offloading_plan(m, probs, COUNTS, 0, 2, assignment_algorithm=algorithm, upstream=upstream)
    assert omap.tolist() == [[False, True], [False, False], [False, False], [False, False]]
    assert rmap.shape == (14, 6) and rprobs.dtype == torch.float64
    want = torch.zeros(14, 6, dtype=torch.bool)
    want[[0, 1, 3, 4, 6], 5] = True
    want[[7, 9, 10, 12, 13], 0] = True
    want[[2, 5], 1] = True
    want[8, 3] = want[11, 4] = True
    assert torch.equal(rmap, want)
    assert torch.equal(rprobs[[0, 1, 3, 4, 6], 5], probs[[0, 1, 3, 4, 6], 0])
    assert torch.equal(rprobs[:, 0], probs[:, 0] * want[:, 0])
    assert torch.equal(rprobs[:, [1, 3, 4]], probs[:, 1:])
    assert not rprobs[:, 2].any()  # rank 0's spare is empty
    # rank 1 sends the other 9: its first 9 tokens of expert 0
    m1 = torch.zeros(26, 4, dtype=torch.bool)
    m1[:20, 0] = True
    m1[20:22, 1] = True
    m1[22:25, 2] = True
    m1[25, 3] = True
    r1, _, omap1 = gen_offloading_plan(m1, m1.float(), COUNTS, 1, 2, assignment_algorithm=algorithm, upstream=upstream)
    assert torch.equal(omap1, omap)
    assert r1[:, 5].nonzero().squeeze(1).tolist() == list(range(9))
    assert r1[:, 0].nonzero().squeeze(1).tolist() == list(range(9, 20))


def test_effective_column_is_rank_then_home_then_spare():
    """balanced_moe_layer.py ae807d3f ``_effective_spare_columns``: spare j on rank j // K at
    r*(M+K) + M + j % K; ``_to_effective_order`` puts home e at (e // M)*(M+K) + e % M."""
    E, R, K = 8, 2, 2  # M = 4
    assert [effective_column(E, R, K, expert=e) for e in range(E)] == [0, 1, 2, 3, 6, 7, 8, 9]
    assert [effective_column(E, R, K, spare=j) for j in range(R * K)] == [4, 5, 10, 11]


def counts_for(loads: list[int], R: int) -> torch.Tensor:
    """A [R, E] count matrix with the given expert totals, rank 0 holding all tokens."""
    c = torch.zeros(R, len(loads), dtype=torch.int32)
    c[0] = torch.tensor(loads)
    return c


def map_for(counts_row: torch.Tensor) -> torch.Tensor:
    E = counts_row.shape[0]
    return torch.repeat_interleave(torch.eye(E, dtype=torch.bool), counts_row.long(), dim=0)


@pytest.mark.parametrize(
    "upstream, spares",
    [
        # balanced_moe (eager): expert 0 (spill 10) fills rank 2 (6) and rank 3 (4); expert 1
        # (spill 8) gets rank 3's last 2 and rank 4's 6; each spare then keeps its largest home:
        # rank 3 keeps expert 0 (4 > 2)
        ("balanced_moe", {0: [2, 3], 1: [4]}),
        # pr2368 (buckets of width 30 // 7 = 4): both spills land in bucket (30-10)//4+1 = 6 and
        # (30-8)//4+1 = 6, expert 0 first.  Rank 2 takes expert 0 (6, 4 left -> bucket 7),
        # rank 3 the next head, expert 1 (6, 2 left -> bucket 7), rank 4 bucket 7's head: expert 0
        ("pr2368", {0: [2, 4], 1: [3]}),
    ],
)
def test_approx_bin_packing_versions_differ_as_their_sources_do(upstream, spares):
    """Expert totals [40, 38, 24, 24, 24] over 5 ranks (M = 1): avg 30; spills 10 and 8;
    ranks 2-4 have 6 spare each."""
    c = counts_for([40, 38, 24, 24, 24], 5)
    m = map_for(c[0])
    _, _, omap = gen_offloading_plan(m, m.float(), c, 0, 5, upstream=upstream)
    got = {e: omap[e].nonzero().squeeze(1).tolist() for e in range(5) if omap[e].any()}
    assert got == spares


def test_one_shot_greedy_threshold_multiplier():
    """Totals [30, 10] over 2 ranks: avg 20; expert 0 spills 10 into rank 1's spare.
    reclaim_spare_experts: rank 0 after offloading has 20; its offloads sorted [0, 10],
    cumsum [0, 10].  threshold 0.4: room 20*1.4 - 20 = 8 -> only the 0 can be undone, the
    spare stays; 0.5: room 10 -> both undone, no rank keeps it: no spare."""
    c = counts_for([30, 10], 2)
    m = map_for(c[0])
    kept = [
        bool(
            gen_offloading_plan(m, m.float(), c, 0, 2, threshold_multiplier=t, assignment_algorithm="one_shot_greedy")[
                2
            ].any()
        )
        for t in (0.0, 0.4, 0.5)
    ]
    assert kept == [True, True, False]
    # upstream applies the threshold only to one_shot_greedy
    assert gen_offloading_plan(m, m.float(), c, 0, 2, threshold_multiplier=0.5)[2].any()


def test_one_shot_greedy_two_spares_per_rank_capacity_rules():
    """Totals [40, 36, 2, 2] over 2 ranks (M = 2, K = 2): avg 40, rank 1 has 36 spare;
    rank 0's experts ascending [36, 40], cumsum - 40 -> [0, 36]: expert 0 spills 36.
    balanced_moe scales capacity by K (72); pr2368 does not (36): both place 36 in rank 1's
    slot 0 (global spare 2), the largest overlap going to slot 0."""
    c = counts_for([40, 36, 2, 2], 2)
    m = map_for(c[0])
    for upstream in ("balanced_moe", "pr2368"):
        _, _, omap = gen_offloading_plan(
            m, m.float(), c, 0, 2, 2, assignment_algorithm="one_shot_greedy", upstream=upstream
        )
        assert omap.nonzero().tolist() == [[0, 2]]


def test_probs_where_nothing_was_routed():
    """balanced_moe copies probs_routing into the home columns and moves only what it moves;
    pr2368 multiplies the probs by the new map."""
    m = rank0_map()
    probs = torch.full((14, 4), 0.25)
    keep = gen_offloading_plan(m, probs, COUNTS, 0, 2)[1]
    zero = gen_offloading_plan(m, probs, COUNTS, 0, 2, upstream="pr2368")[1]
    assert float(keep[2, 0]) == 0.25 and float(zero[2, 0]) == 0.0  # token 2 was not routed to expert 0
    assert float(keep[0, 0]) == 0.0 and float(keep[0, 5]) == 0.25  # token 0 moved to the spare


def test_upstream_argument_names_and_defaults():
    """Upstream's signature: (map_token_to_expert, probs_routing,
    count_tokens_per_expert_from_ep_rank, ep_rank, num_ep_ranks,
    num_spare_experts_per_ep_rank=1, threshold_multiplier=0.0, dtype_index=torch.int32,
    assignment_algorithm="approx_bin_packing")."""
    m = rank0_map()
    a = gen_offloading_plan(
        map_token_to_expert=m,
        probs_routing=m.float(),
        count_tokens_per_expert_from_ep_rank=COUNTS,
        ep_rank=torch.tensor(0),
        num_ep_ranks=2,
        num_spare_experts_per_ep_rank=1,
        threshold_multiplier=0.0,
        dtype_index=torch.int64,
        assignment_algorithm="approx_bin_packing",
    )
    b = gen_offloading_plan(m, m.float(), COUNTS, 0, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


def test_ultracomm_planner_uses_the_same_column_order():
    m = rank0_map()
    rmap, _, omap = gen_offloading_plan(m, m.float(), COUNTS, 0, 2, assignment_algorithm="quota")
    assert rmap.shape == (14, 6) and omap.shape == (4, 2)
    for j in omap.any(0).nonzero().squeeze(1).tolist():
        e = int(omap[:, j].nonzero())
        col = effective_column(4, 2, 1, spare=j)
        assert bool((rmap[:, col] <= m[:, e]).all())  # a spare column holds only its expert's tokens


@settings(max_examples=40, deadline=None)
@given(
    R=st.integers(1, 4),
    M=st.integers(1, 3),
    K=st.integers(1, 2),
    T=st.integers(0, 30),
    top_k=st.integers(1, 3),
    hot=st.sampled_from([0.0, 3.0]),
    seed=st.integers(0, 2**31),
    algorithm=st.sampled_from(["approx_bin_packing", "one_shot_greedy", "quota"]),
    upstream=st.sampled_from(["balanced_moe", "pr2368"]),
    threshold=st.sampled_from([0.0, 0.1]),
)
def test_every_routed_token_lands_on_an_instance_of_its_expert(
    R, M, K, T, top_k, hot, seed, algorithm, upstream, threshold
):
    """Read the way Megatron reads it (column c is rank c // (M+K), local slot c % (M+K)),
    every routed (token, expert) lands in exactly one column holding that expert, with its
    prob; the spares' token totals over all ranks are the plan's."""
    if algorithm == "approx_bin_packing":
        K = 1
    E = R * M
    top_k = min(top_k, E)
    g = torch.Generator().manual_seed(seed)
    maps, probs = [], []
    for _ in range(R):
        logits = torch.randn(T, E, generator=g)
        logits[:, 0] += hot
        m = torch.zeros(T, E, dtype=torch.bool).scatter_(1, logits.topk(top_k, 1).indices, True)
        maps.append(m)
        probs.append(torch.softmax(logits, 1) * m)
    counts = torch.stack([m.sum(0) for m in maps]).to(torch.int32)
    omaps, spare_tokens = [], np.zeros(R * K, np.int64)
    for r in range(R):
        rmap, rprobs, omap = gen_offloading_plan(
            maps[r],
            probs[r],
            counts,
            r,
            R,
            K,
            threshold_multiplier=threshold,
            assignment_algorithm=algorithm,
            upstream=upstream,
        )
        omaps.append(omap)
        assert rmap.shape == (T, R * (M + K))
        assert torch.equal(rmap.sum(1), maps[r].sum(1))
        torch.testing.assert_close(rprobs.sum(1), probs[r].sum(1), rtol=0, atol=1e-6)
        for c in range(R * (M + K)):
            rank, local = divmod(c, M + K)
            if local < M:
                e = rank * M + local
            else:
                holders = omap[:, rank * K + local - M].nonzero()
                if rmap[:, c].any():
                    assert holders.numel() == 1
                else:
                    continue
                e = int(holders)
                spare_tokens[rank * K + local - M] += int(rmap[:, c].sum())
            assert bool((rmap[:, c] <= maps[r][:, e]).all())
            assert torch.equal(rprobs[rmap[:, c], c], probs[r][rmap[:, c], e])
    assert all(torch.equal(o, omaps[0]) for o in omaps)  # every rank computes the same map
    if algorithm != "quota":
        assert all(spare_tokens[j] > 0 for j in omaps[0].any(0).nonzero().squeeze(1).tolist())


# ----------------------------------------------------------------------------- bad input (issue 23 item 4)


def bad(match: str, **kw):
    m = rank0_map()
    args = dict(
        map_token_to_expert=m,
        probs_routing=m.float(),
        count_tokens_per_expert_from_ep_rank=COUNTS,
        ep_rank=0,
        num_ep_ranks=2,
    )
    args.update(kw)
    with pytest.raises(ValueError) as info:
        gen_offloading_plan(**args)
    assert str(info.value) == "ultracomm: gen_offloading_plan: " + match


def test_out_of_range_ranks_and_sizes_are_named():
    bad("ep_rank must be an int in 0..1 (this rank's index in the EP group), got -1", ep_rank=-1)
    bad("ep_rank must be an int in 0..1 (this rank's index in the EP group), got 99", ep_rank=99)
    bad("ep_rank must be an int in 0..1 (this rank's index in the EP group), got True", ep_rank=True)
    bad(
        "ep_rank must be an int in 0..1 (this rank's index in the EP group), got a torch.float32 tensor of shape []",
        ep_rank=torch.tensor(0.0),
    )
    bad("num_ep_ranks must be a positive int (the EP group's size), got 0", num_ep_ranks=0)
    bad(
        "num_ep_ranks=3 does not divide the 4 experts of map_token_to_expert; every EP rank homes the same "
        "number of experts",
        num_ep_ranks=3,
    )
    bad("num_spare_experts_per_ep_rank must be a positive int, got 0", num_spare_experts_per_ep_rank=0)
    bad(
        "assignment_algorithm='approx_bin_packing' supports num_spare_experts_per_ep_rank=1 only (as upstream), "
        "got 2; use 'one_shot_greedy' or an ultracomm planner",
        num_spare_experts_per_ep_rank=2,
    )


def test_token_counts_that_disagree_or_are_fractional_are_named():
    c = COUNTS.clone()
    c[0, 1] = 3
    bad(
        "row ep_rank=0 of count_tokens_per_expert_from_ep_rank says 3 tokens for expert 1, but "
        "map_token_to_expert routes 2 of this rank's tokens to it; pass every rank's map_token_to_expert.sum(0), "
        "gathered over the EP group in rank order",
        count_tokens_per_expert_from_ep_rank=c,
    )
    f = COUNTS.double()
    f[1, 2] = 2.5
    bad(
        "count_tokens_per_expert_from_ep_rank must hold whole token counts; entry [1, 2] is 2.5",
        count_tokens_per_expert_from_ep_rank=f,
    )
    n = COUNTS.clone()
    n[1, 3] = -1
    bad("count_tokens_per_expert_from_ep_rank must be >= 0; entry [1, 3] is -1", count_tokens_per_expert_from_ep_rank=n)
    bad(
        "count_tokens_per_expert_from_ep_rank must be a [num_ep_ranks, experts] = [2, 4] tensor, got [4]",
        count_tokens_per_expert_from_ep_rank=COUNTS[0],
    )
    big = COUNTS.long()
    big[1, 0] = 2**31
    bad(
        "count_tokens_per_expert_from_ep_rank totals 2147483668 tokens, more than dtype_index=torch.int32 holds "
        "(2147483647); pass dtype_index=torch.int64",
        count_tokens_per_expert_from_ep_rank=big,
    )


def test_other_arguments_are_named():
    m = rank0_map()
    bad(
        "map_token_to_expert must be a bool [tokens, experts] tensor, got torch.float32 [14, 4]",
        map_token_to_expert=m.float(),
    )
    bad(
        "probs_routing must be a floating-point tensor shaped like map_token_to_expert [14, 4], got torch.float32 "
        "[14, 3]",
        probs_routing=torch.zeros(14, 3),
    )
    bad("threshold_multiplier must be a finite number (<= 0: off), got nan", threshold_multiplier=float("nan"))
    bad(
        "dtype_index must be an integer torch dtype (torch.int32 or torch.int64), got torch.float32",
        dtype_index=torch.float32,
    )
    bad(
        "assignment_algorithm must be 'approx_bin_packing' or 'one_shot_greedy' (Megatron's) or an ultracomm "
        "planner (device, greedy, lpt, quota, taot), got 'max_flow'",
        assignment_algorithm="max_flow",
    )
    bad("upstream must be one of ['balanced_moe', 'pr2368'], got 'main'", upstream="main")
