"""What the simulator's claims rest on: the calibration's bytes and its stated error, the same
gradient dtype charged to the all-to-all baseline and to ultracomm, the sensitivity grid and
the goal counts."""

from __future__ import annotations

import numpy as np
import pytest

from ultracomm import sim
from ultracomm import scenarios as workloads
from ultracomm.layout import ExpertLayout
from ultracomm.sim import calibration, sensitivity_grid as sens


def test_ultraep_expert_bytes():
    # UltraEP's end-to-end test expert: fc1 3072 x 4096 + fc2 1536 x 4096, bf16
    assert (3072 * 4096 + 1536 * 4096) * 2 == 37_748_736
    assert sim.ULTRAEP_EXPERT.expert_weight_bytes() == 37_748_736
    assert ExpertLayout.swiglu(4096, 1536).weight_bytes == 37_748_736
    # max replicas x bytes / published direct time = the 706-714 GB/s UltraEP reports ...
    cp = [
        m * 37_748_736 / (t * 1e-3) / 1e9
        for m, t in zip(sim.ULTRAEP["replicas_max"], sim.ULTRAEP["weight_sync_direct_ms"])
    ]
    assert [round(x) for x in cp] == [706, 712, 714]
    # ... which DeepSeek-V3's expert could not reach below 1.6 TB/s (NVLink5: 900 GB/s peak)
    dsv3 = workloads.get_model("deepseek-v3").expert_weight_bytes()
    assert (
        min(m * dsv3 / (t * 1e-3) for m, t in zip(sim.ULTRAEP["replicas_max"], sim.ULTRAEP["weight_sync_direct_ms"]))
        > 1.6e12
    )


def test_calibrate_bytes_and_ratios():
    res = sim.calibrate()
    assert res["expert_bytes"] == 37_748_736
    fab = res["fabric"]
    assert fab.world == 64 and fab.multicast_sms == fab.sms == 148 and fab.reduce_sms == 42
    assert fab.host_build_s == fab.d2h_latency_s == fab.h2d_latency_s == 0  # UltraEP plans on the GPU
    assert [r["imbalance"] for r in res["rows"]] == [1.51, 2.01, 3.03]
    for r, pmax, ptot in zip(res["rows"], sim.ULTRAEP["replicas_max"], sim.ULTRAEP["replicas_total"]):
        s, p, q = r["sim"], r["published"], r["sim_over_published"]
        assert (p["replicas_max"], p["replicas_total"]) == (pmax, ptot)
        assert q["weight_sync_direct"] == pytest.approx(s["weight_sync_direct_ms"] / p["weight_sync_direct_ms"])
        assert q["weight_sync_relay"] == pytest.approx(s["weight_sync_relay_ms"] / p["weight_sync_relay_ms"])
        assert s["weight_sync_lb_ms"] <= s["weight_sync_relay_ms"] <= s["weight_sync_direct_ms"]
        # fp32 grads are twice the bf16 bytes: the link-bound reduce takes longer
        assert s["grad_reduce_relay_ms"]["bf16"] < s["grad_reduce_relay_ms"]["fp32"]
    gain_sim = [r["sim"]["weight_sync_direct_ms"] / r["sim"]["weight_sync_relay_ms"] for r in res["rows"]]
    gain_pub = [p / q for p, q in zip(sim.ULTRAEP["weight_sync_direct_ms"], sim.ULTRAEP["weight_sync_relay_ms"])]
    # the stated error follows the gains: more simulated relay gain than published = optimistic for relay
    assert ("optimistic for relay" in res["verdict"]) == all(g > p for g, p in zip(gain_sim, gain_pub))
    # per byte the direct model is checked against the published critical-path bandwidth
    for r in res["rows"]:
        assert abs(r["sim"]["critical_path_GBps"] / r["published"]["critical_path_GBps"] - 1) < 0.1
    hdr, rows = calibration.calibration_table(res)
    assert len(hdr) == len(rows[0]) and rows[0][2] == "4/38"


def test_verdict_direction():
    def res(direct, relay):
        rows = [
            {
                "sim_over_published": {"weight_sync_direct": d, "weight_sync_relay": r},
                "published": {"critical_path_GBps": 710.0, "weight_sync_direct_ms": 0.2, "weight_sync_relay_ms": 0.19},
                "sim": {
                    "critical_path_GBps": 720.0,
                    "weight_sync_direct_ms": 0.2 * d,
                    "weight_sync_relay_ms": 0.19 * r,
                },
            }
            for d, r in zip(direct, relay)
        ]
        return calibration.verdict({"rows": rows, "expert_bytes": 37_748_736})

    v = res([0.99, 1.22], [0.58, 0.88])  # the figures: relay gains 1.8-2.9x simulated vs 1.05x published
    assert "direct 0.99-1.22x (direct predicted on both sides of the published figures)" in v
    assert "relay 0.58-0.88x (relay predicted faster than published, by 12%-42%)" in v and "optimistic for relay" in v
    assert "within 1% of UltraEP's direct multicast" in v
    v = res([1.22, 1.47], [0.85, 1.15])  # relay times close to published, but still more simulated gain
    assert "direct 1.22-1.47x (direct predicted slower than published, by 22%-47%)" in v
    assert "optimistic for relay" in v
    v = res([1.0, 1.0], [1.3, 1.4])  # less simulated gain than published
    assert "pessimistic for relay" in v and "optimistic" not in v


