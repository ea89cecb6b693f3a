"""Issue 32, item 1: torch DDP over the expert-data-parallel group (EP 2 x EDP 2, torchrun,
gloo) with and without ``find_unused_parameters``: the DDP-averaged expert gradients, the
losses and the parameters after 3 SGD steps match the same model without ultracomm
(tests/mp_ddp_edp.py).  Before the replicas' gradients went through autograd, DDP's hooks fired
on the home wgrad alone and its copy-back overwrote the replica part (relative error 0.45-0.73)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


@pytest.mark.slow
def test_ddp_over_the_edp_group_matches_no_replication():
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        os.path.join(HERE, "mp_ddp_edp.py"),
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    lines = re.findall(
        r"rank (\d) find_unused_parameters=(\w+): replicas (\d+), matches the run without "
        r"ultracomm: (yes|NO)",
        p.stdout,
    )
    assert {(int(r), f) for r, f, _, _ in lines} == {(r, f) for r in range(4) for f in ("True", "False")}, p.stdout
    for r, f, replicas, verdict in lines:
        assert int(replicas) > 0, f"rank {r}: nothing was replicated, the case tests nothing"
        assert verdict == "yes", p.stdout
