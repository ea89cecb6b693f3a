"""The viewer's data: a trace boiled down to what the page draws, with bounded size.

Budgets (all parameters of :func:`build_payload`):

* heatmap: expert load per (step bin, expert) of every layer, at most ``max_cells`` cells in
  all (steps are binned; bins hold the mean tokens per step), experts binned above
  ``max_experts`` columns; values as uint16 with a per-layer scale (exact integers when a
  layer's values are integers <= 65535, otherwise within max / 65535);
* series (imbalance, op times, predicted times): at most ``max_points`` step bins per layer
  (means of the steps in a bin, NaN ignored);
* detail samples (per-rank load, placement, trees, egress): at most ``max_detail`` records in
  all, evenly spaced over each layer's records (first and last kept) plus the layer's most
  imbalanced record.  Samples without a recorded plan are planned here with ``planner``
  (:func:`ultracomm.tools.whatif.plan_and_schedule`) when they have a load.

A 1000-step x 94-layer x 128-expert trace stays under ~5 MB of HTML with the defaults.
"""

from __future__ import annotations

import base64
import math
from typing import Any, Optional

import numpy as np

from ..profile import OPS, Trace
from ..profile.fields import schedule_stats
from ..errors import InputError

__all__ = ["build_payload", "default_domain", "step_bins"]

PAYLOAD_VERSION = 1
_U16 = 65535


def default_domain(world: int) -> str:
    """A fabric preset that holds ``world`` ranks: h200x8, nvl72, or <n>x8-rdma."""
    if world <= 8:
        return "h200x8"
    if world <= 72:
        return "nvl72"
    return f"{-(-world // 8)}x8-rdma"


def step_bins(num_steps: int, max_bins: int) -> np.ndarray:
    """int64 edges ``[bins + 1]`` splitting ``num_steps`` step indices into at most
    ``max_bins`` contiguous bins of (nearly) equal size."""
    bins = max(1, min(int(num_steps), int(max_bins)))
    return np.round(np.linspace(0, num_steps, bins + 1)).astype(np.int64)


def _b64(a: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(a).tobytes()).decode("ascii")


def _num(x: float, nd: int = 6) -> Optional[float]:
    """JSON-safe float (None for NaN/inf), rounded to ``nd`` significant digits."""
    x = float(x)
    if not math.isfinite(x):
        return None
    return float(f"{x:.{nd}g}")


def _nums(a: np.ndarray, nd: int = 6) -> list:
    return [_num(v, nd) for v in np.asarray(a, dtype=np.float64).reshape(-1)]


def _ints(a: np.ndarray) -> list:
    return np.asarray(a).astype(np.int64).tolist()


