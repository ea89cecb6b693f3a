"""Side-by-side simulations of one plan: all-to-all, ultracomm direct, ultracomm relay and the
lower bound, with the *same* gradient dtype charged to every method; rows and tables."""

from __future__ import annotations

from typing import Optional, Sequence, Union

import numpy as np

from .baselines import simulate_alltoall
from .fabric import Fabric
from .model import lower_bound, schedule_for, simulate
from ..errors import InputError

#: gradient dtypes the comparisons accept, with their bytes per element
GRAD_DTYPES = {"fp32": 4, "bf16": 2, "fp16": 2}


def grad_dtypes(spec: Union[str, Sequence[str]]) -> tuple[str, ...]:
    """``"fp32,bf16"`` or a sequence -> a tuple of known names (ValueError otherwise)."""
    names = [x.strip().lower() for x in (spec.split(",") if isinstance(spec, str) else spec) if x.strip()]
    bad = [x for x in names if x not in GRAD_DTYPES]
    if not names or bad:
        raise InputError(f"grad dtypes must be some of {', '.join(GRAD_DTYPES)}, got {spec!r}")
    return tuple(dict.fromkeys(names))


def make_plan(load, world: int, slots: int, experts_per_rank: int, planner: str = "greedy", node_of=None):
    """A ReplicaPlan from a load: ``greedy`` = :func:`ultracomm.scenarios.greedy_replicas`;
    ``quota`` (UltraEP), ``lpt``, ``taot`` and ``feplb`` (FEPLB's greedy) from
    :mod:`ultracomm.planners`."""
    from .. import scenarios as workloads

    p = str(planner).lower()
    if p == "greedy":
        return workloads.greedy_replicas(load, world, slots, experts_per_rank)
    from ..planners import Domain, get_planner

    nodes = np.zeros(world, np.int64) if node_of is None else np.asarray(node_of, np.int64)[:world]
    dom = Domain(world, nodes, experts_per_rank)
    return get_planner("greedy" if p == "feplb" else p)(load, dom, slots).plan


def compare(
    plan,
    weight_bytes: int,
    grad_bytes: int,
    fabric: Fabric,
    *,
    chunk_bytes: int = 1 << 20,
    max_depth: Optional[int] = None,
    max_chunks: Optional[int] = None,
    ops: Sequence[str] = ("multicast", "reduce"),
) -> dict:
    """weight_sync and grad_reduce of ``plan`` on ``fabric`` by all-to-all, ultracomm direct
    (relay off) and ultracomm relay (auto), with the lower bound.  ``grad_bytes`` is charged to
    *every* method (dtype parity).  Returns a dict: ``{"multicast": {"a2a", "direct", "relay",
    "lb"} (seconds), "reduce": {...}, "results": {(method, op): SimResult}, "replicas_max",
    "replicas_total", "weight_bytes", "grad_bytes"}`` (only the ``ops`` asked for)."""
    fab = fabric.for_world(int(plan.world))
    out: dict = {"results": {}, "weight_bytes": int(weight_bytes), "grad_bytes": int(grad_bytes)}
    scheds = {
        m: schedule_for(plan, weight_bytes, grad_bytes, fab, mode, chunk_bytes, max_depth)
        for m, mode in (("direct", "off"), ("relay", "auto"))
    }
    for op in ops:
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


def compare_dtypes(plan, weight_bytes: int, dtypes: Sequence[str], fabric: Fabric, **kw) -> list[tuple[str, dict]]:
    """:func:`compare` of bf16 weights (``weight_bytes``) for each gradient dtype in
    ``dtypes``; weight_sync is simulated once (it does not depend on the grad dtype)."""
    elems = int(weight_bytes) // 2
    out: list[tuple[str, dict]] = []
    for dt in grad_dtypes(dtypes):
        gb = elems * GRAD_DTYPES[dt]
        if not out:
            cmp = compare(plan, weight_bytes, gb, fabric, **kw)
        else:
            first = out[0][1]
            cmp = compare(plan, weight_bytes, gb, fabric, ops=("reduce",), **kw)
            cmp["multicast"] = first["multicast"]
            cmp["results"].update({k: v for k, v in first["results"].items() if k[1] == "multicast"})
        out.append((dt, cmp))
    return out


def ratio(x: float, y: float) -> float:
    """x / y, with 0 / 0 (nothing to move) counted as 1."""
    return float(x / y) if y > 0 else (1.0 if x == 0 else float("inf"))


