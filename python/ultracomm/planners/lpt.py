"""DeepSeek EPLB's method (``rebalance_experts``) within ultracomm's fixed-home model.

EPLB places every physical expert, originals included; here every expert stays on its
home rank and only the ``slots_per_rank`` replica slots are placed.  The steps follow
EPLB's:

1. Replica counts: the ``world * slots_per_rank`` replicas (or ``max_replicas``) are
   handed out one at a time. EPLB's ``replicate_experts`` (``counts="eplb"``) gives each
   to the expert with the highest load per instance ``load / instances`` (ties: lower
   id); with free placement that bounds the heaviest GPU. With fixed homes, under
   EPLB's even split, a rank computes the home shares of its experts (the sum of their
   ``load / instances``) however the replicas are packed, so ``counts="rank"`` gives each replica
   to the rank with the largest such sum, to its expert with the highest load per
   instance (ties: lower rank, lower expert). EPLB's rule, which looks at experts alone,
   leaves a rank of many equally hot experts without a replica on rank-blocked loads
   (EP16 at initial 3.0: that rank stays at 1.222 x mean; perf/planners.md); the rank
   rule, which estimates with even shares, can spend replicas on a rank that one min-max
   replica would have relieved. Neither dominates, so the default (``counts="best"``)
   runs steps 2-3 for both and keeps the plan whose most loaded rank is lighter (EPLB's
   on ties; about twice the time). Either way an expert gets at most ``world - 1``
   replicas (one per other rank), and none once its per-instance load would drop below
   ``min_tokens``.
2. Balanced packing (EPLB ``balanced_packing``, longest processing time first): replica
   instances, heaviest first (``load / instances``; ties: lower expert, then instance),
   each go to the rank with the lowest current load among those with a free slot that
   are not the expert's home and do not hold it yet (ties: lower rank).  Rank loads start
   from the home instances' shares.  A replica no rank can take is dropped.
3. Quotas -- the fixed-home adaptation: EPLB splits each expert evenly over its
   instances, which balances there because the packing places the homes too.  With
   fixed homes an even split leaves a hot home rank an even share of each of its hot
   experts (EP64, 90 % of tokens to one rank's experts: 4.36 max:mean), so the tokens of
   each replicated expert are instead split to minimise the most loaded rank for the
   placement found (a min-max transportation problem: bisection on the threshold over
   a max-flow, csrc/planners/balance.cpp; ties of the flow keep tokens at home).

``hierarchical=True`` is EPLB's ``rebalance_experts_hierarchical``: each node's
replica budget (its ranks' slots) goes to the experts homed on the node, and replicas
are packed onto the node's own ranks.  EPLB's first step, packing expert groups onto
nodes, is fixed by the homes here, so an overloaded node stays overloaded (use the
default global policy, like EPLB with one node, to balance across nodes).

Like EPLB it fills every slot it can: good balance, many copies (a replica the quota
step leaves without tokens is kept, as EPLB would copy it; ``info["idle"]`` counts
them).

What differs from EPLB, exactly:

* Only the replica slots are placed; every expert keeps its home instance on its home
  rank (EPLB places every physical expert, originals included).
* Counts: EPLB's ``replicate_experts`` rule, plus the fixed-home rank rule (step 1); the
  default keeps the plan of either whose most loaded rank is lighter.
* Packing: EPLB's ``balanced_packing`` over the replica instances only, rank loads
  starting from the home instances' even shares; a rank takes at most ``slots_per_rank``
  replicas, never a replica of its own expert or a second one of the same expert; a
  replica no rank can take is dropped (``info["dropped"]``).
* Quotas: min-max for the placement (step 3) instead of EPLB's even split.
* Hierarchical: the node of every expert is fixed by its home (EPLB first packs expert
  groups onto nodes).

Where it stays short: on the rank-blocked EP16 load at initial 3.0 it ends at 1.098 x mean
where quota and taot reach 1.010 (perf/planners.md, "lpt on rank-blocked loads"): with the
shares already min-max, what is left is the placement, and at 1.01 x mean that is a tight
covering (spare only 4 % above the excess, in 22 slots) that counting and LPT packing by
shares do not solve.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Domain, PlannerResult, as_load, build_result, check_slots, home_rank_load
from ..errors import InputError, UltracommError

try:  # the planner runs in C++ (csrc/planners/lpt.cpp, balance.cpp)
    from .. import _core as _core_mod

    _HAVE_CPP = hasattr(_core_mod, "lpt_plan")
except ImportError:  # pragma: no cover - core not built
    _core_mod = None
    _HAVE_CPP = False

__all__ = ["plan", "balance_quotas"]


def balance_quotas(expert_load: Any, instance_ranks: list[list[int]], base: Any) -> tuple[int, list[np.ndarray]]:
    """Min-max split of replicated experts' tokens over a fixed placement (step 3).

    Args:
        expert_load: int ``[n]`` tokens of each replicated expert.
        instance_ranks: per expert, the ranks of its instances (home first; ties of the
            flow keep tokens on earlier instances).
        base: int ``[world]`` tokens each rank computes for its unreplicated experts.

    Returns:
        ``(max_load, quotas)``: the smallest possible maximum rank load and, per expert,
        int64 tokens per instance (summing to its load).
    """
    lens = np.fromiter((len(x) for x in instance_ranks), np.int64, len(instance_ranks))
    off = np.concatenate(([0], np.cumsum(lens))).astype(np.int64)
    inst = np.fromiter((r for x in instance_ranks for r in x), np.int64, int(off[-1]))
    T, q = _core().balance_quotas(np.asarray(expert_load, np.int64), off, inst, np.asarray(base, np.int64))
    return int(T), np.split(q, off[1:-1])


def _core():
    if not _HAVE_CPP:
        raise UltracommError(
            "ultracomm._core has no lpt_plan; rebuild the core (pip install --no-build-isolation -e .)"
        )
    return _core_mod


def plan(
    load: Any,
    domain: Domain,
    slots_per_rank: int,
    *,
    min_tokens: int = 1,
    max_replicas: int | None = None,
    hierarchical: bool = False,
    counts: str = "best",
) -> PlannerResult:
    """EPLB-style replica counts + balanced (LPT) packing, with min-max quotas.

    Args:
        load: int64 ``[world, E]``.
        domain: ranks and nodes (used only with ``hierarchical``).
        slots_per_rank: replica slots per rank.
        min_tokens: an expert is only replicated if each instance keeps at least this
            many tokens of an even split.
        max_replicas: total replicas to place (default ``world * slots_per_rank``; with
            ``hierarchical`` each node gets ``max_replicas * its ranks // world``).
        hierarchical: EPLB's hierarchical policy (replicas stay on the home node).
        counts: ``"eplb"`` (EPLB's ``replicate_experts``), ``"rank"`` (the fixed-home
            count rule) or ``"best"`` (both; the plan with the lower most loaded rank,
            EPLB's on ties); see the module docstring.

    ``info``: ``replicas`` (placed), ``dropped`` (no rank could take them), ``idle``
    (placed replicas the quota step gives no tokens), ``max_load`` (the most loaded
    rank's tokens).
    """
    rules = {"eplb": 0, "rank": 1, "best": 2}
    if counts not in rules:
        raise InputError(f"counts must be 'eplb', 'rank' or 'best', got {counts!r}")
    load = as_load(load, domain)
    K = check_slots(slots_per_rank)
    W = domain.world
    el, _ = home_rank_load(load, domain)
    budget = W * K if max_replicas is None else max(0, min(int(max_replicas), W * K))
    group = domain.node_of if hierarchical else None
    slot_src, slot_quota, info = _core().lpt_plan(el, group, W, K, max(int(min_tokens), 1), budget, rules[counts])
    return build_result(load, domain, slot_src, slot_quota, info)
