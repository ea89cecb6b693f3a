"""perf/bench_gpu.py's target lines for issues 33 and 34 (``target_lines``), from synthetic rows named as
the bench names them: a PASS and a MISS per target, "not measured" when a row is missing, the PDL /
plain and hunk / tma-staged choices, and the per-task overhead's arithmetic by hand."""

from __future__ import annotations

import json

import perf_modules
import pytest

bg = perf_modules.load("bench_gpu")
Row = bg.Row
MiB = 1 << 20
STEP = bg.CONTROL_STEP[0]
HUNK, TMA = bg.REDUCE_IMPLS["hunk"], bg.REDUCE_IMPLS["tma"]
DEVICE = dict(name="NVIDIA H100 80GB HBM3", cc="9.0", sms=132, torch="2.x", cuda="12.x")


def by_target(rows, sms=None) -> dict:
    return {t["target"]: t for t in bg.target_lines(rows, sms)}


def one(rows, prefix: str, sms=None) -> dict:
    got = [t for name, t in by_target(rows, sms).items() if name.startswith(prefix)]
    assert len(got) == 1, (prefix, list(by_target(rows, sms)))
    return got[0]


# ----------------------------------------------------------------------------- synthetic rows


def control(label: str, us: dict, pdl_us=None, wrong=None) -> list:
    """The bench's own graph rows of one shape (control_graph_rows), times in us by key, plus an eager
    step row much faster than any graph row: the targets must not read it."""
    times = {k: v * 1e-6 for k, v in us.items()}
    if pdl_us is not None:
        times[bg.CONTROL_STEP_PDL[0]] = pdl_us * 1e-6
    w = {k: 0 for k in times}
    w.update(wrong or {})
    eager = Row("control", f"{label} {STEP}", "device step", 256, 0.1e-6, 0, 0, 0, "", dict(timing="eager"))
    return [eager, *bg.control_graph_rows(label, 256, times, w)]


def launch(graph_us: float) -> list:
    gextra = dict(timing="graph", per_graph=bg.LAUNCH_PER_GRAPH, replays=bg.LAUNCH_REPLAYS)
    return [
        Row("launch", "floor", "empty kernel", 0, 0.1e-6, 0, 0, 0, "", dict(timing="eager")),
        Row("launch", "floor", "empty kernel", 0, graph_us * 1e-6, 0, 0, 0, bg.graph_note(100, 10), gextra),
    ]


