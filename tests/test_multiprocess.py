"""Real multi-process runs: torchrun + gloo + host_shm windows."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import pytest

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import leftover_segments, shm_segments  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


def torchrun(script: str, nproc: int, env: dict | None = None, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={nproc}",
        os.path.join(HERE, "mp", script),
    ]
    full_env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "2", **(env or {})}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=full_env)


@pytest.mark.slow
def test_torchrun_context_4_ranks():
    before = shm_segments()
    p = torchrun("context_worker.py", 4)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    pids = {int(pid) for pid in re.findall(r"rank \d OK \(pid (\d+)\)", p.stdout)}
    for r in range(4):
        assert f"rank {r} OK" in p.stdout
    # this run's ranks only: another test run on the machine may leave segments of its own
    assert len(pids) == 4 and not leftover_segments(before, pids), "host_shm segments left in /dev/shm"


@pytest.mark.slow
def test_dead_peer_times_out_naming_it(tmp_path):
    before = shm_segments()
    p = torchrun("dead_peer_worker.py", 3, env={"DEAD_PEER_RESULTS_DIR": str(tmp_path)})
    results = [json.loads(f.read_text()) for f in sorted(tmp_path.glob("rank*.json"))]
    assert sorted(r["rank"] for r in results) == [0, 1], p.stdout[-3000:] + p.stderr[-3000:]
    by_rank = {r["rank"]: r for r in results}
    # rank 1 holds expert 2, homed on the dead rank 2: it must time out naming rank 2
    r1 = by_rank[1]
    assert r1["error"] is not None, "rank 1 did not time out"
    assert "rank 2" in r1["error"] and "expert 2" in r1["error"], r1["error"]
    assert 1.5 <= r1["elapsed"] < 1.5 + 10, r1["elapsed"]  # waited the timeout, then failed promptly
    # rank 0 pushes expert 0 to rank 2 (waits for its ready flag): also a timeout naming rank 2
    r0 = by_rank[0]
    assert r0["error"] is not None and "rank 2" in r0["error"], r0
    pids = {int(f.read_text()) for f in tmp_path.glob("pid*")}
    assert len(pids) == 3 and not leftover_segments(before, pids), "host_shm segments left after a dead rank"
