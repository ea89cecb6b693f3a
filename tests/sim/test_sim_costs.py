"""The simulator's non-link costs: SM budgets (with the per-chunk cost on their throughput),
host-side build and copies, and the hardware profile JSON that sets them."""

from __future__ import annotations

import json

import numpy as np
import pytest

from ultracomm import sim
from ultracomm import scenarios as workloads

BW = 1e9
LAT = 1e-6
OVH = 0.25e-6
LAUNCH = 2e-6


def fabric(world: int, **kw) -> sim.Fabric:
    return sim.Fabric(
        "test",
        world,
        world,
        BW,
        BW / 4,
        BW,
        BW / 4,
        intra_latency_s=LAT,
        inter_latency_s=3e-6,
        chunk_overhead_s=OVH,
        launch_s=LAUNCH,
        hbm_bw=1e10,
        a2a_startup_s=5e-6,
        a2a_per_peer_s=1e-6,
        **kw,
    )


def approx(x):
    return pytest.approx(x, rel=1e-6, abs=1e-12)


def pool(sms: int, rate: float, chunk: float) -> float:
    # each SM spends OVH per chunk beyond its bytes
    return sms * chunk / (chunk / rate + OVH)


@pytest.mark.parametrize("k", [1, 3])
def test_sm_budget_bounds_multicast_and_reduce(k):
    B, C = 1 << 20, 8
    c = B / C
    fab = fabric(8, multicast_sms=2, reduce_sms=3, sm_copy_bw=0.2e9, sm_reduce_bw=0.1e9)
    plan = workloads.hot_plan(8, 1, 1, 0, k)
    s = sim.schedule_for(plan, B, 2 * B, fab, "off", chunk_bytes=int(c))
    m = sim.simulate(s, fab, "multicast")
    pm = pool(2, 0.2e9, c)  # 0.39 GB/s < the 1 GB/s link: the home's SMs are the bottleneck
    assert m.makespan_s == approx(LAUNCH + k * B / pm + LAT + OVH)
    assert m.critical_rank == 0 and m.critical_link == "sm pool"
    lb, terms = sim.lower_bound(s, fab, "multicast", terms=True)
    assert terms["sm_once"] == approx(B / pm) and lb <= m.makespan_s * (1 + 1e-9)
    # the home pulls and adds k grads (2C chunks of c bytes) with its reduce SMs
    g = sim.simulate(s, fab, "reduce")
    pr = pool(3, 0.1e9, c)
    assert g.makespan_s == approx(LAUNCH + k * 2 * B / pr + LAT + OVH)
    assert g.critical_link == "sm pool"
    # the all-to-all is charged the same budget at the per-SM copy rate on both sides, no per-chunk cost
    a = sim.simulate_alltoall(plan, B, fab, "multicast")
    startup = LAUNCH + 5e-6 + 7e-6
    assert a.makespan_s == approx(2 * k * B / 1e10 + startup + k * B / (2 * 0.2e9) + LAT + OVH)


