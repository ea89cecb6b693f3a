"""ultracomm.tools.whatif: the replay's numbers are the planners' and the simulator's on the same loads."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from ultracomm import sim
from ultracomm import scenarios as workloads
from ultracomm.planners import Domain, get_planner
from ultracomm.planners.base import copy_counts
from ultracomm.profile import Profiler, from_routing_stats, load_trace, spread_expert_load
from ultracomm.tools.whatif import Setting, replay, sample_rows

W, EPR, SLOTS = 8, 4, 2
E = W * EPR
SETTING = Setting(domain="h200x8", ep=W, slots=SLOTS, model="qwen3-30b-a3b", max_chunks=4, tflops=400.0)


@pytest.fixture(scope="module")
def trace(tmp_path_factory):
    path = tmp_path_factory.mktemp("whatif") / "t"
    with Profiler(path, meta={"model": "qwen3-30b-a3b"}) as prof:
        for step in range(3):
            for layer in range(2):
                load = workloads.zipf_load(W, E, 512, 4, 1.6 + 0.4 * layer + 0.1 * step, 7 * step + layer, EPR)
                res = get_planner("greedy")(load, Domain.flat(W, EPR), SLOTS)
                prof.record(layer, load=load, plan=res)
    return load_trace(path)


def direct(load: np.ndarray, planner: str, slot_src=None, plan=None, after=None):
    """The same numbers by calling the planners and the simulator directly."""
    spec = workloads.get_model("qwen3-30b-a3b")
    wb, gb = spec.expert_weight_bytes(), spec.expert_grad_bytes()
    fab = sim.get_fabric("h200x8", W)
    dom = Domain(W, fab.nodes.astype(np.int64), EPR)
    if plan is None:
        res = get_planner(planner)(load, dom, SLOTS)
        plan, slot_src, after = res.plan, res.slot_src, res.rank_load
    sched = sim.schedule_for(plan, wb, gb, fab, "auto", 1 << 20)
    before = load.sum(0).reshape(W, EPR).sum(1)
    flop = 18 * spec.hidden * spec.moe_inter
    saved = (before.max() - np.max(after)) * flop / 400e12
    ws = sim.simulate(sched, fab, "weight_sync", max_chunks=4).makespan_s
    gr = sim.simulate(sched, fab, "grad_reduce", max_chunks=4).makespan_s
    return {
        "imbalance_before": before.max() / before.mean(),
        "busiest_before": int(before.max()),
        "imbalance_after": np.max(after) / np.mean(after),
        "busiest_after": float(np.max(after)),
        "copies_intra": copy_counts(slot_src, dom)[0],
        "copies_inter": copy_counts(slot_src, dom)[1],
        "weight_sync_s": ws,
        "grad_reduce_s": gr,
        "a2a_weight_sync_s": sim.simulate_alltoall(plan, wb, fab, "multicast", grad_bytes=gb).makespan_s,
        "a2a_grad_reduce_s": sim.simulate_alltoall(plan, wb, fab, "reduce", grad_bytes=gb).makespan_s,
        "lb_weight_sync_s": sim.lower_bound(sched, fab, "multicast"),
        "lb_grad_reduce_s": sim.lower_bound(sched, fab, "reduce"),
        "compute_saved_s": saved,
        "net_s": saved - (2 * ws + gr),
    }


def test_replay_equals_planners_and_simulator(trace):
    res = replay(trace, ["quota", "lpt", "recorded"], SETTING, max_records=0)
    assert res.records == res.replayed == 6 and len(res.rows) == 18
    for row in res.rows:
        i = trace.find(row["step"], row["layer"], row["microbatch"])
        load = trace["load"][i]
        if row["planner"] == "recorded":
            want = direct(
                load, "", slot_src=trace["slot_src"][i], plan=trace.plan(i), after=trace["rank_load_after"][i]
            )
        else:
            want = direct(load, row["planner"])
        for k, v in want.items():
            assert row[k] == pytest.approx(v, rel=1e-12, abs=0), (row["planner"], k)
    summ = res.summary()
    for p in ("quota", "lpt", "recorded"):
        rs = [r for r in res.rows if r["planner"] == p]
        assert summ[p]["n"] == 6
        assert summ[p]["mean"]["weight_sync_s"] == pytest.approx(np.mean([r["weight_sync_s"] for r in rs]), rel=1e-12)
        assert summ[p]["total"]["net_s"] == pytest.approx(sum(r["net_s"] for r in rs), rel=1e-12)


def test_sampling_extrapolates(trace):
    rows = sample_rows(trace, 3)
    assert rows.tolist() == [0, 2, 5] or rows.tolist() == [0, 3, 5]
    res = replay(trace, ["quota"], SETTING, max_records=3)
    assert (res.records, res.replayed) == (6, 3)
    assert [(r["step"], r["layer"]) for r in res.rows] == [
        (int(trace["step"][i]), int(trace["layer"][i])) for i in rows
    ]
    t = res.summary()["quota"]["total"]
    assert t["weight_sync_s"] == pytest.approx(2 * sum(r["weight_sync_s"] for r in res.rows), rel=1e-12)
    assert "totals extrapolated x2.0" in res.render()


def test_other_ep_uses_spread_totals(trace):
    res = replay(
        trace, ["quota"], Setting(domain="h200x8", ep=4, slots=SLOTS, model="qwen3-30b-a3b", max_chunks=4), rows=[1]
    )
    load4 = spread_expert_load(trace["expert_load"][1], 4)
    got = get_planner("quota")(load4, Domain(4, np.zeros(4, np.int64), E // 4), SLOTS)
    row = res.rows[0]
    assert row["imbalance_after"] == pytest.approx(got.rank_load.max() / got.rank_load.mean(), rel=1e-12)
    before = load4.sum(0).reshape(4, -1).sum(1)
    assert row["busiest_before"] == before.max()


def test_bad_settings(trace):
    with pytest.raises(ValueError, match=r"unknown planner\(s\) \['eplb'\]"):
        replay(trace, ["eplb"], SETTING)
    with pytest.raises(ValueError, match="do not divide over EP 5"):
        replay(trace, ["quota"], Setting(domain="h200x8", ep=5))
    with pytest.raises(ValueError, match="'recorded' replays the trace's plans, made for EP 8"):
        replay(trace, ["recorded"], Setting(domain="h200x8", ep=4))
    with pytest.raises(ValueError, match="cannot host EP 16"):
        replay(trace, ["quota"], Setting(domain="h200x8", ep=16))
    with pytest.raises(ValueError, match="tflops must be a positive number"):
        replay(trace, ["quota"], Setting(domain="h200x8", ep=8, tflops=0))


def test_routing_stats_replay_skips_recorded():
    counts = np.random.default_rng(1).integers(0, 300, size=(2, 1, E))
    tr = from_routing_stats(counts, W)
    res = replay(tr, ["greedy", "recorded"], SETTING)
    assert [r["planner"] for r in res.rows] == ["greedy", "greedy"]
    assert res.summary()["recorded"]["n"] == 0 and "recorded  0" in res.render()
    load = spread_expert_load(counts[1, 0], W)
    assert res.rows[1]["busiest_before"] == load.sum(0).reshape(W, EPR).sum(1).max()


def test_cli(trace, tmp_path):
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "ultracomm.tools.whatif",
            trace.path,
            "--planner",
            "quota,recorded",
            "--domain",
            "h200x8",
            "--ep",
            "8",
            "--max-chunks",
            "4",
            "--tflops",
            "400",
            "--max-records",
            "2",
            "--json",
            str(tmp_path / "w.json"),
        ],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    got = json.loads((tmp_path / "w.json").read_text())
    want = replay(trace, ["quota", "recorded"], SETTING, max_records=2)
    assert got["records"] == 6 and got["replayed"] == 2 and got["setting"]["model"] == "qwen3-30b-a3b"
    for a, b in zip(got["rows"], want.rows):
        assert a == b  # JSON round-trips floats exactly
    m = want.summary()["quota"]["mean"]
    line = next(ln for ln in out.splitlines() if ln.startswith("quota "))
    assert f"{m['imbalance_before']:.3f}" in line and f"{m['weight_sync_s'] * 1e3:.3f}" in line
    assert f"{m['a2a_grad_reduce_s'] * 1e3:.3f}" in line and f"{m['net_s'] * 1e3:.3f}" in line
    assert "simulated and modelled, no GPU" in out and "400 TFLOP/s (assumed)" in out
    bad = subprocess.run(
        [sys.executable, "-m", "ultracomm.tools.whatif", trace.path, "--planner", "nope"],
        capture_output=True,
        text=True,
    )
    assert bad.returncode == 2 and "unknown planner(s) ['nope']" in bad.stderr
