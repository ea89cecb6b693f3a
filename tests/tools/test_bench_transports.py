"""perf/bench_transports.py: which runs a sweep starts (three methods at once, or two pairs where
they do not fit in memory) and how ``table`` turns the runs' JSON into perf/README.md 6b's rows."""

from __future__ import annotations

import importlib.util
import json
import os
import types

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # tests/


@pytest.fixture(scope="module")
def bt():
    spec = importlib.util.spec_from_file_location(
        "bench_transports", os.path.join(HERE, "..", "perf", "bench_transports.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _row(method, time_us, op="weight_sync", size=1048576, workload="zipf:2", wrong=0):
    return {
        "op": op,
        "method": method,
        "size": size,
        "workload": workload,
        "time_us": time_us,
        "wrong": wrong,
        "replicas": 6,
        "moved_bytes": 6 * size,
        "choice": f"direct, 1 chunk(s) of {size} B" if method != "p2p_gloo" else None,
        "cross_bytes": 3 * size if method == "relay_split" else None,
    }


def _write(path, world, rows, load=(1.5, 2.5)):
    path.write_text(
        json.dumps({"world": world, "rows": rows, "loadavg": {"before": [load[0], 0, 0], "after": [load[1], 0, 0]}})
    )


def test_run_starts_pairs_only_for_the_listed_cases(bt, tmp_path, monkeypatch):
    started, rounds = [], []

    def fake_run(cmd, **kw):
        started.append((cmd[cmd.index("--methods") + 1], os.path.basename(cmd[cmd.index("--json") + 1]), cmd[4]))
        rounds.append(cmd[cmd.index("--iters") + 1])
        return types.SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(bt.subprocess, "run", fake_run)
    args = types.SimpleNamespace(
        out=str(tmp_path), reps=1, worlds=[4, 8], sizes=["1M", "32M"], iters=3, pairs=["8:32M"], rounds={"1M": 5}
    )
    assert bt.run(args) == 0
    three = "p2p_gloo,relay_gloo,relay_split"
    assert started == [
        (three, "w4_s1M_r0.json", "--nproc-per-node=4"),
        (three, "w4_s32M_r0.json", "--nproc-per-node=4"),
        (three, "w8_s1M_r0.json", "--nproc-per-node=8"),
        ("p2p_gloo,relay_gloo", "w8_s32M_r0_gloo.json", "--nproc-per-node=8"),
        ("p2p_gloo,relay_split", "w8_s32M_r0_split.json", "--nproc-per-node=8"),
    ]
    assert rounds == ["5", "3", "5", "3", "3"]  # --rounds by size, else --iters
    # a resumed sweep skips what exists: here one pair's file
    (tmp_path / "w8_s32M_r0_gloo.json").write_text("{}")
    for name in ("w4_s1M_r0.json", "w4_s32M_r0.json", "w8_s1M_r0.json"):
        (tmp_path / name).write_text("{}")
    started.clear()
    assert bt.run(args) == 0
    assert started == [("p2p_gloo,relay_split", "w8_s32M_r0_split.json", "--nproc-per-node=8")]


def test_table_rows_ratios_and_pairs(bt, tmp_path, capsys):
    # world 4: two runs of all three methods; the time is the median over runs (here the mean of two)
    _write(
        tmp_path / "w4_s1M_r0.json", 4, [_row("p2p_gloo", 2000), _row("relay_gloo", 1800), _row("relay_split", 3000)]
    )
    _write(
        tmp_path / "w4_s1M_r1.json",
        4,
        [_row("p2p_gloo", 4000), _row("relay_gloo", 4200), _row("relay_split", 2000)],
        load=(3.0, 4.0),
    )
    # world 8: one pair each; each ratio is to the p2p_gloo of its own run
    _write(tmp_path / "w8_s1M_r0_gloo.json", 8, [_row("p2p_gloo", 10000), _row("relay_gloo", 9000)])
    _write(tmp_path / "w8_s1M_r0_split.json", 8, [_row("p2p_gloo", 8000), _row("relay_split", 10000)])
    assert bt.table(types.SimpleNamespace(dir=str(tmp_path))) == 0
    out = capsys.readouterr().out.splitlines()
    # runs without per-round times (older JSON): the ratio of the medians, no verdict
    assert out[2] == (
        "| weight_sync | 4 | 1048576 | zipf:2 | 6 | 2 x ? | 3.00 | 3.00 | 1.00 (medians) | - | "
        "direct, 1 chunk(s) of 1048576 B | 2.50 | 0.83 (medians) | - | direct, 1 chunk(s) of 1048576 B | "
        "3145728 of 6291456 |"
    )
    assert out[3] == (
        "| weight_sync | 8 | 1048576 | zipf:2 | 6 | 1+1 x ? (pairs) | 10.00 / 8.00 | 9.00 | 0.90 (medians) | "
        "- | direct, 1 chunk(s) of 1048576 B | 10.00 | 1.25 (medians) | - | direct, 1 chunk(s) of 1048576 B | "
        "3145728 of 6291456 |"
    )
    said = "(the median of its per-round ratios; the ratio of the medians where a run kept no per-round times)"
    assert f"- relay_gloo/p2p_gloo per row {said}: median 0.95, min 0.90, max 1.00, rows > 1: 0/2" in out
    assert f"- relay_split/p2p_gloo per row {said}: median 1.04, min 0.83, max 1.25, rows > 1: 1/2" in out
    # the noise floor: p2p_gloo's runs of a row against each other (world 4: 4000 / 2000; world 8: 10000 / 8000)
    assert (
        "- p2p_gloo against itself (its slowest / fastest run of a row, 2 rows with more than one run): "
        "median 1.62, max 2.00" in out
    )
    assert "- #wrong summed over all runs: 0" in out
    assert out[-1] == (
        "- load average (1 min) at the start and end of each run: 1.5-4.0 (w4_s1M_r0 1.5/2.5, "
        "w4_s1M_r1 3.0/4.0, w8_s1M_r0_gloo 1.5/2.5, w8_s1M_r0_split 1.5/2.5)"
    )


def test_table_counts_wrong_elements_of_every_run(bt, tmp_path, capsys):
    _write(tmp_path / "w8_s1M_r0_gloo.json", 8, [_row("p2p_gloo", 10000), _row("relay_gloo", 9000, wrong=3)])
    _write(tmp_path / "w8_s1M_r0_split.json", 8, [_row("p2p_gloo", 8000, wrong=2), _row("relay_split", 10000)])
    assert bt.table(types.SimpleNamespace(dir=str(tmp_path))) == 1
    assert "- #wrong summed over all runs: 5" in capsys.readouterr().out


def _timed(method, times, **kw):
    r = _row(method, sorted(times)[len(times) // 2], **kw)
    r["times_us"] = list(times)
    return r


def test_table_pairs_rounds_and_gives_verdicts(bt, tmp_path, capsys):
    """Per-round ratios pooled over runs: the load swings 4x between rounds, relay_gloo is 10% faster
    in every round (faster, however the medians fall), relay_split equal up to +-5% alternating (same);
    a second row with relay_split 20% slower in every round (slower)."""
    load = [1.0, 4.0, 2.0, 3.0, 1.5, 2.5, 3.5, 1.2, 2.2, 3.2]
    base = [1000 * x for x in load]
    for rep in (0, 1):
        _write(
            tmp_path / f"w4_s1M_r{rep}.json",
            4,
            [
                _timed("p2p_gloo", base),
                _timed("relay_gloo", [0.9 * b for b in base]),
                _timed("relay_split", [b * (1.05 if i % 2 else 0.95) for i, b in enumerate(base)]),
                _timed("p2p_gloo", base, workload="zipf:3"),
                _timed("relay_gloo", base, workload="zipf:3"),
                _timed("relay_split", [1.2 * b for b in base], workload="zipf:3"),
            ],
        )
    assert bt.table(types.SimpleNamespace(dir=str(tmp_path))) == 0
    out = capsys.readouterr().out.splitlines()
    # 20 rounds: the sign test's 95% interval is the 6th to 15th ratio
    assert "| 2 x 10 | " in out[2] and "| 0.90 [0.90, 0.90] | faster |" in out[2], out[2]
    assert "| 1.00 [0.95, 1.05] | same |" in out[2], out[2]
    assert "| 1.00 [1.00, 1.00] | same |" in out[3] and "| 1.20 [1.20, 1.20] | slower |" in out[3], out[3]
    assert any(line.endswith("verdicts at 95%: faster 1, same 1") for line in out if "relay_gloo/" in line)
    assert any(line.endswith("verdicts at 95%: same 1, slower 1") for line in out if "relay_split/" in line)


def test_table_says_which_rows_a_stopped_sweep_left_partial(bt, tmp_path, capsys):
    # world 8 x 32 MiB: the relay_gloo pair ran, the relay_split pair never did
    _write(tmp_path / "w8_s32M_r0_gloo.json", 8, [_row("p2p_gloo", 10000), _row("relay_gloo", 9000)])
    assert bt.table(types.SimpleNamespace(dir=str(tmp_path))) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[2] == "| weight_sync | 8 | 1048576 | zipf:2 | (a partial run: not every method measured) |"