def test_no_budget_means_links_only():
    B = 1 << 20
    plan = workloads.hot_plan(8, 1, 1, 0, 3)
    fab = fabric(8)
    assert fab.multicast_sms == 0 and fab.sm_pool_bw("multicast") == float("inf")
    s = sim.schedule_for(plan, B, 2 * B, fab, "off", chunk_bytes=B // 4)
    assert sim.simulate(s, fab, "multicast").makespan_s == approx(LAUNCH + 3 * B / BW + LAT + OVH)


def test_per_chunk_cost_grows_with_smaller_chunks():
    B = 4 << 20
    plan = workloads.hot_plan(8, 1, 1, 0, 4)
    fab = fabric(8, multicast_sms=1, sm_copy_bw=0.5e9)
    t = {}
    for chunk in (64 << 10, 1 << 20):
        s = sim.schedule_for(plan, B, 2 * B, fab, "off", chunk_bytes=chunk)
        t[chunk] = sim.simulate(s, fab, "multicast").makespan_s
        assert t[chunk] == approx(LAUNCH + 4 * B / pool(1, 0.5e9, chunk) + LAT + OVH)
    assert t[64 << 10] > t[1 << 20]


def test_host_costs_on_weight_sync_only():
    B = 1 << 20
    plan = workloads.hot_plan(8, 1, 1, 0, 3)
    fab = fabric(8, host_build_s=3e-6, d2h_latency_s=1e-6, h2d_latency_s=2e-6, h2d_bw=1e9)
    s = sim.schedule_for(plan, B, 2 * B, fab, "off", chunk_bytes=B // 4)
    task_bytes = max(sum(s.tasks(op, r).nbytes + s.refs(op, r).nbytes for op in (0, 1)) for r in range(8))
    assert task_bytes > 0
    host = 1e-6 + 3e-6 + 2e-6 + task_bytes / 1e9
    m = sim.simulate(s, fab, "multicast")
    assert m.parts["host_s"] == approx(host)
    assert m.makespan_s == approx(host + LAUNCH + 3 * B / BW + LAT + OVH)
    assert m.lower_bound_s >= host
    g = sim.simulate(s, fab, "reduce")  # restore / grad_reduce reuse the device's task lists
    assert g.parts["host_s"] == 0 and g.makespan_s == approx(LAUNCH + 3 * 2 * B / BW + LAT + OVH)
    a = sim.simulate_alltoall(plan, B, fab, "multicast")  # split sizes to the host first
    assert a.parts["host_s"] == approx(1e-6)


def test_presets_charge_ultracomm_defaults():
    from ultracomm.cuda.sm_budget import FALLBACK_PER_CTA_BW as R, default_sms

    for name, mc, rd in (("h100x8", 11, 26), ("h200x8", 11, 26), ("nvl72", 22, 32), ("2x8-rdma", 11, 26)):
        f = sim.get_fabric(name)
        # the GPU executor's auto SM count for the preset's own link: ceil(bw / measured per-CTA rate), at most 32
        assert f.multicast_sms == default_sms(f.intra_bw, R["multicast"], f.sms) == mc
        assert f.reduce_sms == default_sms(f.intra_bw, R["reduce"], f.sms) == rd
        assert f.sms in (132, 148) and f.host_build_s > 0 and f.d2h_latency_s > 0 and f.profile == ""
    with pytest.raises(ValueError, match="multicast_sms"):
        fabric(4, multicast_sms=-1)
    with pytest.raises(ValueError, match="sm_copy_bw"):
        fabric(4, sm_copy_bw=0.0)


def profile_dict(**over) -> dict:
    from ultracomm.cuda.hwprofile import SCHEMA

    d = dict(
        schema=SCHEMA,
        device="made-up GPU",
        compute_capability="9.0",
        sm_count=100,
        date="2026-01-01T00:00:00Z",
        torch="2.11",
        cuda="13.0",
        source="tests",
        d2d_copy_bw=2e12,
        per_sm_copy_bw=90e9,
        per_sm_reduce_bw=60e9,
        sm_sweep=[[1, 90e9]],
        reduce_bw=1e12,
        torch_reduce_bw=1e12,
        flag_rtt_s=1e-6,
        launch_s=3e-6,
        relay_hop_s=[[32768, 3e-6]],
        chunk_overhead_s=2e-6,
        hop_bw=1e11,
    )
    d.update(over)
    return d


def test_hardware_profile(tmp_path):
    p = tmp_path / "x_profile.json"
    p.write_text(json.dumps(profile_dict()))
    base = sim.get_fabric("h200x8")
    f = sim.apply_profile(base, str(p))
    assert (f.sm_copy_bw, f.sm_reduce_bw, f.hbm_bw, f.sms) == (90e9, 60e9, 4e12, 100)
    assert f.launch_s == 3e-6 and f.chunk_overhead_s == 2e-6
    # the per-SM figures are one GPU's HBM: the NVLink budgets keep the measured per-CTA fallback
    # (ceil(370 / 34.5), ceil(370 / 14.6)); a profile's per_cta_bw["nvlink"] sets them
    assert (f.multicast_sms, f.reduce_sms) == (11, 26)
    p.write_text(json.dumps(profile_dict(per_cta_bw={"nvlink": {"multicast": 90e9, "reduce": 60e9}})))
    assert (sim.apply_profile(base, str(p)).multicast_sms, sim.apply_profile(base, str(p)).reduce_sms) == (5, 7)
    p.write_text(json.dumps(profile_dict()))
    # one GPU measures no link: latencies and bandwidths stay
    assert (f.intra_latency_s, f.inter_latency_s, f.intra_bw) == (
        base.intra_latency_s,
        base.inter_latency_s,
        base.intra_bw,
    )
    assert "made-up GPU" in f.describe() and "no hardware profile" in base.describe()
    # unmeasured per-SM rates keep the assumed ones and ultracomm's fallback SM default
    p.write_text(json.dumps(profile_dict(per_sm_copy_bw=None, per_sm_reduce_bw=None, launch_s=None)))
    g = sim.apply_profile(base, str(p))
    assert (g.sm_copy_bw, g.multicast_sms, g.launch_s) == (base.sm_copy_bw, 11, base.launch_s)
    p.write_text(json.dumps(profile_dict(d2d_copy_bw=-1)))
    with pytest.raises(ValueError, match="d2d_copy_bw"):
        sim.apply_profile(base, str(p))


def test_cli_profile_and_budgets(tmp_path, capsys, monkeypatch):
    p = tmp_path / "hw_profile.json"
    p.write_text(json.dumps(profile_dict(per_sm_copy_bw=10e9)))
    out = tmp_path / "o.json"
    args = [
        "--model",
        "qwen3-30b-a3b",
        "--domain",
        "h200x8",
        "--ep",
        "4",
        "--imbalance",
        "2",
        "--grad-dtype",
        "bf16",
        "--json",
        str(out),
    ]
    assert sim.main(args + ["--profile", str(p), "--multicast-sms", "4"]) == 0
    assert "SM budget 4 (weight_sync)" in capsys.readouterr().out
    d = json.loads(out.read_text())
    assert (
        d["fabric"]["sm_copy_bw"] == 10e9 and d["fabric"]["multicast_sms"] == 4 and "made-up" in d["fabric"]["profile"]
    )
    slow = d["rows"][0]["weight_sync_ms"]["relay"]
    assert sim.main(args + ["--profile", str(p), "--multicast-sms", "0"]) == 0  # links only: faster
    assert json.loads(out.read_text())["rows"][0]["weight_sync_ms"]["relay"] < slow
    # ULTRACOMM_HW_PROFILE is found without --profile, and --no-profile ignores it
    monkeypatch.setenv("ULTRACOMM_HW_PROFILE", str(p))
    assert sim.main(args) == 0 and "made-up GPU" in capsys.readouterr().out
    assert sim.main(args + ["--no-profile"]) == 0 and "no hardware profile" in capsys.readouterr().out
    monkeypatch.delenv("ULTRACOMM_HW_PROFILE")
    (tmp_path / "bad.json").write_text("{")
    assert sim.main(args + ["--profile", str(tmp_path / "bad.json")]) == 2
    assert "cannot read hardware profile" in capsys.readouterr().err


def test_maxmin_three_resources():
    # two flows share link 0; the second is also capped by a pool of 0.2
    links = np.array([[0, 1, 3], [0, 2, 4]])
    cap = np.array([1.0, 1.0, 1.0, np.inf, 0.2])
    assert sim._maxmin(links, cap).tolist() == pytest.approx([0.8, 0.2])
