"""Fabric simulator: a flow-level model of a scale-up domain that predicts the makespan of a
:class:`~ultracomm.schedule.Schedule` (weight_sync = multicast, grad_reduce = reduce), of
Megatron MoE ECHO's all-to-all weight distribution, and the lower bound of DESIGN.md.

    python -m ultracomm.sim --model qwen3-235b-a22b --domain nvl72 --ep 64 --slots 2 \\
        --imbalance 1.5,2,3 [--planner greedy] [--json FILE]
    python -m ultracomm.sim --calibrate        # UltraEP's published EP64 figures
    python -m ultracomm.sim --goals            # the project's goal sweep

Everything here is *simulated*: no byte moves.

Fabric model
------------
A :class:`Fabric` is a set of GPUs with, per GPU, four independent links: NVLink egress and
ingress (``intra_bw`` each, one number per direction, non-blocking switch) and, when the
domain spans several nodes, RDMA egress and ingress (``inter_bw`` each, rail-optimised: one
NIC per GPU, non-blocking network).  A transfer between ranks of one node uses the
sender's NVLink egress and the receiver's NVLink ingress; a transfer between nodes uses the
two RDMA links only (GPUDirect RDMA does not touch NVLink).  Bandwidths are *achieved*
figures (the ``*_peak`` fields hold the vendor numbers; see :data:`FABRICS`).

Flows.  Every tree edge of the schedule (one sender -> one receiver slot of one expert,
taken from the task lists: a copy task's destinations, a reduce task's sources) is a flow
that carries the expert's chunks in order, one after the other.  At any instant the
flows that have a chunk ready share the links max-min fairly (progressive filling; rates
are recomputed whenever a flow starts, stalls, resumes or ends -- an event-driven fluid
model).  This models an executor that keeps one chunk of every tree edge in flight (the
persistent TMA kernel with enough SMs; the host executor's workers claiming tasks in
chunk-major list order behave alike when workers >= edges per rank).

Dependencies (chunk pipelining).  A flow leaves node X (a replica slot or a master copy).
Chunk ``c`` may leave X when every flow *into* X has delivered chunk ``c``:

* multicast: X is a relay; its single incoming flow is its parent's copy into it;
* reduce (pull): X is a relay whose partial ``self + sum(children)`` of chunk ``c`` is what
  its parent pulls, so all of X's children must have delivered chunk ``c``.

A delivered chunk becomes visible ``hop latency + chunk_overhead_s`` after its last byte left
(the flag's flight and the handling of the chunk: flag write/poll, accumulation issue).
A flow's next chunk follows its previous one back to back (writes are pipelined; the
overhead is on the dependency path only).  Every op starts ``launch_s`` after t = 0.
The reduce's fp32 accumulation reads and writes HBM at several TB/s, an order of magnitude
above the link, and is not modelled as a resource.

Chunking.  The schedule's own chunks are simulated (1 MiB by default: 36 chunks of a
Qwen3-235B expert, 84 of a DeepSeek-V3 one).  ``max_chunks`` merges consecutive chunks into
at most that many *effective* chunks to bound the event count; merging only lengthens the
pipeline fill (one effective chunk per tree level), so a coarsened result is an upper bound
of the exact one.  The CLI simulates exactly (``--max-chunks 0``) unless told otherwise; an
EP64 schedule with ~256 replicas x 84 chunks takes well under 2 s.

Lower bound
-----------
:func:`lower_bound` is DESIGN.md's bound with tiers.  For one op moving ``B`` bytes per
replica, with ``recv[r]`` the filled slots of rank ``r``, ``once[r]`` the experts homed on
``r`` that have replicas, ``total`` the replicas and ``W`` the ranks:

* one node:  ``max(max recv, max once, total / W) * B / intra_bw``;
* several nodes: a rank's two links can both carry, so the terms above are divided by
  ``intra_bw + inter_bw``; plus the RDMA tier alone: a replica whose node holds no other copy
  of its expert must arrive over RDMA (per rank), a home whose expert is only replicated on
  other nodes must send it over RDMA once (per rank), node ``n`` must receive every expert
  it needs from elsewhere once and send every expert it homes that other nodes need once
  (per node, over its ``gpus`` NICs), all divided by ``inter_bw``.

plus the unavoidable fixed cost ``launch_s + hop latency + chunk_overhead_s`` (the last byte
still has to land and be flagged).  The reduce bound is the same with grad bytes and the
roles of egress and ingress swapped (every replica sends its grad at least once, the home
receives at least one partial per expert).  On one node the byte term equals the schedule
builder's ``stats()['lower_bound_bytes']``.

All-to-all baseline (Megatron MoE ECHO)
---------------------------------------
:func:`simulate_alltoall`.  weight_sync: every home stacks its local experts,
``index_select``s one row per replica it must send (an HBM copy: read + write of its send
bytes at ``hbm_bw``, which counts read + write), then all ranks call
``all_to_all_single`` with split sizes.  Assumptions, all in the all-to-all's favour
except the first two:

1. bulk-synchronous: the collective's transfers start when the *slowest* rank has finished
   its ``index_select`` and the collective has started up (``a2a_startup_s +
   a2a_per_peer_s * (W - 1)``: NCCL posts one send/recv pair per peer);
2. the collective ends when its last flow ends (every rank waits for it);
3. the transfers are the direct pattern (home -> every replica) on the same links at the
   same achieved bandwidth, shared max-min fairly: NCCL's channel buffering and SM copies
   are not charged;
4. no copy on the receive side (ECHO uses the output rows as the replica weights).

grad_reduce (its autograd reverse): the startup, the all-to-all of the replicas' grads back
to their homes (``grad_bytes`` each; fp32 by default like ultracomm's -- ECHO's autograd
reverse would move grads in the weights' dtype), then an ``index_add_`` into the home's
grad: read the received rows, read and write the home rows (3 x grad bytes per received
row at ``hbm_bw``), after the collective.

Domains larger than a preset
----------------------------
``--ep 64`` on ``h200x8`` is an error (naming ``8x8-rdma`` and ``nvl72`` as the fabrics
that hold 64 GPUs): an 8-GPU preset never grows into several nodes silently.
``<n>x8-rdma`` names any number of 8-GPU nodes; a smaller EP uses a preset's first GPUs.

Calibration against UltraEP (``--calibrate``; simulated, constants not tuned)
----------------------------------------------------------------------------
UltraEP's README (EP64, 256 DeepSeek-V3-sized experts, 4 master + 2 redundant slots per
rank) reports weight_sync 0.214 / 0.265 / 0.317 ms direct and 0.194 / 0.195 / 0.188 ms with
its adaptive relay, grad_reduce 1.9-2.4 ms overlapped with compute.  On ``nvl72`` with the
``quota`` planner we predict ~0.60 / 0.60 / 0.84 ms direct (2.3-2.8x the published figure)
and ~0.25 / 0.25 / 0.37 ms relay (1.3-2.0x), grad_reduce 0.49-0.72 ms (0.23-0.34x).
The gaps are byte accounting, not the model: with two redundant slots the busiest rank
receives two experts, 2 x 88,080,384 B = 176 MB, which takes 0.238 ms at 740 GB/s and
0.196 ms even at the 900 GB/s *peak*; direct multicast of an expert with 4 replicas sends
352 MB from one GPU (>= 0.39 ms at peak).  The published relay figure therefore implies
fewer bytes per expert than bf16 DeepSeek-V3 (their critical-path bandwidth, 706-715
GB/s x 0.194 ms = 138 MB, is 1.56 bf16 experts or ~3.1 fp8 ones), or a different byte
count per slot.  Their grad_reduce is measured overlapped with GEMMs on 42 SMs; ours is
the link-bound time on an idle fabric.
"""
from __future__ import annotations

