"""What the rows say against the goals: issue 8's two goals (goal_lines) and a line per target of issues
33 and 34 (target_lines), PASS / MISS / not measured, from the rows only."""

from __future__ import annotations

from typing import Optional, Sequence

from .constants import CONTROL_STEP, CONTROL_STEP_PDL, GOAL_COPY, GOAL_COPY_SMS, GOAL_REDUCE, REDUCE_IMPLS, MiB
from .rows import Row, fmt_size


def goal_lines(rows: Sequence[Row]) -> list[str]:
    """The two goals of issue 8, PASS/MISS/not measured, from the sweep and reduce rows."""
    out = []
    sweep = [r for r in rows if r.section == "sweep" and r.algbw]
    ref = [r for r in sweep if r.impl == "cudaMemcpyAsync"]
    mover = [r for r in sweep if r.impl == "tile mover" and r.extra.get("ctas", 1 << 30) <= GOAL_COPY_SMS]
    if ref and mover:
        best = max(mover, key=lambda r: r.algbw)
        frac = best.algbw / ref[0].algbw
        out.append(
            f"goal copy: tile mover {best.algbw / 1e9:.1f} GB/s with {best.extra['ctas']} CTAs = "
            f"{100 * frac:.1f}% of cudaMemcpyAsync D2D {ref[0].algbw / 1e9:.1f} GB/s at "
            f"{fmt_size(best.size)} (goal >= {100 * GOAL_COPY:.0f}% with <= {GOAL_COPY_SMS}): "
            f"{'PASS' if frac >= GOAL_COPY else 'MISS'}"
        )
    else:
        out.append("goal copy: not measured (sweep rows missing)")
    red = [r for r in rows if r.section == "reduce" and r.algbw]
    if red:
        top = max(r.size for r in red)
        pairs = []
        for r in red:
            if r.size == top and r.impl == "tile mover":
                base = [t for t in red if t.size == top and t.impl == "torch.sum" and t.case == r.case]
                if base:
                    pairs.append((r.case, r.algbw / base[0].algbw))
        if pairs:
            worst = min(pairs, key=lambda p: p[1])
            ok = all(f >= GOAL_REDUCE for _, f in pairs)
            out.append(
                f"goal reduce: worst {worst[0]} at {100 * worst[1]:.1f}% of torch.sum's bandwidth "
                f"(goal >= {100 * GOAL_REDUCE:.0f}% for every case at {fmt_size(top)}): "
                f"{'PASS' if ok else 'MISS'}"
            )
        else:
            out.append("goal reduce: not measured (no torch.sum baseline rows)")
    else:
        out.append("goal reduce: not measured (reduce rows missing)")
    return out


# ----------------------------------------------------------------------------- issues 33 and 34's targets
# The bounds, in the unit each target line shows (us, GB/s, TB/s or a ratio); the rows each target reads
# are named in target_lines' records.
TARGET_CONTROL_US = (("EP8", 25.0), ("EP64", 50.0))  # the whole control plane, graph-replayed device step
TARGET_EP64_KERNEL_US = (  # at EP64, each kernel's graph row: (case suffix, impl, bound)
    ("plan", "k_quota", 25.0),
    ("build", "k_build_slot", 12.0),
    ("exchange", "k_load_exchange", 6.0),
    ("reroute", "k_reroute", 4.0),
)
TARGET_EMPTY_NODE_US = 2.0  # a graph node of an empty kernel
TARGET_COPY_PER_CTA_GBS, TARGET_COPY_16_TBS = 62.5, 1.0
TARGET_REDUCE_PER_CTA_GBS, TARGET_REDUCE_K2_US, TARGET_REDUCE_CTAS = 60.0, 200.0, 23
TARGET_REDUCE_VS_TORCH = 0.85  # with every SM
TARGET_FP16_VS_BF16 = 1.10  # k=8: fp16's time at most 10% above bf16's
TARGET_RELAY_US = ((1, 120.0), (4, 200.0))  # 64 MiB stream at 128 KiB chunks, by depth
TARGET_FANOUT_TBS = 1.2  # 1 -> 8, bytes written
TARGET_TASK_US = 1.0  # per-task overhead
TARGET_REDUCE_BYTES = TARGET_RELAY_BYTES = 64 * MiB
LOOPBACK_CHUNK = 1 << 20  # Loopback's default chunk (the sweep's rows before they carried extra["tasks"])


