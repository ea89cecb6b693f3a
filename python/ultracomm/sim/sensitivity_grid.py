"""Sensitivity: the same plan simulated over a grid of the costs the model is least sure of.

The grid (:data:`SETTINGS`) crosses three (hop latency, per-chunk overhead) corners --
2 + 0.5 us (the default), 5 + 5 us and 10 + 10 us -- with chunk sizes 256 KiB, 1 MiB and
4 MiB.  The RDMA hop keeps its offset above the NVLink hop (default 5 - 2 = 3 us).  The
per-chunk overhead is charged as everywhere in the model: on the dependency path and on the
SM budget's throughput.  The schedule is rebuilt for every setting (the builder picks its
trees with the fabric's latencies and the chunk size), the plan is not.

A conclusion that holds at every setting is robust to these costs; one that holds only at
the default (the optimistic corner) says so in the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence, Union

from .compare import _row, compare_dtypes, grad_dtypes, make_plan
from .fabric import Fabric


@dataclass(frozen=True)
class Setting:
    """One point of the sensitivity grid."""

    hop_s: float
    overhead_s: float
    chunk_bytes: int

    @property
    def label(self) -> str:
        c = self.chunk_bytes
        size = f"{c >> 20} MiB" if c >= 1 << 20 else f"{c >> 10} KiB"
        return f"{self.hop_s * 1e6:g}+{self.overhead_s * 1e6:g} us, {size}"

    def fabric(self, fab: Fabric) -> Fabric:
        """``fab`` with this setting's hop latency and per-chunk overhead."""
        return fab.replace(
            intra_latency_s=self.hop_s,
            inter_latency_s=self.hop_s + max(0.0, fab.inter_latency_s - fab.intra_latency_s),
            chunk_overhead_s=self.overhead_s,
        )


CORNERS = ((2e-6, 0.5e-6), (5e-6, 5e-6), (10e-6, 10e-6))
CHUNKS = (256 << 10, 1 << 20, 4 << 20)
SETTINGS = tuple(Setting(h, o, c) for h, o in CORNERS for c in CHUNKS)
#: the default setting (the optimistic corner) and the pessimistic latency corner
DEFAULT = Setting(2e-6, 0.5e-6, 1 << 20)

#: metrics a sensitivity reports as ranges
METRICS = (
    "weight_sync_relay_over_lb",
    "grad_reduce_relay_over_lb",
    "weight_sync_a2a_over_relay",
    "grad_reduce_a2a_over_relay",
    "weight_sync_direct_over_relay",
    "grad_over_weight",
)


def sensitivity(
    plan,
    weight_bytes: int,
    fabric: Fabric,
    *,
    grad_dtype: Union[str, Sequence[str]] = "fp32",
    settings: Sequence[Setting] = SETTINGS,
    max_depth: Optional[int] = None,
    max_chunks: Optional[int] = None,
) -> dict:
    """Simulate ``plan`` (bf16 weights of ``weight_bytes``) at every setting, for each gradient
    dtype.  Returns ``{dtype: {"settings": [{"setting": label, metric: value, ...}], "range":
    {metric: [min, max]}, "pessimistic": {metric: value at the 10+10 us corner, worst chunk
    size}}}``."""
    fab0 = fabric.for_world(int(plan.world))
    per: dict = {d: [] for d in grad_dtypes(grad_dtype)}
    for s in settings:
        for d, cmp in compare_dtypes(
            plan,
            weight_bytes,
            tuple(per),
            s.fabric(fab0),
            chunk_bytes=s.chunk_bytes,
            max_depth=max_depth,
            max_chunks=max_chunks,
        ):
            r = _row(0.0, 0.0, cmp, d)
            per[d].append(
                {
                    "setting": s.label,
                    "hop_us": s.hop_s * 1e6,
                    "overhead_us": s.overhead_s * 1e6,
                    "chunk_bytes": s.chunk_bytes,
                    **{m: r[m] for m in METRICS},
                    "weight_sync_relay_ms": r["weight_sync_ms"]["relay"],
                    "grad_reduce_relay_ms": r["grad_reduce_ms"]["relay"],
                }
            )
    worst_corner = max(h for h, _ in CORNERS)
    out = {}
    for d, rows in per.items():
        pess = [x for x in rows if abs(x["hop_us"] - worst_corner * 1e6) < 1e-9] or rows
        out[d] = {
            "settings": rows,
            "range": {m: [min(x[m] for x in rows), max(x[m] for x in rows)] for m in METRICS},
            # relay's worst case: highest relay/LB, lowest gains over a2a and direct
            "pessimistic": {
                m: (max if m.endswith("over_lb") or m == "grad_over_weight" else min)(x[m] for x in pess)
                for m in METRICS
            },
        }
    return out


def sensitivity_case(
    model,
    fabric: Fabric,
    ep: int,
    slots: int,
    imbalance: float,
    *,
    planner: str = "greedy",
    tokens: int = 8192,
    seed: int = 0,
    num_experts: Optional[int] = None,
    grad_dtype: Union[str, Sequence[str]] = "fp32",
    settings: Sequence[Setting] = SETTINGS,
    **kw,
) -> dict:
    """:func:`sensitivity` of one goal-sweep case (the same load and plan as
    :func:`~ultracomm.sim.compare.run_case` makes)."""
    from .. import scenarios as workloads

    spec = workloads.get_model(model) if isinstance(model, str) else model
    fab = fabric.for_world(ep)
    E = int(num_experts or spec.num_experts)
    epr = E // ep
    load = workloads.zipf_load(ep, E, tokens, spec.top_k, float(imbalance), seed, epr)
    plan = make_plan(load, ep, slots, epr, planner, fab.nodes)
    return sensitivity(plan, spec.expert_weight_bytes(), fab, grad_dtype=grad_dtype, settings=settings, **kw)
