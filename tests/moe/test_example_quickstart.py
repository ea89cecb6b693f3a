"""examples/quickstart.py (the README's "Using it" example) as a user runs it: torchrun on CPU."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

from conftest import leftover_segments, shm_segments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def run(world: int, *args: str) -> str:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        os.path.join(ROOT, "examples", "quickstart.py"),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "2"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    return p.stdout


def losses(out: str) -> list[float]:
    return [float(x) for x in re.findall(r"^step \d+ loss ([0-9.]+)", out, re.M)]


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_quickstart_matches_no_replication(world):
    before = shm_segments()
    out = run(world)
    ref = run(world, "--no-replication")
    got, want = losses(out), losses(ref)
    assert len(got) == 3 and got == pytest.approx(want, rel=1e-5), (out, ref)  # the same model
    assert got[-1] < got[0]  # it trains
    # balancing happened: per layer the token imbalance before -> after
    pairs = [tuple(map(float, m)) for m in re.findall(r"([0-9.]+) -> ([0-9.]+)", out)]
    assert len(pairs) == 3 * 2 and all(after < before for before, after in pairs), out
    assert "imbalance" not in ref
    assert not leftover_segments(before), "host_shm segments left in /dev/shm"
