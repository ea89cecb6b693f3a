"""The goal sweep (simulated): every model preset at EP 8, 16, 64 and 72, and the counts of
cases that meet each of the project's goals, per gradient dtype (the all-to-all baseline is
always charged the same gradient dtype as ultracomm)."""

from __future__ import annotations

from typing import Sequence, Union

import numpy as np

from .compare import grad_dtypes, run_case
from .fabric import get_fabric

# The goal sweep: (EP, fabric) pairs and the models whose expert count divides EP.
GOAL_CONFIGS = ((8, "h200x8"), (16, "2x8-rdma"), (64, "nvl72"), (72, "nvl72"))
GOAL_MODELS = ("qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3", "glm-4.5", "kimi-k2", "gpt-oss-120b", "mixtral-8x7b")

#: the goals, as (key, text, test on one case)
GOALS = (
    ("ws_lb", "weight_sync relay <= 1.10x LB", lambda c: c["weight_sync_relay_over_lb"] <= 1.10),
    ("gr_lb", "grad_reduce relay <= 1.10x LB", lambda c: c["grad_reduce_relay_over_lb"] <= 1.10),
    (
        "ws_a2a",
        "EP64 imb>=2: relay >= 2x faster than a2a (weight_sync)",
        lambda c: c["weight_sync_a2a_over_relay"] >= 2,
    ),
    (
        "gr_a2a",
        "EP64 imb>=2: relay >= 2x faster than a2a (grad_reduce)",
        lambda c: c["grad_reduce_a2a_over_relay"] >= 2,
    ),
    ("gr_ws", "grad_reduce <= 2.2x weight_sync", lambda c: c["grad_over_weight"] <= 2.2),
)


def is_ep64_hot(c: dict) -> bool:
    """The cases goal 2 speaks about: EP64 at imbalance >= 2."""
    return c["ep"] == 64 and c["imbalance"] >= 2


def goals(
    imbalances=(1.5, 2.0, 3.0),
    slots_list=(1, 2, 4),
    planner: str = "greedy",
    pad: bool = True,
    progress=None,
    grad_dtype: Union[str, Sequence[str]] = ("bf16", "fp32"),
    configs=GOAL_CONFIGS,
    models=GOAL_MODELS,
    profile=None,
    **kw,
) -> dict:
    """The Goals sweep (simulated): every model at EP 8 (h200x8), 16 (2x8-rdma), 64 and 72
    (nvl72) where EP divides its experts (with ``pad``, models that do not divide are also
    run with their expert count rounded up to a multiple of EP, marked ``padded``); one case
    per gradient dtype; ``profile``: a hardware profile applied to every fabric."""
    from .. import scenarios as workloads

    cases = []
    for ep, dom in configs:
        for name in models:
            E = workloads.get_model(name).num_experts
            padded = E % ep != 0
            if padded and (not pad or E < ep):
                continue
            Ep = -(-E // ep) * ep
            for slots in slots_list:
                rows = run_case(
                    name,
                    get_fabric(dom, profile=profile),
                    ep,
                    slots,
                    imbalances,
                    planner=planner,
                    num_experts=Ep,
                    grad_dtype=grad_dtype,
                    **kw,
                )
                for r in rows:
                    r.update(model=name, ep=ep, domain=dom, slots=slots, num_experts=Ep, padded=padded, planner=planner)
                    cases.append(r)
                    if progress:
                        progress(r)
    return {"cases": cases, "grad_dtypes": list(grad_dtypes(grad_dtype))}


def goal_counts(cases: list[dict]) -> dict:
    """``{dtype: {goal key: (met, of)}}``; the EP64 goals count EP64 cases at imbalance >= 2."""
    out: dict = {}
    for dt in dict.fromkeys(c["grad_dtype"] for c in cases):
        sel = [c for c in cases if c["grad_dtype"] == dt]
        row = {}
        for key, _, test in GOALS:
            pool = [c for c in sel if is_ep64_hot(c)] if key.endswith("a2a") else sel
            row[key] = (sum(bool(test(c)) for c in pool), len(pool))
        out[dt] = row
    return out


def _worst(sel, key, fn=max):
    c = fn(sel, key=lambda c: c[key])
    return f"{c[key]:.3f} ({c['model']} EP{c['ep']} slots {c['slots']} imb {c['imbalance']:g})"


def _a2a_line(tag: str, hot: list[dict], key: str, op: str) -> str:
    return (
        f"[{tag}] EP64 imb>=2 a2a/relay {op}: min {_worst(hot, key, min)}; "
        f"{sum(c[key] < 2 for c in hot)}/{len(hot)} cases < 2"
    )


def goal_summary(cases: list[dict]) -> str:
    """A few lines per case group (EP divides experts / padded) and gradient dtype."""
    lines = []
    dts = list(dict.fromkeys(c["grad_dtype"] for c in cases))
    for padded in (False, True):
        tag = "padded expert counts" if padded else "EP divides experts"
        grp = [c for c in cases if c["padded"] == padded]
        if not grp:
            continue
        ws = [c for c in grp if c["grad_dtype"] == dts[0]]  # weight_sync does not depend on the grad dtype
        n_over = sum(c["weight_sync_relay_over_lb"] > 1.10 for c in ws)
        lines.append(
            f"[{tag}] weight_sync relay/LB: max {_worst(ws, 'weight_sync_relay_over_lb')}; "
            f"{n_over}/{len(ws)} cases > 1.10"
        )
        hot = [c for c in ws if is_ep64_hot(c)]
        if hot:
            lines.append(_a2a_line(tag, hot, "weight_sync_a2a_over_relay", "weight_sync"))
        for ep in sorted({c["ep"] for c in ws}):
            e = [c for c in ws if c["ep"] == ep]
            lines.append(
                f"[{tag}]   EP{ep} ({e[0]['domain']}): weight_sync relay/LB max "
                f"{_worst(e, 'weight_sync_relay_over_lb')}, median "
                f"{float(np.median([c['weight_sync_relay_over_lb'] for c in e])):.3f}"
            )
        for dt in dts:
            g = [c for c in grp if c["grad_dtype"] == dt]
            lines.append(
                f"[{tag}, {dt} grads] grad_reduce relay/LB: max {_worst(g, 'grad_reduce_relay_over_lb')}; "
                f"{sum(c['grad_reduce_relay_over_lb'] > 1.10 for c in g)}/{len(g)} cases > 1.10"
            )
            hot = [c for c in g if is_ep64_hot(c)]
            if hot:
                lines.append(_a2a_line(f"{tag}, {dt} grads", hot, "grad_reduce_a2a_over_relay", "grad_reduce"))
            lines.append(
                f"[{tag}, {dt} grads] grad_reduce/weight_sync (relay): max {_worst(g, 'grad_over_weight')}; "
                f"{sum(c['grad_over_weight'] > 2.2 for c in g)}/{len(g)} cases > 2.2"
            )
    return "\n".join(lines)
