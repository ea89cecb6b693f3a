"""FEPLB-style greedy balancer: whole experts only.

Repeatedly take the most loaded rank; if its load exceeds the mean by more than
``tau`` tokens, replicate its busiest *eligible* ("dynamic") expert onto the least
loaded rank that has a free slot and route **all** of that expert's tokens to the
replica (the home copy computes nothing).  An expert is eligible if it is dynamic,
has at least ``min_tokens`` tokens, has not been moved yet, and moving it strictly
lowers the pair's maximum (its load is below the gap between the two ranks).  Stops
when the most loaded rank has no such expert or no slot is left.  Deterministic:
ties go to the lowest rank / expert id.

FEPLB moves within the NVLink domain only; pass ``intra_node_only=True`` for that.

Regime -- what it is for and where it stops:

* Whole experts only: a moved expert computes all of its tokens on one replica, so no
  plan it makes goes below ``max_e tokens(e)``, and the most loaded rank can only shed
  an expert smaller than its gap to the least loaded rank with a free slot.  It stops
  at the first rank that has no such expert.
* Use it where each rank's load is spread over many experts that are small next to
  the mean -- small EP groups of fine-grained experts (16 experts per rank at EP8:
  1.02-1.06 max:mean from Zipf 1.2-3.0; 8 per rank at EP16: 1.04-1.07; FEPLB's own
  case is GLM-5 at EP8) -- and when few copies and no token splitting (every token of
  a moved expert goes to one place, so the dispatcher needs no quotas) matter more
  than the last percent of balance.
* It cannot balance when a rank's load sits in a few experts each near or above the
  mean: 4 experts per rank at EP64 stay at 1.17-1.26 from Zipf 1.2-3.0, and the
  hot-rank loads at 4.8-14.4, where quota and taot reach 1.01 (perf/planners.md,
  "greedy's regime").  Use quota or taot there.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from .base import Domain, PlannerResult, as_load, build_result, check_slots, home_rank_load
from ..errors import InputError

__all__ = ["plan"]


def _dynamic_mask(dynamic: Any, el: np.ndarray, domain: Domain) -> np.ndarray:
    E = domain.num_experts
    if dynamic is None:
        return np.ones(E, bool)
    if isinstance(dynamic, (int, np.integer)) and not isinstance(dynamic, bool):
        # the ``dynamic`` busiest experts of each rank (a stand-in for FEPLB's
        # router-predictor choice from history)
        d = int(dynamic)
        epr = domain.experts_per_rank
        order = np.argsort(-el.reshape(domain.world, epr), axis=1, kind="stable")[:, :d]
        mask = np.zeros((domain.world, epr), bool)
        np.put_along_axis(mask, order, True, axis=1)
        return mask.reshape(-1)
    m = np.asarray(dynamic, dtype=bool)
    if m.shape != (E,):
        raise InputError(f"dynamic mask must have shape [{E}], got {tuple(m.shape)}")
    return m


def plan(
    load: Any,
    domain: Domain,
    slots_per_rank: int,
    *,
    tau: float = 0.0,
    min_tokens: int = 1,
    dynamic: Any = None,
    intra_node_only: bool = False,
    max_moves: int | None = None,
) -> PlannerResult:
    """Greedy whole-expert balancing (FEPLB); for mild skew over many experts (see the
    module docstring for the regime -- it cannot split an expert's tokens).

    Args:
        load: int64 ``[world, E]`` tokens each rank sends to each expert.
        domain: ranks and nodes.
        slots_per_rank: replica slots per rank.
        tau: stop once ``max(rank load) - mean <= tau`` tokens.
        min_tokens: experts with fewer tokens are never moved.
        dynamic: which experts may move: ``None`` (all), an int ``dyn`` (each rank's
            ``dyn`` busiest experts) or a bool mask ``[E]``.
        intra_node_only: only move experts to ranks on the home's node.
        max_moves: cap on the number of moved experts (default: no cap).
    """
    load = as_load(load, domain)
    K = check_slots(slots_per_rank)
    W, epr = domain.world, domain.experts_per_rank
    el, L0 = home_rank_load(load, domain)
    mean = float(L0.mean())
    dyn = _dynamic_mask(dynamic, el, domain) & (el >= max(int(min_tokens), 1))
    # per rank: eligible experts, busiest first (ties: lower id)
    order = np.lexsort((np.arange(el.size), -el))
    cand: list[list[int]] = [[] for _ in range(W)]
    for e in order[dyn[order]].tolist():
        cand[e // epr].append(e)
    elist = el.tolist()
    L = L0.astype(np.float64).tolist()
    free = [K] * W
    node = domain.node_of.tolist()
    slot_src = np.full((W, K), -1, np.int32)
    slot_quota = np.zeros((W, K), np.int64)
    limit = W * K if max_moves is None else min(int(max_moves), W * K)
    moves = 0
    open_ranks = [r for r in range(W) if free[r] > 0]
    while moves < limit and open_ranks:
        src = max(range(W), key=L.__getitem__)
        if L[src] - mean <= tau:
            break
        if intra_node_only:
            targets = [r for r in open_ranks if node[r] == node[src] and r != src]
        else:
            targets = [r for r in open_ranks if r != src]
        if not targets:
            break
        dst = min(targets, key=L.__getitem__)
        gap = L[src] - L[dst]
        pick = -1
        for i, e in enumerate(cand[src]):
            if elist[e] < gap:
                pick = i
                break
        if pick < 0:
            break
        e = cand[src].pop(pick)
        k = K - free[dst]
        slot_src[dst, k] = e
        slot_quota[dst, k] = elist[e]
        free[dst] -= 1
        if free[dst] == 0:
            open_ranks.remove(dst)
        L[src] -= elist[e]
        L[dst] += elist[e]
        moves += 1
    return build_result(load, domain, slot_src, slot_quota, {"moves": moves})
