"""The flow engine: an event-driven fluid simulation of chunked flows on shared resources.

Each flow crosses its sender's egress link, its receiver's ingress link (NVLink or RDMA by
tier) and the SM pools of the ranks whose SMs move its bytes (the sender's for a push, the
receiver's for a pull-and-add, both for a collective that runs kernels on both sides).
Flows with a chunk ready share the resources max-min fairly (progressive filling); rates are
recomputed whenever a flow starts, stalls, resumes or ends.
"""

from __future__ import annotations

import heapq
import math
from typing import Sequence

import numpy as np
from ..errors import UltracommError


def _maxmin(links: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows using resources ``links[i, :]`` (progressive filling)."""
    n = links.shape[0]
    L = cap.shape[0]
    rate = np.empty(n)
    idx = np.arange(n)
    rem = cap.astype(np.float64).copy()
    lk = links
    while idx.size:
        cnt = np.bincount(lk.ravel(), minlength=L)
        used = cnt > 0
        share = np.full(L, np.inf)
        share[used] = np.maximum(rem[used], 0.0) / cnt[used]
        s = share.min()
        bott = share <= s * (1 + 1e-9)
        fr = bott[lk].any(axis=1)
        rate[idx[fr]] = s
        rem -= s * np.bincount(lk[fr].ravel(), minlength=L)
        keep = ~fr
        idx, lk = idx[keep], lk[keep]
    return rate


def _run_flows(
    src_node, dst_node, src_rank, dst_rank, chunk_sizes, fab, start=None, deps_enabled=True, pools: Sequence[tuple] = ()
):
    """Event-driven fluid simulation.

    Flows ``i`` carry ``len(chunk_sizes)`` chunks from ``src_rank[i]`` to ``dst_rank[i]``;
    chunk ``c`` of flow ``i`` may start once every flow whose ``dst_node`` is ``src_node[i]``
    has delivered chunk ``c`` (+ hop latency + chunk overhead), and not before ``start[i]``.
    ``pools``: ``(pool_rank, pool_bw)`` pairs: flow ``i`` also crosses the SM pool of rank
    ``pool_rank[i]`` (``pool_bw`` bytes/s per rank; an infinite ``pool_bw`` is no limit).
    Returns (arrival time of each flow's last chunk incl. latency +
    overhead, events, rate updates).
    """
    nF = len(src_rank)
    C = len(chunk_sizes)
    W = fab.world
    node = fab.nodes
    inter = node[src_rank] != node[dst_rank]
    # resources: [0,W) nvlink egress, [W,2W) nvlink ingress, [2W,3W) rdma egress,
    # [3W,4W) rdma ingress, then W per SM pool set
    la = np.where(inter, 2 * W + src_rank, src_rank).astype(np.int64)
    lb = np.where(inter, 3 * W + dst_rank, W + dst_rank).astype(np.int64)
    cols, caps = [la, lb], [np.full(2 * W, fab.intra_bw), np.full(2 * W, fab.inter_bw)]
    for pool_rank, pool_bw in pools:
        if math.isfinite(pool_bw):
            cols.append(sum(c.size for c in caps) + np.asarray(pool_rank, dtype=np.int64))
            caps.append(np.full(W, float(pool_bw)))
    links = np.stack(cols, axis=1)
    cap = np.concatenate(caps)
    lat = np.where(inter, fab.inter_latency_s, fab.intra_latency_s) + fab.chunk_overhead_s
    start = np.zeros(nF) if start is None else np.asarray(start, dtype=np.float64)

    # deps: flows into my source node; dependents: flows out of my destination node
    into: dict = {}
    for i, d in enumerate(dst_node):
        into.setdefault(d, []).append(i)
    deps = [into.get(s, []) if deps_enabled else [] for s in src_node]
    outof: dict = {}
    for i, s in enumerate(src_node):
        outof.setdefault(s, []).append(i)
    dependents = [outof.get(d, []) if deps_enabled else [] for d in dst_node]

    vis = np.full((nF, C), np.inf)  # time chunk c of flow i is visible at its receiver
    cur = np.zeros(nF, dtype=np.int64)
    rem = np.zeros(nF)
    active = np.zeros(nF, dtype=bool)
    done = np.zeros(nF, dtype=bool)
    heap: list = []

    def ready_time(i, c):
        t = start[i]
        for j in deps[i]:
            v = vis[j, c]
            if v == np.inf:
                return None
            t = max(t, v)
        return t

    t = 0.0
    for i in range(nF):
        rt = ready_time(i, 0)
        if rt is not None:
            heapq.heappush(heap, (rt, i, 0))
    act = np.zeros(0, dtype=np.int64)
    rates = np.zeros(0)
    changed = True
    events = updates = 0
    n_done = 0
    tiny = 1e-12
    while n_done < nF:
        if changed:
            act = np.flatnonzero(active)
            rates = _maxmin(links[act], cap) if act.size else np.zeros(0)
            updates += 1
            changed = False
        t_timer = heap[0][0] if heap else np.inf
        if act.size:
            tt = rem[act] / rates
            dt = float(tt.min())
            t_fin = t + dt
        else:
            t_fin = np.inf
        if t_fin == np.inf and t_timer == np.inf:
            raise UltracommError("simulation deadlocked: a flow waits for a chunk no flow delivers")
        events += 1
        if t_fin <= t_timer:
            dt = t_fin - t
            rem[act] -= rates * dt
            t = t_fin
            fin = act[tt <= dt * (1 + 1e-9) + tiny]
            rem[fin] = 0.0
            for i in fin.tolist():
                c = int(cur[i])
                vis[i, c] = t + lat[i]
                for k in dependents[i]:
                    if cur[k] == c and not active[k] and not done[k]:
                        rt = ready_time(k, c)
                        if rt is not None:
                            heapq.heappush(heap, (rt, k, c))
                c += 1
                cur[i] = c
                if c == C:
                    active[i] = False
                    done[i] = True
                    n_done += 1
                    changed = True
                    continue
                rt = ready_time(i, c)
                if rt is not None and rt <= t:
                    rem[i] = chunk_sizes[c]
                else:
                    active[i] = False
                    changed = True
                    if rt is not None:
                        heapq.heappush(heap, (rt, i, c))
        else:
            if act.size:
                rem[act] -= rates * (t_timer - t)
            t = t_timer
        while heap and heap[0][0] <= t:
            _, i, c = heapq.heappop(heap)
            if cur[i] == c and not active[i] and not done[i]:
                active[i] = True
                rem[i] = chunk_sizes[c]
                changed = True
    return vis[:, C - 1] if C else start.copy(), events, updates
