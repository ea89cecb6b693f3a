"""Names and shapes of a trace's per-record arrays, shared by the recorder and the reader."""

from __future__ import annotations

from typing import Any

import numpy as np
from ..errors import InputError

FORMAT = "ultracomm-profile"
VERSION = 1
INDEX = "index.json"
OPS = ("weight_sync", "restore", "grad_reduce")
DETAILS = ("full", "experts")
STAT_OPS = ("multicast", "reduce")
STAT_VECTORS = ("egress", "ingress")
STAT_INTS = ("depth", "max_egress", "max_ingress", "lower_bound_bytes")
STAT_FLOATS = ("lower_bound_s", "predicted_s", "tree_lower_bound_s")
TREE = ("parent_rank", "parent_slot", "tree_depth")


def as_numpy(x: Any) -> np.ndarray:
    if hasattr(x, "detach"):  # torch tensor, without importing torch
        x = x.detach().cpu().numpy()
    return np.asarray(x)


def int_array(x: Any, name: str) -> np.ndarray:
    a = as_numpy(x)
    if a.dtype.kind not in "iu":
        raise InputError(f"ultracomm.profile: {name} must hold integer token counts, got dtype {a.dtype}")
    if a.size and a.min() < 0:
        raise InputError(f"ultracomm.profile: {name} has negative entries")
    return a.astype(np.int64, copy=True)


def spread_expert_load(expert_load: Any, world: int) -> np.ndarray:
    """int64 ``[world, E]`` whose column sums are ``expert_load [E]``: each expert's tokens
    split as evenly as integers allow over the source ranks (the remainder goes to ranks
    ``e, e+1, ...`` modulo ``world``, so no rank is favoured).  This is how per-expert totals
    become the ``[world, E]`` load a planner takes."""
    el = int_array(expert_load, "expert_load").reshape(-1)
    if not isinstance(world, (int, np.integer)) or world < 1:
        raise InputError(f"ultracomm.profile: world must be an int >= 1, got {world!r}")
    q, r = np.divmod(el, int(world))
    ranks = np.arange(int(world))[:, None]
    extra = ((ranks - np.arange(el.size)[None, :]) % int(world)) < r[None, :]
    return q[None, :] + extra.astype(np.int64)


def empty_arrays(world: int, E: int, S: int, n: int = 0) -> dict:
    """Every per-record array of ``n`` records holding nothing (no load, plan, stats, times)."""
    out = {"step": np.zeros(n, np.int64), "layer": np.zeros(n, np.int32), "microbatch": np.zeros(n, np.int32)}
    for k in ("has_load", "has_full_load", "has_plan", "has_stats"):
        out[k] = np.zeros(n, bool)
    out.update(
        expert_load=np.zeros((n, E), np.int64),
        slot_src=np.full((n, world, S), -1, np.int32),
        home_of=np.zeros((n, E), np.int32),
        rank_load_after=np.full((n, world), np.nan),
    )
    for op in STAT_OPS:
        for k in STAT_VECTORS:
            out[f"{op}_{k}"] = np.zeros((n, world), np.int64)
        for k in STAT_INTS:
            out[f"{op}_{k}"] = np.zeros(n, np.int64)
        for k in STAT_FLOATS:
            out[f"{op}_{k}"] = np.full(n, np.nan)
        for k in TREE:
            out[f"{op}_{k}"] = np.full((n, world, S), -1 if k != "tree_depth" else 0, np.int32)
    for op in OPS:
        out[f"time_{op}"] = np.full(n, np.nan)
    return out


def schedule_stats(schedule: Any) -> dict:
    """``{"multicast": {...}, "reduce": {...}}``: a Schedule's stats and trees as stored in a
    record (vectors ``[world]``, trees ``[world, slots]``, scalars)."""
    out: dict = {}
    for op in STAT_OPS:
        st = schedule.stats(op)
        pr, ps, d = schedule.tree(op)
        out[op] = {
            **{k: np.asarray(st[k], dtype=np.int64) for k in STAT_VECTORS},
            **{k: int(st[k]) for k in STAT_INTS},
            **{k: float(st[k]) for k in STAT_FLOATS},
            "parent_rank": np.array(pr, dtype=np.int32),
            "parent_slot": np.array(ps, dtype=np.int32),
            "tree_depth": np.array(d, dtype=np.int32),
        }
    return out
