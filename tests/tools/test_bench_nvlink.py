"""perf/bench_nvlink.py on the CPU: its arithmetic, its dry run (the whole harness under torchrun with
the host transport and host_shm windows: setup, plan, rows, verification, table, JSON), its
verification catching a corrupted destination, and its "not measured" exit without two GPUs.  The
NVLink measurement itself needs a two-GPU machine (none has run it yet)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import perf_modules
import pytest

from conftest import leftover_segments, shm_segments

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
BENCH = os.path.join(ROOT, "perf", "bench_nvlink.py")
KiB = 1 << 10


def load_bench():
    return perf_modules.load("bench_nvlink", fresh=True)


bn = load_bench()


def torchrun(out, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        BENCH,
        "--dry-run-host",
        "--out",
        str(out),
        "--reps",
        "3",
        "--trials",
        "2",
        *args,
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def rows_of(out) -> tuple[dict, list[dict]]:
    with open(os.path.join(out, "bench_nvlink.json")) as f:
        rec = json.load(f)
    return rec, rec["rows"]


def test_rows_count_the_bytes_written_and_rate_against_the_baseline():
    mk = bn.row
    base = mk(bn.copy_case(), bn.MEMCPY, 1 << 20, 1e-5, 0, "", None)
    mover = mk(bn.copy_case(8), bn.MOVER, 1 << 20, 2e-5, 0, "8 CTAs/rank", 8)
    other = mk(bn.copy_case(8), bn.MOVER, 1 << 20, 1e-5, 0, "", 8, "graph")  # no graph baseline: no ratio
    assert base.algbw == base.busbw == (1 << 20) / 1e-5  # payload = traffic = S
    bn.add_ratios([base, mover, other])
    assert mover.extra["vs_baseline"] == pytest.approx(0.5) and "50.0% of cudaMemcpyAsync" in mover.note
    assert "vs_baseline" not in other.extra
    d = mover.to_dict()
    for k in ("section", "case", "impl", "size", "time_s", "algbw", "busbw", "wrong", "note", "ctas"):
        assert k in d
    assert d["section"] == "nvlink" and d["case"] == "1->1 peer 8 CTAs" and d["ctas"] == 8


def test_goal_line_uses_the_largest_size_and_at_most_12_ctas():
    S = 256 << 20
    rows = [
        bn.row(bn.copy_case(), bn.MEMCPY, S, 1e-3, 0, "", None),
        bn.row(bn.copy_case(12), bn.MOVER, S, 1.05e-3, 0, "", 12),  # 95%
        bn.row(bn.copy_case(16), bn.MOVER, S, 1.0e-3, 0, "", 16),  # faster, but over 12 CTAs
        bn.row(bn.copy_case(), bn.MEMCPY, 1 << 20, 1e-5, 0, "", None),
        bn.row(bn.copy_case(4), bn.MOVER, 1 << 20, 1e-4, 0, "", 4),
    ]
    (line,) = bn.goal_lines(rows)
    assert "12 CTAs = 95.2%" in line and "256M" in line and line.endswith("PASS")
    rows[1].time_s = 2e-3
    assert bn.goal_lines(rows)[0].endswith("MISS")
    assert "not evaluated" in bn.goal_lines(rows, dry_run=True)[0]
    assert "not measured" in bn.goal_lines([])[0]


def test_times_take_the_slowest_rank_per_trial_then_the_median():
    assert bn.combine_times([[1.0, 5.0, 2.0], [3.0, 1.0, 1.0]]) == 3.0  # per trial 3, 5, 2
    assert bn.combine_times([None, [2.0, 4.0, 3.0]]) == 3.0  # one-sided: the active rank's
    assert bn.combine_times([None, None]) is None


def test_no_gpu_prints_why_writes_not_measured_rows_and_exits_0(tmp_path):
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_WORLD_SIZE")}
    p = subprocess.run(
        [sys.executable, BENCH, "--out", str(tmp_path), "--sizes", "1M,16M", "--ctas", "4,8"],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert p.returncode == 0, p.stdout + p.stderr
    lines = p.stdout.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("bench_nvlink: not measured: "), p.stdout
    rec, rows = rows_of(tmp_path)
    # per size: cudaMemcpyAsync, the tile mover at 4 and 8 CTAs, torch add_, the reduce at 4 and 8
    assert len(rows) == 2 * 6
    assert all(r["time_s"] is None and r["note"].startswith("not measured: ") for r in rows)
    assert {(r["case"], r["impl"]) for r in rows} == {
        ("1->1 peer", "cudaMemcpyAsync"),
        ("1->1 peer 4 CTAs", "tile mover"),
        ("1->1 peer 8 CTAs", "tile mover"),
        ("reduce 2->1 peer", "torch add_ (peer view)"),
        ("reduce 2->1 peer 4 CTAs", "tile mover"),
        ("reduce 2->1 peer 8 CTAs", "tile mover"),
    }
    assert rec["wrong_total"] == 0 and rec["mode"] == "nvlink"


@pytest.mark.slow
def test_host_dry_run_measures_every_row_and_verifies_every_byte(tmp_path):
    before = shm_segments()
    p = torchrun(tmp_path, "--sizes", "64K", "--ctas", "4,8")
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rec, rows = rows_of(tmp_path)
    got = [(r["case"], r["impl"], r["size"], r["ctas"]) for r in rows]
    assert got == [
        ("1->1 peer", "memmove", 64 * KiB, None),
        ("1->1 peer 4 CTAs", "tile mover", 64 * KiB, 4),
        ("1->1 peer 8 CTAs", "tile mover", 64 * KiB, 8),
        ("reduce 2->1 peer", "torch add_ (peer view)", 64 * KiB, None),
        ("reduce 2->1 peer 4 CTAs", "tile mover", 64 * KiB, 4),
        ("reduce 2->1 peer 8 CTAs", "tile mover", 64 * KiB, 8),
    ]
    for r in rows:
        assert r["section"] == "nvlink" and r["wrong"] == 0 and r["time_s"] > 0, r
        assert r["note"].startswith("host dry run, not NVLink"), r
        assert r["algbw"] == r["busbw"] == pytest.approx(r["size"] / r["time_s"])
        assert r["timing"] == "eager"
    assert all("vs_baseline" in r for r in rows if r["impl"] == "tile mover")
    assert rec["errors"] == [] and rec["wrong_total"] == 0 and rec["mode"] == "host dry run"
    assert "1->1 peer 4 CTAs" in p.stdout and "#wrong" in p.stdout  # the table
    assert not leftover_segments(before), "host_shm segments left in /dev/shm"


@pytest.mark.slow
def test_a_corrupted_destination_is_counted(tmp_path):
    p = torchrun(tmp_path, "--sizes", "64K", "--ctas", "4", "--corrupt-for-test")
    assert p.returncode == 1, p.stdout[-3000:] + p.stderr[-3000:]  # #wrong > 0 fails the run
    rec, rows = rows_of(tmp_path)
    assert len(rows) == 4 and all(r["wrong"] == 1 for r in rows), rows  # one flipped byte per destination
    assert rec["wrong_total"] == 4
