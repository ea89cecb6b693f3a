"""The main job's bandwidth test runs end to end (small sizes) and verifies every byte."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest


@pytest.mark.slow
def test_bench_small(tmp_path):
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        "-m",
        "ultracomm.tools.bench",
        "all",
        "--min-bytes",
        "64K",
        "--max-bytes",
        "256K",
        "--factor",
        "4",
        "--iters",
        "2",
        "--warmup",
        "1",
        "--chunk-bytes",
        "32K",
        "--grad-dtype",
        "bf16",
        "--json",
        str(out),
    ]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "2"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "#wrong" in p.stdout
    rec = json.loads(out.read_text())
    assert rec["world"] == 2
    rows = rec["rows"]
    # 2 ops x 2 sizes x (a2a_shm, a2a_gloo, p2p_gloo, direct, relay, relay_gloo, relay_split)
    assert len(rows) == 28
    assert {r["method"] for r in rows} == {
        "a2a_shm",
        "a2a_gloo",
        "p2p_gloo",
        "direct",
        "relay",
        "relay_gloo",
        "relay_split",
    }
    assert {r["transport"] for r in rows if r["method"].endswith("gloo")} == {"gloo (TCP loopback)"}
    assert {r["transport"] for r in rows if r["method"] == "relay_split"} == {
        "shared memory within a domain + gloo across"
    }
    assert {r["transport"] for r in rows if not r["method"].endswith(("gloo", "split"))} == {"shared memory"}
    # 2 ranks in two domains: every replica byte crosses over gloo
    assert all(r["cross_bytes"] == r["moved_bytes"] > 0 for r in rows if r["method"] == "relay_split")
    assert all(r["cross_bytes"] is None for r in rows if r["method"] != "relay_split")
    # every method moves bf16 weights and, here, bf16 grads: the same bytes per expert in both ops
    assert {r["grad_dtype"] for r in rows} == {"bf16"}
    assert sorted(r["size"] for r in rows if r["op"] == "grad_reduce") == sorted(
        r["size"] for r in rows if r["op"] == "weight_sync"
    )
    for row in rows:
        assert row["wrong"] == 0
        assert row["time_us"] > 0 and row["p90_us"] >= row["time_us"]
        assert row["lb_ratio"] >= 1.0 - 1e-9
        assert set(row) >= {"op", "method", "size", "replicas", "algbw_GBps", "busbw_GBps", "cpbw_GBps", "depth"}
    assert {r["op"] for r in rows} == {"weight_sync", "grad_reduce"}


@pytest.mark.slow
def test_bench_zipf_workloads_and_plot(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "ultracomm.tools.bench",
        "weight_sync",
        "--workload",
        "zipf:1.5,2",
        "--experts-per-rank",
        "4",
        "--top-k",
        "2",
        "--min-bytes",
        "64K",
        "--max-bytes",
        "64K",
        "--iters",
        "2",
        "--chunk-bytes",
        "16K",
        "--methods",
        "a2a,relay",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "1"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert [(r["workload"], r["method"]) for r in rows] == [
        ("zipf:1.5", "a2a_gloo"),
        ("zipf:1.5", "relay"),
        ("zipf:2", "a2a_gloo"),
        ("zipf:2", "relay"),
    ]
    assert all(r["wrong"] == 0 for r in rows)
    assert abs(rows[0]["imbalance"] - 1.5) < 0.05 and abs(rows[2]["imbalance"] - 2.0) < 0.05
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow
def test_bench_interleaved_methods_check_every_byte(tmp_path):
    """--interleave: every method set up at once and timed round-robin; each still verified (#wrong),
    each with its own iterations, grads and choice."""
    out = tmp_path / "bench.json"
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=4",
        "-m",
        "ultracomm.tools.bench",
        "all",
        "--workload",
        "zipf:3",
        "--experts-per-rank",
        "4",
        "--top-k",
        "2",
        "--min-bytes",
        "64K",
        "--max-bytes",
        "64K",
        "--iters",
        "3",
        "--interleave",
        "--methods",
        "p2p_gloo,relay_gloo,relay_split",
        "--json",
        str(out),
    ]
    p = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "2"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "methods interleaved per iteration" in p.stdout and "# load average (1 min) " in p.stdout
    rec = json.loads(out.read_text())
    assert [len(rec["loadavg"][k]) for k in ("before", "after")] == [3, 3]
    rows = rec["rows"]
    assert [(r["op"], r["method"]) for r in rows] == [
        (op, m) for op in ("weight_sync", "grad_reduce") for m in ("p2p_gloo", "relay_gloo", "relay_split")
    ]
    assert all(r["wrong"] == 0 and r["time_us"] > 0 for r in rows)
    assert all(r["choice"] for r in rows if r["method"] != "p2p_gloo")
    for r in rows:  # per iteration in round order, for paired ratios (ultracomm.tools.paired)
        assert len(r["times_us"]) == 3 and r["interleaved"] and r["time_us"] == sorted(r["times_us"])[1]
    for r in rows:  # the split transport's route (ultracomm.alpha_beta.split_route) and what it sent over gloo
        if r["method"] == "relay_split":
            route = r["choice"].split(":")[0]
            assert route in ("split", "messages"), r["choice"]
            if route == "messages":  # every edge a message
                assert r["cross_bytes"] == r["moved_bytes"], r
            else:
                assert 0 < r["cross_bytes"] < r["moved_bytes"], r
    # 64 KiB experts: shared memory cannot pay for itself in a multicast, so the messages route is taken
    assert [r["choice"].split(":")[0] for r in rows if r["method"] == "relay_split"][0] == "messages"


def test_interleaved_rounds_take_every_order():
    """Every permutation in turn: each method in each place, and right after each other method, equally often."""
    import collections
    import itertools

    from ultracomm.tools.bench import round_order

    m = ["p2p_gloo", "relay_gloo", "relay_split"]
    rounds = [round_order(m, i) for i in range(12)]
    assert rounds[:6] == [list(p) for p in itertools.permutations(m)] and rounds[6:] == rounds[:6]
    seq = [x for r in rounds[:6] for x in r]  # the run as it goes, round after round
    after = collections.Counter(zip(seq, seq[1:] + seq[:1]))
    assert all(after[(a, b)] == after[(b, a)] for a in m for b in m if a != b)
    assert {x: [r.index(x) for r in rounds[:6]].count(0) for x in m} == {x: 2 for x in m}
    assert round_order(["a", "b"], 0) == ["a", "b"] and round_order(["a", "b"], 1) == ["b", "a"]
    assert round_order([], 3) == []


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_bench_args() -> list[str]:
    """The arguments of README.md's ``torchrun ... -m ultracomm.tools.bench`` line (Measuring)."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    (line,) = [ln for ln in text.splitlines() if ln.startswith("torchrun --nproc-per-node 4 -m ultracomm.tools.bench")]
    return line.split("-m ultracomm.tools.bench", 1)[1].split()


@pytest.mark.slow
def test_readme_bench_command_runs(tmp_path):
    """README's command as written (its workloads, experts and top-k), at a small size and one method."""
    args = readme_bench_args()
    args[args.index("--plot") + 1] = str(tmp_path / "bench.png")
    small = ["--min-bytes", "64K", "--max-bytes", "64K", "--iters", "1", "--warmup", "0", "--methods", "relay"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m"]
    cmd += ["ultracomm.tools.bench", *args, *small, "--json", str(tmp_path / "bench.json")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "ULTRACOMM_NUM_WORKERS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env=env)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert sorted({r["workload"] for r in rows}) == ["zipf:1.5", "zipf:2", "zipf:3"]
    assert all(r["wrong"] == 0 for r in rows)


@pytest.mark.slow
def test_unreachable_workload_is_a_usage_error():
    """Default experts (2 per rank) and top-k (8) at world 4 give no skew: refused, naming the options."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=4", "-m"]
    cmd += ["ultracomm.tools.bench", "weight_sync", "--workload", "zipf:1.5"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=240, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert p.returncode != 0
    assert "error: --workload zipf:1.5: target_imbalance 1.5 is not reachable" in p.stderr, p.stderr[-3000:]
    assert "more --experts-per-rank or a lower --top-k" in p.stderr
