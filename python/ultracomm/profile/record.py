"""One record (step, layer, micro-batch) and how a batch of them becomes the trace's arrays.

Recording keeps references (plans, schedules) and copies of loads only; everything derived
(plan arrays, schedule stats and trees, rank loads after balancing, op times from CUDA events)
is computed by the writer thread in :func:`records_to_arrays`, off the training thread.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import numpy as np

from .fields import OPS, STAT_FLOATS, STAT_INTS, STAT_OPS, STAT_VECTORS, TREE, as_numpy, schedule_stats
from ..errors import InputTypeError


class Record:
    """One (step, layer, micro-batch); filled by ``Profiler.record`` and the Context's ops."""

    __slots__ = (
        "step",
        "layer",
        "microbatch",
        "load",
        "expert_load",
        "plan",
        "rank_after",
        "schedule",
        "times",
        "pending",
        "vid",
        "has_data",
        "has_ops",
        "sealed",
        "nbytes",
    )

    def __init__(self, step: int, layer: int, microbatch: int):
        self.step, self.layer, self.microbatch = step, layer, microbatch
        self.load: Optional[np.ndarray] = None  # [world, E] (int32 when it fits), detail "full"
        self.expert_load: Optional[np.ndarray] = None  # [E] int64
        self.plan: Any = None  # ReplicaPlan or PlannerResult (a reference)
        self.rank_after: Optional[np.ndarray] = None  # [world] given by the caller
        self.schedule: Any = None  # Schedule (a reference)
        self.times: dict[str, list] = {}  # op -> seconds or (start, end) CUDA events
        self.pending = 0  # operations begun and not yet timed
        self.vid: Any = None
        self.has_data = False  # Profiler.record filled it
        self.has_ops = False  # a Context operation filled it
        self.sealed = False  # taken by the writer: later op times are late
        self.nbytes = 512  # memory estimate, for the buffer bound


def plan_shape(plan: Any) -> tuple[int, int, int]:
    """``(world, slots_per_rank, num_experts)`` of a ReplicaPlan or PlannerResult, cheaply."""
    if hasattr(plan, "rank_load") and hasattr(plan, "domain"):  # PlannerResult
        w, s = plan.slot_src.shape
        return int(w), int(s), int(plan.domain.num_experts)
    if all(hasattr(plan, k) for k in ("world", "slots_per_rank", "num_experts", "slot_src", "home_of")):
        return int(plan.world), int(plan.slots_per_rank), int(plan.num_experts)
    raise InputTypeError(f"ultracomm.profile: plan must be a ReplicaPlan or a PlannerResult, got {type(plan).__name__}")


def plan_arrays(plan: Any) -> tuple[np.ndarray, np.ndarray, Optional[np.ndarray]]:
    """``(slot_src int32 [world, S], home_of int32 [E], exact tokens per rank after or None)``."""
    after = None
    if hasattr(plan, "rank_load") and hasattr(plan, "domain"):  # PlannerResult: exact quotas
        after = np.asarray(plan.rank_load, dtype=np.float64)
        return np.asarray(plan.slot_src, np.int32), np.asarray(plan.domain.home_of, np.int32), after
    return as_numpy(plan.slot_src).astype(np.int32), as_numpy(plan.home_of).astype(np.int32), after


def even_rank_load(expert_load: np.ndarray, slot_src: np.ndarray, home_of: np.ndarray, world: int) -> np.ndarray:
    """float64 ``[world]``: each expert's load split evenly over its home and replicas
    (:func:`ultracomm.scenarios.max_mean_after`'s model, for plans without quotas)."""
    filled = slot_src >= 0
    reps = np.bincount(slot_src[filled], minlength=home_of.size)
    share = expert_load / (1.0 + reps)
    out = np.bincount(home_of, weights=share, minlength=world)
    out += np.where(filled, share[np.where(filled, slot_src, 0)], 0.0).sum(axis=1)
    return out


