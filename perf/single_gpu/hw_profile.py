"""The hardware profile (schema ultracomm.hwprofile/1) from the measured rows, and the relay fit it
carries (per-hop cost against chunk bytes)."""

from __future__ import annotations

import statistics
from typing import Optional, Sequence

from .rows import Row


def linear_fit(xs: Sequence[float], ys: Sequence[float]) -> tuple[float, float]:
    """Least squares ``y = a + b x`` -> ``(a, b)``; needs two distinct xs."""
    if len(xs) < 2 or len(set(xs)) < 2:
        raise ValueError("linear_fit needs at least two distinct x values")
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sum((x - mx) ** 2 for x in xs)
    return my - b * mx, b


def hop_costs(fill: dict[int, dict[int, float]]) -> tuple[list[list], Optional[float], Optional[float]]:
    """Relay fill times ``{chunk: {depth: seconds}}`` -> (``[[chunk, per-hop s]]`` (slope over depth),
    chunk_overhead_s (intercept over chunk bytes, >= 0, or None), hop_bw (1/slope, or None))."""
    per_hop = []
    for chunk in sorted(fill):
        depths = sorted(fill[chunk])
        if len(depths) >= 2:
            _, slope = linear_fit(depths, [fill[chunk][d] for d in depths])
            if slope > 0:
                per_hop.append([int(chunk), slope])
    if len(per_hop) < 2:
        return per_hop, None, None
    a, b = linear_fit([c for c, _ in per_hop], [s for _, s in per_hop])
    return per_hop, (a if a >= 0 else None), (1.0 / b if b > 0 else None)


def build_profile(rows: Sequence[Row], device: dict, stamp: str) -> dict:
    """The hardware profile dict (schema ultracomm.hwprofile/1) from the measured rows."""

    def pick(section, impl, pred=lambda r: True, key=lambda r: r.size):
        cand = [r for r in rows if r.section == section and r.impl == impl and r.algbw and pred(r)]
        return max(cand, key=key) if cand else None

    memcpy = pick("copy", "cudaMemcpyAsync") or pick("sweep", "cudaMemcpyAsync")
    sweep = sorted(
        {r.extra["ctas"]: r.algbw for r in rows if r.section == "sweep" and r.impl == "tile mover" and r.algbw}.items()
    )
    one_reduce = pick("reduce", "tile mover", lambda r: r.extra.get("ctas") == 1)
    red = pick(
        "reduce",
        "tile mover",
        lambda r: r.extra.get("dtype") == "fp32" and r.extra.get("ctas") != 1,
        key=lambda r: (r.size, r.extra.get("k", 0)),
    )
    tred = None
    if red is not None:
        tred = pick("reduce", "torch.sum", lambda r: r.case == red.case and r.size == red.size)
    flag = [r for r in rows if r.section == "flag" and r.time_s]
    launch = [r for r in rows if r.section == "launch" and r.impl == "empty kernel" and r.time_s]
    fill: dict[int, dict[int, float]] = {}
    for r in rows:
        if r.section == "relay" and r.extra.get("mode") == "fill" and r.time_s and r.extra.get("chain"):
            fill.setdefault(r.extra["chunk"], {})[r.extra["depth"]] = r.time_s
    per_hop, overhead, hop_bw = hop_costs(fill)
    return {
        "schema": "ultracomm.hwprofile/1",
        "device": device["name"],
        "compute_capability": device["cc"],
        "sm_count": device["sms"],
        "date": stamp,
        "torch": device["torch"],
        "cuda": device["cuda"],
        "source": "perf/bench_gpu.py",
        "d2d_copy_bw": memcpy.algbw if memcpy else None,
        "per_sm_copy_bw": dict(sweep).get(1),
        "per_sm_reduce_bw": one_reduce.algbw if one_reduce else None,
        "sm_sweep": [[int(c), bw] for c, bw in sweep],
        "reduce_bw": red.algbw if red else None,
        "torch_reduce_bw": tred.algbw if tred else None,
        "flag_rtt_s": flag[0].time_s if flag else None,
        "launch_s": launch[0].time_s if launch else None,
        "relay_hop_s": per_hop,
        "chunk_overhead_s": overhead,
        "hop_bw": hop_bw,
    }
