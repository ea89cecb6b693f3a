"""EPLB-style longest-processing-time (LPT) packing of replicas.

1. Replica counts (EPLB ``replicate_experts``): hand the ``world * slots_per_rank``
   replica slots out one at a time, each to the expert with the largest
   ``load / instances`` (ties: lower id); an expert gets at most ``world - 1``
   replicas.  Experts with fewer than ``min_tokens`` tokens per instance get none.
2. Each expert's tokens are split evenly over its instances (remainder to the lowest
   instances).
3. LPT: replica instances, heaviest first, go to the least loaded rank (homes'
   shares included) that has a free slot, is not the expert's home and does not
   hold it yet (ties: lower rank).  A replica with no such rank is dropped and its
   tokens go back to the home.

Like EPLB it fills every slot it can: good balance, many copies.
"""
from __future__ import annotations

import heapq
from typing import Any

import numpy as np

from .base import Domain, PlannerResult, as_load, build_result, check_slots, home_rank_load

__all__ = ["plan"]


def plan(
    load: Any,
    domain: Domain,
    slots_per_rank: int,
    *,
    min_tokens: int = 1,
    max_replicas: int | None = None,
) -> PlannerResult:
    """EPLB-style replication + LPT packing.

    Args:
        load: int64 ``[world, E]``.
        domain: ranks and nodes (topology is ignored, as in EPLB).
        slots_per_rank: replica slots per rank.
        min_tokens: an expert is only replicated if each instance keeps at least this
            many tokens.
        max_replicas: total replicas to place (default ``world * slots_per_rank``).
    """
    load = as_load(load, domain)
    K = check_slots(slots_per_rank)
    W, epr = domain.world, domain.experts_per_rank
    el, _ = home_rank_load(load, domain)
    E = el.size
    budget = W * K if max_replicas is None else min(int(max_replicas), W * K)
    mt = max(int(min_tokens), 1)
    count = [1] * E
    elist = el.tolist()
    # 1. replica counts
    heap = [(-elist[e], e) for e in range(E) if elist[e] >= 2 * mt]
    heapq.heapify(heap)
    placed = 0
    while placed < budget and heap:
        _, e = heapq.heappop(heap)
        count[e] += 1
        placed += 1
        c = count[e]
        if c < W and elist[e] // (c + 1) >= mt:
            heapq.heappush(heap, (-(elist[e] / (c + 1)), e))
    # 2. even split, 3. LPT over replica instances
    cnt = np.asarray(count, np.int64)
    base = el // cnt
    rem = el - base * cnt
    home_share = base + (rem > 0)
    rank_load = home_share.reshape(W, epr).sum(1).tolist()
    reps: list[tuple[int, int, int]] = []  # (-tokens, expert, instance)
    for e in np.flatnonzero(cnt > 1).tolist():
        b, r = int(base[e]), int(rem[e])
        for i in range(1, count[e]):
            reps.append((-(b + (1 if i < r else 0)), e, i))
    reps.sort()
    free = [K] * W
    holds: list[set[int]] = [set() for _ in range(W)]
    rheap = [(rank_load[r], r) for r in range(W) if K > 0]
    heapq.heapify(rheap)
    slot_src = np.full((W, K), -1, np.int32)
    slot_quota = np.zeros((W, K), np.int64)
    dropped = 0
    home = domain.home_of
    for negq, e, _ in reps:
        q = -negq
        h = int(home[e])
        skipped = []
        dst = -1
        while rheap:
            ld, r = heapq.heappop(rheap)
            if r == h or e in holds[r]:
                skipped.append((ld, r))
                continue
            dst = r
            break
        for item in skipped:
            heapq.heappush(rheap, item)
        if dst < 0:
            dropped += 1
            continue
        k = K - free[dst]
        slot_src[dst, k] = e
        slot_quota[dst, k] = q
        free[dst] -= 1
        holds[dst].add(e)
        rank_load[dst] += q
        if free[dst] > 0:
            heapq.heappush(rheap, (rank_load[dst], dst))
    return build_result(
        load, domain, slot_src, slot_quota, {"replicas": placed - dropped, "dropped": dropped}
    )
