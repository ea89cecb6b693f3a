"""perf/bench_backward_wait.py runs under torchrun (world 2, tiny sizes, 2 steps): its table row
parses, and its JSON record has the expected keys, positive times and one counted reduce wait per
MoE layer and step."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.mark.slow
def test_bench_backward_wait_table_and_json(tmp_path):
    out = tmp_path / "bbw.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "perf", "bench_backward_wait.py"),
        "--steps",
        "2",
        "--layers",
        "2",
        "--hidden",
        "16",
        "--inner",
        "8",
        "--tokens",
        "32",
        "--json",
        str(out),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    lines = p.stdout.splitlines()
    header = [line for line in lines if line.startswith("#") and "world" in line and "expert bytes" in line]
    assert len(header) == 1, p.stdout
    rows = [line.split() for line in lines if line.strip() and not line.startswith("#") and line.split()[0].isdigit()]
    assert len(rows) == 1 and len(rows[0]) == 7, p.stdout
    world, nbytes, step, wait, wait_pct, dense, bound_pct = rows[0]
    assert (int(world), int(nbytes)) == (2, 8 * 16 * 8)
    assert float(step) > 0 and float(wait) > 0 and float(dense) > 0
    assert 0 < float(wait_pct) <= 100 and 0 < float(bound_pct) <= float(wait_pct)

    rec = json.loads(out.read_text())
    for key in (
        "world",
        "hidden",
        "inner",
        "tokens",
        "layers",
        "steps",
        "expert_bytes",
        "step_ms",
        "wait_ms",
        "dense_bwd_ms",
        "bound_ms",
        "wait_pct",
        "bound_pct",
        "reduce_waits_per_step",
        "per_step_ms",
    ):
        assert key in rec, key
    assert (rec["world"], rec["expert_bytes"], rec["layers"], rec["steps"]) == (2, 1024, 2, 2)
    assert all(rec[k] > 0 for k in ("step_ms", "wait_ms", "dense_bwd_ms", "bound_ms"))
    assert rec["wait_ms"] < rec["step_ms"] and rec["bound_ms"] <= min(rec["wait_ms"], rec["dense_bwd_ms"])
    assert rec["reduce_waits_per_step"] == [2]  # one _backward_reduce wait per MoE layer, nothing else counted
    assert len(rec["per_step_ms"]) == 2 and all(v > 0 for r in rec["per_step_ms"] for v in r[:3])
