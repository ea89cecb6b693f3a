"""The one-command performance report runs end to end (quick mode) and says what it measured."""
from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.slow
def test_report_quick(tmp_path):
    p = subprocess.run([sys.executable, os.path.join(ROOT, "perf", "report.py"), "--quick", "--nproc", "2",
                        "--out", str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env={**os.environ, "ULTRACOMM_NUM_WORKERS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    md = (tmp_path / "README.md").read_text()
    for section in ("## 1. Simulated", "## 2. Simulated goal sweep", "## 3. Simulated vs published",
                    "## 4. Measured on this machine (CPU)", "no GPU figure in this report was measured"):
        assert section in md
    for png in ("sim_qwen3-235b_nvl72_ep64.png", "bench_cpu.png"):
        assert (tmp_path / png).read_bytes()[:4] == b"\x89PNG"
    rep = json.loads((tmp_path / "report.json").read_text())
    assert all(r["wrong"] == 0 for r in rep["measured"]["rows"])
    assert {r["method"] for r in rep["measured"]["rows"]} == {"a2a", "p2p", "direct", "relay"}
    head = rep["headline"]
    assert [r["imbalance"] for r in head] == [1.5, 2.0, 3.0]
    for r in head:  # simulated relay is never below the lower bound nor slower than direct
        assert r["weight_sync_ms"]["lb"] <= r["weight_sync_ms"]["relay"] * (1 + 1e-9)
        assert r["weight_sync_ms"]["relay"] <= r["weight_sync_ms"]["direct"] * (1 + 1e-9)
