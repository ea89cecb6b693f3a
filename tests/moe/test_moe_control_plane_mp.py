"""Issue 19's CPU check of the whole control plane, as users run it: torchrun, gloo, world 4
and 8, ReplicaManager with its defaults on the host executor (tests/mp_control_plane.py).  After
setup a training step makes no torch.distributed call and no store call from ultracomm's frames
(each counted by wrapping the functions), with two micro-batches in flight (F0 F1 B1 B0) and with
activation checkpointing; master grads match the float64 no-replication reference within 1e-5 and
a rerun is bit-identical.  Issue 32 item 8: the same with no manager option at all, three layers
(the default plan check is the window's on the host transport)."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


def run(world: int, *args: str) -> list[str]:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        os.path.join(HERE, "mp_control_plane.py"),
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    # each rank prints its line in one write, but the launcher may put it inside another rank's line
    found = {
        (int(r), ck): text
        for r, ck, text in re.findall(r"rank (\d+) checkpoint=(\w+): (.*?imbalance [0-9.]+ -> [0-9.]+)", p.stdout)
    }
    assert set(found) == {(r, ck) for r in range(world) for ck in ("None", "non_reentrant")}, p.stdout
    for line in found.values():
        assert "grads match no replication: yes" in line and "rerun bit-identical: yes" in line, line
    return list(found.values())


@pytest.mark.slow
@pytest.mark.parametrize("world", [4, 8])
def test_default_control_plane_makes_no_collective_after_setup(world):
    for line in run(world):
        assert "calls after setup 0 []" in line, line


@pytest.mark.slow
def test_a_default_three_layer_training_step_makes_no_collective_after_setup():
    """No option at all (transport, plan check, planner: the defaults): 0 store and 0
    torch.distributed calls from ultracomm's frames per 3-layer training step after setup."""
    for line in run(2, "default"):
        assert "managers [('host', 'window', 'LoadBoard')]; layers 3; calls after setup 0 []" in line, line


@pytest.mark.slow
def test_the_counter_sees_a_host_plan_agreement():
    """The control: with plan_check="agree" every weight_sync agrees the plan through the
    group's store, and the same counter sees those calls."""
    for line in run(4, "agree"):
        assert "calls after setup 0 " not in line and "'store'" in line, line
