"""perf/bench_recv_alignment.py: buffers where it says, and a real run that checks every byte."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/
SCRIPT = os.path.join(HERE, "..", "perf", "bench_recv_alignment.py")


def load():
    spec = importlib.util.spec_from_file_location("bench_recv_alignment", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.parametrize("offset", [0, 64, 2048, 4095])
def test_buffers_start_where_asked_and_are_zero(offset):
    from ultracomm.host_memory import PAGE_BYTES

    t = load().at_offset(3 * PAGE_BYTES + 5, offset)
    assert t.numel() == 3 * PAGE_BYTES + 5 and t.data_ptr() % PAGE_BYTES == offset
    assert int(t.count_nonzero()) == 0


@pytest.mark.slow
def test_run_compares_every_offset_to_the_first_and_checks_the_bytes(tmp_path):
    out = tmp_path / "align.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        SCRIPT,
        "--size",
        "64K",
        "--rounds",
        "3",
        "--offsets",
        "64,0,2048",
        "--json",
        str(out),
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "vs offset 64" in p.stdout and "#wrong" in p.stdout
    rec = json.loads(out.read_text())
    assert rec["world"] == 4 and rec["size"] == 65536 and rec["wrong"] == 0
    assert [r["offset"] for r in rec["rows"]] == [64, 0, 2048]
    assert all(len(r["times_us"]) == 3 and r["time_us"] > 0 for r in rec["rows"])
    first = rec["rows"][0]
    assert first["ratio"] == 1.0 and first["verdict"] == "same"  # the first offset against itself
