"""perf/bench_transports.py: which runs a sweep starts (three methods at once, or two pairs where
they do not fit in memory) and how ``table`` turns the runs' JSON into perf/README.md 6b's rows."""
from __future__ import annotations

import importlib.util
import json
import os
import types

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


@pytest.fixture(scope="module")
def bt():
    spec = importlib.util.spec_from_file_location("bench_transports", os.path.join(HERE, "..", "perf",
                                                                                   "bench_transports.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(method, time_us, op="weight_sync", size=1048576, workload="zipf:2", wrong=0):
    return {"op": op, "method": method, "size": size, "workload": workload, "time_us": time_us, "wrong": wrong,
            "replicas": 6, "moved_bytes": 6 * size, "choice": f"direct, 1 chunk(s) of {size} B" if method != "p2p_gloo"
            else None, "cross_bytes": 3 * size if method == "relay_split" else None}


def _write(path, world, rows, load=(1.5, 2.5)):
    path.write_text(json.dumps({"world": world, "rows": rows, "loadavg": {"before": [load[0], 0, 0],
                                                                          "after": [load[1], 0, 0]}}))


def test_run_starts_pairs_only_for_the_listed_cases(bt, tmp_path, monkeypatch):
    started = []

    def fake_run(cmd, **kw):
        started.append((cmd[cmd.index("--methods") + 1], os.path.basename(cmd[cmd.index("--json") + 1]),
                        cmd[4]))
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bt.subprocess, "run", fake_run)
    args = types.SimpleNamespace(out=str(tmp_path), reps=1, worlds=[4, 8], sizes=["1M", "32M"], iters=3,
                                 pairs=["8:32M"])
    assert bt.run(args) == 0
    three = "p2p_gloo,relay_gloo,relay_split"
    assert started == [
        (three, "w4_s1M_r0.json", "--nproc-per-node=4"),
        (three, "w4_s32M_r0.json", "--nproc-per-node=4"),
        (three, "w8_s1M_r0.json", "--nproc-per-node=8"),
        ("p2p_gloo,relay_gloo", "w8_s32M_r0_gloo.json", "--nproc-per-node=8"),
        ("p2p_gloo,relay_split", "w8_s32M_r0_split.json", "--nproc-per-node=8"),
    ]
    # a resumed sweep skips what exists: here one pair's file
    (tmp_path / "w8_s32M_r0_gloo.json").write_text("{}")
    for name in ("w4_s1M_r0.json", "w4_s32M_r0.json", "w8_s1M_r0.json"):
        (tmp_path / name).write_text("{}")
    started.clear()
    assert bt.run(args) == 0
    assert started == [("p2p_gloo,relay_split", "w8_s32M_r0_split.json", "--nproc-per-node=8")]


def test_table_rows_ratios_and_pairs(bt, tmp_path, capsys):
    # world 4: two runs of all three methods; the time is the median over runs (here the mean of two)
    _write(tmp_path / "w4_s1M_r0.json", 4, [_row("p2p_gloo", 2000), _row("relay_gloo", 1800),
                                            _row("relay_split", 3000)])
    _write(tmp_path / "w4_s1M_r1.json", 4, [_row("p2p_gloo", 4000), _row("relay_gloo", 4200),
                                            _row("relay_split", 2000)], load=(3.0, 4.0))
    # world 8: one pair each; each ratio is to the p2p_gloo of its own run
    _write(tmp_path / "w8_s1M_r0_gloo.json", 8, [_row("p2p_gloo", 10000), _row("relay_gloo", 9000)])
    _write(tmp_path / "w8_s1M_r0_split.json", 8, [_row("p2p_gloo", 8000), _row("relay_split", 10000)])
    assert bt.table(types.SimpleNamespace(dir=str(tmp_path))) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == ("| weight_sync | 4 | 1048576 | zipf:2 | 6 | 2 | 3.00 | 3.00 | 1.00 | direct, 1 chunk(s) of 1048576 B "
                      "| 2.50 | 0.83 | direct, 1 chunk(s) of 1048576 B | 3145728 of 6291456 |")
    assert out[3] == ("| weight_sync | 8 | 1048576 | zipf:2 | 6 | 1+1 (pairs) | 10.00 / 8.00 | 9.00 | 0.90 | "
                      "direct, 1 chunk(s) of 1048576 B | 10.00 | 1.25 | direct, 1 chunk(s) of 1048576 B | "
                      "3145728 of 6291456 |")
    assert "- relay_gloo/p2p_gloo: median 0.95, min 0.90, max 1.00, rows > 1: 0/2" in out
    assert "- relay_split/p2p_gloo: median 1.04, min 0.83, max 1.25, rows > 1: 1/2" in out
    # the noise floor: p2p_gloo's runs of a row against each other (world 4: 4000 / 2000; world 8: 10000 / 8000)
    assert "- p2p_gloo against itself (its slowest / fastest run of a row, 2 rows with more than one run): " \
           "median 1.62, max 2.00" in out
    assert "- #wrong summed over all runs: 0" in out
    assert out[-1] == ("- load average (1 min) at the start and end of each run: 1.5-4.0 (w4_s1M_r0 1.5/2.5, "
                       "w4_s1M_r1 3.0/4.0, w8_s1M_r0_gloo 1.5/2.5, w8_s1M_r0_split 1.5/2.5)")


def test_table_counts_wrong_elements_of_every_run(bt, tmp_path, capsys):
    _write(tmp_path / "w8_s1M_r0_gloo.json", 8, [_row("p2p_gloo", 10000), _row("relay_gloo", 9000, wrong=3)])
    _write(tmp_path / "w8_s1M_r0_split.json", 8, [_row("p2p_gloo", 8000, wrong=2), _row("relay_split", 10000)])
    assert bt.table(types.SimpleNamespace(dir=str(tmp_path))) == 1
    assert "- #wrong summed over all runs: 5" in capsys.readouterr().out