def _row(imb: float, achieved: float, cmp: dict, grad_dtype: str) -> dict:
    m, g = cmp["multicast"], cmp["reduce"]
    res = cmp["results"]
    return {
        "imbalance": imb,
        "imbalance_achieved": achieved,
        "grad_dtype": grad_dtype,
        "weight_bytes": cmp["weight_bytes"],
        "grad_bytes": cmp["grad_bytes"],
        "replicas_max": cmp["replicas_max"],
        "replicas_total": cmp["replicas_total"],
        "weight_sync_ms": {k: m[k] * 1e3 for k in ("a2a", "direct", "relay", "lb")},
        "weight_sync_relay_depth": m["relay_depth"],
        "weight_sync_relay_over_lb": ratio(m["relay"], m["lb"]),
        "weight_sync_a2a_over_relay": ratio(m["a2a"], m["relay"]),
        "weight_sync_direct_over_relay": ratio(m["direct"], m["relay"]),
        "grad_reduce_ms": {k: g[k] * 1e3 for k in ("a2a", "direct", "relay", "lb")},
        "grad_reduce_relay_depth": g["relay_depth"],
        "grad_reduce_relay_over_lb": ratio(g["relay"], g["lb"]),
        "grad_reduce_a2a_over_relay": ratio(g["a2a"], g["relay"]),
        "grad_reduce_direct_over_relay": ratio(g["direct"], g["relay"]),
        "grad_over_weight": ratio(g["relay"], m["relay"]),
        "a2a_bytes": {op: res[("a2a", op)].bytes for op in ("multicast", "reduce")},
        "relay_bytes": {op: res[("relay", op)].bytes for op in ("multicast", "reduce")},
        "parts_ms": {f"{meth}/{op}": {k: v * 1e3 for k, v in r.parts.items()} for (meth, op), r in res.items()},
        "critical": {f"{meth}/{op}": [r.critical_rank, r.critical_link] for (meth, op), r in res.items()},
        "max_egress_ingress": {
            f"{meth}/{op}": [int(r.egress.max(initial=0)), int(r.ingress.max(initial=0))]
            for (meth, op), r in res.items()
        },
    }


def run_case(
    model,
    fabric: Fabric,
    ep: int,
    slots: int,
    imbalances: Sequence[float],
    *,
    planner: str = "greedy",
    tokens: int = 8192,
    seed: int = 0,
    chunk_bytes: int = 1 << 20,
    max_depth: Optional[int] = None,
    max_chunks: Optional[int] = None,
    num_experts: Optional[int] = None,
    grad_dtype: Union[str, Sequence[str]] = "fp32",
) -> list[dict]:
    """One row per (imbalance, gradient dtype): Zipf load (``tokens`` per rank, the model's
    top-k), plan, and :func:`compare` on the model's bf16 expert weights, with grads of
    ``grad_dtype`` (``"fp32"``, ``"bf16"`` or several, e.g. ``"bf16,fp32"``) charged to every
    method.  ``model``: a preset name or a :class:`~ultracomm.scenarios.ModelSpec`;
    ``num_experts`` overrides its expert count (e.g. padded to a multiple of ``ep``)."""
    from .. import scenarios as workloads

    spec = workloads.get_model(model) if isinstance(model, str) else model
    dtypes = grad_dtypes(grad_dtype)
    fab = fabric.for_world(ep)
    E = int(num_experts or spec.num_experts)
    if E % ep:
        raise InputError(f"{spec.name}: {E} experts do not divide over EP {ep}")
    epr = E // ep
    wb = spec.expert_weight_bytes()  # bf16 weights
    rows = []
    kw = dict(chunk_bytes=chunk_bytes, max_depth=max_depth, max_chunks=max_chunks)
    for imb in imbalances:
        load = workloads.zipf_load(ep, E, tokens, spec.top_k, float(imb), seed, epr)
        plan = make_plan(load, ep, slots, epr, planner, fab.nodes)
        achieved = workloads.imbalance(load, epr)
        for dt, cmp in compare_dtypes(plan, wb, dtypes, fab, **kw):
            rows.append(_row(float(imb), achieved, cmp, dt))
    return rows


HDR = (
    "imb",
    "reps",
    "ws a2a",
    "direct",
    "relay",
    "LB",
    "rly/LB",
    "a2a/rly",
    "grads",
    "gr a2a",
    "direct",
    "relay",
    "LB",
    "rly/LB",
    "a2a/rly",
    "gr/ws",
)


def fmt_row(r: dict) -> list:
    w, g = r["weight_sync_ms"], r["grad_reduce_ms"]
    return [
        f"{r['imbalance']:g}",
        f"{r['replicas_max']}/{r['replicas_total']}",
        f"{w['a2a']:.3f}",
        f"{w['direct']:.3f}",
        f"{w['relay']:.3f}",
        f"{w['lb']:.3f}",
        f"{r['weight_sync_relay_over_lb']:.3f}",
        f"{r['weight_sync_a2a_over_relay']:.2f}",
        r["grad_dtype"],
        f"{g['a2a']:.3f}",
        f"{g['direct']:.3f}",
        f"{g['relay']:.3f}",
        f"{g['lb']:.3f}",
        f"{r['grad_reduce_relay_over_lb']:.3f}",
        f"{r['grad_reduce_a2a_over_relay']:.2f}",
        f"{r['grad_over_weight']:.2f}",
    ]


def table(rows: Sequence[Sequence[str]], hdr: Sequence[str]) -> str:
    """A plain-text table, right-aligned, with a rule under the header."""
    cols = [hdr, *rows]
    wid = [max(len(str(c[i])) for c in cols) for i in range(len(hdr))]
    lines = ["  ".join(str(c).rjust(wid[i]) for i, c in enumerate(row)) for row in cols]
    lines.insert(1, "  ".join("-" * x for x in wid))
    return "\n".join(lines)
