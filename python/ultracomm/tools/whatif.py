"""What-if replay: what would expert replication buy on *your* routing statistics?

    python -m ultracomm.tools.whatif TRACE --planner quota,taot,greedy,lpt --domain nvl72 --ep 64
    python -m ultracomm.tools.whatif counts.npy --ep 64       # a [steps, layers, E] token-count array

Replays the loads of a trace (:mod:`ultracomm.profile`) through the balancing planners
(:mod:`ultracomm.planners`) and the fabric simulator (:mod:`ultracomm.sim`) and reports, per
planner, per replayed record and in total over the trace:

* imbalance (max:mean rank load) before and after balancing, and the tokens on the busiest
  rank before and after;
* replica copies, intra- and inter-node;
* simulated weight_sync (multicast) and grad_reduce of the plan's ultracomm schedule (relay
  ``auto``), next to the all-to-all weight distribution of Megatron MoE ECHO moving the same
  replicas (:func:`ultracomm.sim.simulate_alltoall`), and the lower bound;
* the MoE compute time balancing saves: ``(busiest tokens before - after) x FLOP per token
  / --tflops``.  FLOP per token and expert: ``6 * H * I`` forward (SwiGLU: three ``H x I``
  matmuls), ``18 * H * I`` forward + backward (``--forward-only`` for inference).  The
  default 500 TFLOP/s is an *assumption* (about half the 989 TFLOP/s dense bf16 peak of an
  H100/H200 SXM, vendor spec), not a measurement: pass the figure your grouped GEMMs reach;
* net = compute saved - (2 x weight_sync + grad_reduce): the forward multicast, the backward
  restore and the gradient reduction, counted as if nothing overlapped them (the worst case).

Everything here is *simulated* or *modelled*: no GPU is involved and no byte moves.

Records.  A trace of 1000 steps x 94 layers holds 94,000 records; planning and simulating
all of them takes hours, so ``--max-records`` (default 64) evenly spaced records are
replayed and the totals are extrapolated (sum over the replayed records x records /
replayed; the output says so).  ``--max-chunks`` (default 16) merges a schedule's chunks for
the simulator (an upper bound of the exact time, see :mod:`ultracomm.sim`); 0 simulates every
chunk.

Loads.  A trace with full ``[world, E]`` loads is replayed as recorded when ``--ep`` equals
its world; per-expert totals (``detail="experts"``, imported routing statistics) or a
different ``--ep`` use the per-expert totals spread evenly over the source ranks
(:func:`ultracomm.profile.spread_expert_load`).  ``recorded`` as a planner name replays the
trace's own plans (records without one are skipped for it).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from dataclasses import dataclass, field
from typing import Any, Optional, Sequence

import numpy as np

from ..profile import Trace, load_trace, spread_expert_load
from ..profile.trace_checks import TraceError, check_options
from ..errors import InputError

__all__ = ["Setting", "WhatIf", "plan_and_schedule", "replay", "sample_rows", "main"]

DEFAULT_TFLOPS = 500.0
RECORDED = "recorded"


@dataclass(frozen=True)
class Setting:
    """Where and what to replay.

    Attributes:
        domain: fabric preset (:func:`ultracomm.sim.get_fabric`).
        ep: EP ranks.
        slots: replica slots per rank.
        model: model preset (:mod:`ultracomm.scenarios`): expert bytes and FLOP per token.
        weight_bytes, grad_bytes: bytes per expert (default: the model's bf16 weights and
            fp32 grads).
        chunk_bytes: the schedule's chunk size.
        max_chunks: chunks simulated per flow (0: all).
        tflops: achieved expert-GEMM TFLOP/s (an assumption unless you measured it).
        forward_only: inference (forward FLOP only).
    """

    domain: str = "nvl72"
    ep: int = 64
    slots: int = 2
    model: str = "qwen3-235b-a22b"
    weight_bytes: Optional[int] = None
    grad_bytes: Optional[int] = None
    chunk_bytes: int = 1 << 20
    max_chunks: int = 16
    tflops: float = DEFAULT_TFLOPS
    forward_only: bool = False

    def resolved(self) -> dict:
        """Fabric, model spec, bytes per expert and FLOP per token of this setting."""
        from .. import sim
        from .. import scenarios as workloads

        spec = workloads.get_model(self.model)
        if not (self.tflops > 0 and math.isfinite(self.tflops)):
            raise InputError(f"tflops must be a positive number, got {self.tflops!r}")
        if not isinstance(self.slots, int) or self.slots < 0:
            raise InputError(f"slots must be an int >= 0, got {self.slots!r}")
        fab = sim.get_fabric(self.domain, self.ep)
        flop = (6 if self.forward_only else 18) * spec.hidden * spec.moe_inter
        return {
            "fabric": fab,
            "spec": spec,
            "flop_per_token": flop,
            "weight_bytes": int(self.weight_bytes or spec.expert_weight_bytes()),
            "grad_bytes": int(self.grad_bytes or spec.expert_grad_bytes()),
        }


def plan_and_schedule(
    load: np.ndarray,
    planner: str,
    fabric: Any,
    slots: int,
    weight_bytes: int,
    grad_bytes: int,
    chunk_bytes: int = 1 << 20,
):
    """``(PlannerResult, Schedule)``: ``planner`` on ``load [world, E]`` over ``fabric``'s ranks
    and nodes, and the plan's all-rank schedule (relay ``auto``, the fabric's bandwidths)."""
    from .. import sim
    from ..planners import Domain, get_planner

    W, E = load.shape
    dom = Domain(W, fabric.nodes[:W].astype(np.int64), E // W)
    res = get_planner(planner)(load, dom, slots)
    return res, sim.schedule_for(res.plan, weight_bytes, grad_bytes, fabric, "auto", chunk_bytes)


def sample_rows(trace: Trace, max_records: int, *, need_plan: bool = False) -> np.ndarray:
    """Up to ``max_records`` evenly spaced rows of ``trace`` that hold a load (and a plan when
    ``need_plan``), first and last included; all of them when there are fewer."""
    ok = trace.arrays["has_load"].copy()
    if need_plan:
        ok &= trace.arrays["has_plan"]
    rows = np.flatnonzero(ok)
    if max_records <= 0 or rows.size <= max_records:
        return rows
    pick = np.unique(np.round(np.linspace(0, rows.size - 1, max_records)).astype(np.int64))
    return rows[pick]


@dataclass
class WhatIf:
    """Result of :func:`replay`.

    Attributes:
        rows: one dict per (replayed record, planner): ``step, layer, microbatch, planner,
            imbalance_before, imbalance_after, busiest_before, busiest_after (tokens),
            copies_intra, copies_inter, weight_sync_s, grad_reduce_s, a2a_weight_sync_s,
            a2a_grad_reduce_s, lb_weight_sync_s, lb_grad_reduce_s, compute_saved_s, net_s``.
        planners: the planners, in order.
        records: records of the trace with a load; ``replayed``: how many were replayed.
        setting: the :class:`Setting`; ``info``: what it resolved to (fabric, bytes, FLOP).
    """

    rows: list[dict]
    planners: list[str]
    records: int
    replayed: int
    setting: Setting
    info: dict = field(default_factory=dict)

    _SUMS = ("weight_sync_s", "grad_reduce_s", "a2a_weight_sync_s", "a2a_grad_reduce_s", "compute_saved_s", "net_s")
    _MEANS = (
        "imbalance_before",
        "imbalance_after",
        "busiest_before",
        "busiest_after",
        "copies_intra",
        "copies_inter",
        *_SUMS,
    )

    def summary(self) -> dict:
        """Per planner: ``mean`` (per replayed record) of every number, ``total`` (sums over
        the whole trace, extrapolated by records / replayed) of the times, and ``n``."""
        scale = self.records / self.replayed if self.replayed else 0.0
        out = {}
        for p in self.planners:
            rs = [r for r in self.rows if r["planner"] == p]
            if not rs:
                out[p] = {"n": 0, "mean": {}, "total": {}}
                continue
            mean = {k: float(np.mean([r[k] for r in rs])) for k in self._MEANS}
            total = {k: float(np.sum([r[k] for r in rs])) * (self.records / len(rs)) for k in self._SUMS}
            out[p] = {"n": len(rs), "mean": mean, "total": total, "scale": scale}
        return out

    def render(self, source: str = "") -> str:
        """The text report the CLI prints."""
        info, s = self.info, self.setting
        fab = info.get("fabric")
        lines = [
            f"# what-if replay (simulated and modelled, no GPU){': ' + source if source else ''}",
            f"# {self.records} records with a load, {self.replayed} replayed"
            + (
                f" (evenly spaced; totals extrapolated x{self.records / self.replayed:.1f})"
                if self.replayed and self.replayed < self.records
                else ""
            ),
            f"# model {s.model}: {info.get('weight_bytes', 0):,} B weights / {info.get('grad_bytes', 0):,} B "
            f"grads per expert; {info.get('flop_per_token', 0) / 1e6:.1f} MFLOP per token and expert "
            f"({'forward' if s.forward_only else 'forward + backward'}) at {s.tflops:g} TFLOP/s (assumed)",
            f"# {fab.describe() if fab is not None else s.domain}; EP {s.ep}, {s.slots} slots/rank, "
            f"chunks {s.chunk_bytes} B" + (f", at most {s.max_chunks} simulated per flow" if s.max_chunks else ""),
            "# weight_sync / grad_reduce: ultracomm schedule (relay auto) vs all-to-all (Megatron MoE ECHO) "
            "moving the same replicas",
            "# net = compute saved - (2 x weight_sync + grad_reduce), nothing overlapped",
            "",
            "per replayed record (means):",
        ]
        summ = self.summary()
        hdr = (
            "planner",
            "n",
            "imb before",
            "imb after",
            "copies in/out",
            "busiest tokens",
            "weight_sync ms",
            "a2a ms",
            "grad_reduce ms",
            "a2a ms",
            "compute saved ms",
            "net ms",
        )
        rows = []
        for p in self.planners:
            m = summ[p]["mean"]
            if not m:
                rows.append([p, "0"] + ["-"] * (len(hdr) - 2))
                continue
            rows.append(
                [
                    p,
                    str(summ[p]["n"]),
                    f"{m['imbalance_before']:.3f}",
                    f"{m['imbalance_after']:.3f}",
                    f"{m['copies_intra']:.1f}/{m['copies_inter']:.1f}",
                    f"{m['busiest_before']:.0f} -> {m['busiest_after']:.0f}",
                    f"{m['weight_sync_s'] * 1e3:.3f}",
                    f"{m['a2a_weight_sync_s'] * 1e3:.3f}",
                    f"{m['grad_reduce_s'] * 1e3:.3f}",
                    f"{m['a2a_grad_reduce_s'] * 1e3:.3f}",
                    f"{m['compute_saved_s'] * 1e3:.3f}",
                    f"{m['net_s'] * 1e3:.3f}",
                ]
            )
        lines.append(_table(rows, hdr))
        lines += ["", f"whole trace ({self.records} records; ms):"]
        hdr2 = ("planner", "weight_sync", "a2a", "grad_reduce", "a2a", "compute saved", "net", "comm saved vs a2a")
        rows = []
        for p in self.planners:
            t = summ[p]["total"]
            if not t:
                rows.append([p] + ["-"] * (len(hdr2) - 1))
                continue
            a2a_net = t["compute_saved_s"] - (2 * t["a2a_weight_sync_s"] + t["a2a_grad_reduce_s"])
            rows.append(
                [
                    p,
                    *(
                        _ms(t[k])
                        for k in (
                            "weight_sync_s",
                            "a2a_weight_sync_s",
                            "grad_reduce_s",
                            "a2a_grad_reduce_s",
                            "compute_saved_s",
                            "net_s",
                        )
                    ),
                    _ms(t["net_s"] - a2a_net, "+"),
                ]
            )
        lines.append(_table(rows, hdr2))
        return "\n".join(lines)

    def to_json(self) -> dict:
        fab = self.info.get("fabric")
        return {
            "setting": self.setting.__dict__,
            "records": self.records,
            "replayed": self.replayed,
            "planners": self.planners,
            "fabric": None if fab is None else fab.describe(),
            "weight_bytes": self.info.get("weight_bytes"),
            "grad_bytes": self.info.get("grad_bytes"),
            "flop_per_token": self.info.get("flop_per_token"),
            "summary": self.summary(),
            "rows": self.rows,
        }


def _ms(seconds: float, sign: str = "") -> str:
    v = seconds * 1e3
    return f"{v:{sign},.3f}" if abs(v) < 1000 else f"{v:{sign},.0f}"


def _table(rows: Sequence[Sequence[str]], hdr: Sequence[str]) -> str:
    cols = [list(hdr), *rows]
    wid = [max(len(str(c[i])) for c in cols) for i in range(len(hdr))]
    out = ["  ".join(str(c).rjust(wid[i]) if i else str(c).ljust(wid[i]) for i, c in enumerate(row)) for row in cols]
    out.insert(1, "  ".join("-" * w for w in wid))
    return "\n".join(out)


def _max_mean(x: np.ndarray) -> float:
    m = float(np.mean(x))
    return float(np.max(x)) / m if m > 0 else 1.0


def replay(
    trace: Trace,
    planners: Sequence[str] = ("quota", "taot", "greedy", "lpt"),
    setting: Optional[Setting] = None,
    *,
    max_records: int = 64,
    rows: Optional[Sequence[int]] = None,
) -> WhatIf:
    """Replay ``trace``'s loads through ``planners`` and the simulator (module docstring).

    ``rows``: the trace rows to replay (default :func:`sample_rows` with ``max_records``).
    Raises ValueError for unknown planners, a fabric that cannot hold ``setting.ep`` ranks,
    or an EP that does not divide the trace's experts."""
    from .. import sim
    from ..planners import PLANNERS, Domain
    from ..planners.base import copy_counts

    s = setting or Setting(ep=trace.world)
    bad = [p for p in planners if p not in PLANNERS and p != RECORDED]
    if bad:
        raise InputError(f"unknown planner(s) {bad}; choose from {sorted(PLANNERS)} or {RECORDED!r}")
    if trace.num_experts % s.ep:
        raise InputError(f"the trace's {trace.num_experts} experts do not divide over EP {s.ep}")
    if RECORDED in planners and s.ep != trace.world:
        raise InputError(f"'recorded' replays the trace's plans, made for EP {trace.world}; use --ep {trace.world}")
    info = s.resolved()
    fab = info["fabric"]
    wb, gb, flop = info["weight_bytes"], info["grad_bytes"], info["flop_per_token"]
    flops = s.tflops * 1e12
    epr = trace.num_experts // s.ep
    dom = Domain(s.ep, fab.nodes[: s.ep].astype(np.int64), epr)
    sel = sample_rows(trace, max_records) if rows is None else np.asarray(rows, dtype=np.int64)
    a = trace.arrays
    out: list[dict] = []
    for i, load in zip(sel.tolist(), trace.loads(sel.tolist())):
        if s.ep != trace.world:
            load = spread_expert_load(load.sum(axis=0), s.ep)
        before = load.sum(axis=0).reshape(s.ep, epr).sum(axis=1)
        base = {
            "step": int(a["step"][i]),
            "layer": int(a["layer"][i]),
            "microbatch": int(a["microbatch"][i]),
            "imbalance_before": _max_mean(before),
            "busiest_before": int(before.max()),
        }
        for p in planners:
            if p == RECORDED:
                plan = trace.plan(i)
                if plan is None:
                    continue
                after = a["rank_load_after"][i]
                slot_src = a["slot_src"][i]
                sched = sim.schedule_for(plan, wb, gb, fab, "auto", s.chunk_bytes)
            else:
                res, sched = plan_and_schedule(load, p, fab, s.slots, wb, gb, s.chunk_bytes)
                plan, after, slot_src = res.plan, res.rank_load, res.slot_src
            intra, inter = copy_counts(np.asarray(slot_src), dom)
            ws = sim.simulate(sched, fab, "multicast", max_chunks=s.max_chunks or None)
            gr = sim.simulate(sched, fab, "reduce", max_chunks=s.max_chunks or None)
            a_ws = sim.simulate_alltoall(plan, wb, fab, "multicast", grad_bytes=gb)
            a_gr = sim.simulate_alltoall(plan, wb, fab, "reduce", grad_bytes=gb)
            busiest_after = float(np.max(after))
            saved = (base["busiest_before"] - busiest_after) * flop / flops
            out.append(
                {
                    **base,
                    "planner": p,
                    "imbalance_after": _max_mean(np.asarray(after, dtype=np.float64)),
                    "busiest_after": busiest_after,
                    "copies_intra": int(intra),
                    "copies_inter": int(inter),
                    "weight_sync_s": ws.makespan_s,
                    "grad_reduce_s": gr.makespan_s,
                    "a2a_weight_sync_s": a_ws.makespan_s,
                    "a2a_grad_reduce_s": a_gr.makespan_s,
                    "lb_weight_sync_s": ws.lower_bound_s,
                    "lb_grad_reduce_s": gr.lower_bound_s,
                    "compute_saved_s": saved,
                    "net_s": saved - (2 * ws.makespan_s + gr.makespan_s),
                }
            )
    return WhatIf(out, list(planners), int(a["has_load"].sum()), int(sel.size), s, info)


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ultracomm.tools.whatif",
        description="Replay a load trace through the balancing planners and the fabric simulator: imbalance, "
        "copies, simulated weight_sync/grad_reduce vs all-to-all, and the MoE compute a balanced "
        "step saves.  Simulated and modelled, no GPU.",
    )
    ap.add_argument("trace", help="trace directory (ultracomm.profile) or a [steps, layers, E] .npy/.npz")
    ap.add_argument(
        "--planner",
        default="quota,taot,greedy,lpt",
        help="comma-separated: quota, taot, greedy, lpt, device, recorded (the trace's own plans)",
    )
    ap.add_argument("--domain", default="nvl72", help="fabric preset: h100x8, h200x8, nvl72, <n>x8-rdma")
    ap.add_argument("--ep", type=int, default=None, help="EP ranks (default: the trace's world)")
    ap.add_argument("--slots", type=int, default=2, help="replica slots per rank")
    ap.add_argument(
        "--model",
        default=None,
        help="model preset for expert bytes and FLOP (default: the trace's meta 'model', else qwen3-235b-a22b)",
    )
    ap.add_argument(
        "--tflops",
        type=float,
        default=DEFAULT_TFLOPS,
        help=f"achieved expert GEMM TFLOP/s (default {DEFAULT_TFLOPS:g}, an assumption)",
    )
    ap.add_argument("--forward-only", action="store_true", help="inference: forward FLOP only")
    ap.add_argument("--max-records", type=int, default=64, help="records replayed (evenly spaced; 0: all)")
    ap.add_argument("--max-chunks", type=int, default=16, help="chunks simulated per flow (0: exact)")
    ap.add_argument("--json", metavar="FILE", help="also write rows and summary as JSON")
    a = ap.parse_args(argv)
    try:
        check_options(a)  # before the trace is read: bad options fail at once
        planners = [p.strip() for p in a.planner.split(",") if p.strip()]
        if not planners:
            raise TraceError(
                f"--planner {a.planner!r}: name at least one of quota, taot, greedy, lpt, device, recorded"
            )
        trace = load_trace(a.trace, loads=False, world=a.ep)
        model = a.model or trace.meta.get("model") or "qwen3-235b-a22b"
        setting = Setting(
            domain=a.domain,
            ep=a.ep or trace.world,
            slots=a.slots,
            model=model,
            tflops=a.tflops,
            forward_only=a.forward_only,
            max_chunks=a.max_chunks,
        )
        res = replay(trace, planners, setting, max_records=a.max_records)
    except (ValueError, KeyError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if res.replayed == 0:
        print("error: the trace holds no record with a load to replay", file=sys.stderr)
        return 2
    print(res.render(a.trace))
    if a.json:
        try:
            with open(a.json, "w") as f:
                json.dump(res.to_json(), f, indent=1, default=str)
        except OSError as e:
            print(f"error: --json {a.json}: {e.strerror}", file=sys.stderr)
            return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
