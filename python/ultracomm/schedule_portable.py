"""The device control plane's schedule builder, host build (``include/ultracomm/impl/sched_build.h``).

One rank's multicast and reduce task lists -- the records ``ultracomm.schedule.build_schedule``
emits and every executor runs -- built by portable C++ that nvcc compiles unchanged into
``csrc/cuda/k_build.cu``: no allocation (caller scratch), fixed capacities (world <= 1024,
slots <= 8, experts <= 65536, bytes per expert <= 2**40), integers only, so every rank and both
builds compute the same lists and the same :attr:`PortableSchedule.digest` from the same plan.
The source is written over a lane group: on the GPU it runs as one CTA (block scans, one
candidate tree per warp, scratch in shared memory when it fits), here on one lane; the tests
run it on host threads as lanes and hold every lane count to the same bytes.

Trees (not the host builder's search, a simpler deterministic one; see the header): a per-rank
capacity ``L`` (children over all experts) and the depth limit; experts, most replicas first,
hang their replicas breadth first under the shallowest sender with spare capacity.  With
``node_of`` every expert enters each remote node once (its gateway hangs from the home's node)
and fans out there.  ``L`` starts at the bytes lower bound (in experts) and grows; per op the
candidate with the least ``max(k, fixed) * bytes + depth * (chunk + hop)`` wins.

Task lists, summation order and levels are those of :mod:`ultracomm.schedule` (see its
docstring): a reduce sums a node's children in ``(rank, slot)`` order, recursively, so
``ultracomm.tools.reference.reference_reduce_tree`` reproduces the result bit for bit.  The digest
(of the inputs and both trees: the same on every rank) is a sum of mixed per-field terms, so the
GPU's CTA build and this host build compute the same value for any lane count
(include/ultracomm/impl/sched_write.h); it differs from the host builder's for the same plan (its
header tags the builder), so ranks that mix the two builders are caught by the executors' digest
check.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from . import _core
from .records import REF_DTYPE, TASK_DTYPE
from .schedule import _i32, _op
from .schedule_base import OpLike, ScheduleBase
from .errors import InputError

__all__ = [
    "PortableSchedule",
    "build_schedule_portable",
    "hop_bytes",
    "MAX_WORLD",
    "MAX_SLOTS",
    "MAX_EXPERTS",
    "INTRA_LATENCY_S",
]

INTRA_LATENCY_S = 2e-6  # the cost model's per-hop latency by default (a flag and a wake-up on NVLink)


def hop_bytes(intra_bw: float, intra_latency_s: float = INTRA_LATENCY_S) -> int:
    """The cost model's per-hop latency as whole bytes of link time (the build is integer-only)."""
    if not (intra_bw > 0 and intra_latency_s >= 0):
        raise InputError("build_schedule_portable: intra_bw must be > 0 and intra_latency_s >= 0")
    return int(round(float(intra_latency_s) * float(intra_bw)))


MAX_WORLD = int(_core.SCHEDULE_PORTABLE_MAX_WORLD)
MAX_SLOTS = int(_core.SCHEDULE_PORTABLE_MAX_SLOTS)
MAX_EXPERTS = int(_core.SCHEDULE_PORTABLE_MAX_EXPERTS)
_NAMES = ("multicast", "reduce")