import argparse
import dataclasses
import heapq
import json
import math
import re
import sys
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import numpy as np

from .records import MASTER, Op

__all__ = [
    "Fabric",
    "FABRICS",
    "get_fabric",
    "SimResult",
    "simulate",
    "simulate_alltoall",
    "lower_bound",
    "schedule_for",
    "compare",
    "make_plan",
    "run_case",
    "calibrate",
    "goals",
    "main",
]

GB = 1e9

# ----------------------------------------------------------------------------- fabrics


@dataclass(frozen=True)
class Fabric:
    """A scale-up domain: per-GPU link bandwidths (bytes/s, each direction) and latencies.

    Attributes:
        name: preset name.
        world: number of GPUs.
        node_of: node index of each GPU (tuple of ``world`` ints; default: ``gpus_per_node``
            consecutive GPUs per node).
        gpus_per_node: GPUs per node (the NVLink domain size).
        intra_bw: achieved NVLink bandwidth per GPU per direction (egress = ingress).
        inter_bw: achieved RDMA bandwidth per GPU per direction (second tier; unused when
            every GPU is on one node).
        intra_bw_peak, inter_bw_peak: vendor peaks (documentation; not used by the model).
        intra_latency_s, inter_latency_s: per-hop latency (data + flag visible at the
            receiver after the last byte left).
        chunk_overhead_s: handling of one chunk on the dependency path (flag write/poll,
            next task issue).
        launch_s: start of an op (kernel launch / first task claim).
        hbm_bw: achieved device-to-device copy bandwidth, read + write bytes counted
            (all-to-all baseline's ``index_select`` and ``index_add_``).
        a2a_startup_s, a2a_per_peer_s: the all-to-all collective's startup: fixed + per
            peer (NCCL posts a send/recv pair per peer).
    """

    name: str
    world: int
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    intra_bw_peak: float
    inter_bw_peak: float
    intra_latency_s: float = 2e-6
    inter_latency_s: float = 5e-6
    chunk_overhead_s: float = 0.5e-6
    launch_s: float = 4e-6
    hbm_bw: float = 4.3e12
    a2a_startup_s: float = 10e-6
    a2a_per_peer_s: float = 0.3e-6
    node_of: Optional[tuple] = None
    notes: str = ""

    def __post_init__(self) -> None:
        if self.world < 1 or self.gpus_per_node < 1:
            raise ValueError(f"Fabric {self.name!r}: world and gpus_per_node must be >= 1")
        for f in ("intra_bw", "inter_bw", "hbm_bw"):
            v = getattr(self, f)
            if not (v > 0 and math.isfinite(v)):
                raise ValueError(f"Fabric {self.name!r}: {f} must be positive, got {v!r}")
        for f in ("intra_latency_s", "inter_latency_s", "chunk_overhead_s", "launch_s",
                  "a2a_startup_s", "a2a_per_peer_s"):
            if not getattr(self, f) >= 0:
                raise ValueError(f"Fabric {self.name!r}: {f} must be >= 0")
        if self.node_of is None:
            nodes = tuple(int(r // self.gpus_per_node) for r in range(self.world))
        else:
            nodes = tuple(int(x) for x in self.node_of)
            if len(nodes) != self.world or min(nodes) < 0:
                raise ValueError(f"Fabric {self.name!r}: node_of must have {self.world} entries >= 0")
        object.__setattr__(self, "node_of", nodes)

    @property
    def nodes(self) -> np.ndarray:
        """int32 ``[world]`` node of each rank."""
        return np.asarray(self.node_of, dtype=np.int32)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def for_world(self, world: int) -> "Fabric":
        """The first ``world`` GPUs of this fabric (an EP group of that size).

        A world larger than the fabric is an error: an 8-GPU NVLink preset does not silently
        grow into several nodes (ask for ``"8x8-rdma"`` or ``"nvl72"`` instead)."""
        world = int(world)
        if world < 1:
            raise ValueError(f"world must be >= 1, got {world}")
        if world > self.world:
            hint = ""
            if self.gpus_per_node == 8:
                hint = (f"; for {world} GPUs use '{-(-world // 8)}x8-rdma' (nodes of 8 over RDMA)"
                        + (" or 'nvl72' (one NVLink domain)" if world <= 72 else ""))
            raise ValueError(f"fabric {self.name!r} has {self.world} GPUs, cannot host EP {world}{hint}")
        if world == self.world:
            return self
        return dataclasses.replace(self, world=world, node_of=self.node_of[:world])

    def describe(self) -> str:
        tier = (f", {self.num_nodes} nodes x {self.gpus_per_node}, RDMA {self.inter_bw / GB:.0f} GB/s "
                f"(peak {self.inter_bw_peak / GB:.0f})" if self.multi_node else "")
        return (f"{self.name}: {self.world} GPUs, NVLink {self.intra_bw / GB:.0f} GB/s per direction "
                f"achieved (peak {self.intra_bw_peak / GB:.0f}){tier}; hop {self.intra_latency_s * 1e6:.1f} us"
                + (f" / {self.inter_latency_s * 1e6:.1f} us RDMA" if self.multi_node else "")
                + f", chunk overhead {self.chunk_overhead_s * 1e6:.1f} us, launch {self.launch_s * 1e6:.0f} us")


# Hopper NVLink4: 450 GB/s per direction peak; NCCL's own model and p2p copies achieve
# ~370 GB/s (20.6 GB/s x 18 links; 371-380 GB/s measured).  That ratio, 370/450 = 0.822,
# is assumed for NVLink5 too (no measured GB200 figure at hand): 900 -> 740 GB/s.
_HOPPER_EFF = 370.0 / 450.0
_NVL4 = 370 * GB
_NVL5 = 900 * GB * _HOPPER_EFF
_RDMA = 50 * GB  # 400 Gb/s per GPU (one ConnectX-7 per GPU), used at line rate

FABRICS: dict[str, Fabric] = {
    "h100x8": Fabric("h100x8", 8, 8, _NVL4, _RDMA, 450 * GB, _RDMA, hbm_bw=3.0e12,
                     notes="8x H100 SXM, NVLink4 (NVSwitch); HBM3 3.35 TB/s peak, copy ~3.0 TB/s assumed"),
    "h200x8": Fabric("h200x8", 8, 8, _NVL4, _RDMA, 450 * GB, _RDMA, hbm_bw=4.3e12,
                     notes="8x H200, NVLink4; D2D copy 4.3 TB/s measured (read+write)"),
    "nvl72": Fabric("nvl72", 72, 72, _NVL5, _RDMA, 900 * GB, _RDMA, hbm_bw=7.2e12,
                    notes="GB200 NVL72: 72 GPUs in one NVLink5 domain, 900 GB/s peak per direction, "
                          "740 GB/s assumed achieved (Hopper's 370/450); HBM3e 8 TB/s, copy 7.2 TB/s assumed"),
}


def _rdma_preset(n: int) -> Fabric:
    return Fabric(f"{n}x8-rdma", 8 * n, 8, _NVL4, _RDMA, 450 * GB, _RDMA, hbm_bw=4.3e12,
                  notes=f"{n} nodes of 8x H100/H200 (NVLink4), 400 Gb/s RDMA per GPU between nodes")


for _n in (2, 4):
    FABRICS[f"{_n}x8-rdma"] = _rdma_preset(_n)


def get_fabric(name: str, world: Optional[int] = None) -> Fabric:
    """The preset ``name`` (``h100x8``, ``h200x8``, ``nvl72``, ``<n>x8-rdma``), cut to its first
    ``world`` GPUs when given (a larger world is a ValueError, see :meth:`Fabric.for_world`)."""
    key = str(name).strip().lower()
    if key in FABRICS:
        fab = FABRICS[key]
    else:
        m = re.fullmatch(r"(\d+)x8-rdma", key)
        if not m or int(m.group(1)) < 1:
            raise ValueError(f"unknown fabric {name!r}; presets: {', '.join(FABRICS)} (or <n>x8-rdma)")
        fab = _rdma_preset(int(m.group(1)))
    return fab if world is None else fab.for_world(world)


def schedule_for(plan, weight_bytes: int, grad_bytes: int, fabric: Fabric, relay_mode: str = "auto",
                 chunk_bytes: int = 1 << 20, max_depth: Optional[int] = None):
    """:func:`~ultracomm.schedule.build_schedule` with the fabric's nodes, bandwidths and hop
    latencies (latency + chunk overhead per hop); ``max_depth`` None: the builder's default."""
    from .schedule import build_schedule

    fab = fabric.for_world(int(plan.world))
    kw = {} if max_depth is None else {"max_depth": int(max_depth)}
    return build_schedule(plan, int(weight_bytes), int(grad_bytes),
                          node_of=fab.nodes if fab.multi_node else None, chunk_bytes=int(chunk_bytes),
                          relay_mode=relay_mode, intra_bw=fab.intra_bw, inter_bw=fab.inter_bw,
                          intra_latency_s=fab.intra_latency_s + fab.chunk_overhead_s,
                          inter_latency_s=fab.inter_latency_s + fab.chunk_overhead_s, **kw)


# ----------------------------------------------------------------------------- result


@dataclass
class SimResult:
    """What :func:`simulate` / :func:`simulate_alltoall` return (all times in seconds).

    Attributes:
        op: ``"multicast"`` or ``"reduce"``.
        method: ``"schedule"`` or ``"alltoall"``.
        makespan_s: time until the last rank is done.
        per_rank_finish: float64 ``[world]``: when each rank's last transfer (sent or received)
            landed; 0 for ranks with nothing to do.
        lower_bound_s: :func:`lower_bound` of the same plan and op.
        critical_rank: the rank whose busiest link is the most loaded among the ranks that
            finish last (-1 when nothing moves).
        critical_link: that link, e.g. ``"egress nvlink"``.
        bytes: bytes per replica (weights or grads).
        replicas: replica slots filled.
        egress, ingress: int64 ``[world]`` bytes each rank sends / receives.
        flows: tree edges simulated.
        chunks: chunks simulated per flow (after merging), ``effective_chunk_bytes`` their size.
        events, rate_updates: event-loop counters; ``wall_s`` simulation wall time.
        parts: for the all-to-all, the makespan's terms (``prep_s``, ``startup_s``,
            ``transfer_s``, ``post_s``).
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
        d = {k: getattr(self, k) for k in ("op", "method", "makespan_s", "lower_bound_s", "critical_rank",
                                           "critical_link", "bytes", "replicas", "flows", "chunks",
                                           "effective_chunk_bytes", "events", "rate_updates", "wall_s")}
        d["ratio_to_lb"] = self.ratio_to_lb
        d["max_egress"] = int(self.egress.max()) if self.egress.size else 0
        d["max_ingress"] = int(self.ingress.max()) if self.ingress.size else 0
        d["per_rank_finish"] = [float(x) for x in self.per_rank_finish]
        d["parts"] = dict(self.parts)
        return d


def _opname(op) -> str:
    if isinstance(op, str):
        k = op.strip().lower()
        alias = {"multicast": "multicast", "weight_sync": "multicast", "weights": "multicast",
                 "reduce": "reduce", "grad_reduce": "reduce", "grads": "reduce"}
        if k not in alias:
            raise ValueError(f"op must be 'multicast'/'weight_sync' or 'reduce'/'grad_reduce', got {op!r}")
        return alias[k]
    v = int(op)
    if v not in (0, 1):
        raise ValueError(f"op must be Op.MULTICAST or Op.REDUCE, got {op!r}")
    return "multicast" if v == 0 else "reduce"


# ----------------------------------------------------------------------------- lower bound


def _plan_arrays(plan_or_sched) -> tuple[np.ndarray, np.ndarray]:
    """(slot_src [W, S] int64, home_of [E] int64) of a plan or a schedule."""
    if hasattr(plan_or_sched, "inputs") and callable(plan_or_sched.inputs):
        inp = plan_or_sched.inputs()
        W, S = int(inp["world"]), int(inp["slots_per_rank"])
        return (np.asarray(inp["slot_src"], dtype=np.int64).reshape(W, S),
                np.asarray(inp["home_of"], dtype=np.int64).reshape(-1))
    src = plan_or_sched.slot_src
    home = plan_or_sched.home_of
    src = src.numpy() if hasattr(src, "numpy") else np.asarray(src)
    home = home.numpy() if hasattr(home, "numpy") else np.asarray(home)
    return src.astype(np.int64), home.astype(np.int64).reshape(-1)


def _bound_terms(slot_src: np.ndarray, home_of: np.ndarray, fab: Fabric, nbytes: int) -> dict:
    W = slot_src.shape[0]
    E = home_of.shape[0]
    B = float(nbytes)
    filled = slot_src >= 0
    recv = filled.sum(axis=1)
    reps = np.bincount(slot_src[filled], minlength=E)
    total = int(reps.sum())
    once = np.bincount(home_of[reps > 0], minlength=W)
    terms = {}
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


def lower_bound(schedule_or_plan, fabric: Fabric, op, nbytes: Optional[int] = None, *,
                terms: bool = False):
    """DESIGN.md's lower bound of ``op`` on ``fabric`` (seconds), with tiers (module doc).

    ``schedule_or_plan``: a Schedule (bytes from its inputs) or a ReplicaPlan (then pass
    ``nbytes``, the bytes per replica of this op).  With ``terms=True`` returns
    ``(seconds, {term: seconds})``; the fixed cost is the ``"fixed"`` term."""
    name = _opname(op)
    src, home = _plan_arrays(schedule_or_plan)
    if nbytes is None:
        if not hasattr(schedule_or_plan, "inputs"):
            raise ValueError("lower_bound of a plan needs nbytes")
        inp = schedule_or_plan.inputs()
        nbytes = int(inp["weight_bytes"] if name == "multicast" else inp["grad_bytes"])
    fab = fabric.for_world(src.shape[0])
    t = _bound_terms(src, home, fab, int(nbytes))
    bw = max(t.values(), default=0.0)
    fixed = _fixed_cost(fab) if bw > 0 else 0.0
    t["fixed"] = fixed
    lb = bw + fixed
    return (lb, t) if terms else lb


# ----------------------------------------------------------------------------- flow engine


def _maxmin(a: np.ndarray, b: np.ndarray, cap: np.ndarray) -> np.ndarray:
    """Max-min fair rates of flows using links ``a[i]`` and ``b[i]`` (progressive filling)."""
    n = a.shape[0]
    L = cap.shape[0]
    rate = np.empty(n)
    idx = np.arange(n)
    rem = cap.astype(np.float64).copy()
    aa, bb = a, b
    while idx.size:
        cnt = np.bincount(aa, minlength=L) + np.bincount(bb, minlength=L)
        used = cnt > 0
        share = np.full(L, np.inf)
        share[used] = np.maximum(rem[used], 0.0) / cnt[used]
        s = share.min()
        bott = share <= s * (1 + 1e-9)
        fr = bott[aa] | bott[bb]
        rate[idx[fr]] = s
        rem -= s * (np.bincount(aa[fr], minlength=L) + np.bincount(bb[fr], minlength=L))
        keep = ~fr
        idx, aa, bb = idx[keep], aa[keep], bb[keep]
    return rate


def _run_flows(src_node, dst_node, src_rank, dst_rank, chunk_sizes, fab: Fabric, start=None,
               deps_enabled=True):
    """Event-driven fluid simulation.

    Flows ``i`` carry ``len(chunk_sizes)`` chunks from ``src_rank[i]`` to ``dst_rank[i]``;
    chunk ``c`` of flow ``i`` may start once every flow whose ``dst_node`` is ``src_node[i]``
    has delivered chunk ``c`` (+ hop latency + chunk overhead), and not before ``start[i]``.
    Returns (arrival time of each flow's last chunk incl. latency + overhead, events, updates).
    """
    nF = len(src_rank)
    C = len(chunk_sizes)
    W = fab.world
    node = fab.nodes
    inter = node[src_rank] != node[dst_rank]
    # links: [0,W) nvlink egress, [W,2W) nvlink ingress, [2W,3W) rdma egress, [3W,4W) rdma ingress
    la = np.where(inter, 2 * W + src_rank, src_rank).astype(np.int64)
    lb = np.where(inter, 3 * W + dst_rank, W + dst_rank).astype(np.int64)
    cap = np.concatenate([np.full(2 * W, fab.intra_bw), np.full(2 * W, fab.inter_bw)])
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
            rates = _maxmin(la[act], lb[act], cap) if act.size else np.zeros(0)
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
            raise RuntimeError("simulation deadlocked: a flow waits for a chunk no flow delivers")
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


def _critical(prf, egress, ingress, inter_e, inter_i, fab, makespan):
    if makespan <= 0 or not prf.size:
        return -1, ""
    last = np.flatnonzero(prf >= makespan * (1 - 1e-3))
    best, who, what = -1.0, -1, ""
    for r in last.tolist():
        for v, nm in ((egress[r] - inter_e[r], "egress nvlink"), (ingress[r] - inter_i[r], "ingress nvlink")):
            x = v / fab.intra_bw
            if x > best:
                best, who, what = x, r, nm
        for v, nm in ((inter_e[r], "egress rdma"), (inter_i[r], "ingress rdma")):
            x = v / fab.inter_bw
            if x > best:
                best, who, what = x, r, nm
    return who, what


def simulate(schedule, fabric: Fabric, op, *, max_chunks: Optional[int] = None) -> SimResult:
    """Makespan of ``schedule``'s ``op`` (``"multicast"``/``"weight_sync"`` or
    ``"reduce"``/``"grad_reduce"``) on ``fabric`` (cut to the schedule's world).

    ``max_chunks``: merge consecutive chunks into at most this many effective chunks
    (``None``/0: the schedule's chunks).  The schedule must hold every rank's task lists
    (``build_schedule(..., rank=None)``)."""
    t0 = time.perf_counter()
    name = _opname(op)
    op_i = 0 if name == "multicast" else 1
    if schedule.built_for is not None:
        raise ValueError("simulate needs a schedule built for all ranks (rank=None)")
    W, S = schedule.world, schedule.slots_per_rank
    fab = fabric.for_world(W)
    inp = schedule.inputs()
    nbytes = int(inp["weight_bytes"] if op_i == 0 else inp["grad_bytes"])
    e, sr, ss, dr, ds, sizes = _edges(schedule, op_i)
    sizes = _merge_chunks(sizes, max_chunks)
    node = fab.nodes
    inter = node[sr] != node[dr] if sr.size else np.zeros(0, bool)
    egress = np.bincount(sr, minlength=W).astype(np.int64) * nbytes
    ingress = np.bincount(dr, minlength=W).astype(np.int64) * nbytes
    inter_e = np.bincount(sr[inter], minlength=W).astype(np.int64) * nbytes
    inter_i = np.bincount(dr[inter], minlength=W).astype(np.int64) * nbytes
    lb = lower_bound(schedule, fab, name)
    replicas = int((np.asarray(inp["slot_src"]) >= 0).sum())
    if sr.size == 0 or sizes.size == 0 or sizes.sum() == 0:
        return SimResult(name, "schedule", 0.0, np.zeros(W), lb, -1, "", nbytes, replicas, egress, ingress,
                         wall_s=time.perf_counter() - t0)
    src_node = _node_key(e, sr, ss, S)
    dst_node = _node_key(e, dr, ds, S)
    start = np.full(sr.size, fab.launch_s)
    end, events, updates = _run_flows(src_node, dst_node, sr, dr, sizes, fab, start)
    prf = _finish(end, sr, dr, W)
    mk = float(end.max())
    cr, cl = _critical(prf, egress, ingress, inter_e, inter_i, fab, mk)
    return SimResult(name, "schedule", mk, prf, lb, cr, cl, nbytes, replicas, egress, ingress,
                     flows=int(sr.size), chunks=int(sizes.size), effective_chunk_bytes=int(sizes.max()),
                     events=events, rate_updates=updates, wall_s=time.perf_counter() - t0)


def simulate_alltoall(plan, weight_bytes: int, fabric: Fabric, op, *, grad_bytes: Optional[int] = None
                      ) -> SimResult:
    """Makespan of Megatron MoE ECHO's all-to-all weight distribution (``op`` multicast) or
    of its autograd reverse (``op`` reduce; ``grad_bytes`` default ``2 * weight_bytes``, fp32
    grads of bf16 weights) for ``plan`` on ``fabric``.  Assumptions in the module doc."""
    t0 = time.perf_counter()
    name = _opname(op)
    src, home = _plan_arrays(plan)
    W = src.shape[0]
    fab = fabric.for_world(W)
    nbytes = int(weight_bytes) if name == "multicast" else int(2 * weight_bytes if grad_bytes is None
                                                               else grad_bytes)
    rr, ss = np.nonzero(src >= 0)
    ee = src[rr, ss]
    hh = home[ee]
    if name == "multicast":
        sr, dr = hh, rr
    else:
        sr, dr = rr, hh
    egress = np.bincount(sr, minlength=W).astype(np.int64) * nbytes
    ingress = np.bincount(dr, minlength=W).astype(np.int64) * nbytes
    node = fab.nodes
    inter = node[sr] != node[dr]
    inter_e = np.bincount(sr[inter], minlength=W).astype(np.int64) * nbytes
    inter_i = np.bincount(dr[inter], minlength=W).astype(np.int64) * nbytes
    lb = lower_bound(plan, fab, name, nbytes)
    if rr.size == 0 or nbytes == 0:
        return SimResult(name, "alltoall", 0.0, np.zeros(W), lb, -1, "", nbytes, 0, egress, ingress,
                         wall_s=time.perf_counter() - t0)
    startup = fab.launch_s + fab.a2a_startup_s + fab.a2a_per_peer_s * (W - 1)
    sent_rows = np.bincount(hh, minlength=W)
    if name == "multicast":
        prep = float((2.0 * sent_rows * nbytes / fab.hbm_bw).max())  # index_select: read + write
        post = 0.0
    else:
        prep = 0.0
        post = float((3.0 * sent_rows * nbytes / fab.hbm_bw).max())  # index_add_: 2 reads + 1 write
    t_start = prep + startup
    n = rr.size
    ids = np.arange(n)
    end, events, updates = _run_flows(ids, ids + n, sr, dr, np.array([float(nbytes)]), fab,
                                      np.full(n, t_start), deps_enabled=False)
    coll_end = float(end.max())
    mk = coll_end + post
    prf = np.full(W, mk)
    cr, cl = _critical(_finish(end, sr, dr, W), egress, ingress, inter_e, inter_i, fab, coll_end)
    return SimResult(name, "alltoall", mk, prf, lb, cr, cl, nbytes, int(n), egress, ingress, flows=int(n),
                     chunks=1, effective_chunk_bytes=nbytes, events=events, rate_updates=updates,
                     wall_s=time.perf_counter() - t0,
                     parts={"prep_s": prep, "startup_s": startup, "transfer_s": coll_end - t_start,
                            "post_s": post})


# ----------------------------------------------------------------------------- comparisons


def make_plan(load, world: int, slots: int, experts_per_rank: int, planner: str = "greedy",
              node_of=None):
    """A ReplicaPlan from a load: ``greedy`` = :func:`ultracomm.workloads.greedy_replicas`;
    ``quota`` (UltraEP), ``lpt``, ``taot`` and ``feplb`` (FEPLB's greedy) from
    :mod:`ultracomm.planners`."""
    from . import workloads

    p = str(planner).lower()
    if p == "greedy":
        return workloads.greedy_replicas(load, world, slots, experts_per_rank)
    from .planners import Domain, get_planner

    nodes = np.zeros(world, np.int64) if node_of is None else np.asarray(node_of, np.int64)[:world]
    dom = Domain(world, nodes, experts_per_rank)
    return get_planner("greedy" if p == "feplb" else p)(load, dom, slots).plan


def compare(plan, weight_bytes: int, grad_bytes: int, fabric: Fabric, *, chunk_bytes: int = 1 << 20,
            max_depth: Optional[int] = None, max_chunks: Optional[int] = None) -> dict:
    """weight_sync and grad_reduce of ``plan`` on ``fabric`` by all-to-all, ultracomm direct
    (relay off) and ultracomm relay (auto), with the lower bound.  Returns a dict:
    ``{"multicast": {"a2a", "direct", "relay", "lb"} (seconds), "reduce": {...},
    "results": {(method, op): SimResult}, "replicas_max", "replicas_total", "relayed"}``."""
    fab = fabric.for_world(int(plan.world))
    out: dict = {"results": {}}
    scheds = {m: schedule_for(plan, weight_bytes, grad_bytes, fab, mode, chunk_bytes, max_depth)
              for m, mode in (("direct", "off"), ("relay", "auto"))}
    for op in ("multicast", "reduce"):
        row = {}
        a = simulate_alltoall(plan, weight_bytes, fab, op, grad_bytes=grad_bytes)
        out["results"][("a2a", op)] = a
        row["a2a"] = a.makespan_s
        for m, s in scheds.items():
            r = simulate(s, fab, op, max_chunks=max_chunks)
            out["results"][(m, op)] = r
            row[m] = r.makespan_s
            row[m + "_depth"] = int(s.stats(op)["depth"])
        row["lb"] = lower_bound(scheds["relay"], fab, op)
        out[op] = row
    nr = plan.num_replicas.numpy() if hasattr(plan.num_replicas, "numpy") else np.asarray(plan.num_replicas)
    out["replicas_max"] = int(nr.max(initial=0))
    out["replicas_total"] = int(nr.sum())
    return out


def _row(imb: float, achieved: float, cmp: dict) -> dict:
    m, g = cmp["multicast"], cmp["reduce"]

    def ratio(x, y):  # 0 / 0 (nothing to move) counts as 1
        return x / y if y > 0 else (1.0 if x == 0 else float("inf"))

    return {
        "imbalance": imb,
        "imbalance_achieved": achieved,
        "replicas_max": cmp["replicas_max"],
        "replicas_total": cmp["replicas_total"],
        "weight_sync_ms": {k: m[k] * 1e3 for k in ("a2a", "direct", "relay", "lb")},
        "weight_sync_relay_depth": m["relay_depth"],
        "weight_sync_relay_over_lb": ratio(m["relay"], m["lb"]),
        "weight_sync_a2a_over_relay": ratio(m["a2a"], m["relay"]),
        "grad_reduce_ms": {k: g[k] * 1e3 for k in ("a2a", "direct", "relay", "lb")},
        "grad_reduce_relay_depth": g["relay_depth"],
        "grad_reduce_relay_over_lb": ratio(g["relay"], g["lb"]),
        "grad_reduce_a2a_over_relay": ratio(g["a2a"], g["relay"]),
        "grad_over_weight": ratio(g["relay"], m["relay"]),
        "a2a_parts_ms": {op: {k: v * 1e3 for k, v in cmp["results"][("a2a", op)].parts.items()}
                         for op in ("multicast", "reduce")},
        "critical": {f"{meth}/{op}": [r.critical_rank, r.critical_link]
                     for (meth, op), r in cmp["results"].items()},
    }


_HDR = ("imb", "reps", "ws a2a", "direct", "relay", "LB", "rly/LB", "a2a/rly",
        "gr a2a", "direct", "relay", "LB", "rly/LB", "a2a/rly", "gr/ws")


def _fmt_row(r: dict) -> list:
    w, g = r["weight_sync_ms"], r["grad_reduce_ms"]
    return [f"{r['imbalance']:g}", f"{r['replicas_max']}/{r['replicas_total']}",
            f"{w['a2a']:.3f}", f"{w['direct']:.3f}", f"{w['relay']:.3f}", f"{w['lb']:.3f}",
            f"{r['weight_sync_relay_over_lb']:.3f}", f"{r['weight_sync_a2a_over_relay']:.2f}",
            f"{g['a2a']:.3f}", f"{g['direct']:.3f}", f"{g['relay']:.3f}", f"{g['lb']:.3f}",
            f"{r['grad_reduce_relay_over_lb']:.3f}", f"{r['grad_reduce_a2a_over_relay']:.2f}",
            f"{r['grad_over_weight']:.2f}"]


def _table(rows: Sequence[Sequence[str]], hdr: Sequence[str]) -> str:
    cols = [hdr, *rows]
    wid = [max(len(str(c[i])) for c in cols) for i in range(len(hdr))]
    lines = ["  ".join(str(c).rjust(wid[i]) for i, c in enumerate(row)) for row in cols]
    lines.insert(1, "  ".join("-" * x for x in wid))
    return "\n".join(lines)


def run_case(model: str, fabric: Fabric, ep: int, slots: int, imbalances: Sequence[float], *,
             planner: str = "greedy", tokens: int = 8192, seed: int = 0, chunk_bytes: int = 1 << 20,
             max_depth: Optional[int] = None, max_chunks: Optional[int] = None, num_experts: Optional[int] = None
             ) -> list[dict]:
    """One row per imbalance: Zipf load (``tokens`` per rank, the model's top-k), plan, and
    :func:`compare` on the model's bf16 expert weights / fp32 grads.  ``num_experts``
    overrides the model's expert count (e.g. padded to a multiple of ``ep``)."""
    from . import workloads

    spec = workloads.get_model(model)
    fab = fabric.for_world(ep)
    E = int(num_experts or spec.num_experts)
    if E % ep:
        raise ValueError(f"{spec.name}: {E} experts do not divide over EP {ep}")
    epr = E // ep
    wb, gb = spec.expert_weight_bytes(), spec.expert_grad_bytes()
    rows = []
    for imb in imbalances:
        load = workloads.zipf_load(ep, E, tokens, spec.top_k, float(imb), seed, epr)
        plan = make_plan(load, ep, slots, epr, planner, fab.nodes)
        cmp = compare(plan, wb, gb, fab, chunk_bytes=chunk_bytes, max_depth=max_depth, max_chunks=max_chunks)
        rows.append(_row(float(imb), workloads.imbalance(load, epr), cmp))
    return rows


# UltraEP v1.0.0 README: EP64, 256 experts (DeepSeek-V3 sizes), 4 master + 2 redundant slots per
# rank, top-8, 8k tokens/rank, bf16.
ULTRAEP = {
    "imbalance": (1.51, 2.01, 3.03),
    "replicas": ("4/38", "5/46", "6/51"),
    "weight_sync_direct_ms": (0.214, 0.265, 0.317),
    "weight_sync_relay_ms": (0.194, 0.195, 0.188),
    "grad_reduce_ms": (1.9, 2.4),
}


def calibrate(domain: str = "nvl72", planner: str = "quota", **kw) -> dict:
    """Our predictions in UltraEP's published setting, next to its figures."""
    rows = run_case("deepseek-v3", get_fabric(domain), 64, 2, ULTRAEP["imbalance"], planner=planner, **kw)
    out = []
    for i, r in enumerate(rows):
        d, rl = r["weight_sync_ms"]["direct"], r["weight_sync_ms"]["relay"]
        g = r["grad_reduce_ms"]["relay"]
        pd, pr = ULTRAEP["weight_sync_direct_ms"][i], ULTRAEP["weight_sync_relay_ms"][i]
        lo, hi = ULTRAEP["grad_reduce_ms"]
        out.append({**r, "published": {"replicas": ULTRAEP["replicas"][i], "weight_sync_direct_ms": pd,
                                       "weight_sync_relay_ms": pr, "grad_reduce_ms": [lo, hi]},
                    "sim_over_published": {"weight_sync_direct": d / pd, "weight_sync_relay": rl / pr,
                                           "grad_reduce_relay_vs_mid": g / ((lo + hi) / 2)}})
    return {"setting": "UltraEP: EP64, 256 experts x 88,080,384 B bf16, 4 master + 2 redundant slots, "
                       f"top-8, 8192 tokens/rank, planner {planner}, fabric {domain}",
            "rows": out}


# The goal sweep: (EP, fabric) pairs and the models whose expert count divides EP.
GOAL_CONFIGS = ((8, "h200x8"), (16, "2x8-rdma"), (64, "nvl72"), (72, "nvl72"))
GOAL_MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "glm-4.5", "kimi-k2", "gpt-oss-120b",
               "mixtral-8x7b")


def goals(imbalances=(1.5, 2.0, 3.0), slots_list=(1, 2, 4), planner: str = "greedy", pad: bool = True,
          progress=None, **kw) -> dict:
    """The Goals sweep (simulated): every model at EP 8 (h200x8), 16 (2x8-rdma), 64 and 72
    (nvl72) where EP divides its experts (with ``pad``, models that do not divide are also
    run with their expert count rounded up to a multiple of EP, marked ``padded``)."""
    from . import workloads

    cases = []
    for ep, dom in GOAL_CONFIGS:
        for name in GOAL_MODELS:
            E = workloads.get_model(name).num_experts
            padded = E % ep != 0
            if padded and (not pad or E < ep):
                continue
            Ep = -(-E // ep) * ep
            for slots in slots_list:
                rows = run_case(name, get_fabric(dom), ep, slots, imbalances, planner=planner,
                                num_experts=Ep, **kw)
                for r in rows:
                    r.update(model=name, ep=ep, domain=dom, slots=slots, num_experts=Ep, padded=padded)
                    cases.append(r)
                    if progress:
                        progress(r)
    return {"cases": cases}


def _goal_summary(cases: list[dict]) -> str:
    lines = []
    for padded in (False, True):
        sel = [c for c in cases if c["padded"] == padded]
        if not sel:
            continue
        tag = "padded expert counts" if padded else "EP divides experts"
        for key in ("weight_sync_relay_over_lb", "grad_reduce_relay_over_lb"):
            worst = max(sel, key=lambda c: c[key])
            n_over = sum(c[key] > 1.10 for c in sel)
            lines.append(f"[{tag}] {key}: max {worst[key]:.3f} ({worst['model']} EP{worst['ep']} "
                         f"slots {worst['slots']} imb {worst['imbalance']:g}); {n_over}/{len(sel)} cases > 1.10")
        ep64 = [c for c in sel if c["ep"] == 64 and c["imbalance"] >= 2]
        if ep64:
            w = min(ep64, key=lambda c: c["weight_sync_a2a_over_relay"])
            lines.append(f"[{tag}] EP64 imb>=2 a2a/relay weight_sync: min {w['weight_sync_a2a_over_relay']:.2f} "
                         f"({w['model']} slots {w['slots']} imb {w['imbalance']:g}); "
                         f"{sum(c['weight_sync_a2a_over_relay'] < 2 for c in ep64)}/{len(ep64)} cases < 2")
        for ep in sorted({c["ep"] for c in sel}):
            e = [c for c in sel if c["ep"] == ep]
            ws = max(e, key=lambda c: c["weight_sync_relay_over_lb"])
            gr = max(e, key=lambda c: c["grad_reduce_relay_over_lb"])
            lines.append(f"[{tag}]   EP{ep} ({e[0]['domain']}): relay/LB max weight_sync "
                         f"{ws['weight_sync_relay_over_lb']:.3f} ({ws['model']} slots {ws['slots']} imb "
                         f"{ws['imbalance']:g}), grad_reduce {gr['grad_reduce_relay_over_lb']:.3f} ({gr['model']} "
                         f"slots {gr['slots']} imb {gr['imbalance']:g}); median weight_sync "
                         f"{float(np.median([c['weight_sync_relay_over_lb'] for c in e])):.3f}")
        w = max(sel, key=lambda c: c["grad_over_weight"])
        lines.append(f"[{tag}] grad_reduce/weight_sync (relay): max {w['grad_over_weight']:.3f} "
                     f"({w['model']} EP{w['ep']} slots {w['slots']} imb {w['imbalance']:g}); "
                     f"{sum(c['grad_over_weight'] > 2.2 for c in sel)}/{len(sel)} cases > 2.2")
    return "\n".join(lines)


def _floats(s: str) -> list[float]:
    try:
        v = [float(x) for x in s.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {s!r}") from None
    if not v or any(x < 1 for x in v):
        raise argparse.ArgumentTypeError(f"imbalances must be >= 1, got {s!r}")
    return v


def _size(s: str) -> int:
    """argparse type for byte sizes: :func:`ultracomm.env.parse_size` (``1M``, ``256K``)."""
    from .env import parse_size

    try:
        return parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ultracomm.sim",
        description="Simulated weight_sync / grad_reduce times: all-to-all (Megatron MoE ECHO), ultracomm "
                    "direct and relay, and the lower bound, on a modelled fabric.")
    ap.add_argument("--model", default="qwen3-235b-a22b", help="model preset (ultracomm.workloads.MODELS)")
    ap.add_argument("--domain", default="nvl72", help="fabric preset: h100x8, h200x8, nvl72, <n>x8-rdma")
    ap.add_argument("--ep", type=int, default=64, help="EP ranks (must fit the fabric and divide the experts)")
    ap.add_argument("--slots", type=int, default=2, help="replica slots per rank")
    ap.add_argument("--imbalance", type=_floats, default=[1.5, 2.0, 3.0],
                    help="target max:mean rank loads of the Zipf loads, comma separated")
    ap.add_argument("--planner", default="greedy",
                    help="greedy (workloads.greedy_replicas), quota (UltraEP), lpt, taot, feplb")
    ap.add_argument("--tokens", type=int, default=8192, help="tokens per rank")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--chunk-bytes", type=_size, default=1 << 20)
    ap.add_argument("--max-depth", type=int, default=None, help="relay tree depth limit (default: the builder's)")
    ap.add_argument("--max-chunks", type=int, default=0, help="merge chunks to at most this many (0: exact)")
    ap.add_argument("--json", metavar="FILE", help="write the rows (and the fabric) as JSON")
    ap.add_argument("--calibrate", action="store_true",
                    help="UltraEP's setting (EP64 DeepSeek-V3, 4+2 slots) next to its published figures")
    ap.add_argument("--goals", action="store_true", help="the goal sweep over models and EP sizes")
    a = ap.parse_args(argv)
    kw = dict(tokens=a.tokens, seed=a.seed, chunk_bytes=a.chunk_bytes, max_depth=a.max_depth,
              max_chunks=a.max_chunks or None)
    try:
        if a.calibrate:
            dom = a.domain
            planner = a.planner if "--planner" in (argv if argv is not None else sys.argv) else "quota"
            res = calibrate(dom, planner, **kw)
            fab = get_fabric(dom, 64)
            print("# simulated; " + fab.describe())
            print("# " + res["setting"])
            rows = []
            for r in res["rows"]:
                p, s = r["published"], r["sim_over_published"]
                rows.append([f"{r['imbalance']:g}", f"{r['replicas_max']}/{r['replicas_total']}", p["replicas"],
                             f"{r['weight_sync_ms']['direct']:.3f}", f"{p['weight_sync_direct_ms']:.3f}",
                             f"{s['weight_sync_direct']:.2f}",
                             f"{r['weight_sync_ms']['relay']:.3f}", f"{p['weight_sync_relay_ms']:.3f}",
                             f"{s['weight_sync_relay']:.2f}", f"{r['weight_sync_ms']['lb']:.3f}",
                             f"{r['grad_reduce_ms']['relay']:.3f}",
                             f"{p['grad_reduce_ms'][0]:.1f}-{p['grad_reduce_ms'][1]:.1f}",
                             f"{s['grad_reduce_relay_vs_mid']:.2f}"])
            print(_table(rows, ("imb", "reps", "pub", "direct", "pub", "sim/pub", "relay", "pub", "sim/pub",
                                "LB", "gr relay", "pub", "sim/pub")))
            out = {"fabric": dataclasses.asdict(fab), **res}
        elif a.goals:
            def prog(r):
                print(f"{r['model']:>16} EP{r['ep']:<3} {r['domain']:>9} E={r['num_experts']:<4}"
                      f"{'(padded)' if r['padded'] else '        '} slots {r['slots']} "
                      + "  ".join(_fmt_row(r)), flush=True)

            print("# simulated goal sweep; columns: model EP fabric experts slots | " + " ".join(_HDR))
            res = goals(a.imbalance, planner=a.planner, progress=prog, **kw)
            print(_goal_summary(res["cases"]))
            out = res
        else:
            fab = get_fabric(a.domain, a.ep)
            rows = run_case(a.model, fab, a.ep, a.slots, a.imbalance, planner=a.planner, **kw)
            print(f"# simulated: {a.model}, EP {a.ep}, {a.slots} slots/rank, planner {a.planner}, "
                  f"{a.tokens} tokens/rank; times in ms")
            print("# " + fab.describe())
            print(_table([_fmt_row(r) for r in rows], _HDR))
            out = {"model": a.model, "domain": a.domain, "ep": a.ep, "slots": a.slots, "planner": a.planner,
                   "tokens_per_rank": a.tokens, "fabric": dataclasses.asdict(fab), "rows": rows}
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if a.json:
        with open(a.json, "w") as f:
            json.dump(out, f, indent=1, default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    return 0


if __name__ == "__main__":
    sys.exit(main())