def row_name(r: Row) -> str:
    """``section / case / impl`` (+ ``[graph]`` for graph-replayed rows, + the size for sized rows)."""
    s = f"{r.section} / {r.case} / {r.impl}"
    if r.extra.get("timing") == "graph":
        s += " [graph]"
    if r.size and r.section not in ("control", "launch"):
        s += f" ({fmt_size(r.size)})"
    return s


def _rows_named(
    rows: Sequence[Row], section: str, case: str, impl: str, size: Optional[int] = None, graph: bool = False
) -> list[Row]:
    return [
        r
        for r in rows
        if (r.section, r.case, r.impl) == (section, case, impl)
        and (size is None or r.size == size)
        and (not graph or r.extra.get("timing") == "graph")
    ]


def _measured(rows: Sequence[Row], *name, **kw) -> Optional[Row]:
    """The last measured row of that name (time_s set), or None."""
    got = [r for r in _rows_named(rows, *name, **kw) if r.time_s]
    return got[-1] if got else None


def _why_missing(rows: Sequence[Row], section: str, case: str, impl: str, size=None, graph=False) -> str:
    """What a target says for a row it needs and does not have: the row's name, and its own note when
    the bench wrote the row without a time (budget, no device support, a failure)."""
    want = f"{section} / {case} / {impl}" + (" [graph]" if graph else "") + (f" ({fmt_size(size)})" if size else "")
    there = _rows_named(rows, section, case, impl, size, graph)
    if there and there[-1].note:
        return f"{want}: {there[-1].note}"
    # the rows the bench writes instead (impl "-"): a row or shape not started (--budget-s), a section or
    # shape that failed or was interrupted
    instead = [
        r
        for r in rows
        if r.section == section and not r.time_s and r.note and (r.case in ("-", case) or case.startswith(r.case + " "))
    ]
    if instead:
        return f"{want} missing ({instead[-1].case}: {instead[-1].note})"
    return f"{want} missing"


def _wrong(r: Row) -> int:
    return 0 if r.note.startswith("informational") else (r.wrong or 0)


def _target(
    issue: int,
    target: str,
    op: str,
    bound: float,
    unit: str,
    value: Optional[float] = None,
    used: Sequence[Row] = (),
    detail: str = "",
    missing: str = "",
) -> dict:
    """One target's record: issue, target, value, bound, op, unit, verdict (PASS / MISS / not measured),
    rows (names of the rows read), detail, and the printed line.  A row with #wrong > 0 misses."""
    wrong = sum(_wrong(r) for r in used)
    if value is None:
        verdict = "not measured"
    elif wrong:
        verdict = "MISS"
        detail = ", ".join(x for x in (detail, f"#wrong {wrong}") if x)
    else:
        verdict = "PASS" if (value <= bound if op == "<=" else value >= bound) else "MISS"
    head = f"target issue {issue}: {target} {op} {bound:g} {unit}"
    if value is None:
        line = f"{head}: not measured ({missing or detail or 'rows missing'})"
    else:
        shown = f"{value:.3f}" if unit.startswith("x ") or unit == "TB/s" else f"{value:.2f}"
        line = f"{head}: {shown} {unit}" + (f" ({detail})" if detail else "") + f": {verdict}"
    return dict(
        issue=issue,
        target=target,
        value=value,
        bound=bound,
        op=op,
        unit=unit,
        verdict=verdict,
        rows=[row_name(r) for r in used],
        detail=detail if value is not None else (missing or detail),
        line=line,
    )