def _run_sums(keys: np.ndarray, rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(distinct keys, sum of ``rows`` per key) for sorted ``keys``."""
    if keys.size == 0:
        return keys, rows[:0].astype(np.float64)
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    return keys[starts], np.add.reduceat(rows.astype(np.float64), starts, axis=0)


def _heat(
    trace: Trace, layers: np.ndarray, ustep: np.ndarray, sidx: np.ndarray, max_cells: int, max_experts: int
) -> dict:
    E = trace.num_experts
    if E > max_experts:
        e_edges = step_bins(E, max_experts)
    else:
        e_edges = np.arange(E + 1)
    cols = e_edges.size - 1
    rows_per_layer = max(1, max_cells // max(1, layers.size * cols))
    edges = step_bins(ustep.size, rows_per_layer)
    a = trace.arrays
    out = {
        "step_bins": [[int(ustep[edges[b]]), int(ustep[edges[b + 1] - 1])] for b in range(edges.size - 1)],
        "expert_bins": None if cols == E else [[int(e_edges[c]), int(e_edges[c + 1] - 1)] for c in range(cols)],
        "rows": int(edges.size - 1),
        "cols": int(cols),
        "layers": {},
    }
    bin_of_step = np.searchsorted(edges, np.arange(ustep.size), side="right") - 1
    el = a["expert_load"]
    nb = edges.size - 1
    for layer in layers.tolist():
        sel = np.flatnonzero((a["layer"] == layer) & a["has_load"])
        sel = sel[np.argsort(sidx[sel], kind="stable")]
        # sum the micro-batches of each step, then the steps of each bin (runs of equal keys)
        steps, per_step = _run_sums(sidx[sel], el[sel])
        bins, binned_rows = _run_sums(bin_of_step[steps], per_step)
        binned = np.zeros((nb, E))
        binned[bins] = binned_rows
        nsteps = np.bincount(bin_of_step[steps], minlength=nb)
        binned /= np.maximum(nsteps, 1)[:, None]
        if cols != E:
            binned = np.add.reduceat(binned, e_edges[:-1], axis=1) / np.diff(e_edges)[None, :]
        mx = float(binned.max(initial=0.0))
        exact = mx <= _U16 and np.all(binned == np.round(binned))
        scale = 1.0 if exact or mx == 0 else mx / _U16
        q = np.round(binned / scale).astype("<u2")
        out["layers"][str(layer)] = {
            "scale": scale,
            "max": mx,
            "sum": int(q.sum(dtype=np.int64)),
            "empty_rows": _ints(np.flatnonzero(nsteps == 0)),
            "data": _b64(q),
        }
    return out


def _series(trace: Trace, layers: np.ndarray, ustep: np.ndarray, sidx: np.ndarray, max_points: int) -> dict:
    a = trace.arrays
    edges = step_bins(ustep.size, max_points)
    bin_of_step = np.searchsorted(edges, np.arange(ustep.size), side="right") - 1
    nb = edges.size - 1
    x = [float(np.mean(ustep[edges[b] : edges[b + 1]])) for b in range(nb)]
    values = {"imb_before": trace.imbalance_before, "imb_after": trace.imbalance_after}
    for op in OPS:
        values[f"t_{op}"] = a[f"time_{op}"] * 1e3
    for key, op in (("ws", "multicast"), ("gr", "reduce")):
        values[f"pred_{key}"] = np.where(a["has_stats"], a[f"{op}_predicted_s"], np.nan) * 1e3
        values[f"lb_{key}"] = np.where(a["has_stats"], a[f"{op}_lower_bound_s"], np.nan) * 1e3
    out: dict = {"x": [_num(v) for v in x], "layers": {}}
    for layer in layers.tolist():
        sel = np.flatnonzero(a["layer"] == layer)
        b = bin_of_step[sidx[sel]]
        ser = {}
        for k, v in values.items():
            vv = v[sel]
            ok = np.isfinite(vv)
            s = np.bincount(b[ok], weights=vv[ok], minlength=nb)
            c = np.bincount(b[ok], minlength=nb)
            with np.errstate(invalid="ignore", divide="ignore"):
                m = np.where(c > 0, s / np.maximum(c, 1), np.nan)
            ser[k] = _nums(m, 5) if ok.any() else None
        out["layers"][str(layer)] = ser
    return out


def _pick(rows: np.ndarray, k: int, worst: Optional[int]) -> np.ndarray:
    if rows.size <= k:
        return rows
    pick = rows[np.unique(np.round(np.linspace(0, rows.size - 1, k)).astype(np.int64))]
    if worst is not None and worst not in pick:
        near = int(np.argmin(np.abs(pick - worst)[1:-1])) + 1 if pick.size > 2 else None
        if near is not None:
            pick[near] = worst
    return np.sort(pick)


def _compact(a: np.ndarray) -> list:
    """Integers when every value is one (token counts), else 6-digit floats."""
    a = np.asarray(a, dtype=np.float64)
    if np.isfinite(a).all() and np.array_equal(a, np.round(a)):
        return _ints(a)
    return _nums(a)


def _stats_json(st: dict) -> dict:
    # link bytes are whole experts: send counts x one unit (their gcd) keep the page small
    eg, ing = np.asarray(st["egress"], np.int64), np.asarray(st["ingress"], np.int64)
    unit = int(np.gcd.reduce(np.concatenate([eg, ing]))) or 1
    return {
        "unit": unit,
        "egress": _ints(eg // unit),
        "ingress": _ints(ing // unit),
        "parent_rank": _ints(st["parent_rank"]),
        "parent_slot": _ints(st["parent_slot"]),
        "depth": _ints(st["tree_depth"]),
        "max_depth": int(st["depth"]),
        "max_egress": int(st["max_egress"]),
        "max_ingress": int(st["max_ingress"]),
        "lower_bound_bytes": int(st["lower_bound_bytes"]),
        "lower_bound_s": _num(st["lower_bound_s"]),
        "predicted_s": _num(st["predicted_s"]),
    }


def _recorded_stats(trace: Trace, i: int, op: str) -> dict:
    a = trace.arrays
    keys = (
        "egress",
        "ingress",
        "depth",
        "max_egress",
        "max_ingress",
        "lower_bound_bytes",
        "lower_bound_s",
        "predicted_s",
        "parent_rank",
        "parent_slot",
        "tree_depth",
    )
    return {k: a[f"{op}_{k}"][i] for k in keys}


def build_payload(
    trace: Trace,
    *,
    planner: str = "auto",
    domain: Optional[str] = None,
    slots: int = 2,
    model: Optional[str] = None,
    max_cells: int = 1_000_000,
    max_experts: int = 512,
    max_points: int = 256,
    max_detail: int = 800,
    title: Optional[str] = None,
) -> dict:
    """The JSON-able dict the page reads (module docstring for the budgets).

    ``planner``: ``auto`` (recorded plans; records without one are planned with ``quota``),
    ``recorded`` (only recorded plans), ``none``, or a planner name (plans every sample, even
    where one was recorded).  ``domain``/``slots``/``model``: the fabric, replica slots and
    expert sizes used when planning here (default fabric: :func:`default_domain`)."""
    a = trace.arrays
    n = len(trace)
    if n == 0:
        raise InputError("the trace holds no records")
    layers = trace.layers
    ustep, sidx = np.unique(a["step"], return_inverse=True)
    sidx = sidx.reshape(-1)
    imb_b, imb_a = trace.imbalance_before, trace.imbalance_after
    before = trace.rank_load_before

    plan_here = planner not in ("auto", "recorded", "none")
    fill = planner == "auto" or plan_here
    pname = "quota" if planner == "auto" else planner
    setting = None
    if fill and (plan_here or not a["has_plan"].all()) and a["has_load"].any():
        from ..tools.whatif import Setting

        model = model or trace.meta.get("model") or "qwen3-235b-a22b"
        setting = Setting(domain=domain or default_domain(trace.world), ep=trace.world, slots=slots, model=model)
        info = setting.resolved()

    per_layer = max(1, int(max_detail) // max(1, layers.size))
    detail: dict = {}
    planned = 0
    for layer in layers.tolist():
        rows = np.flatnonzero(a["layer"] == layer)
        finite = np.where(np.isfinite(imb_b[rows]), imb_b[rows], -np.inf)
        worst = int(rows[int(np.argmax(finite))]) if np.isfinite(finite).any() else None
        pick = _pick(rows, per_layer, worst)
        need = [
            int(i) for i in pick if setting is not None and a["has_load"][i] and (plan_here or not a["has_plan"][i])
        ]
        loads = dict(zip(need, trace.loads(need))) if need else {}
        samples = []
        for i in pick.tolist():
            smp: dict[str, Any] = {
                "row": i,
                "step": int(a["step"][i]),
                "mb": int(a["microbatch"][i]),
                "imb_before": _num(imb_b[i]),
                "imb_after": _num(imb_a[i]),
                "before": _compact(before[i]) if a["has_load"][i] else None,
                "after": None,
                "slot_src": None,
                "mc": None,
                "rd": None,
                "plan_source": None,
                "times": {op: _num(a[f"time_{op}"][i] * 1e3) for op in OPS},
            }
            if i in loads:
                from ..tools.whatif import plan_and_schedule

                res, sched = plan_and_schedule(
                    loads[i], pname, info["fabric"], slots, info["weight_bytes"], info["grad_bytes"]
                )
                st = schedule_stats(sched)
                after = res.rank_load.astype(np.float64)
                smp.update(
                    after=_compact(after),
                    slot_src=_ints(res.slot_src),
                    plan_source=pname,
                    mc=_stats_json(st["multicast"]),
                    rd=_stats_json(st["reduce"]),
                    imb_after=_num(after.max() / after.mean() if after.mean() > 0 else 1.0),
                )
                planned += 1
            elif a["has_plan"][i] and planner != "none":
                smp.update(
                    after=_compact(a["rank_load_after"][i]), slot_src=_ints(a["slot_src"][i]), plan_source="recorded"
                )
                if a["has_stats"][i]:
                    smp.update(
                        mc=_stats_json(_recorded_stats(trace, i, "multicast")),
                        rd=_stats_json(_recorded_stats(trace, i, "reduce")),
                    )
            samples.append(smp)
        detail[str(layer)] = samples

    nsteps_mb = int(a["microbatch"].max()) + 1 if n else 0
    meta = {
        "world": trace.world,
        "num_experts": trace.num_experts,
        "experts_per_rank": trace.experts_per_rank,
        "slots_per_rank": int(max(trace.slots_per_rank, slots if setting is not None else 0)),
        "detail": trace.detail,
        "records": n,
        "steps": int(ustep.size),
        "first_step": int(ustep[0]),
        "last_step": int(ustep[-1]),
        "layers": _ints(layers),
        "microbatches": nsteps_mb,
        "node_of": _ints(trace.node_of) if trace.node_of.size == trace.world else [0] * trace.world,
        "source": trace.path or trace.meta.get("source") or "(in memory)",
        "recorded_plans": int(a["has_plan"].sum()),
        "planned_here": planned,
        "planner": pname if planned else ("recorded" if a["has_plan"].any() else None),
        "fabric": info["fabric"].describe() if setting is not None else None,
        "model": setting.model if setting is not None else trace.meta.get("model"),
        "trace_meta": {k: v for k, v in trace.meta.items() if isinstance(v, (str, int, float, bool))},
        "imbalance_before_mean": _num(np.nanmean(imb_b)) if np.isfinite(imb_b).any() else None,
        "imbalance_after_mean": _num(np.nanmean(imb_a)) if np.isfinite(imb_a).any() else None,
        "late_ops": trace.late_ops,
    }
    if (
        setting is not None
        and meta["fabric"] is not None
        and trace.node_of.size == trace.world
        and not trace.node_of.any()
    ):
        meta["node_of"] = _ints(info["fabric"].nodes[: trace.world])
    return {
        "version": PAYLOAD_VERSION,
        "title": title or str(meta["source"]),
        "meta": meta,
        "heat": _heat(trace, layers, ustep, sidx, max_cells, max_experts),
        "series": _series(trace, layers, ustep, sidx, max_points),
        "detail": detail,
    }