class PortableSchedule(ScheduleBase):
    """One rank's lists of both ops, both trees (global), stats and the digest."""

    def __init__(self, raw: dict, inputs: dict):
        self._raw = raw
        self._in = inputs

    @property
    def digest(self) -> int:
        return int(self._raw["digest"])

    @property
    def built_for(self) -> int:
        return int(self._in["rank"])

    @property
    def world(self) -> int:
        return int(self._in["world"])

    @property
    def slots_per_rank(self) -> int:
        return int(self._in["slots_per_rank"])

    @property
    def num_experts(self) -> int:
        return int(self._in["num_experts"])

    @property
    def chunk_bytes(self) -> int:
        return int(self._in["chunk_bytes"])

    @property
    def weight_chunks(self) -> int:
        return -(-int(self._in["weight_bytes"]) // self.chunk_bytes)

    @property
    def grad_chunks(self) -> int:
        return -(-int(self._in["grad_bytes"]) // self.chunk_bytes)

    def inputs(self) -> dict:
        return dict(self._in)

    def tasks(self, op: OpLike, rank: int) -> np.ndarray:
        """``TASK_DTYPE`` list of ``rank`` (empty unless it is :attr:`built_for`)."""
        if int(rank) != self.built_for:
            return np.zeros(0, TASK_DTYPE)
        return self._raw[_NAMES[_op(op)]]["tasks"]

    def refs(self, op: OpLike, rank: int) -> np.ndarray:
        if int(rank) != self.built_for:
            return np.zeros(0, REF_DTYPE)
        return self._raw[_NAMES[_op(op)]]["refs"]

    def tree(self, op: OpLike):
        """``(parent_rank, parent_slot, depth)``, int32 ``[world, slots]``, as Schedule.tree."""
        o = self._raw[_NAMES[_op(op)]]
        return o["parent_rank"], o["parent_slot"], o["depth"]

    def stats(self, op: Optional[OpLike] = None) -> dict:
        """Per op: egress / ingress bytes per rank, ``inter_egress`` / ``inter_ingress`` (their
        cross-node part under ``node_of``, as :meth:`ultracomm.schedule.Schedule.stats`: the ``split``
        transport's route reads them), their maxima, ``max_link_bytes``,
        ``lower_bound_bytes`` (the host builder's formula: max(most filled slots of a rank,
        most replicated experts homed on a rank, ceil(replicas / world)) x bytes), ``ratio``
        (max_link_bytes / lower_bound_bytes, 1.0 when nothing moves), depth, ``cap`` (the
        chosen tree's capacity L), ``busiest`` (children of its busiest rank), and in seconds at
        ``intra_bw``: ``lower_bound_s``, ``predicted_s`` (the builder's cost of the chosen tree)
        and ``tree_lower_bound_s`` (nan: not computed by this builder)."""
        if op is None:
            return {n: self.stats(i) for i, n in enumerate(_NAMES)}
        o = _op(op)
        raw = self._raw[_NAMES[o]]
        W, S = self.world, self.slots_per_rank
        B = int(self._in["weight_bytes"] if o == 0 else self._in["grad_bytes"])
        pr = raw["parent_rank"].reshape(-1)
        src = np.asarray(self._in["slot_src"]).reshape(-1)
        filled = np.bincount(np.nonzero(pr >= 0)[0] // max(S, 1), minlength=W)[:W] if S else np.zeros(W, np.int64)
        kids = np.bincount(pr[pr >= 0], minlength=W)[:W] if pr.size else np.zeros(W, np.int64)
        home_of = np.asarray(self._in["home_of"])
        reps = np.unique(src[src >= 0])
        once = int(np.bincount(home_of[reps], minlength=W).max()) if reps.size else 0
        total = int((src >= 0).sum())
        lb = max(int(filled.max()) if W else 0, once, -(-total // W)) * B
        send = [int(x) * B for x in kids]
        fed = [int(x) * B for x in filled]
        egress, ingress = (send, fed) if o == 0 else (fed, send)
        # the cross-node part of each side (the host builder's inter tier; zeros on one node): edges whose
        # parent and child sit on different nodes of node_of
        nodes = self._in["node_of"]
        child = np.nonzero(pr >= 0)[0] // max(S, 1)
        parent = pr[pr >= 0]
        if nodes is None or not child.size:
            send_x = fed_x = [0] * W
        else:
            cross = np.asarray(nodes)[parent] != np.asarray(nodes)[child]
            send_x = [int(x) * B for x in np.bincount(parent[cross], minlength=W)[:W]]
            fed_x = [int(x) * B for x in np.bincount(child[cross], minlength=W)[:W]]
        inter_egress, inter_ingress = (send_x, fed_x) if o == 0 else (fed_x, send_x)
        mx = max(max(egress, default=0), max(ingress, default=0))
        # the cost model in seconds (one tier: intra_bw); tree_lower_bound_s is not computed (nan)
        bw = float(self._in["intra_bw"])
        fixed = int(filled.max()) if W else 0
        cost = max(int(raw["busiest"]), fixed) * B + int(raw["depth_max"]) * (
            min(self.chunk_bytes, B) + self._in["hop_bytes"]
        )
        return {
            "egress": egress,
            "ingress": ingress,
            "inter_egress": inter_egress,
            "inter_ingress": inter_ingress,
            "max_egress": max(egress, default=0),
            "lower_bound_s": lb / bw,
            "predicted_s": cost / bw if B else 0.0,
            "tree_lower_bound_s": float("nan"),
            "max_ingress": max(ingress, default=0),
            "max_link_bytes": mx,
            "lower_bound_bytes": lb,
            "ratio": mx / lb if lb else 1.0,
            "depth": int(raw["depth_max"]),
            "cap": int(raw["cap"]),
            "busiest": int(raw["busiest"]),
            "bytes": B,
            "chunks": -(-B // self.chunk_bytes),
            "relayed": bool((raw["parent_slot"][raw["parent_rank"] >= 0] >= 0).any()),
        }

    def __repr__(self) -> str:
        return (
            f"PortableSchedule(rank={self.built_for}, world={self.world}, slots={self.slots_per_rank}, "
            f"experts={self.num_experts}, digest={self.digest:#018x})"
        )


def build_schedule_portable(
    plan,
    weight_bytes: int,
    grad_bytes: int,
    *,
    rank: int,
    node_of=None,
    chunk_bytes: int = 1 << 20,
    max_depth: int = 8,
    intra_bw: float = 370e9,
    intra_latency_s: float = INTRA_LATENCY_S,
) -> PortableSchedule:
    """Build ``rank``'s multicast and reduce task lists of ``plan`` with the portable builder.

    ``plan`` is duck-typed as for :func:`ultracomm.schedule.build_schedule` (``.slot_src``
    ``[world, slots]``, ``.home_of`` ``[E]``).  ``node_of`` ([world]) makes the trees
    topology-aware.  The cost model's per-hop latency enters as whole bytes of link time,
    ``round(intra_latency_s * intra_bw)``, so the build itself stays integer-only.  Raises
    ValueError naming the problem on invalid input (before anything is built).
    """
    world, slots = int(plan.world), int(plan.slots_per_rank)
    slot_src = _i32(plan.slot_src, "slot_src").reshape(world, slots)
    home_of = _i32(plan.home_of, "home_of").reshape(-1)
    nodes = None if node_of is None else _i32(node_of, "node_of").reshape(-1)
    for name, v in (("weight_bytes", weight_bytes), ("grad_bytes", grad_bytes), ("chunk_bytes", chunk_bytes)):
        if int(v) < 0:
            raise InputError(f"build_schedule_portable: {name} must be >= 0, got {v}")
    hop = hop_bytes(intra_bw, intra_latency_s)
    raw = _core.build_schedule_portable(
        slot_src, home_of, nodes, int(weight_bytes), int(grad_bytes), int(chunk_bytes), int(rank), int(max_depth), hop
    )
    inputs = dict(
        world=world,
        slots_per_rank=slots,
        num_experts=len(home_of),
        slot_src=slot_src.reshape(-1).tolist(),
        home_of=home_of.tolist(),
        node_of=None if nodes is None else nodes.tolist(),
        weight_bytes=int(weight_bytes),
        grad_bytes=int(grad_bytes),
        chunk_bytes=int(chunk_bytes),
        max_depth=int(max_depth),
        hop_bytes=hop,
        rank=int(rank),
        intra_bw=float(intra_bw),
    )
    return PortableSchedule(raw, inputs)