def resolve_time(v: Any, wait_s: float = 60.0) -> float:
    """Seconds from a float, or from a ``(start, end)`` pair of CUDA-event-like objects
    (``start.elapsed_time(end)`` in milliseconds, once ``end`` completed: polled with
    ``end.query()`` for up to ``wait_s``, NaN if it did not complete; objects without
    ``query`` are ``end.synchronize()``d)."""
    if isinstance(v, tuple):
        start, end = v
        if hasattr(end, "query"):
            deadline = time.monotonic() + wait_s
            while not end.query():
                if time.monotonic() >= deadline:
                    return float("nan")
                time.sleep(1e-3)
        else:
            end.synchronize()
        return float(start.elapsed_time(end)) / 1e3
    return float(v)


def records_to_arrays(
    recs: list[Record], world: int, num_experts: int, slots: int, detail: str, wait_s: float = 60.0
) -> dict:
    """The per-record arrays of ``recs`` (names in :class:`ultracomm.profile.Trace`)."""
    n, W, E, S = len(recs), world, num_experts, slots
    out: dict[str, np.ndarray] = {
        "step": np.array([r.step for r in recs], np.int64),
        "layer": np.array([r.layer for r in recs], np.int32),
        "microbatch": np.array([r.microbatch for r in recs], np.int32),
        "has_load": np.array([r.expert_load is not None for r in recs]),
        "has_full_load": np.array([r.load is not None for r in recs]),
        "has_plan": np.array([r.plan is not None for r in recs]),
        "has_stats": np.array([r.schedule is not None for r in recs]),
    }
    el = np.zeros((n, E), np.int64)
    for i, r in enumerate(recs):
        if r.expert_load is not None:
            el[i] = r.expert_load
    out["expert_load"] = el
    if detail == "full" and out["has_full_load"].any():
        big = any(r.load is not None and r.load.dtype == np.int64 for r in recs)
        ld = np.zeros((n, W, E), np.int64 if big else np.int32)
        for i, r in enumerate(recs):
            if r.load is not None:
                ld[i] = r.load
        out["load"] = ld
    src, home, after = np.full((n, W, S), -1, np.int32), np.zeros((n, E), np.int32), np.full((n, W), np.nan)
    for i, r in enumerate(recs):
        if r.plan is not None:
            src[i], home[i], exact = plan_arrays(r.plan)
            if r.rank_after is not None:
                after[i] = r.rank_after
            elif exact is not None:
                after[i] = exact
            elif r.expert_load is not None:
                after[i] = even_rank_load(r.expert_load, src[i], home[i], W)
        elif r.rank_after is not None:
            after[i] = r.rank_after
    out.update(slot_src=src, home_of=home, rank_load_after=after)
    cache: dict[int, dict] = {}  # one schedule serves many records (a Context caches them)
    stats = []
    for r in recs:
        if r.schedule is not None and id(r.schedule) not in cache:
            cache[id(r.schedule)] = schedule_stats(r.schedule)
        stats.append(None if r.schedule is None else cache[id(r.schedule)])
    for op in STAT_OPS:
        vec = {k: np.zeros((n, W), np.int64) for k in STAT_VECTORS}
        ints = {k: np.zeros(n, np.int64) for k in STAT_INTS}
        flts = {k: np.full(n, np.nan) for k in STAT_FLOATS}
        tree = {k: np.full((n, W, S), -1 if k != "tree_depth" else 0, np.int32) for k in TREE}
        for i, st in enumerate(stats):
            if st is None:
                continue
            for d in (vec, ints, flts, tree):
                for k in d:
                    d[k][i] = st[op][k]
        for d in (vec, ints, flts, tree):
            out.update({f"{op}_{k}": v for k, v in d.items()})
    for op in OPS:
        t = np.full(n, np.nan)
        for i, r in enumerate(recs):
            if op in r.times:
                t[i] = sum(resolve_time(v, wait_s) for v in r.times[op])
        out[f"time_{op}"] = t
    return out
