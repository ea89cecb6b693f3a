"""Schedule builder front end: ReplicaPlan -> per-rank task lists of both operations.

The work is done in C++ (``ultracomm._core.build_schedule``, ``csrc/schedule/schedule_builder.cpp``);
this module converts the plan, names things and exports JSON.

Trees.  Every replica slot of expert ``e`` has exactly one parent: the home's master copy
or another replica of ``e`` (a relay).  Multicast pushes weights down the tree; reduce pulls
grads up the *same kind* of tree (built by the same code, balancing the puller's ingress
instead of the sender's egress).

Relay vs direct (``relay_mode="auto"``).  Per op, the builder picks the candidate tree with the
least predicted time.  On one node a relay tree is a candidate only if no rank sends (multicast)
or pulls (reduce) more experts than in the direct tree, so an auto schedule's max egress / max
ingress never exceed the direct schedule's.  On several nodes the topology rule comes first:
every expert crosses to each remote node once, fed from the home's node, and relay trees are
compared with direct by per-tier time (max over ranks and tiers -- intra, inter -- of bytes /
tier bandwidth), not by bytes.  A relay tree's max egress (ingress) *bytes* can then exceed
direct's: it may load a relay with cheap intra-node sends to save slow inter-node ones; its
per-tier time never exceeds direct's.  ``relay_mode="force"`` uses relay trees only, whatever
their egress.

Summation order (determinism contract).  A reduce task on rank ``r`` computes, per chunk,
``acc = float32(self)``, then ``acc += float32(src)`` for each source in ``refs`` order, which
is ascending ``(rank, slot)``; then writes ``acc`` back in the grad dtype.  A relay's task
runs first (lower level) and its partial is the source its parent reads.  So the home's
gradient chunk is, recursively, ``self + sum_{children c by (rank, slot)} partial(c)`` with
``partial(c) = grad(c) + sum_{children of c by (rank, slot)} partial(...)``.  See
``ultracomm.tools.reference.reference_reduce_tree``, which reproduces it bit for bit in numpy.
"""

from __future__ import annotations

import operator
from typing import Any, Optional, Union

import numpy as np

from . import _core
from .records import Op, RelayMode
from .schedule_base import OpLike, ScheduleBase
from .errors import InputError, InputTypeError

__all__ = ["Schedule", "build_schedule", "OpLike"]


_MODES = {"auto": RelayMode.AUTO, "off": RelayMode.OFF, "force": RelayMode.FORCE}


def _op(op: OpLike) -> int:
    if isinstance(op, str):
        try:
            return int(Op[op.upper()])
        except KeyError:
            raise InputError(f"op must be 'multicast' or 'reduce', got {op!r}") from None
    v = int(op)
    if v not in (0, 1):
        raise InputError(f"op must be Op.MULTICAST or Op.REDUCE, got {op!r}")
    return v


def _mode(mode: Union[str, int, RelayMode]) -> int:
    if isinstance(mode, str):
        if mode.lower() not in _MODES:
            raise InputError(f"relay_mode must be 'auto', 'off' or 'force', got {mode!r}")
        return int(_MODES[mode.lower()])
    v = int(mode)
    if v not in (0, 1, 2):
        raise InputError(f"relay_mode must be auto (0), off (1) or force (2), got {mode!r}")
    return v


def _count(name: str, v: Any) -> int:
    """``v`` as an int in ``[0, 2**63)`` (numpy ints too), for build_schedule's sizes: a float or a
    string was truncated or parsed before, a value past int64 met pybind11's TypeError."""
    if isinstance(v, bool):
        raise InputTypeError(f"ultracomm: build_schedule: {name} must be an int, got bool")
    try:
        i = operator.index(v)
    except TypeError:
        raise InputTypeError(f"ultracomm: build_schedule: {name} must be an int, got {type(v).__name__}") from None
    if not 0 <= i < 1 << 63:
        raise InputError(f"ultracomm: build_schedule: {name} must be >= 0 and < 2**63, got {i}")
    return i


def _i32(x: Any, name: str) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    a = np.asarray(x)
    if a.dtype == np.int32:  # the common case: no range scan (a few us per call)
        return np.ascontiguousarray(a)
    if a.dtype.kind not in "iu":
        raise InputError(f"{name} must be an integer array, got dtype {a.dtype}")
    if a.size and (a.min() < np.iinfo(np.int32).min or a.max() > np.iinfo(np.int32).max):
        raise InputError(f"{name} has values outside int32")
    return np.ascontiguousarray(a, dtype=np.int32)


