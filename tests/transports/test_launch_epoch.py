"""The persistent kernel's launch epoch (csrc/cuda/persistent_args.h ``launch_epoch``), built
with g++ -Werror: one value per launch, max(requested, every rank's last epoch + 1).  Loopback
ranks wait on each other's flags for >= their own epoch, so two ranks of one launch on
different epochs would wait forever; the abort word too only stops groups it reached."""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cpp_build import CXX, build_probe

pytestmark = pytest.mark.skipif(CXX is None, reason="needs g++")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    return build_probe(
        tmp_path_factory.mktemp("launch_epoch") / "probe", ["tests/cpp/launch_epoch_probe.cpp"], opt="-O0"
    )


def epochs(probe: Path, *cases: tuple[int, int, list[int]]) -> list[int]:
    args: list[str] = []
    for requested, nranks, last in cases:
        args += [str(requested), str(nranks), *map(str, last), "--"]
    out = subprocess.run([str(probe), *args], capture_output=True, text=True, check=True).stdout
    return [int(x) for x in out.split()]


def test_fresh_state_runs_the_requested_epoch(probe):
    assert epochs(probe, (1, 1, []), (5, 4, [0, 0, 0, 0])) == [1, 5]


def test_replays_run_past_the_last_epoch(probe):
    # a CUDA graph replay requests the captured epoch again: the launch runs last + 1
    assert epochs(probe, (5, 1, [5]), (5, 2, [9, 9])) == [6, 10]


def test_one_epoch_for_every_rank_of_a_launch(probe):
    # ranks whose last epochs differ (e.g. a runner that earlier ran fewer ranks) all run the
    # largest: rank 1's 7 + 1, not rank 0's requested 5
    assert epochs(probe, (5, 2, [3, 7]), (2, 3, [1, 0, 4])) == [8, 5]


def test_ranks_outside_the_launch_do_not_count(probe):
    assert epochs(probe, (5, 1, [3, 100])) == [5]