def _pick_best(cands: Sequence[tuple], higher: bool) -> tuple:
    """The best (label, value, rows) of ``cands`` (higher or lower value); candidates whose rows have
    #wrong > 0 are chosen only when every candidate has."""
    ok = [c for c in cands if not sum(_wrong(r) for r in c[2])]
    pool = ok or list(cands)
    return (max if higher else min)(pool, key=lambda c: c[1])


def _control_targets(rows: Sequence[Row]) -> list[dict]:
    out = []
    step = CONTROL_STEP[0]
    for label, bound in TARGET_CONTROL_US:
        case = f"{label} {step}"
        cands, parts = [], []
        for impl in (CONTROL_STEP[1], CONTROL_STEP_PDL[1]):
            r = _measured(rows, "control", case, impl, graph=True)
            if r is None:
                parts.append(f"{impl}: not measured")
            else:
                cands.append((impl, r.time_s * 1e6, [r]))
                parts.append(f"{impl} {r.time_s * 1e6:.2f} us")
        name = f"{label} control plane (exchange+plan+build+reroute, graph replay)"
        if not cands:
            miss = "; ".join(
                _why_missing(rows, "control", case, impl, graph=True) for impl in (CONTROL_STEP[1], CONTROL_STEP_PDL[1])
            )
            out.append(_target(33, name, "<=", bound, "us", missing=miss))
            continue
        impl, value, used = _pick_best(cands, higher=False)
        detail = "; ".join(parts) + f"; counted: {impl}"
        out.append(_target(33, name, "<=", bound, "us", value, used, detail))
    for key, impl, bound in TARGET_EP64_KERNEL_US:
        case = f"EP64 {key}"
        r = _measured(rows, "control", case, impl, graph=True)
        name = f"EP64 {impl} ({key}, graph replay)"
        if r is None:
            out.append(
                _target(33, name, "<=", bound, "us", missing=_why_missing(rows, "control", case, impl, graph=True))
            )
        else:
            out.append(_target(33, name, "<=", bound, "us", r.time_s * 1e6, [r]))
    r = _measured(rows, "launch", "floor", "empty kernel", graph=True)
    name = "graph node of an empty kernel"
    if r is None:
        out.append(
            _target(
                33,
                name,
                "<=",
                TARGET_EMPTY_NODE_US,
                "us",
                missing=_why_missing(rows, "launch", "floor", "empty kernel", graph=True),
            )
        )
    else:
        out.append(_target(33, name, "<=", TARGET_EMPTY_NODE_US, "us", r.time_s * 1e6, [r]))
    return out