class Schedule(ScheduleBase):
    """Per-rank task lists of multicast and reduce, their trees and stats."""

    def __init__(self, core: "_core.Schedule"):
        self._core = core

    # -- identity -------------------------------------------------------------------------
    @property
    def digest(self) -> int:
        """FNV-1a 64 over the inputs and both trees: equal on every rank for the same plan."""
        return int(self._core.digest)

    @property
    def built_for(self) -> Optional[int]:
        """The only rank whose task lists were generated, or None for all ranks."""
        r = int(self._core.built_for)
        return None if r < 0 else r

    @property
    def world(self) -> int:
        return int(self._core.world)

    @property
    def slots_per_rank(self) -> int:
        return int(self._core.slots_per_rank)

    @property
    def num_experts(self) -> int:
        return int(self._core.num_experts)

    @property
    def chunk_bytes(self) -> int:
        return int(self._core.chunk_bytes)

    @property
    def weight_chunks(self) -> int:
        return int(self._core.weight_chunks)

    @property
    def grad_chunks(self) -> int:
        return int(self._core.grad_chunks)

    # -- task lists -----------------------------------------------------------------------
    def tasks(self, op: OpLike, rank: int) -> np.ndarray:
        """Read-only ``TASK_DTYPE`` view of ``rank``'s list (empty for ranks not built)."""
        return self._core.tasks(_op(op), int(rank))

    def refs(self, op: OpLike, rank: int) -> np.ndarray:
        """Read-only ``REF_DTYPE`` view of ``rank``'s refs (tasks index into it)."""
        return self._core.refs(_op(op), int(rank))

    def tree(self, op: OpLike):
        """``(parent_rank, parent_slot, depth)``, each int32 ``[world, slots]``; -1/-1/0 for
        empty slots, parent_slot == MASTER (-1) when the parent is the home's master copy."""
        o = _op(op)
        return self._core.parent_rank(o), self._core.parent_slot(o), self._core.depth(o)

    # -- stats ----------------------------------------------------------------------------
    def stats(self, op: Optional[OpLike] = None) -> dict:
        """Stats of one op, or ``{"multicast": ..., "reduce": ...}`` when op is None.

        Keys: egress, ingress, inter_egress, inter_ingress (bytes per rank), max_egress,
        max_ingress, max_link_bytes (= max of the two), depth, num_tasks (per rank),
        lower_bound_bytes, lower_bound_s, tree_lower_bound_s, predicted_s, relayed, bytes, chunks.

        ``tree_lower_bound_s`` bounds ``predicted_s`` of *any* tree of the plan (same cost
        model: link time + per-hop chunk time and latency): the hop a replica is away from its
        home, and the expert with the most replicas, which needs either a large fan-out (link
        time) or a deep tree (path fill).  Above ``lower_bound_s`` + one hop it shows that
        DESIGN.md's bound is out of reach of relay trees.
        """
        if op is None:
            return {"multicast": self._core.stats(0), "reduce": self._core.stats(1)}
        return self._core.stats(_op(op))

    def inputs(self) -> dict:
        return dict(self._core.input())

    def __repr__(self) -> str:
        m, r = self.stats(Op.MULTICAST), self.stats(Op.REDUCE)
        return (
            f"Schedule(world={self.world}, slots={self.slots_per_rank}, experts={self.num_experts}, "
            f"multicast depth={m['depth']} max_egress={m['max_egress']}, "
            f"reduce depth={r['depth']} max_ingress={r['max_ingress']}, digest={self.digest:#018x})"
        )


def build_schedule(
    plan,
    weight_bytes: int,
    grad_bytes: int,
    *,
    node_of=None,
    chunk_bytes: int = 1 << 20,
    relay_mode: Union[str, int, RelayMode] = "auto",
    max_depth: int = 8,
    intra_bw: float = 370e9,
    inter_bw: float = 50e9,
    rank: Optional[int] = None,
    intra_latency_s: float = 2e-6,
    inter_latency_s: float = 5e-6,
) -> Schedule:
    """Build the multicast and reduce schedules of ``plan``.

    ``plan`` is duck-typed: ``.slot_src`` ([world, slots] ints, torch or numpy; -1 = empty),
    ``.home_of`` ([E]), ``.world``, ``.slots_per_rank``, ``.num_experts``.  ``node_of``
    ([world]) enables topology-aware trees; ``rank`` builds the task lists of that rank only
    (trees, stats and digest are still global).  ``intra_latency_s`` / ``inter_latency_s``:
    per-hop latency of the cost model (one per tree level on a path), which with the chunk
    time decides how deep a tree pays off (``max_depth`` is only the limit).  With
    ``relay_mode="force"``, ``max_depth=1`` is raised to 2 (a relay tree needs depth 2): the
    trees are those of ``max_depth=2``, while ``inputs()`` and the digest keep 1.  See the module
    docstring for how auto compares relay and direct schedules (max egress on one node, per-tier
    time on several).  Raises InputError (a ValueError) on invalid input, InputTypeError (a
    TypeError) for a size or depth that is not an int.
    """
    world, slots, experts = int(plan.world), int(plan.slots_per_rank), int(plan.num_experts)
    slot_src = _i32(plan.slot_src, "slot_src").reshape(-1)
    home_of = _i32(plan.home_of, "home_of").reshape(-1)
    nodes = None if node_of is None else _i32(node_of, "node_of").reshape(-1)
    weight_bytes, grad_bytes, chunk_bytes, max_depth = (
        _count(name, v)
        for name, v in (
            ("weight_bytes", weight_bytes),
            ("grad_bytes", grad_bytes),
            ("chunk_bytes", chunk_bytes),
            ("max_depth", max_depth),
        )
    )
    core = _core.build_schedule(
        world,
        slots,
        experts,
        slot_src,
        home_of,
        nodes,
        weight_bytes,
        grad_bytes,
        chunk_bytes,
        _mode(relay_mode),
        max_depth,
        float(intra_bw),
        float(inter_bw),
        -1 if rank is None else int(rank),
        float(intra_latency_s),
        float(inter_latency_s),
    )
    return Schedule(core)
