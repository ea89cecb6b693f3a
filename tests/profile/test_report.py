"""The one-command performance report runs end to end (quick mode) and says what it measured."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_report_quick(tmp_path):
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "perf", "report.py"), "--quick", "--nproc", "2", "--out", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "ULTRACOMM_NUM_WORKERS": "1"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "README.md").read_text()
    for section in (
        "## Goals at a glance (simulated)",
        "## 1. Simulated",
        "## 2. Simulated goal sweep",
        "## 3. Sensitivity of the EP64 goal (simulated)",
        "## 4. EP8 relay gains: unverified by hardware",
        "## 5. Simulated vs published (UltraEP)",
        "## 6. Measured on this machine (CPU)",
        "## 7. The model's costs and their sources",
        "No GPU figure in this report was measured",
        "37,748,736 B",
        "charged the same gradient dtype",
    ):
        assert section in md, section
    for png in ("sim_qwen3-235b_nvl72_ep64.png", "bench_cpu.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    rep = json.loads((tmp_path / "report.json").read_text())
    rows = rep["measured"]["rows"]
    assert all(r["wrong"] == 0 for r in rows)
    assert {(r["method"], r["transport"]) for r in rows} == {
        ("a2a_shm", "shared memory"),
        ("a2a_gloo", "gloo (TCP loopback)"),
        ("p2p_gloo", "gloo (TCP loopback)"),
        ("direct", "shared memory"),
        ("relay", "shared memory"),
        ("relay_gloo", "gloo (TCP loopback)"),
        ("relay_split", "shared memory within a domain + gloo across"),
    }
    sim = rep["simulated"]
    head = sim["headline"]
    assert [(r["imbalance"], r["grad_dtype"]) for r in head] == [
        (x, d) for x in (1.5, 2.0, 3.0) for d in ("bf16", "fp32")
    ]
    for r in head:  # simulated relay is never below the lower bound nor slower than direct
        assert r["weight_sync_ms"]["lb"] <= r["weight_sync_ms"]["relay"] * (1 + 1e-9)
        assert r["weight_sync_ms"]["relay"] <= r["weight_sync_ms"]["direct"] * (1 + 1e-9)
        assert r["a2a_bytes"]["reduce"] == r["relay_bytes"]["reduce"] == r["grad_bytes"]  # same dtype both sides
    assert {c["grad_dtype"] for c in sim["goals"]} == {"bf16", "fp32"}
    assert sim["calibration"]["expert_bytes"] == 37_748_736
    assert sim["calibration"]["verdict"] in md  # the stated error is the computed one