def sweep(ctas: int, gbs_per_cta: float, size: int = 256 * MiB, ran_at=None, tasks=True, wrong=0) -> Row:
    """A sweep row as mover_multicast writes it (payload S, traffic 2S), at a per-CTA rate."""
    used = ran_at or ctas
    t = size / (gbs_per_cta * 1e9 * used)
    extra = dict(ctas=used, tasks=size // MiB, chunk=MiB) if tasks else dict(ctas=used)
    return Row("sweep", f"{ctas} CTAs", "tile mover", size, t, size, 2 * size, wrong, f"{used} CTAs/rank", extra)


def reduce(case: str, impl: str, us: float, ctas: int = 23, size: int = 64 * MiB, section="reduce", wrong=0) -> Row:
    k = int(case.split()[0][2:])
    path = "tma" if impl == TMA else "hunk"
    return Row(
        section,
        case,
        impl,
        size,
        us * 1e-6,
        size,
        (k + 2) * size,
        wrong,
        f"{ctas} CTAs/rank",
        dict(k=k, dtype=case.split()[1], ctas=ctas, reduce_path=path),
    )


def torch_sum(case: str, us: float, size: int = 64 * MiB) -> Row:
    k = int(case.split()[0][2:])
    return Row(
        "reduce", case, "torch.sum", size, us * 1e-6, size, (k + 2) * size, 5, "informational #wrong: torch's order"
    )


def relay(depth: int, us: float, chunk: str = "128K", chain=True, size: int = 64 * MiB) -> Row:
    c = {"32K": 32 << 10, "128K": 128 << 10, "1M": MiB}[chunk]
    return Row(
        "relay",
        f"D={depth} chunk={chunk} stream",
        "tile mover",
        size,
        us * 1e-6,
        depth * size,
        2 * depth * size,
        0,
        "",
        dict(mode="stream", depth=depth, chunk=c, chain=chain, ctas=23, senders=depth),
    )


def fanout(tbs: float) -> Row:
    s = 64 * MiB
    return Row("fanout", "1->8", "tile mover", s, 8 * s / (tbs * 1e12), 8 * s, 9 * s, 0, "", dict(ctas=23))


# ----------------------------------------------------------------------------- issue 33


def test_every_target_has_a_line_and_nothing_measured_says_so():
    got = bg.target_lines([])
    assert [t["issue"] for t in got] == [33] * 7 + [34] * 10
    assert all(t["verdict"] == "not measured" and t["value"] is None for t in got)
    assert all(t["line"].startswith(f"target issue {t['issue']}: ") and "not measured (" in t["line"] for t in got)
    assert got[0]["line"] == (
        "target issue 33: EP8 control plane (exchange+plan+build+reroute, graph replay) <= 25 us: not measured "
        "(control / EP8 exchange+plan+build+reroute / device step [graph] missing; "
        "control / EP8 exchange+plan+build+reroute / device step, PDL [graph] missing)"
    )


@pytest.mark.parametrize(
    "plain, pdl, verdict, counted, value",
    [
        (30.0, 24.0, "PASS", "device step, PDL", 24.0),  # PDL is better and within bound
        (24.0, 30.0, "PASS", "device step", 24.0),  # the plain graph is better
        (26.0, 25.5, "MISS", "device step, PDL", 25.5),
        (24.9, None, "PASS", "device step", 24.9),  # no PDL time: the plain one counts
        (25.1, None, "MISS", "device step", 25.1),
    ],
)
def test_control_plane_ep8_takes_the_better_of_plain_and_pdl(plain, pdl, verdict, counted, value):
    t = one(control("EP8", {STEP: plain}, pdl), "EP8 control plane")
    assert t["verdict"] == verdict and t["value"] == pytest.approx(value)
    assert t["detail"].endswith(f"counted: {counted}") and t["bound"] == 25.0 and t["op"] == "<="
    assert t["rows"] == [f"control / EP8 {STEP} / {counted} [graph]"]  # not the 0.1 us eager row
    if pdl is None:
        assert "device step, PDL: not measured" in t["detail"]


@pytest.mark.parametrize("us, verdict", [(49.0, "PASS"), (51.0, "MISS")])
def test_control_plane_ep64_bound_is_50us(us, verdict):
    t = one(control("EP64", {STEP: us}, us + 5), "EP64 control plane")
    assert t["verdict"] == verdict and t["unit"] == "us" and t["bound"] == 50.0
    assert t["line"].endswith(f": {verdict}") and f"{us:.2f} us" in t["line"]


def test_a_pdl_row_with_wrong_results_is_not_counted():
    rows = control("EP8", {STEP: 24.0}, 10.0, wrong={"pdl": 3})
    t = one(rows, "EP8 control plane")
    assert t["verdict"] == "PASS" and t["value"] == pytest.approx(24.0) and t["detail"].endswith("counted: device step")
    rows = control("EP8", {STEP: 20.0}, 10.0, wrong={"pdl": 3, STEP: 1})  # both wrong: the faster, MISS
    t = one(rows, "EP8 control plane")
    assert t["verdict"] == "MISS" and "#wrong 3" in t["detail"]


@pytest.mark.parametrize(
    "key, impl, inside, outside",
    [("plan", "k_quota", 24.5, 25.5), ("build", "k_build_slot", 11.5, 12.5), ("exchange", "k_load_exchange", 5.5, 6.5)]
    + [("reroute", "k_reroute", 3.9, 4.1)],
)
def test_ep64_kernel_bounds(key, impl, inside, outside):
    for us, verdict in ((inside, "PASS"), (outside, "MISS")):
        rows = control("EP8", {key: 0.1}) + control("EP64", {key: us})  # EP8's row is not read
        t = one(rows, f"EP64 {impl}")
        assert (t["verdict"], t["value"]) == (verdict, pytest.approx(us))
        assert t["rows"] == [f"control / EP64 {key} / {impl} [graph]"]


def test_ep64_kernel_not_measured_names_the_row_and_its_note():
    rows = bg.control_graph_rows("EP64", 256, {"plan": 20e-6}, {"plan": 0}, dict(build="this _cuda has no build_slot"))
    t = one(rows, "EP64 k_build_slot")
    assert t["verdict"] == "not measured" and t["line"].endswith(
        "not measured (control / EP64 build / k_build_slot [graph]: not measured (graph replay): "
        "this _cuda has no build_slot)"
    )
    assert one(rows, "EP64 k_quota")["verdict"] == "PASS"


@pytest.mark.parametrize("us, verdict", [(1.9, "PASS"), (2.1, "MISS")])
def test_empty_kernel_graph_node(us, verdict):
    t = one(launch(us), "graph node of an empty kernel")
    assert t["verdict"] == verdict and t["value"] == pytest.approx(us)
    assert t["rows"] == ["launch / floor / empty kernel [graph]"]


# ----------------------------------------------------------------------------- issue 34: copy


def test_copy_per_cta_is_the_worst_row_up_to_16_ctas():
    rows = [sweep(1, 90.0), sweep(8, 70.0), sweep(16, 63.0), sweep(32, 40.0)]  # 32 CTAs: not a <= 16 row
    t = one(rows, "local copy per CTA")
    assert t["verdict"] == "PASS" and t["value"] == pytest.approx(63.0)
    assert t["detail"] == "worst: 16 CTAs; 1 CTA 90.00 GB/s" and len(t["rows"]) == 3
    rows[1] = sweep(8, 62.0)
    t = one(rows, "local copy per CTA")
    assert t["verdict"] == "MISS" and t["value"] == pytest.approx(62.0) and t["detail"].startswith("worst: 8 CTAs")


@pytest.mark.parametrize("per_cta, verdict", [(63.0, "PASS"), (62.0, "MISS")])
def test_copy_with_16_ctas_is_one_tbs(per_cta, verdict):
    t = one([sweep(1, 90.0), sweep(16, per_cta)], "local copy with 16 CTAs")
    assert t["verdict"] == verdict and t["value"] == pytest.approx(16 * per_cta / 1e3) and t["unit"] == "TB/s"
    assert t["rows"] == ["sweep / 16 CTAs / tile mover (256M)"]


def test_copy_with_16_ctas_says_when_the_row_was_capped():
    t = one([sweep(16, 80.0, ran_at=12)], "local copy with 16 CTAs")
    assert t["detail"] == "ran at 12 CTAs, not 16" and t["value"] == pytest.approx(12 * 80.0 / 1e3)
    assert t["verdict"] == "MISS"
    assert one([], "local copy with 16 CTAs")["line"].endswith("(sweep / 16 CTAs / tile mover missing)")


# ----------------------------------------------------------------------------- issue 34: reduce


def k2_rate(us: float, ctas: int = 23) -> float:
    """GB/s of traffic per CTA of a k=2 64 MiB reduce (4 x 64 MiB)."""
    return 4 * 64 * MiB / (us * 1e-6) / ctas / 1e9


def test_reduce_k2_takes_the_better_impl():
    rows = [reduce("k=2 fp32", HUNK, 250.0), reduce("k=2 fp32", TMA, 180.0)]
    t = one(rows, "reduce k=2 fp32 64M at 23 CTAs")
    assert t["verdict"] == "PASS" and t["value"] == pytest.approx(180.0)
    assert t["detail"] == (f"{HUNK} 250.00 us (23 CTAs); {TMA} 180.00 us (23 CTAs); better: {TMA}")
    assert t["rows"] == [f"reduce / k=2 fp32 / {TMA} (64M)"]
    per = one(rows, "reduce traffic per CTA")
    assert per["verdict"] == "PASS" and per["value"] == pytest.approx(k2_rate(180.0))  # 64.8 GB/s
    assert per["detail"].endswith(f"better: {TMA}")
    rows = [reduce("k=2 fp32", HUNK, 190.0), reduce("k=2 fp32", TMA, 210.0)]
    assert one(rows, "reduce k=2 fp32")["detail"].endswith(f"better: {HUNK}")


@pytest.mark.parametrize("us, verdict", [(199.0, "PASS"), (201.0, "MISS")])
def test_reduce_k2_time_bound(us, verdict):
    t = one([reduce("k=2 fp32", HUNK, us), reduce("k=2 fp32", TMA, us + 50)], "reduce k=2 fp32 64M")
    assert t["verdict"] == verdict and t["bound"] == 200.0


@pytest.mark.parametrize("us, verdict", [(190.0, "PASS"), (200.0, "MISS")])  # 61.3 / 58.3 GB/s per CTA
def test_reduce_traffic_per_cta_bound(us, verdict):
    t = one([reduce("k=2 fp32", HUNK, us)], "reduce traffic per CTA")
    assert t["verdict"] == verdict and t["value"] == pytest.approx(k2_rate(us)) and t["bound"] == 60.0
    assert f"not measured: reduce / k=2 fp32 / {TMA} (64M) missing" in t["detail"]


def test_reduce_k2_at_another_cta_count_says_so_or_reads_the_23_cta_sweep_row():
    rows = [reduce("k=2 fp32", HUNK, 150.0, ctas=20)]
    t = one(rows, "reduce k=2 fp32 64M")
    assert t["detail"].startswith(f"{HUNK} 150.00 us (at 20 CTAs, not 23)") and t["verdict"] == "PASS"
    assert one(rows, "reduce traffic per CTA")["value"] == pytest.approx(k2_rate(150.0, 20))
    rows.append(reduce("k=2 fp32 23 CTAs", HUNK, 170.0, section="reduce_sweep"))
    t = one(rows, "reduce k=2 fp32 64M")
    assert t["value"] == pytest.approx(170.0) and t["rows"] == [f"reduce_sweep / k=2 fp32 23 CTAs / {HUNK} (64M)"]
    assert "23 CTAs, reduce_sweep's row (the reduce row ran at 20 CTAs)" in t["detail"]


def test_reduce_k2_quick_size_is_not_the_target():
    t = one([reduce("k=2 fp32", HUNK, 50.0, size=16 * MiB)], "reduce k=2 fp32 64M")
    assert t["verdict"] == "not measured" and "reduce / k=2 fp32 / tile mover (64M) missing" in t["line"]


def test_reduce_all_sm_vs_torch_sum():
    base = [torch_sum("k=2 fp32", 100.0), torch_sum("k=8 bf16", 100.0)]
    none = one(base + [reduce("k=2 fp32", HUNK, 100.0)], "reduce with every SM", sms=132)
    assert none["verdict"] == "not measured" and none["line"].endswith(
        "not measured (no all-SM reduce row: reduce rows ran at <= 23 CTAs of 132 SMs)"
    )
    assert "device SM count unknown" in one(base, "reduce with every SM")["line"]
    rows = base + [
        reduce("k=2 fp32", HUNK, 100 / 0.90, ctas=132),
        reduce("k=2 fp32", TMA, 100 / 0.80, ctas=132),
        reduce("k=8 bf16", HUNK, 100 / 0.95, ctas=132),
    ]
    t = one(rows, "reduce with every SM", sms=132)
    assert t["verdict"] == "PASS" and t["value"] == pytest.approx(0.90)  # k=2 is the worst case, at its hunk rate
    assert t["detail"] == f"worst k=2 fp32 at 64M, {HUNK}"
    rows[2] = reduce("k=2 fp32", HUNK, 100 / 0.84, ctas=132)
    t = one(rows, "reduce with every SM", sms=132)
    assert t["verdict"] == "MISS" and t["value"] == pytest.approx(0.84)


@pytest.mark.parametrize("ratio, verdict", [(1.09, "PASS"), (1.11, "MISS")])
def test_fp16_within_10_percent_of_bf16(ratio, verdict):
    rows = [reduce("k=8 bf16", HUNK, 300.0), reduce("k=8 fp16", HUNK, 300.0 * ratio)]
    t = one(rows, "reduce k=8 fp16")
    assert t["verdict"] == verdict and t["value"] == pytest.approx(ratio) and t["bound"] == 1.10
    assert t["rows"] == [f"reduce / k=8 fp16 / {HUNK} (64M)", f"reduce / k=8 bf16 / {HUNK} (64M)"]


def test_fp16_vs_bf16_counts_the_impl_with_the_lower_ratio():
    rows = [reduce("k=8 bf16", HUNK, 300.0), reduce("k=8 fp16", HUNK, 600.0)]
    rows += [reduce("k=8 bf16", TMA, 400.0), reduce("k=8 fp16", TMA, 420.0)]
    t = one(rows, "reduce k=8 fp16")
    assert t["verdict"] == "PASS" and t["value"] == pytest.approx(1.05) and t["detail"].endswith(f"counted: {TMA}")
    assert f"{HUNK} 2.000" in t["detail"]
    t = one(rows[:3], "reduce k=8 fp16")  # the tma-staged fp16 row missing: the hunk ratio alone
    assert t["verdict"] == "MISS" and t["value"] == pytest.approx(2.0)
    assert f"not measured: reduce / k=8 fp16 / {TMA} missing" in t["detail"]


# ----------------------------------------------------------------------------- issue 34: relay, fan-out


@pytest.mark.parametrize("depth, inside, outside", [(1, 119.0, 121.0), (4, 199.0, 201.0)])
def test_relay_stream_bounds(depth, inside, outside):
    for us, verdict in ((inside, "PASS"), (outside, "MISS")):
        rows = [relay(depth, 1.0, chunk="1M"), relay(depth, us)]  # the 1M-chunk row is not read
        t = one(rows, f"relay stream 64M, 128K chunks, D={depth}")
        assert (t["verdict"], t["value"]) == (verdict, pytest.approx(us))
        assert t["rows"] == [f"relay / D={depth} chunk=128K stream / tile mover (64M)"]


def test_relay_without_128k_rows_or_a_chain_is_not_measured():
    t = one([relay(1, 50.0, chunk="32K")], "relay stream 64M, 128K chunks, D=1")  # --quick has no 128K
    assert t["line"].endswith("not measured (relay / D=1 chunk=128K stream / tile mover (64M) missing)")
    t = one([relay(4, 50.0, chain=False)], "relay stream 64M, 128K chunks, D=4")
    assert t["verdict"] == "not measured" and "not a chain" in t["line"]


@pytest.mark.parametrize("tbs, verdict", [(1.25, "PASS"), (1.15, "MISS")])
def test_fanout_1_to_8_written(tbs, verdict):
    t = one([fanout(tbs)], "1->8 fan-out")
    assert (
        t["verdict"] == verdict
        and t["value"] == pytest.approx(tbs)
        and t["rows"] == ["fanout / 1->8 / tile mover (64M)"]
    )


# ----------------------------------------------------------------------------- issue 34: per-task overhead


@pytest.mark.parametrize("per_task_us, verdict", [(10.5, "PASS"), (11.5, "MISS")])
def test_per_task_overhead_by_hand(per_task_us, verdict):
    """256 MiB in 256 tasks of 1 MiB; the best per-CTA rate is the 2-CTA row's 1 MiB per 10 us
    (104.8576 GB/s): the overhead is the 1-CTA row's time per task minus 10 us."""
    best = MiB / 10e-6
    one_cta = Row(
        "sweep",
        "1 CTAs",
        "tile mover",
        256 * MiB,
        256 * per_task_us * 1e-6,
        256 * MiB,
        512 * MiB,
        0,
        "",
        dict(ctas=1, tasks=256, chunk=MiB),
    )
    rows = [one_cta, sweep(2, best / 1e9), sweep(4, 50.0)]
    t = one(rows, "per-task overhead")
    assert t["value"] == pytest.approx(per_task_us - 10.0) and t["verdict"] == verdict
    assert t["detail"].startswith(f"256 tasks (extra tasks): {per_task_us:.3f} us per task - 1 MiB at 104.86 GB/s")
    assert t["rows"] == ["sweep / 1 CTAs / tile mover (256M)", "sweep / 2 CTAs / tile mover (256M)"]
    # a row without extra tasks (older JSON): 256M / 1M chunks, the same value
    del one_cta.extra["tasks"], one_cta.extra["chunk"]
    t = one(rows, "per-task overhead")
    assert t["value"] == pytest.approx(per_task_us - 10.0) and "256 tasks (derived: 256M / 1M chunks)" in t["detail"]


def test_per_task_overhead_reads_copy_and_relay_stream_rates_and_says_when_it_is_zero():
    rows = [sweep(1, 100.0)]
    t = one(rows, "per-task overhead")
    assert t["value"] == pytest.approx(0.0, abs=1e-9) and "0 by construction" in t["detail"]
    # a relay stream hop at 1 MiB per 8 us per CTA: per task 1 MiB / 100 GB/s - 8 us
    hop = relay(2, 64 * MiB / (MiB / 8e-6) / 23 * 1e6)  # 23 CTAs per hop, each at 1 MiB / 8 us
    t = one(rows + [hop], "per-task overhead")
    assert t["value"] == pytest.approx((MiB / 100e9 - 8e-6) * 1e6) and t["rows"][1].startswith("relay / D=2")
    assert one([], "per-task overhead")["line"].endswith("not measured (sweep / 1 CTAs / tile mover missing)")


def test_wrong_bytes_make_a_fast_row_miss():
    t = one([fanout(2.0)], "1->8 fan-out")
    assert t["verdict"] == "PASS"
    bad = fanout(2.0)
    bad.wrong = 7
    t = one([bad], "1->8 fan-out")
    assert t["verdict"] == "MISS" and t["detail"].endswith("#wrong 7")


# ----------------------------------------------------------------------------- where the lines go


def test_targets_in_the_results_json_and_the_printed_output():
    rows = control("EP8", {STEP: 20.0}, 18.0) + launch(1.5) + [sweep(16, 70.0), fanout(1.3)]
    rows += [torch_sum("k=2 fp32", 100.0), reduce("k=2 fp32", HUNK, 110.0, ctas=132)]
    rec = bg.results_record(DEVICE, "2026-12-08T00:00:00Z", False, bg.SECTIONS, rows, [])
    assert json.loads(json.dumps(rec)) == rec and rec["goals"] == bg.goal_lines(rows)  # issue 8's unchanged
    targets = rec["targets"]
    assert targets == bg.target_lines(rows, 132)  # the device's SM count: the 132-CTA row is all-SM
    keys = {"issue", "target", "value", "bound", "op", "unit", "verdict", "rows", "detail", "line"}
    assert all(set(t) == keys for t in targets)
    verdicts = {t["target"].split(" (")[0]: t["verdict"] for t in targets}
    assert verdicts["EP8 control plane"] == "PASS" and verdicts["EP64 control plane"] == "not measured"
    assert verdicts["graph node of an empty kernel"] == "PASS" and verdicts["1->8 fan-out, bytes written"] == "PASS"
    assert verdicts["reduce with every SM vs torch.sum"] == "PASS"
    src = open(bg.__file__).read()
    main = src[src.index("def main(") :]
    assert 'print("\\n".join(t["line"] for t in target_lines(gpu.rows, gpu.info.get("sms"))))' in main


def test_sweep_rows_carry_their_task_count():
    """mover_multicast's rows carry extra tasks (Loopback.num_tasks) and chunk: the 1-CTA sweep's
    256 MiB in 1 MiB chunks is 256 tasks on the home rank."""
    import ultracomm as uc
    from ultracomm.records import Op
    from ultracomm.schedule import build_schedule

    d = object.__new__(bg.Loopback)
    d.world, d.ops = 2, {"multicast": Op.MULTICAST, "reduce": Op.REDUCE}
    plan = uc.ReplicaPlan.make(bg.one_expert(1), experts_per_rank=1)
    d.sched = build_schedule(plan, 256 * MiB, 256 * MiB, chunk_bytes=MiB, relay_mode="off", max_depth=8)
    assert d.num_tasks("multicast") == 256 and d.sched.chunk_bytes == MiB
    # the row mover_multicast writes from such a domain: rank 0's CTAs, the tasks, the chunk, the grid
    import types

    d.cta_note = lambda op: ("16 CTAs on rank 0, 1 per idle rank", 16, 17)
    d.timed_multicast = lambda timer: (1e-3, False, 0)
    d.close = lambda: None
    g = object.__new__(bg.Gpu)
    g.timer, g.torch, g.domain = None, types.SimpleNamespace(float32="f32"), lambda *a, **k: d
    r = g.mover_multicast("sweep", "16 CTAs", 1, 256 * MiB, multicast_sms=16)
    assert r.extra == dict(ctas=16, tasks=256, chunk=MiB, grid=17) and r.note == "16 CTAs on rank 0, 1 per idle rank"


def test_not_measured_quotes_what_the_bench_wrote_instead():
    """Rows the bench writes instead of a measured one (impl "-"): out of time, a failed shape."""
    late = Row("sweep", "16 CTAs", "-", 0, None, 0, 0, None, "not measured: out of time (--budget-s)")
    t = one([late], "local copy with 16 CTAs")
    assert t["line"].endswith(
        "not measured (sweep / 16 CTAs / tile mover missing (16 CTAs: not measured: out of time (--budget-s)))"
    )
    failed = Row("control", "EP64", "-", 256, None, 0, 0, None, "FAILED: RuntimeError: boom")
    assert "(EP64: FAILED: RuntimeError: boom)" in one([failed], "EP64 k_quota")["line"]


# ----------------------------------------------------------------------------- all-SM reduce rows


def test_reduce_sweep_runs_every_case_at_the_sm_count_too():
    """run_reduce_sweep: every case at the device's SM count first (so a bench its budget cuts short
    still has the all-SM rows), then every case at 1..32 CTAs (the SM count once, even when it is in
    the list), each through both impls, named "<k> <dtype> <n> CTAs" at the reduce section's 64 MiB
    (16 MiB with --quick), the size of its torch.sum rows."""
    got = []

    def reduce_row(section, case, k, dt, size, name, ctas, path):
        got.append((case, size, ctas, path))
        return Row(section, case, bg.REDUCE_IMPLS[path], size, None, 0, 0, None, "")

    for quick, sms, size in (
        (False, 132, 64 * MiB),
        (True, 132, 16 * MiB),
        (False, 23, 64 * MiB),
        (False, None, 64 * MiB),
    ):
        g = object.__new__(bg.Gpu)
        g.rows, g.quick, g.info = [], quick, dict(sms=sms) if sms else {}
        g.torch = __import__("types").SimpleNamespace(float32="f32", bfloat16="bf16", float16="f16")
        g.late = lambda *a, **k: False
        g.reduce_row = reduce_row
        got.clear()
        g.run_reduce_sweep()
        base = [1, 2, 4, 8, 16, 32] if quick else [1, 2, 4, 8, 12, 16, 23, 32]
        cases = ((2, "fp32"), (8, "bf16"), (8, "fp16"))
        first = [(k, name, sms) for k, name in cases] if sms and sms not in base else []
        order = first + [(k, name, c) for k, name in cases for c in base]  # all-SM rows of every case first
        want = [(f"k={k} {name} {c} CTAs", size, c, path) for k, name, c in order for path in ("hunk", "tma")]
        assert got == want, (quick, sms)
        assert g.reduce_sweep_cases() == order


def test_reduce_all_sm_reads_the_sweep_rows_at_the_sm_count():
    """The sweep's rows at the SM count pair with the reduce section's torch.sum row of the same k,
    dtype and size; rows below the SM count are not all-SM; the worst case counts, each at its
    better impl; a torch.sum row of another size does not pair."""
    base = [torch_sum("k=2 fp32", 100.0), torch_sum("k=8 bf16", 100.0), torch_sum("k=8 fp16", 100.0)]
    sweep = [
        reduce("k=2 fp32 23 CTAs", HUNK, 100 / 0.5, ctas=23, section="reduce_sweep"),  # not all-SM
        reduce("k=2 fp32 132 CTAs", HUNK, 100 / 0.88, ctas=132, section="reduce_sweep"),
        reduce("k=2 fp32 132 CTAs", TMA, 100 / 0.91, ctas=132, section="reduce_sweep"),
        reduce("k=8 bf16 132 CTAs", HUNK, 100 / 0.95, ctas=132, section="reduce_sweep"),
        reduce("k=8 fp16 132 CTAs", TMA, 100 / 0.87, ctas=132, section="reduce_sweep"),
    ]
    t = one(base + sweep, "reduce with every SM", sms=132)
    assert t["verdict"] == "PASS" and t["value"] == pytest.approx(0.87)  # fp16 is the worst, at its tma rate
    assert t["detail"] == f"worst k=8 fp16 at 64M, {TMA}"
    assert t["rows"] == [f"reduce_sweep / k=8 fp16 132 CTAs / {TMA} (64M)", "reduce / k=8 fp16 / torch.sum (64M)"]
    sweep[4] = reduce("k=8 fp16 132 CTAs", TMA, 100 / 0.80, ctas=132, section="reduce_sweep")
    t = one(base + sweep, "reduce with every SM", sms=132)
    assert t["verdict"] == "MISS" and t["value"] == pytest.approx(0.80)
    # the quick size against the full-size torch.sum: no pair
    quick = [reduce("k=2 fp32 132 CTAs", HUNK, 25.0, ctas=132, size=16 * MiB, section="reduce_sweep")]
    t = one(base + quick, "reduce with every SM", sms=132)
    assert t["verdict"] == "not measured" and "no torch.sum row for the all-SM rows' case and size" in t["line"]
    # a 132-CTA row on a 148-SM device is not every SM
    t = one(base + sweep, "reduce with every SM", sms=148)
    assert t["verdict"] == "not measured" and "reduce rows ran at <= 132 CTAs of 148 SMs" in t["line"]
