"""Simulated makespan of a Schedule's ops on a Fabric, and DESIGN.md's lower bound.

See the package docstring (:mod:`ultracomm.sim`) for the model; this module turns a
Schedule's task lists into flows for :mod:`ultracomm.sim.engine` and adds the costs that
are not flows (launch, host-side build and copies).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from ..records import MASTER, Op
from .engine import _run_flows
from .fabric import Fabric
from ..errors import InputError


def schedule_for(
    plan,
    weight_bytes: int,
    grad_bytes: int,
    fabric: Fabric,
    relay_mode: str = "auto",
    chunk_bytes: int = 1 << 20,
    max_depth: Optional[int] = None,
    costs=None,
):
    """:func:`~ultracomm.schedule.build_schedule` with the fabric's nodes, bandwidths and hop
    latencies (latency + chunk overhead per hop); ``max_depth`` None: the builder's default.

    ``costs`` (an :class:`ultracomm.alpha_beta.AlphaBeta`): the schedule a message transport
    (``p2p``: NCCL point-to-point, gloo) runs instead -- the same :func:`~ultracomm.alpha_beta.choose_schedule`
    the Context uses, so simulated message-transport figures follow its chunk and tree choice
    (``chunk_bytes`` is then ignored)."""
    from ..schedule import build_schedule

    fab = fabric.for_world(int(plan.world))
    kw = {} if max_depth is None else {"max_depth": int(max_depth)}
    if costs is not None:
        from ..alpha_beta import choose_schedule

        return choose_schedule(
            plan,
            int(weight_bytes),
            int(grad_bytes),
            costs,
            relay_mode=relay_mode,
            node_of=fab.nodes if fab.multi_node else None,
            **kw,
        ).schedule
    return build_schedule(
        plan,
        int(weight_bytes),
        int(grad_bytes),
        node_of=fab.nodes if fab.multi_node else None,
        chunk_bytes=int(chunk_bytes),
        relay_mode=relay_mode,
        intra_bw=fab.intra_bw,
        inter_bw=fab.inter_bw,
        intra_latency_s=fab.intra_latency_s + fab.chunk_overhead_s,
        inter_latency_s=fab.inter_latency_s + fab.chunk_overhead_s,
        **kw,
    )


@dataclass
class SimResult:
    """What :func:`simulate` / :func:`~ultracomm.sim.baselines.simulate_alltoall` return (all
    times in seconds; every one of them *simulated*).

    Attributes:
        op: ``"multicast"`` or ``"reduce"``.
        method: ``"schedule"`` or ``"alltoall"``.
        makespan_s: time until the last rank is done.
        per_rank_finish: float64 ``[world]``: when each rank's last transfer (sent or received)
            landed; 0 for ranks with nothing to do.
        lower_bound_s: :func:`lower_bound` of the same plan and op.
        critical_rank: the rank whose busiest resource is the most loaded among the ranks that
            finish last (-1 when nothing moves).
        critical_link: that resource, e.g. ``"egress nvlink"`` or ``"sm pool"``.
        bytes: bytes per replica (weights or grads).
        replicas: replica slots filled.
        egress, ingress: int64 ``[world]`` bytes each rank sends / receives.
        flows: tree edges simulated.
        chunks: chunks simulated per flow (after merging), ``effective_chunk_bytes`` their size.
        events, rate_updates: event-loop counters; ``wall_s`` simulation wall time.
        parts: the makespan's fixed terms (``host_s``, ``launch_s``; for the all-to-all also
            ``prep_s``, ``startup_s``, ``transfer_s``, ``post_s``).
    """

    op: str
    method: str
    makespan_s: float
    per_rank_finish: np.ndarray
    lower_bound_s: float
    critical_rank: int
    critical_link: str
    bytes: int
    replicas: int
    egress: np.ndarray
    ingress: np.ndarray
    flows: int = 0
    chunks: int = 0
    effective_chunk_bytes: int = 0
    events: int = 0
    rate_updates: int = 0
    wall_s: float = 0.0
    parts: dict = field(default_factory=dict)

    @property
    def ratio_to_lb(self) -> float:
        return self.makespan_s / self.lower_bound_s if self.lower_bound_s > 0 else 1.0

    def to_dict(self) -> dict:
        d = {
            k: getattr(self, k)
            for k in (
                "op",
                "method",
                "makespan_s",
                "lower_bound_s",
                "critical_rank",
                "critical_link",
                "bytes",
                "replicas",
                "flows",
                "chunks",
                "effective_chunk_bytes",
                "events",
                "rate_updates",
                "wall_s",
            )
        }
        d["ratio_to_lb"] = self.ratio_to_lb
        d["max_egress"] = int(self.egress.max()) if self.egress.size else 0
        d["max_ingress"] = int(self.ingress.max()) if self.ingress.size else 0
        d["per_rank_finish"] = [float(x) for x in self.per_rank_finish]
        d["parts"] = dict(self.parts)
        return d


def _opname(op) -> str:
    if isinstance(op, str):
        k = op.strip().lower()
        alias = {
            "multicast": "multicast",
            "weight_sync": "multicast",
            "weights": "multicast",
            "reduce": "reduce",
            "grad_reduce": "reduce",
            "grads": "reduce",
        }
        if k not in alias:
            raise InputError(f"op must be 'multicast'/'weight_sync' or 'reduce'/'grad_reduce', got {op!r}")
        return alias[k]
    v = int(op)
    if v not in (0, 1):
        raise InputError(f"op must be Op.MULTICAST or Op.REDUCE, got {op!r}")
    return "multicast" if v == 0 else "reduce"


# ----------------------------------------------------------------------------- lower bound


def _plan_arrays(plan_or_sched) -> tuple[np.ndarray, np.ndarray]:
    """(slot_src [W, S] int64, home_of [E] int64) of a plan or a schedule."""
    if hasattr(plan_or_sched, "inputs") and callable(plan_or_sched.inputs):
        inp = plan_or_sched.inputs()
        W, S = int(inp["world"]), int(inp["slots_per_rank"])
        return (
            np.asarray(inp["slot_src"], dtype=np.int64).reshape(W, S),
            np.asarray(inp["home_of"], dtype=np.int64).reshape(-1),
        )
    src = plan_or_sched.slot_src
    home = plan_or_sched.home_of
    src = src.numpy() if hasattr(src, "numpy") else np.asarray(src)
    home = home.numpy() if hasattr(home, "numpy") else np.asarray(home)
    return src.astype(np.int64), home.astype(np.int64).reshape(-1)


def _bound_terms(slot_src: np.ndarray, home_of: np.ndarray, fab: Fabric, nbytes: int, pool_bw: float) -> dict:
    W = slot_src.shape[0]
    E = home_of.shape[0]
    B = float(nbytes)
    filled = slot_src >= 0
    recv = filled.sum(axis=1)
    reps = np.bincount(slot_src[filled], minlength=E)
    total = int(reps.sum())
    once = np.bincount(home_of[reps > 0], minlength=W)
    terms = {}
    if math.isfinite(pool_bw):
        # every replica is written (or pulled and added) once by some rank's SMs, and a home
        # handles each of its replicated experts at least once
        terms["sm_once"] = once.max(initial=0) * B / pool_bw
        terms["sm_total/W"] = total * B / W / pool_bw
    if not fab.multi_node:
        terms["max_recv"] = recv.max(initial=0) * B / fab.intra_bw
        terms["max_once"] = once.max(initial=0) * B / fab.intra_bw
        terms["total/W"] = total * B / W / fab.intra_bw
        return terms
    both = fab.intra_bw + fab.inter_bw
    terms["max_recv"] = recv.max(initial=0) * B / both
    terms["max_once"] = once.max(initial=0) * B / both
    terms["total/W"] = total * B / W / both
    node = fab.nodes[:W].astype(np.int64)
    N = int(node.max()) + 1
    size = np.bincount(node, minlength=N)
    # holders[n, e]: expert e has a copy (home or replica) on node n
    holders = np.zeros((N, E), dtype=np.int64)
    np.add.at(holders, (node[home_of], np.arange(E)), 1)
    rr, ss = np.nonzero(filled)
    ee = slot_src[rr, ss]
    np.add.at(holders, (node[rr], ee), 1)
    sole = holders[node[rr], ee] == 1  # no other copy on the replica's node
    sole_recv = np.bincount(rr[sole], minlength=W)
    terms["rdma_recv"] = sole_recv.max(initial=0) * B / fab.inter_bw
    # experts only replicated on other nodes: home must send them over RDMA
    home_node_reps = np.zeros(E, dtype=np.int64)
    same = node[rr] == node[home_of[ee]]
    np.add.at(home_node_reps, ee[same], 1)
    remote_only = (reps > 0) & (home_node_reps == 0)
    terms["rdma_once"] = np.bincount(home_of[remote_only], minlength=W).max(initial=0) * B / fab.inter_bw
    # per node: experts it needs from elsewhere (in), experts it homes needed elsewhere (out)
    need = np.zeros((N, E), dtype=bool)
    need[node[rr], ee] = True
    need[node[home_of], np.arange(E)] = False
    cin = need.sum(axis=1)
    out_e = need.any(axis=0)
    cout = np.bincount(node[home_of[out_e]], minlength=N)
    terms["rdma_node"] = float(np.max(np.maximum(cin, cout) * B / (size * fab.inter_bw), initial=0.0))
    terms["rdma_total/W"] = cin.sum() * B / W / fab.inter_bw
    return terms


def _fixed_cost(fab: Fabric) -> float:
    hop = min(fab.intra_latency_s, fab.inter_latency_s) if fab.multi_node else fab.intra_latency_s
    return fab.launch_s + hop + fab.chunk_overhead_s


def _task_bytes(schedule) -> int:
    """Largest per-rank size of the task and ref lists of both ops (what a GPU transport
    copies to the device once per weight_sync)."""
    best = 0
    for r in range(schedule.world):
        n = sum(int(schedule.tasks(op, r).nbytes) + int(schedule.refs(op, r).nbytes) for op in (0, 1))
        best = max(best, n)
    return best


def host_cost_s(fab: Fabric, op: str, task_bytes: int = 0) -> float:
    """Host-side time before a schedule-driven op can start on the device: for weight_sync the
    plan comes to the host, the rank's task lists are built and copied to the device; restore
    and grad_reduce reuse them (0)."""
    if op != "multicast" or not (fab.d2h_latency_s or fab.host_build_s or fab.h2d_latency_s):
        return 0.0  # not a schedule-building op, or host costs not modelled (a bare Fabric)
    return fab.d2h_latency_s + fab.host_build_s + fab.h2d_latency_s + task_bytes / fab.h2d_bw


def _chunk_bytes_of(schedule_or_plan) -> Optional[int]:
    if hasattr(schedule_or_plan, "inputs") and callable(schedule_or_plan.inputs):
        return int(schedule_or_plan.inputs()["chunk_bytes"])
    return None


def lower_bound(
    schedule_or_plan,
    fabric: Fabric,
    op,
    nbytes: Optional[int] = None,
    *,
    terms: bool = False,
    host_s: Optional[float] = None,
):
    """DESIGN.md's lower bound of ``op`` on ``fabric`` (seconds), with tiers and the SM budget
    (package doc).

    ``schedule_or_plan``: a Schedule (bytes, chunk size and task lists from it) or a
    ReplicaPlan (then pass ``nbytes``, the bytes per replica of this op; SM pools at their
    raw rate).  ``host_s``: the host-side fixed cost to include (default: a Schedule's own,
    :func:`host_cost_s`; 0 for a plan).  With ``terms=True`` returns ``(seconds, {term:
    seconds})``; the fixed cost is the ``"fixed"`` term."""
    name = _opname(op)
    src, home = _plan_arrays(schedule_or_plan)
    is_sched = hasattr(schedule_or_plan, "inputs")
    if nbytes is None:
        if not is_sched:
            raise InputError("lower_bound of a plan needs nbytes")
        inp = schedule_or_plan.inputs()
        nbytes = int(inp["weight_bytes"] if name == "multicast" else inp["grad_bytes"])
    fab = fabric.for_world(src.shape[0])
    pool = fab.sm_pool_bw(name, _chunk_bytes_of(schedule_or_plan))
    t = _bound_terms(src, home, fab, int(nbytes), pool)
    bw = max(t.values(), default=0.0)
    if host_s is None:
        host_s = host_cost_s(fab, name, _task_bytes(schedule_or_plan)) if is_sched else 0.0
    fixed = _fixed_cost(fab) + host_s if bw > 0 else 0.0
    t["fixed"] = fixed
    lb = bw + fixed
    return (lb, t) if terms else lb


# ----------------------------------------------------------------------------- schedules


def _edges(schedule, op_i: int):
    """Tree edges of one op from the task lists: arrays (expert, src_rank, src_slot, dst_rank,
    dst_slot) with data flowing src -> dst, and the chunk sizes."""
    W = schedule.world
    rows = []
    chunk_sz: dict = {}
    for r in range(W):
        t = schedule.tasks(op_i, r)
        if t.size == 0:
            continue
        refs = schedule.refs(op_i, r)
        c0 = t[t["chunk"] == 0]
        ch, first = np.unique(t["chunk"], return_index=True)
        for c, k in zip(ch.tolist(), first.tolist()):
            chunk_sz.setdefault(c, int(t["bytes"][k]))
        cnt = c0["ref_count"].astype(np.int64)
        rep = np.repeat(np.arange(c0.size), cnt)
        off = np.arange(rep.size) - np.repeat(np.cumsum(cnt) - cnt, cnt)
        ref = refs[c0["ref_begin"][rep].astype(np.int64) + off]
        rows.append((c0["expert"][rep], c0["self_rank"][rep], c0["self_slot"][rep], ref["rank"], ref["slot"]))
    if not rows:
        z = np.zeros(0, dtype=np.int64)
        return z, z, z, z, z, np.zeros(0)
    e, sr, ss, dr, ds = (np.concatenate([x[k] for x in rows]).astype(np.int64) for k in range(5))
    C = max(chunk_sz) + 1 if chunk_sz else 0
    sizes = np.array([chunk_sz[c] for c in range(C)], dtype=np.float64)
    if op_i == int(Op.MULTICAST):
        return e, sr, ss, dr, ds, sizes
    # reduce: the task's rank pulls from its sources: data flows source -> self
    return e, dr, ds, sr, ss, sizes


def _merge_chunks(sizes: np.ndarray, max_chunks: Optional[int]) -> np.ndarray:
    if not max_chunks or sizes.size <= max_chunks:
        return sizes
    g = -(-sizes.size // int(max_chunks))
    pad = (-sizes.size) % g
    return np.concatenate([sizes, np.zeros(pad)]).reshape(-1, g).sum(axis=1)


def _node_key(expert, rank, slot, S):
    # master copies: (rank, MASTER, expert) -> negative ids; replica slots: rank * S + slot
    return np.where(slot == MASTER, -1 - expert, rank * max(S, 1) + slot)


def _finish(per_flow_end, sr, dr, W):
    prf = np.zeros(W)
    if per_flow_end.size:
        np.maximum.at(prf, sr, per_flow_end)
        np.maximum.at(prf, dr, per_flow_end)
    return prf


def _critical(prf, egress, ingress, inter_e, inter_i, fab, makespan, pool_bytes=None, pool_bw=math.inf):
    if makespan <= 0 or not prf.size:
        return -1, ""
    last = np.flatnonzero(prf >= makespan * (1 - 1e-3))
    best, who, what = -1.0, -1, ""
    for r in last.tolist():
        cands = [
            ((egress[r] - inter_e[r]) / fab.intra_bw, "egress nvlink"),
            ((ingress[r] - inter_i[r]) / fab.intra_bw, "ingress nvlink"),
            (inter_e[r] / fab.inter_bw, "egress rdma"),
            (inter_i[r] / fab.inter_bw, "ingress rdma"),
        ]
        if pool_bytes is not None and math.isfinite(pool_bw):
            cands.append((pool_bytes[r] / pool_bw, "sm pool"))
        for x, nm in cands:
            if x > best:
                best, who, what = x, r, nm
    return who, what


def simulate(schedule, fabric: Fabric, op, *, max_chunks: Optional[int] = None) -> SimResult:
    """Simulated makespan of ``schedule``'s ``op`` (``"multicast"``/``"weight_sync"`` or
    ``"reduce"``/``"grad_reduce"``) on ``fabric`` (cut to the schedule's world).

    ``max_chunks``: merge consecutive chunks into at most this many effective chunks
    (``None``/0: the schedule's chunks).  The schedule must hold every rank's task lists
    (``build_schedule(..., rank=None)``)."""
    t0 = time.perf_counter()
    name = _opname(op)
    op_i = 0 if name == "multicast" else 1
    if schedule.built_for is not None:
        raise InputError("simulate needs a schedule built for all ranks (rank=None)")
    W, S = schedule.world, schedule.slots_per_rank
    fab = fabric.for_world(W)
    inp = schedule.inputs()
    nbytes = int(inp["weight_bytes"] if op_i == 0 else inp["grad_bytes"])
    e, sr, ss, dr, ds, sizes = _edges(schedule, op_i)
    raw_chunk = float(sizes.max()) if sizes.size else 0.0
    sizes = _merge_chunks(sizes, max_chunks)
    node = fab.nodes
    inter = node[sr] != node[dr] if sr.size else np.zeros(0, bool)
    egress = np.bincount(sr, minlength=W).astype(np.int64) * nbytes
    ingress = np.bincount(dr, minlength=W).astype(np.int64) * nbytes
    inter_e = np.bincount(sr[inter], minlength=W).astype(np.int64) * nbytes
    inter_i = np.bincount(dr[inter], minlength=W).astype(np.int64) * nbytes
    host = host_cost_s(fab, name, _task_bytes(schedule))
    lb = lower_bound(schedule, fab, name, host_s=host)
    replicas = int((np.asarray(inp["slot_src"]) >= 0).sum())
    parts = {"host_s": host, "launch_s": fab.launch_s}
    if sr.size == 0 or sizes.size == 0 or sizes.sum() == 0:
        return SimResult(
            name,
            "schedule",
            0.0,
            np.zeros(W),
            lb,
            -1,
            "",
            nbytes,
            replicas,
            egress,
            ingress,
            wall_s=time.perf_counter() - t0,
            parts={"host_s": 0.0, "launch_s": 0.0},
        )
    # push (multicast): the sender's SMs write; pull-and-add (reduce): the receiver's SMs read and add
    pool_rank = sr if name == "multicast" else dr
    pool_bw = fab.sm_pool_bw(name, raw_chunk)
    src_node = _node_key(e, sr, ss, S)
    dst_node = _node_key(e, dr, ds, S)
    start = np.full(sr.size, host + fab.launch_s)
    end, events, updates = _run_flows(src_node, dst_node, sr, dr, sizes, fab, start, pools=[(pool_rank, pool_bw)])
    prf = _finish(end, sr, dr, W)
    mk = float(end.max())
    pool_bytes = egress if name == "multicast" else ingress
    cr, cl = _critical(prf, egress, ingress, inter_e, inter_i, fab, mk, pool_bytes, pool_bw)
    return SimResult(
        name,
        "schedule",
        mk,
        prf,
        lb,
        cr,
        cl,
        nbytes,
        replicas,
        egress,
        ingress,
        flows=int(sr.size),
        chunks=int(sizes.size),
        effective_chunk_bytes=int(sizes.max()),
        events=events,
        rate_updates=updates,
        wall_s=time.perf_counter() - t0,
        parts=parts,
    )
