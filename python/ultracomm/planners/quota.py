"""UltraEP quota-driven planner.

The planner solves for the *quota* (tokens each expert instance computes) directly,
coupling replica placement with token rerouting.  It searches for the smallest
global per-rank load threshold ``T`` it can meet:

* ``feasible(T)``: for every rank above ``T`` (most loaded first), shed its excess
  ``L_r - T`` from its hottest experts first; each step opens a replica of the
  current hottest expert on the least loaded rank (largest spare ``T - L_j``) that
  still has a free slot, and moves ``min(expert's remaining home tokens, excess,
  spare)`` tokens of quota to it.  A step that would move fewer than ``min_tokens``
  is not taken (a rank may end up to ``min_tokens - 1`` above ``T``).  ``T`` is
  infeasible when spare slots or capacity run out.
* The search gallops up from ``ceil(mean)`` in steps of ``eps * mean`` and then
  bisects until the bracket is within ``eps * mean`` (tolerance ``eps``); the
  smallest feasible ``T`` found gives the plan.  Usually one or two probes.

Token split: a source rank's own tokens go to its own instance first, the rest
north-west-corner (:func:`~ultracomm.planners.base.split_tokens`).

UltraEP keeps replication inside one scale-up domain; with ``intra_node_only=True``
replicas only go to ranks on the expert's home node.
"""
from __future__ import annotations

import heapq
import math
from typing import Any

import numpy as np

from .base import Domain, PlannerResult, as_load, build_result, check_slots, home_rank_load

__all__ = ["plan", "feasible"]


def feasible(
    T: int,
    L: list[int],
    rank_experts: list[list[tuple[int, int]]],
    K: int,
    node: list[int] | None,
    min_tokens: int,
) -> list[tuple[int, int, int]] | None:
    """Replicas ``[(expert, rank, tokens), ...]`` that bring every rank to at most
    ``T`` (+ ``min_tokens - 1``), or ``None`` if the greedy cannot.

    ``L``: per-rank loads; ``rank_experts[r]``: ``(tokens, expert)`` of rank ``r``'s
    home experts, hottest first; ``node``: node of each rank to keep replicas
    intra-node (``None``: anywhere)."""
    W = len(L)
    hot = sorted((r for r in range(W) if L[r] > T), key=lambda r: (-L[r], r))
    if not hot:
        return []
    if K <= 0:
        return None
    mt = min_tokens
    nn = (max(node) + 1) if node is not None else 1
    heaps: list[list[tuple[int, int]]] = [[] for _ in range(nn)]
    for j in range(W):
        sp = T - L[j]
        if sp >= mt:
            heaps[node[j] if node is not None else 0].append((-sp, j))
    for h in heaps:
        heapq.heapify(h)
    free = [K] * W
    out: list[tuple[int, int, int]] = []
    for r in hot:
        heap = heaps[node[r] if node is not None else 0]
        x = L[r] - T
        for le, e in rank_experts[r]:
            if x < mt:
                break
            avail = le
            while avail >= mt and x >= mt:
                if not heap:
                    return None
                negsp, j = heap[0]
                a = min(avail, x, -negsp)
                out.append((e, j, a))
                avail -= a
                x -= a
                free[j] -= 1
                sp = -negsp - a
                if free[j] > 0 and sp >= mt:
                    heapq.heapreplace(heap, (-sp, j))
                else:
                    heapq.heappop(heap)
        if x >= mt:
            return None
    return out


def plan(
    load: Any,
    domain: Domain,
    slots_per_rank: int,
    *,
    eps: float = 0.01,
    min_tokens: int = 1,
    intra_node_only: bool = False,
) -> PlannerResult:
    """UltraEP quota planner.

    Args:
        load: int64 ``[world, E]``.
        domain: ranks and nodes.
        slots_per_rank: replica slots per rank.
        eps: relative tolerance of the threshold search (``eps * mean`` tokens).
        min_tokens: smallest quota a new replica may take.
        intra_node_only: keep replicas on the expert's home node.

    ``info``: ``threshold`` (the T met), ``probes`` (feasibility checks run).
    """
    load = as_load(load, domain)
    K = check_slots(slots_per_rank)
    W, epr = domain.world, domain.experts_per_rank
    el, L0 = home_rank_load(load, domain)
    L = L0.tolist()
    total = int(L0.sum())
    mean = total / W
    lb = -(-total // W)
    mt = max(int(min_tokens), 1)
    tol = max(1, int(math.floor(eps * mean)))
    # hottest first, ties lower id
    elr = el.reshape(W, epr)
    order = np.argsort(-elr, axis=1, kind="stable")
    srt = np.take_along_axis(elr, order, axis=1).tolist()
    ids = (order + (np.arange(W) * epr)[:, None]).tolist()
    rank_experts = [list(zip(srt[r], ids[r])) for r in range(W)]
    node = domain.node_of.tolist() if intra_node_only else None

    hi = max(L) if L else 0
    best: list[tuple[int, int, int]] = []
    probes = 0
    lo = lb - 1
    if hi - lo > tol and K > 0:
        d = tol
        while True:  # gallop
            T = lo + d
            if T >= hi:
                break
            probes += 1
            res = feasible(T, L, rank_experts, K, node, mt)
            if res is not None:
                hi, best = T, res
                break
            lo = T
            d *= 2
        while hi - lo > tol:  # bisect
            T = (lo + hi) // 2
            probes += 1
            res = feasible(T, L, rank_experts, K, node, mt)
            if res is not None:
                hi, best = T, res
            else:
                lo = T
    slot_src = np.full((W, K), -1, np.int32)
    slot_quota = np.zeros((W, K), np.int64)
    fill = [0] * W
    for e, j, a in best:
        k = fill[j]
        fill[j] = k + 1
        slot_src[j, k] = e
        slot_quota[j, k] = a
    return build_result(
        load, domain, slot_src, slot_quota, {"threshold": hi, "probes": probes}
    )