def _sweep_tasks(r: Row) -> tuple[int, str]:
    """(tasks, how known) of a sweep row: its extra["tasks"], else its size over its chunk (1 -> 1
    direct: one task per chunk; Loopback's default chunk when the row does not say)."""
    if r.extra.get("tasks"):
        return int(r.extra["tasks"]), "extra tasks"
    chunk = int(r.extra.get("chunk") or LOOPBACK_CHUNK)
    return -(-r.size // chunk), f"derived: {fmt_size(r.size)} / {fmt_size(chunk)} chunks"


def _copy_targets(rows: Sequence[Row]) -> list[dict]:
    out = []
    sweep = [
        r for r in rows if r.section == "sweep" and r.impl == "tile mover" and r.algbw_per_cta and r.extra["ctas"] <= 16
    ]
    name = "local copy per CTA (sweep, every row with <= 16 CTAs)"
    if not sweep:
        out.append(
            _target(
                34, name, ">=", TARGET_COPY_PER_CTA_GBS, "GB/s", missing="sweep / <n> CTAs / tile mover rows missing"
            )
        )
    else:
        worst = min(sweep, key=lambda r: r.algbw_per_cta)
        one = [r for r in sweep if r.extra["ctas"] == 1]
        detail = f"worst: {worst.case}" + (
            "" if worst.case == f"{worst.extra['ctas']} CTAs" else f" (ran at {worst.extra['ctas']})"
        )
        if one:
            detail += f"; 1 CTA {one[-1].algbw_per_cta / 1e9:.2f} GB/s"
        out.append(_target(34, name, ">=", TARGET_COPY_PER_CTA_GBS, "GB/s", worst.algbw_per_cta / 1e9, sweep, detail))
    r = _measured(rows, "sweep", "16 CTAs", "tile mover")
    name = "local copy with 16 CTAs (sweep)"
    if r is None:
        out.append(
            _target(
                34, name, ">=", TARGET_COPY_16_TBS, "TB/s", missing=_why_missing(rows, "sweep", "16 CTAs", "tile mover")
            )
        )
    else:
        detail = "" if r.extra.get("ctas") == 16 else f"ran at {r.extra.get('ctas')} CTAs, not 16"
        out.append(_target(34, name, ">=", TARGET_COPY_16_TBS, "TB/s", r.algbw / 1e12, [r], detail))
    return out


def _reduce_k2_rows(rows: Sequence[Row]) -> tuple[list[tuple], list[str]]:
    """Per reduce impl, the k=2 fp32 64 MiB row the targets read: the ``reduce`` row when it ran at 23
    CTAs, else reduce_sweep's ``k=2 fp32 23 CTAs`` row, else the ``reduce`` row at its own CTA count
    (said in the detail).  -> ([(impl, row, note)], [why missing, per impl without one])."""
    got, missing = [], []
    n, want = TARGET_REDUCE_BYTES, TARGET_REDUCE_CTAS
    for impl in REDUCE_IMPLS.values():
        r = _measured(rows, "reduce", "k=2 fp32", impl, size=n)
        s = _measured(rows, "reduce_sweep", f"k=2 fp32 {want} CTAs", impl, size=n)
        if r is not None and r.extra.get("ctas") == want:
            got.append((impl, r, f"{want} CTAs"))
        elif s is not None and s.extra.get("ctas") == want:
            why = f"the reduce row ran at {r.extra.get('ctas')} CTAs" if r is not None else "no reduce row"
            got.append((impl, s, f"{want} CTAs, reduce_sweep's row ({why})"))
        elif r is not None:
            got.append((impl, r, f"at {r.extra.get('ctas')} CTAs, not {want}"))
        else:
            missing.append(_why_missing(rows, "reduce", "k=2 fp32", impl, size=n))
    return got, missing


def _reduce_targets(rows: Sequence[Row], sms: Optional[int]) -> list[dict]:
    out = []
    got, missing = _reduce_k2_rows(rows)
    for name, op, bound, unit, value_of, higher in (
        (
            "reduce traffic per CTA (k=2 fp32 64M)",
            ">=",
            TARGET_REDUCE_PER_CTA_GBS,
            "GB/s",
            lambda r: r.busbw / r.extra["ctas"] / 1e9,
            True,
        ),
        (
            f"reduce k=2 fp32 64M at {TARGET_REDUCE_CTAS} CTAs",
            "<=",
            TARGET_REDUCE_K2_US,
            "us",
            lambda r: r.time_s * 1e6,
            False,
        ),
    ):
        if not got:
            out.append(_target(34, name, op, bound, unit, missing="; ".join(missing)))
            continue
        cands = [(impl, value_of(r), [r]) for impl, r, _ in got if r.extra.get("ctas")]
        if not cands:
            out.append(_target(34, name, op, bound, unit, missing="the k=2 fp32 rows carry no CTA count"))
            continue
        parts = [f"{impl} {value_of(r):.2f} {unit} ({note})" for impl, r, note in got] + [
            f"not measured: {m}" for m in missing
        ]
        impl, value, used = _pick_best(cands, higher)
        out.append(_target(34, name, op, bound, unit, value, used, "; ".join(parts) + f"; better: {impl}"))
    out.append(_reduce_all_sm(rows, sms))
    out.append(_fp16_vs_bf16(rows))
    return out


def _reduce_all_sm(rows: Sequence[Row], sms: Optional[int]) -> dict:
    """Every SM: the tile mover's reduce rows with CTAs >= the device's SMs, as a share of torch.sum's
    rate for the same case and size (the worst case, each at its better impl)."""
    name = "reduce with every SM vs torch.sum (worst case)"
    movers = [
        r
        for r in rows
        if r.section in ("reduce", "reduce_sweep")
        and r.impl in REDUCE_IMPLS.values()
        and r.algbw
        and sms
        and (r.extra.get("ctas") or 0) >= sms
    ]
    by_case: dict = {}
    for r in movers:
        case = r.case if r.section == "reduce" else " ".join(r.case.split()[:2])
        base = _measured(rows, "reduce", case, "torch.sum", size=r.size)
        if base is not None:
            by_case.setdefault((case, r.size), []).append((r.impl, r.algbw / base.algbw, [r, base]))
    if not by_case:
        top = max((r.extra.get("ctas") or 0 for r in rows if r.section.startswith("reduce") and r.algbw), default=0)
        why = "device SM count unknown" if not sms else f"reduce rows ran at <= {top} CTAs of {sms} SMs"
        if sms and movers:
            why = "no torch.sum row for the all-SM rows' case and size"
        return _target(34, name, ">=", TARGET_REDUCE_VS_TORCH, "x torch.sum", missing=f"no all-SM reduce row: {why}")
    per_case = {key: _pick_best(c, higher=True) for key, c in by_case.items()}
    (case, size), (impl, value, used) = min(per_case.items(), key=lambda kv: kv[1][1])
    detail = f"worst {case} at {fmt_size(size)}, {impl}"
    return _target(34, name, ">=", TARGET_REDUCE_VS_TORCH, "x torch.sum", value, used, detail)


def _fp16_vs_bf16(rows: Sequence[Row]) -> dict:
    """k=8: fp16's time over bf16's (same bytes), per impl at the largest size both have; the impl
    with the lower ratio counts."""
    name = "reduce k=8 fp16 time vs bf16's"
    cands, parts, missing = [], [], []
    for impl in REDUCE_IMPLS.values():
        f16 = {r.size: r for r in rows if (r.section, r.case, r.impl) == ("reduce", "k=8 fp16", impl) and r.time_s}
        b16 = {r.size: r for r in rows if (r.section, r.case, r.impl) == ("reduce", "k=8 bf16", impl) and r.time_s}
        both = sorted(set(f16) & set(b16))
        if not both:
            missing.extend(
                _why_missing(rows, "reduce", case, impl) for case, d in (("k=8 fp16", f16), ("k=8 bf16", b16)) if not d
            )
            if f16 and b16:
                missing.append(f"{impl}: fp16 and bf16 rows at different sizes")
            continue
        f, b = f16[both[-1]], b16[both[-1]]
        ratio = f.time_s / b.time_s
        cands.append((impl, ratio, [f, b]))
        parts.append(f"{impl} {ratio:.3f} ({f.time_s * 1e6:.1f} / {b.time_s * 1e6:.1f} us at {fmt_size(f.size)})")
    if not cands:
        return _target(34, name, "<=", TARGET_FP16_VS_BF16, "x bf16 time", missing="; ".join(missing))
    impl, value, used = _pick_best(cands, higher=False)
    detail = "; ".join(parts + [f"not measured: {m}" for m in missing]) + f"; counted: {impl}"
    return _target(34, name, "<=", TARGET_FP16_VS_BF16, "x bf16 time", value, used, detail)


def _relay_fanout_targets(rows: Sequence[Row]) -> list[dict]:
    out = []
    for depth, bound in TARGET_RELAY_US:
        case = f"D={depth} chunk=128K stream"
        name = f"relay stream 64M, 128K chunks, D={depth}"
        r = _measured(rows, "relay", case, "tile mover", size=TARGET_RELAY_BYTES)
        if r is None:
            why = _why_missing(rows, "relay", case, "tile mover", size=TARGET_RELAY_BYTES)
            out.append(_target(34, name, "<=", bound, "us", missing=why))
        elif depth > 1 and not r.extra.get("chain", True):
            out.append(_target(34, name, "<=", bound, "us", missing=f"{row_name(r)}: the schedule is not a chain"))
        else:
            out.append(_target(34, name, "<=", bound, "us", r.time_s * 1e6, [r], f"{r.extra.get('ctas')} CTAs/hop"))
    r = _measured(rows, "fanout", "1->8", "tile mover")
    name = "1->8 fan-out, bytes written"
    if r is None:
        out.append(
            _target(
                34, name, ">=", TARGET_FANOUT_TBS, "TB/s", missing=_why_missing(rows, "fanout", "1->8", "tile mover")
            )
        )
    else:
        out.append(
            _target(
                34,
                name,
                ">=",
                TARGET_FANOUT_TBS,
                "TB/s",
                r.algbw / 1e12,
                [r],
                f"{r.extra.get('ctas')} CTAs, {fmt_size(r.size)} source",
            )
        )
    return out


def _task_overhead(rows: Sequence[Row]) -> dict:
    """Issue 34's per-task overhead: the 1-CTA sweep row's time per task minus its bytes per task at
    the best per-CTA copy rate measured (the tile mover's 1 -> 1 copies: sweep, copy and relay
    stream rows; 0 by construction when the 1-CTA row is itself the best)."""
    name = "per-task overhead (1-CTA sweep)"
    one = [r for r in rows if r.section == "sweep" and r.impl == "tile mover" and r.time_s and r.extra.get("ctas") == 1]
    if not one:
        return _target(
            34, name, "<=", TARGET_TASK_US, "us", missing=_why_missing(rows, "sweep", "1 CTAs", "tile mover")
        )
    r = one[-1]
    tasks, how = _sweep_tasks(r)
    copies = [
        x
        for x in rows
        if x.impl == "tile mover"
        and x.algbw_per_cta
        and (
            x.section == "sweep"
            or (x.section == "copy" and x.case == "1->1")
            or (x.section == "relay" and x.extra.get("mode") == "stream")
        )
    ]
    best = max(copies, key=lambda x: x.algbw_per_cta)
    per_task = r.time_s / tasks
    moving = r.size / tasks / best.algbw_per_cta
    value = (per_task - moving) * 1e6
    detail = (
        f"{tasks} tasks ({how}): {per_task * 1e6:.3f} us per task - {r.size / tasks / MiB:g} MiB at "
        f"{best.algbw_per_cta / 1e9:.2f} GB/s per CTA ({row_name(best)}) {moving * 1e6:.3f} us"
    )
    if best is r:
        detail += "; the 1-CTA row is itself the best per-CTA rate: 0 by construction"
    used = [r] if best is r else [r, best]
    return _target(34, name, "<=", TARGET_TASK_US, "us", value, used, detail)


def target_lines(rows: Sequence[Row], sms: Optional[int] = None) -> list[dict]:
    """A record per target of issues 33 and 34 (``_target``'s keys; ``line`` is what is printed),
    computed from the rows only: issue 33 from the graph-replayed control and launch rows, issue 34
    from the sweep, reduce (both impls), reduce_sweep, relay and fanout rows.  ``sms``: the device's
    SM count (an all-SM reduce row is one with at least that many CTAs)."""
    return [
        *_control_targets(rows),
        *_copy_targets(rows),
        *_reduce_targets(rows, sms),
        *_relay_fanout_targets(rows),
        _task_overhead(rows),
    ]