def test_alltoall_charged_the_same_grad_dtype():
    fab = sim.get_fabric("h200x8")
    load = workloads.zipf_load(8, 64, 4096, 8, 3.0, 0, 8)
    plan = sim.make_plan(load, 8, 2, 8)
    wb = 1 << 20
    for gb in (wb, 2 * wb):  # bf16 and fp32 grads of bf16 weights
        cmp = sim.compare(plan, wb, gb, fab)
        assert cmp["grad_bytes"] == gb
        assert cmp["results"][("a2a", "reduce")].bytes == cmp["results"][("relay", "reduce")].bytes == gb
        assert cmp["results"][("direct", "reduce")].bytes == gb
    rows = sim.run_case("qwen3-30b-a3b", fab, 8, 2, [2.0], grad_dtype="fp32,bf16")
    wb = workloads.get_model("qwen3-30b-a3b").expert_weight_bytes()
    assert [(r["grad_dtype"], r["grad_bytes"], r["a2a_bytes"]["reduce"]) for r in rows] == [
        ("fp32", 2 * wb, 2 * wb),
        ("bf16", wb, wb),
    ]
    with pytest.raises(ValueError, match="grad dtypes"):
        sim.run_case("qwen3-30b-a3b", fab, 8, 2, [2.0], grad_dtype="fp8")


def test_sensitivity_grid():
    assert len(sim.SETTINGS) == 9
    labels = [s.label for s in sim.SETTINGS]
    assert labels[0] == "2+0.5 us, 256 KiB" and labels[4] == "5+5 us, 1 MiB" and labels[-1] == "10+10 us, 4 MiB"
    f = sens.Setting(10e-6, 10e-6, 1 << 20).fabric(sim.get_fabric("2x8-rdma"))
    assert (f.intra_latency_s, f.inter_latency_s, f.chunk_overhead_s) == pytest.approx((10e-6, 13e-6, 10e-6))
    res = sim.sensitivity_case("qwen3-30b-a3b", sim.get_fabric("h200x8"), 4, 2, 2.0, grad_dtype="bf16,fp32")
    assert set(res) == {"bf16", "fp32"}
    for d, r in res.items():
        assert [x["setting"] for x in r["settings"]] == labels
        for m in sens.METRICS:
            vals = [x[m] for x in r["settings"]]
            assert r["range"][m] == [min(vals), max(vals)]
            corner = [x[m] for x in r["settings"] if x["hop_us"] == 10]
            assert r["pessimistic"][m] == (
                max(corner) if m.endswith("over_lb") or m == "grad_over_weight" else min(corner)
            )
        # larger hop latency and per-chunk cost never make the same chunk size faster here
        t = {(x["hop_us"], x["chunk_bytes"]): x["weight_sync_relay_ms"] for x in r["settings"]}
        for c in sens.CHUNKS:
            assert t[(2, c)] <= t[(5, c)] <= t[(10, c)]
    # weight_sync does not depend on the grad dtype
    assert [x["weight_sync_relay_ms"] for x in res["bf16"]["settings"]] == [
        x["weight_sync_relay_ms"] for x in res["fp32"]["settings"]
    ]


def test_goal_counts():
    def case(dt, ep, imb, ws_lb, gr_lb, ws_a2a, gr_a2a, gw):
        return {
            "grad_dtype": dt,
            "ep": ep,
            "imbalance": imb,
            "weight_sync_relay_over_lb": ws_lb,
            "grad_reduce_relay_over_lb": gr_lb,
            "weight_sync_a2a_over_relay": ws_a2a,
            "grad_reduce_a2a_over_relay": gr_a2a,
            "grad_over_weight": gw,
        }

    cases = [
        case("bf16", 64, 2.0, 1.0, 1.2, 2.5, 1.5, 1.0),
        case("bf16", 64, 1.5, 1.3, 1.0, 1.0, 1.0, 3.0),
        case("fp32", 64, 3.0, 1.05, 1.05, 2.0, 2.1, 2.2),
        case("fp32", 8, 3.0, 1.0, 1.0, 1.0, 1.0, 1.0),
    ]
    c = sim.goal_counts(cases)
    assert c["bf16"] == {"ws_lb": (1, 2), "gr_lb": (1, 2), "ws_a2a": (1, 1), "gr_a2a": (0, 1), "gr_ws": (1, 2)}
    assert c["fp32"] == {"ws_lb": (2, 2), "gr_lb": (2, 2), "ws_a2a": (1, 1), "gr_a2a": (1, 1), "gr_ws": (2, 2)}


def test_goal_sweep_small():
    res = sim.goals((2.0,), slots_list=(2,), configs=((8, "h200x8"),), models=("qwen3-30b-a3b",))
    assert res["grad_dtypes"] == ["bf16", "fp32"]
    assert [(c["model"], c["ep"], c["grad_dtype"]) for c in res["cases"]] == [
        ("qwen3-30b-a3b", 8, "bf16"),
        ("qwen3-30b-a3b", 8, "fp32"),
    ]
    text = sim.goal_summary(res["cases"])
    assert "[EP divides experts, bf16 grads]" in text and "[EP divides experts, fp32 grads]" in text
    assert np.isfinite(res["cases"][0]["grad_over_weight"])
