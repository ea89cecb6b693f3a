"""perf/bench_gpu.py without a GPU: its arithmetic, its profile (schema-valid), its CPU exit, and
scripts/gpu_check.sh's structure.  The measurements themselves need a device (gpu_check.sh runs them)."""

from __future__ import annotations

import ctypes
import inspect
import json
import os
import re
import subprocess
import sys

import numpy as np
import perf_modules
import pytest

from ultracomm.cuda.hwprofile import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def load_bench():
    return perf_modules.load("bench_gpu", fresh=True)


bg = load_bench()
Row = bg.Row
MiB = 1 << 20


def test_rates_count_the_documented_bytes():
    r = Row("fanout", "1->4", "tile mover", 64 * MiB, 1e-3, 4 * 64 * MiB, 5 * 64 * MiB, 0)
    assert r.algbw == 4 * 64 * MiB / 1e-3 and r.busbw == 5 * 64 * MiB / 1e-3
    assert Row("x", "-", "-", 0, None, 0, 0, None).algbw is None
    d = Row("sweep", "2 CTAs", "tile mover", 8, 2.0, 8, 16, 0, "n", dict(ctas=2)).to_dict()
    assert d["ctas"] == 2 and d["algbw"] == 4.0 and d["busbw"] == 8.0 and d["payload_bytes"] == 8
    assert d["algbw_per_cta"] == 2.0
    relay = Row("relay", "D=2 chunk=128K stream", "tile mover", 8, 2.0, 16, 32, 0, "", dict(ctas=2, senders=2))
    assert relay.algbw_per_cta == 2.0 and Row("copy", "1->1", "cudaMemcpyAsync", 8, 2.0, 8, 16, 0).algbw_per_cta is None


def test_table_columns():
    rows = [
        Row("copy", "1->1", "cudaMemcpyAsync", 256 * MiB, 250e-6, 256 * MiB, 512 * MiB, 0),
        Row("copy", "1->1", "tile mover", 1 << 30, None, 0, 0, None, "not measured: no _cuda"),
    ]
    lines = bg.format_table(rows).splitlines()
    assert lines[0].split() == [
        "size",
        "case",
        "impl",
        "time(us)",
        "algbw(GB/s)",
        "busbw(GB/s)",
        "GB/s/CTA",
        "#wrong",
        "note",
    ]
    assert lines[2].split() == ["256M", "1->1", "cudaMemcpyAsync", "250.00", "1073.7", "2147.5", "-", "0"]
    assert lines[3].split()[:8] == ["1G", "1->1", "tile", "mover", "-", "-", "-", "-"]
    swept = Row("sweep", "16 CTAs", "tile mover", 256 * MiB, 250e-6, 256 * MiB, 512 * MiB, 0, "", dict(ctas=16))
    assert bg.format_table([swept]).splitlines()[2].split() == [
        "256M",
        "16",
        "CTAs",
        "tile",
        "mover",
        "250.00",
        "1073.7",
        "2147.5",
        "67.1",
        "0",
    ]
    assert lines[3].endswith("not measured: no _cuda")


def test_linear_fit_and_hop_costs():
    assert bg.linear_fit([1, 2, 3], [3, 5, 7]) == pytest.approx((1.0, 2.0))
    with pytest.raises(ValueError, match="two distinct"):
        bg.linear_fit([1, 1], [1, 2])
    # per-hop cost 2 us + chunk / 100 GB/s, launch 5 us
    fill = {c: {d: 5e-6 + d * (2e-6 + c / 100e9) for d in (1, 2, 3, 4)} for c in (32768, 1 << 20, 4 << 20)}
    per_hop, overhead, hop_bw = bg.hop_costs(fill)
    assert [c for c, _ in per_hop] == [32768, 1 << 20, 4 << 20]
    assert per_hop[1][1] == pytest.approx(2e-6 + (1 << 20) / 100e9)
    assert overhead == pytest.approx(2e-6) and hop_bw == pytest.approx(100e9)
    assert bg.hop_costs({32768: {1: 1e-6}}) == ([], None, None)


def rows_for_profile():
    r = []
    r.append(Row("launch", "floor", "empty kernel", 0, 2.5e-6, 0, 0, 0))
    r.append(Row("flag", "rtt", "release/acquire", 8, 1.5e-6, 0, 0, 0))
    r.append(Row("copy", "1->1", "cudaMemcpyAsync", 1 << 30, (1 << 30) / 2e12, 1 << 30, 2 << 30, 0))
    r.append(Row("copy", "1->1", "cudaMemcpyAsync", MiB, MiB / 1e12, MiB, 2 * MiB, 0))
    r.append(Row("sweep", "1->1", "cudaMemcpyAsync", 256 * MiB, 256 * MiB / 2e12, 256 * MiB, 512 * MiB, 0))
    for ctas, bw in ((1, 90e9), (8, 700e9), (16, 1.85e12), (32, 1.95e12)):
        r.append(
            Row(
                "sweep",
                f"{ctas} CTAs",
                "tile mover",
                256 * MiB,
                256 * MiB / bw,
                256 * MiB,
                512 * MiB,
                0,
                extra=dict(ctas=ctas),
            )
        )
    for k in (2, 8):
        n = 64 * MiB
        r.append(
            Row("reduce", f"k={k} fp32", "torch.sum", n, n / 1.0e12, n, (k + 2) * n, 0, extra=dict(k=k, dtype="fp32"))
        )
        r.append(
            Row(
                "reduce",
                f"k={k} fp32",
                "tile mover",
                n,
                n / 0.9e12,
                n,
                (k + 2) * n,
                0,
                extra=dict(k=k, dtype="fp32", ctas=23),
            )
        )
    r.append(
        Row(
            "reduce",
            "k=2 fp32-1cta",
            "tile mover",
            4 * MiB,
            4 * MiB / 50e9,
            4 * MiB,
            16 * MiB,
            0,
            extra=dict(k=2, dtype="fp32-1cta", ctas=1),
        )
    )
    for c in (32768, 1 << 20):
        for d in (1, 2, 3):
            r.append(
                Row(
                    "relay",
                    f"D={d}",
                    "tile mover",
                    c,
                    4e-6 + d * (3e-6 + c / 200e9),
                    d * c,
                    2 * d * c,
                    0,
                    extra=dict(mode="fill", depth=d, chunk=c, chain=True),
                )
            )
        # a tree that is not a chain must not enter the fit
        r.append(
            Row(
                "relay",
                "D=4",
                "tile mover",
                c,
                1.0,
                4 * c,
                8 * c,
                0,
                extra=dict(mode="fill", depth=4, chunk=c, chain=False),
            )
        )
    return r


DEVICE = dict(name="NVIDIA H200", cc="9.0", sms=132, torch="2.11.0+cu130", cuda="13.0")


def test_profile_from_rows_is_schema_valid():
    prof = bg.build_profile(rows_for_profile(), DEVICE, "2025-12-01T00:00:00Z")
    p = validate(prof)
    assert p.d2d_copy_bw == pytest.approx(2e12)  # the largest copy row
    assert p.per_sm_copy_bw == pytest.approx(90e9) and p.per_sm_reduce_bw == pytest.approx(50e9)
    assert [c for c, _ in p.sm_sweep] == [1, 8, 16, 32]
    assert p.reduce_bw == pytest.approx(0.9e12) and p.torch_reduce_bw == pytest.approx(1.0e12)
    assert (p.flag_rtt_s, p.launch_s) == (1.5e-6, 2.5e-6)
    assert p.chunk_overhead_s == pytest.approx(3e-6) and p.hop_bw == pytest.approx(200e9)
    empty = bg.build_profile([Row("copy", "1->1", "cudaMemcpyAsync", MiB, 1e-6, MiB, 2 * MiB, 0)], DEVICE, "d")
    q = validate(empty)
    assert q.sm_sweep == () and q.per_sm_copy_bw is None and q.relay_hop_s == () and q.flag_rtt_s is None


def test_goal_lines():
    lines = bg.goal_lines(rows_for_profile())
    assert lines[0] == (
        "goal copy: tile mover 1850.0 GB/s with 16 CTAs = 92.5% of cudaMemcpyAsync D2D 2000.0 GB/s "
        "at 256M (goal >= 90% with <= 16): PASS"
    )
    assert (
        lines[1]
        == "goal reduce: worst k=2 fp32 at 90.0% of torch.sum's bandwidth (goal >= 85% for every case at 64M): PASS"
    )
    assert bg.goal_lines([]) == [
        "goal copy: not measured (sweep rows missing)",
        "goal reduce: not measured (reduce rows missing)",
    ]


def test_ordered_sum_is_sequential_fp32():
    import torch

    rows = torch.tensor([[1.0, 2.0**24], [2.0**-30, 1.0], [-1.0, 1.0]], dtype=torch.float32)
    want = torch.tensor([0.0, 2.0**24], dtype=torch.float32)  # fp32, in order: 1 + 2^-30 = 1; 2^24 + 1 = 2^24
    assert torch.equal(bg.ordered_sum(torch, rows), want)
    half = rows.to(torch.float16)[:, :1]  # fp16 rows: accumulate in fp32, round once at the end
    assert torch.equal(bg.ordered_sum(torch, half), ((half[0].float() + half[1].float()) + half[2].float()).half())


@pytest.mark.skipif(bg.unavailable_reason() is None, reason="this machine has a GPU")
def test_cpu_machine_exits_with_a_message():
    p = subprocess.run(
        [sys.executable, os.path.join(ROOT, "perf", "bench_gpu.py"), "--quick"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 2
    assert p.stderr.startswith("bench_gpu: nothing measured: ") and "Traceback" not in p.stderr
    assert p.stdout == ""


def test_unknown_section_is_refused():
    with pytest.raises(SystemExit):
        bg.main(["--only", "copy,teleport"])


def test_gpu_check_script_structure():
    path = os.path.join(ROOT, "scripts", "gpu_check.sh")
    assert subprocess.run(["bash", "-n", path]).returncode == 0
    text = open(path).read()
    assert "set -uo pipefail" in text
    assert int(re.search(r"DEADLINE=\$\(\(SECONDS \+ (\d+)\)\)", text).group(1)) <= 480  # under 8 minutes
    assert re.search(r"step build-pip \d+ .*pip install .*--no-build-isolation", text)
    assert re.search(r"step build-inplace \d+ .*scripts/build_inplace\.py", text)  # the fallback build
    # a pip build without _cuda is uninstalled first: its editable import hook precedes PYTHONPATH
    assert text.index("pip uninstall -y ultracomm") < text.index("step build-inplace")
    assert re.search(r"step gpu-tests \d+ .*-m pytest tests .*-m gpu", text)
    assert re.search(r"step bench-gpu \d+ .*perf/bench_gpu\.py --out \"\$OUT\"", text)
    bench = re.search(r"step bench-gpu .*", text).group(0)
    assert "--only" not in bench and "lb_prefetch" in bg.SECTIONS  # every section runs, issue 37's lb_prefetch too
    outside = re.sub(r"step\(\) \{.*?\n\}", "", text, flags=re.S)
    assert not re.search(r"(^|[;&|(]\s*)timeout\s", outside, re.M), (
        "every timed command goes through step (the deadline)"
    )


def _step_function() -> str:
    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    return re.search(r"step\(\) \{.*?\n\}", text, re.S).group(0)


@pytest.mark.parametrize(
    "left, cap, cmd, want_rc, want",
    [
        (100, 30, "true", 0, ["gpu_check: demo (timeout 30s)", "gpu_check: demo rc=0 in 0s"]),  # the step's own cap
        (20, 30, "exit 3", 3, ["gpu_check: demo (timeout 20s)", "gpu_check: demo rc=3 in 0s"]),  # cut to the time left
        (5, 30, "true", 124, ["gpu_check: demo skipped: out of time"]),
    ],
)
def test_gpu_check_step_respects_the_deadline(left, cap, cmd, want_rc, want):
    script = f"exec 3>&1\nDEADLINE=$((SECONDS + {left}))\n{_step_function()}\nstep demo {cap} bash -c '{cmd}'"
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=30)
    # bash's SECONDS counts whole seconds: a command of a few ms reports 1 s when it straddles a
    # second boundary (it did on a loaded machine), so the duration is read as 0 or 1
    got = [re.sub(r" in [01]s$", " in 0s", line) for line in p.stdout.splitlines()]
    assert (p.returncode, got) == (want_rc, want)


def test_gpu_check_step_interrupts_then_kills_at_its_timeout():
    """SIGINT first (pytest writes its XML, Python prints where it was), SIGKILL 10 s later.  (python3 -S: no site
    packages to import, so a loaded machine cannot stretch its start past the 1 s step.)"""
    script = (
        f"exec 3>&1\nDEADLINE=$((SECONDS + 100))\n{_step_function()}\n"
        "step demo 1 python3 -S -c 'import time\ntry:\n time.sleep(30)\nexcept KeyboardInterrupt:\n print(\"interrupted\")\n raise'"
    )
    p = subprocess.run(["bash", "-c", script], capture_output=True, text=True, timeout=60)
    lines = p.stdout.splitlines()
    assert lines[:2] == ["gpu_check: demo (timeout 1s)", "interrupted"] and p.returncode == 124, p.stdout + p.stderr


# ----------------------------------------------------------------------------- the copy_engine row


def test_copy_engine_row_counts_bytes_and_compares_with_the_tile_mover():
    tile = Row(
        "fanout", "1->4", "tile mover", 64 * MiB, 1e-3, 4 * 64 * MiB, 5 * 64 * MiB, 0, "20 CTAs/rank", dict(ctas=20)
    )
    rows = [Row("fanout", "1->4", "4 x cudaMemcpyAsync", 64 * MiB, 1e-3, 4 * 64 * MiB, 8 * 64 * MiB, 0), tile]
    assert bg.tile_row(rows, 4, 64 * MiB) is tile
    assert bg.tile_row(rows, 4, MiB) is None and bg.tile_row(rows, 2, 64 * MiB) is None
    r = bg.copy_engine_row("1->4", 4, 64 * MiB, 2e-3, 0, "cpu-bound", tile)
    assert (r.section, r.case, r.impl, r.size) == ("copy_engine", "1->4", "copy engine", 64 * MiB)
    assert r.payload == 4 * 64 * MiB and r.traffic == 2 * 4 * 64 * MiB  # each copy reads the source
    assert r.algbw == 4 * 64 * MiB / 2e-3 and r.busbw == 8 * 64 * MiB / 2e-3
    assert r.note == "4 CTAs (gate kernels), cpu-bound, 50.0% of tile mover" and r.extra["sms"] == 4
    d = r.to_dict()
    assert (d["sms"], d["destinations"], d["vs_tile_mover"], d["wrong"]) == (4, 4, 0.5, 0)
    missing = bg.copy_engine_row("1->1", 1, MiB, None, None, "not measured: no libcuda")
    assert missing.algbw is None and missing.note == "not measured: no libcuda"
    assert "vs_tile_mover" not in missing.to_dict()


def test_copy_engine_rows_in_the_table_and_the_json_record():
    rows = [Row("copy", "1->1", "tile mover", 256 * MiB, 200e-6, 256 * MiB, 512 * MiB, 0, "16 CTAs/rank")]
    rows.append(bg.copy_engine_row("1->1", 1, 256 * MiB, 400e-6, 3, "", bg.tile_row(rows, 1, 256 * MiB)))
    lines = bg.format_table([r for r in rows if r.section == "copy_engine"]).splitlines()
    assert lines[2].split()[:9] == ["256M", "1->1", "copy", "engine", "400.00", "671.1", "1342.2", "-", "3"]
    assert lines[2].endswith("1 CTA (gate kernels), 50.0% of tile mover")
    rec = bg.results_record(DEVICE, "2026-12-01T00:00:00Z", False, bg.SECTIONS, rows, [])
    assert json.loads(json.dumps(rec)) == rec  # plain JSON
    ce = [x for x in rec["rows"] if x["section"] == "copy_engine"]
    assert len(ce) == 1 and ce[0]["payload_bytes"] == 256 * MiB and ce[0]["traffic_bytes"] == 512 * MiB
    assert ce[0]["wrong"] == 3 and ce[0]["impl"] == "copy engine" and rec["sections"][-1] == "copy_engine"
    assert bg.wrong_total(rows) == 3
    informational = Row("reduce", "k=2 fp32", "torch.sum", 4, 1.0, 4, 16, 7, "informational #wrong: torch's order")
    assert bg.wrong_total(rows + [informational]) == 3


def stub_gpu(**kw):
    """A Gpu without a device: its bookkeeping only."""
    g = object.__new__(bg.Gpu)
    g.rows, g.errors, g.poisoned, g.kept, g.deadline, g.reserve_s = [], [], None, [], None, 0.0
    g.lb_reserve_s = 0.0
    g.__dict__.update(kw)
    return g


def test_budget_keeps_time_for_copy_engine_and_a_poisoned_device_skips_sections():
    import time

    g = stub_gpu(deadline=time.monotonic() + 20.0, reserve_s=30.0)
    assert g.late("relay", "D=1") and not g.late("copy_engine", "1->1 1M", reserve=False)
    assert [(r.section, r.case, r.time_s, r.note) for r in g.rows] == [
        ("relay", "D=1", None, "not measured: out of time (--budget-s)")
    ]
    assert not stub_gpu().late("relay")  # no budget
    g = stub_gpu(poisoned="a copy_engine operation failed earlier and left its streams blocked")
    g.section("copy_engine", lambda: pytest.fail("a section ran on a poisoned device"))
    assert g.rows[0].note == "not measured: a copy_engine operation failed earlier and left its streams blocked"


def test_only_copy_engine_and_a_budget_are_accepted():
    if bg.unavailable_reason() is None:
        pytest.skip("this machine has a GPU: main would measure")
    assert bg.main(["--only", "copy_engine", "--budget-s", "60"]) == 2


class RunningDriver:
    """Executes each driver call at once on host memory; a stream wait must already hold when it is
    enqueued (a loopback set is submitted in an order that runs on one queue)."""

    def __init__(self):
        self.handles, self.calls = iter(range(0x100, 1 << 20)), 0

    def bind(self, device):
        pass

    def stream_create(self, priority=0):
        return next(self.handles)

    def stream_destroy(self, stream):
        pass

    def memcpy(self, dst, src, nbytes, stream):
        self.calls += 1
        ctypes.memmove(dst, src, nbytes)

    def write_value(self, stream, addr, value):
        ctypes.c_uint64.from_address(addr).value = value

    def wait_value(self, stream, addr, value, equal=False):
        from ultracomm.transports.copy_engine.plan import geq

        v = ctypes.c_uint64.from_address(addr).value
        assert v == value if equal else geq(v, value), "a stream wait enqueued before its flag was raised"

    def function(self, ptx, name):
        return 0xF00

    def launch(self, function, threads, stream, args):
        """A gate kernel (ultracomm.transports.copy_engine.gate.descriptor), on the host: its waits
        must already hold, then its copies and flag writes run (the epoch word is args[1])."""
        words = lambda at, n: list((ctypes.c_uint64 * n).from_address(at))  # noqa: E731
        base, epoch = args[0].value, args[1].value
        n_wait, n_copy, n_write, _ = words(base, 4)
        at = base + 32
        value = lambda v: epoch if v == (1 << 64) - 1 else v  # noqa: E731
        for addr, v, eq in (words(at + 24 * i, 3) for i in range(n_wait)):
            self.wait_value(stream, addr, value(v), equal=bool(eq))
        at += 24 * n_wait
        for dst, src, nbytes in (words(at + 24 * i, 3) for i in range(n_copy)):
            self.memcpy(dst, src, nbytes, stream)
        at += 24 * n_copy
        for addr, v in (words(at + 16 * i, 2) for i in range(n_write)):
            self.write_value(stream, addr, value(v))


@pytest.fixture
def host_copy_engine(monkeypatch):
    """The copy_engine transport and torch.cuda's streams and events, on host memory."""
    import contextlib
    import types

    import torch

    import ultracomm.transports.copy_engine as ce

    drv = RunningDriver()
    stream = types.SimpleNamespace(cuda_stream=0x77, synchronize=lambda: None, wait_event=lambda ev: None)
    event = lambda *a, **k: types.SimpleNamespace(record=lambda s=None: None, query=lambda: True)  # noqa: E731
    monkeypatch.setattr(ce, "require", lambda *a, **k: None)
    monkeypatch.setattr(ce, "driver", lambda: drv)
    monkeypatch.setattr(ce, "pinned_words", lambda n: torch.zeros(n, dtype=torch.int64))
    monkeypatch.setattr(torch.cuda, "Event", event)
    monkeypatch.setattr(
        torch.cuda,
        "ExternalStream",
        lambda h, device=None: types.SimpleNamespace(cuda_stream=h, wait_event=lambda ev: None),
    )
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda device=None: stream)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return drv


@pytest.mark.parametrize("n", [1, 3])
def test_copy_engine_loopback_domain_multicasts_bit_exact_on_host_memory(host_copy_engine, n):
    """The bench's copy_engine domain end to end on the CPU: one transport per rank, the last rank's
    call enqueues the set, every replica gets the home's bytes, #wrong counts what differs."""
    import torch

    import ultracomm

    g = stub_gpu(torch=torch, uc=ultracomm, dev=torch.device("cpu"))
    size = 3 * 4096 + 64  # several 4 KiB chunks and a tail, fp32
    d = bg.Loopback(g, n + 1, bg.one_expert(n), size, torch.float32, chunk_bytes=4096, transport="copy_engine")
    assert d.lb is None and len(d.ce) == n + 1 and d.ctas == 0
    d.fill_replicas(bg.SENTINEL)
    assert d.multicast_wrong() == n * size  # nothing moved yet: every byte is the sentinel
    d.run("multicast")
    assert d.multicast_wrong() == 0 and host_copy_engine.calls >= n * 4
    d.slot(n, "weights").view(torch.uint8)[5] ^= 1  # one flipped byte is one wrong byte
    assert d.multicast_wrong() == 1
    d.run("multicast")  # the next epoch repairs it
    assert d.multicast_wrong() == 0 and d.epoch == 2
    with pytest.raises(ValueError, match="multicast only"):
        d.run("reduce")
    d.close()
    assert g.poisoned is None and d.ce == [] and d.windows == []


def test_a_failed_copy_engine_domain_poisons_the_device(host_copy_engine):
    import torch

    import ultracomm
    from ultracomm.errors import UltracommError

    g = stub_gpu(torch=torch, uc=ultracomm, dev=torch.device("cpu"))
    d = bg.Loopback(g, 2, bg.one_expert(1), 4096, torch.float32, chunk_bytes=4096, transport="copy_engine")
    windows = d.windows
    d.ce[1]._dog.fail(UltracommError("ultracomm: rank 1 weight_sync (multicast) epoch 1 timed out"))
    with pytest.raises(UltracommError, match="timed out"):
        d.check()
    d.close()
    assert g.poisoned and g.kept == [windows]  # blocked streams may still write into them


def test_gpu_check_leaves_few_files_and_packs_every_log(tmp_path):
    """Results stay a handful of files under $OUT (a remote machine may return only a few); every
    step's own output goes into logs.tar.gz, also when the script ends early."""
    import tarfile

    text = open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()
    top = set(re.findall(r'"\$OUT/([^"/$]+)"', text)) - {"logs"}  # the folder that is packed
    assert top == {"env.txt", "gpu-tests.xml", "gpu-tests.log", "bench_gpu.txt", "logs.tar.gz"}, top
    assert len(top) + 2 <= 8  # + bench_gpu.json and the profile, written by bench_gpu.py into $OUT
    assert "trap pack EXIT" in text and re.search(r'LOGS="\$OUT/logs"', text)
    pack = re.search(r"pack\(\) \{.*?\n\}", text, re.S).group(0)
    out = tmp_path / "out"
    (out / "logs").mkdir(parents=True)
    for i in range(12):
        (out / "logs" / f"step{i}.log").write_text(f"log {i}\n")
    (out / "env.txt").write_text("env\n")
    p = subprocess.run(
        ["bash", "-c", f'OUT="{out}"; LOGS="$OUT/logs"\n{pack}\ntrap pack EXIT\nexit 3'],
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert p.returncode == 3, p.stderr  # the script's own status survives the trap
    assert sorted(os.listdir(out)) == ["env.txt", "logs.tar.gz"]
    with tarfile.open(out / "logs.tar.gz") as tar:
        assert sorted(tar.getnames()) == ["logs", *sorted(f"logs/step{i}.log" for i in range(12))]
        assert tar.extractfile("logs/step7.log").read() == b"log 7\n"


# ----------------------------------------------------------------------------- graph-replayed rows (issue 33)


class FakeTorch:
    """torch.cuda's graph and event API on a fake clock: each replay of a graph advances the
    device clock by its captured calls x `per_call_s`; eager calls advance it by `eager_s`."""

    def __init__(self, per_call_s=2e-6, eager_s=10e-6):
        import types

        self.clock, self.capturing, self.replays, self.log = 0.0, None, 0, []
        fake = self

        class Graph:
            def __init__(self):
                self.calls = 0

            def replay(self):
                fake.replays += 1
                fake.clock += self.calls * per_call_s

        class Ctx:
            def __init__(self, g, stream=None):
                self.g = g

            def __enter__(self):
                fake.capturing = self.g

            def __exit__(self, *a):
                fake.capturing = None

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self):
                self.t = fake.clock

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3

        class Stream:
            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

        self.cuda = types.SimpleNamespace(
            CUDAGraph=Graph, graph=Ctx, Event=Event, Stream=Stream, current_stream=lambda *a: Stream()
        )
        self.eager_s = eager_s

    def call(self):
        if self.capturing is not None:
            self.capturing.calls += 1
            self.log.append("captured")
        else:
            self.clock += self.eager_s
            self.log.append("eager")


def test_graph_timer_captures_per_graph_calls_and_divides_by_replays():
    ft = FakeTorch(per_call_s=2e-6)
    timer = bg.Timer(ft, reps=5, trials=3)
    t = timer.graph(ft.call, per_graph=7, replays=4)
    assert t == pytest.approx(2e-6)  # device time per call, not per replay
    assert ft.log == ["eager"] + ["captured"] * 7  # once eagerly (setup, check), then captured
    assert ft.replays == 1 + 3 * 4  # one warm replay, then trials x replays


def test_control_shapes_cover_ep8_to_ep288():
    assert [(label, W) for label, W, _ in bg.CONTROL_SHAPES] == [("EP8", 8), ("EP16", 16), ("EP64", 64), ("EP288", 288)]
    assert all(label == f"EP{W}" and W * epr <= 1024 for label, W, epr in bg.CONTROL_SHAPES)
    assert [k for k, _ in bg.CONTROL_KERNELS] == ["exchange", "plan", "build", "reroute"]


def test_control_graph_rows_keep_the_eager_names_and_say_graph():
    times = dict(exchange=3e-6, plan=20e-6, build=10e-6, reroute=2e-6)
    times["exchange+plan+build+reroute"] = 40e-6
    wrong = dict(exchange=0, plan=0, build=1, reroute=0)
    wrong["exchange+plan+build+reroute"] = 1
    rows = bg.control_graph_rows("EP64", 256, times, wrong, dict(plan="probes 8"))
    assert [(r.section, r.case, r.impl) for r in rows] == [
        ("control", "EP64 exchange", "k_load_exchange"),
        ("control", "EP64 plan", "k_quota"),
        ("control", "EP64 build", "k_build_slot"),
        ("control", "EP64 reroute", "k_reroute"),
        ("control", "EP64 exchange+plan+build+reroute", "device step"),
        ("control", "EP64 exchange+plan+build+reroute", "device step, PDL"),
    ]
    assert all("graph replay" in r.note and r.extra["timing"] == "graph" for r in rows[:5])
    assert rows[1].note == "graph replay: 10 per graph x 20 replays, device time; probes 8"
    assert [r.time_s for r in rows] == [3e-6, 20e-6, 10e-6, 2e-6, 40e-6, None] and rows[2].wrong == 1
    d = rows[4].to_dict()
    assert d["timing"] == "graph" and d["per_graph"] == bg.CONTROL_PER_GRAPH and d["replays"] == bg.CONTROL_REPLAYS
    assert d["pdl"] is False and rows[5].extra["pdl"] is True
    # without a PDL time the PDL row says why (here: no note given)
    assert rows[5].note == "not measured (graph replay): no time" and rows[5].wrong is None
    # a kernel that could not be captured: its row says why, with no time and no #wrong
    rows = bg.control_graph_rows(
        "EP8", 256, dict(plan=1e-6), {}, dict(build="this _cuda build has no Runner.build_slot")
    )
    assert rows[2].time_s is None and rows[2].wrong is None
    assert rows[2].note == "not measured (graph replay): this _cuda build has no Runner.build_slot"
    assert "graph" in bg.format_table(rows)


def test_control_graph_row_with_pdl_beside_the_plain_step():
    """The step's graph with programmatic dependent launch (sm_90+) is a row of its own beside the
    plain step's: the same section and case, impl "device step, PDL", its note says graph replay
    and programmatic dependent launch; a device without it gets the row with the reason."""
    step = bg.CONTROL_STEP[0]
    times = {step: 40e-6, "pdl": 31e-6}
    rows = bg.control_graph_rows("EP8", 256, times, {step: 0, "pdl": 0})
    plain, pdl = rows[4], rows[5]
    assert (plain.section, plain.case, plain.impl) == ("control", f"EP8 {step}", "device step")
    assert (pdl.section, pdl.case, pdl.impl) == ("control", f"EP8 {step}", "device step, PDL")
    assert pdl.time_s == 31e-6 and pdl.wrong == 0
    assert pdl.note == "graph replay: 10 per graph x 20 replays, device time; programmatic dependent launch"
    assert "programmatic" not in plain.note
    rows = bg.control_graph_rows(
        "EP8", 256, {step: 40e-6}, {step: 0}, dict(pdl="sm_80 has no programmatic dependent launch (sm_90+)")
    )
    assert rows[5].time_s is None and rows[5].note == (
        "not measured (graph replay): sm_80 has no programmatic dependent launch (sm_90+)"
    )


def test_control_step_graph_runs_the_four_kernels_once():
    """The whole step captured for the graph rows calls each of the four kernels once, not itself
    (it was its own entry in the dict it iterated: the step's graph row could never be timed)."""
    src = open(inspect.getsourcefile(bg.Gpu._control_shape)).read()  # perf/single_gpu/control.py
    body = src[src.index("    def _control_shape(") : src.index("    def control_build(")]
    assert "step = tuple(kernels.values())" in body and "for fn in step:" in body
    assert body.index("step = tuple(kernels.values())") < body.index("kernels[CONTROL_STEP[0]] = whole")
    assert "set_programmatic_launch(True)" in body and "set_programmatic_launch(False)" in body


def test_launch_rows_eager_and_graph_replayed():
    """run_launch on a stub: the empty kernel and the no-task persistent kernel each get an eager
    row (the enqueue rate) and a graph-replayed row (LAUNCH_PER_GRAPH launches per graph), same
    names; the profile's launch_s stays the first (eager) empty-kernel row."""
    calls = []

    class StubTimer:
        def __call__(self, fn, reps=None):
            fn()
            return 11e-6, True

        def graph(self, fn, per_graph=10, replays=20):
            calls.append((per_graph, replays))
            fn()
            return 1.5e-6

    class Domain:
        def run(self, op):
            calls.append(op)

        def check(self):
            pass

        def close(self):
            calls.append("closed")

    import types

    g = stub_gpu(timer=StubTimer(), tma_reason=None, torch=types.SimpleNamespace(float32="f32"))
    g.binding = lambda name: ((lambda stream: calls.append("empty")), "")
    g.stream = lambda: 0
    g.domain = lambda *a, **k: Domain()
    g.run_launch()
    got = [(r.case, r.impl, r.time_s, r.extra.get("timing")) for r in g.rows]
    assert got == [
        ("floor", "empty kernel", 11e-6, "eager"),
        ("floor", "empty kernel", 1.5e-6, "graph"),
        ("no tasks", "tile mover", 11e-6, "eager"),
        ("no tasks", "tile mover", 1.5e-6, "graph"),
    ]
    assert g.rows[1].note == "graph replay: 100 per graph x 10 replays, device time"
    assert "persistent launch" in g.rows[3].note and "graph replay" in g.rows[3].note
    assert calls.count((bg.LAUNCH_PER_GRAPH, bg.LAUNCH_REPLAYS)) == 2 and calls[-1] == "closed"
    prof = bg.build_profile(g.rows, DEVICE, "d")
    assert prof["launch_s"] == 11e-6


# ----------------------------------------------------------------------------- lb_prefetch (issue 37)

LB_W, LB_EPR, LB_S = bg.LB_SHAPE


def test_lb_shape_is_deepeps_published_test_shape():
    """DeepEP's tests/ep/test_prefetch_weights.py defaults: 8 processes, 64 experts, 8 redundant experts,
    64M weights + 16K + 4K scale factors per expert, empty ratio 0.25, random pattern."""
    assert (LB_W, LB_W * LB_EPR, LB_S) == (8, 64, 8)
    assert [n for _, n, _ in bg.LB_MEMBERS] == [64 * MiB, 16 << 10, 4 << 10] and bg.LB_EMPTY == 0.25
    assert bg.SECTIONS[-2:] == ("lb_prefetch", "copy_engine")  # copy_engine stays last


@pytest.mark.parametrize("seed", [0, 1, 7])
def test_lb_mapping_quarter_empty_no_home_no_duplicate_seeded(seed):
    m = bg.lb_mapping(LB_W, LB_EPR, LB_S, 0.25, seed)
    assert m.dtype == np.int32 and m.shape == (8, 8)
    assert ((m == -1).sum(axis=1) == 2).all()  # exactly 25% of every rank's slots are empty
    assert ((m >= -1) & (m < 64)).all()
    for r in range(8):
        ids = m[r][m[r] >= 0]
        assert len(set(ids.tolist())) == len(ids) == 6  # no expert twice on a rank
        assert not (ids // LB_EPR == r).any()  # never on its home rank
    assert np.array_equal(m, bg.lb_mapping(LB_W, LB_EPR, LB_S, 0.25, seed))  # seeded
    assert not np.array_equal(m, bg.lb_mapping(LB_W, LB_EPR, LB_S, 0.25, seed + 100))
    # the empty slots are not always the same columns, nor the experts always the same
    many = [bg.lb_mapping(LB_W, LB_EPR, LB_S, 0.25, s) for s in range(20)]
    assert len({tuple(np.flatnonzero(x[0] < 0)) for x in many}) > 1


def test_lb_mapping_refuses_a_shape_with_too_few_remote_experts():
    with pytest.raises(ValueError, match="distinct remote experts"):
        bg.lb_mapping(2, 2, 4, 0.0, 0)  # 4 filled slots, 2 remote experts
    assert (bg.lb_mapping(2, 2, 4, 0.5, 0) >= 0).sum() == 4
    assert (bg.lb_mapping(4, 2, 4, 1.0, 0) == -1).all()


def test_lb_bytes_and_rows_count_exactly_the_documented_bytes():
    m = np.array([[2, -1, 3], [0, 3, -1]], np.int32)  # 2 ranks x 2 experts, 4 filled slots, 3 distinct experts
    members = (("weights", 1024, "float8_e4m3fn"), ("sf0", 64, "float32"), ("sf1", 32, "float32"))
    b = bg.lb_bytes(m, 2, [1024, 64, 32])
    assert b == dict(
        per_expert=1120,
        filled=4,
        distinct=3,
        payload=4 * 1120,
        copy_traffic=8 * 1120,
        multicast_traffic=7 * 1120,
        sent_per_rank=[1, 3],
        critical_bytes=3 * 1120,
    )
    r = bg.lb_row(bg.LB_COPIES, m, 2, members, 1e-3, 0, "12 copies")
    assert (r.section, r.case, r.impl, r.size) == ("lb_prefetch", "EP2 4 experts x 3 slots", bg.LB_COPIES, 1120)
    assert (r.payload, r.traffic, r.algbw) == (4480, 8960, 4480 / 1e-3)
    assert r.note == (
        "12 copies, payload 4 filled slots x 1120 B (1K float8_e4m3fn + 64 float32 + 32 float32); "
        "busbw counts 2 x payload (each copy reads its home's tensor and writes the slot)"
    )
    x = r.to_dict()
    assert (x["timing"], x["filled"], x["distinct"], x["critical_bytes"], x["sent_per_rank"]) == (
        "eager",
        4,
        3,
        3360,
        [1, 3],
    )
    mc = bg.lb_row(
        bg.LB_MULTICAST,
        m,
        2,
        members,
        2e-3,
        5,
        "4 CTAs/rank",
        dict(ctas=4, senders=2),
        graph=(bg.LB_PER_GRAPH, bg.LB_REPLAYS),
    )
    assert (mc.payload, mc.traffic, mc.wrong, mc.algbw_per_cta) == (4480, 7840, 5, 4480 / 2e-3 / 8)
    assert mc.note.startswith(
        f"graph replay: {bg.LB_PER_GRAPH} per graph x {bg.LB_REPLAYS} replays, device time; "
        "4 CTAs/rank, payload 4 filled slots x 1120 B"
    )
    assert mc.note.endswith(
        "busbw counts (3 experts + 4 slots) x 1120 B (each mapped expert read once, each slot written)"
    )
    assert (mc.extra["timing"], mc.extra["per_graph"], mc.extra["ctas"]) == ("graph", bg.LB_PER_GRAPH, 4)
    # at the published shape: 48 filled slots of 64 MiB + 20 KiB
    full = bg.lb_row(bg.LB_COPIES, bg.lb_mapping(*bg.LB_SHAPE), LB_EPR, bg.LB_MEMBERS, 1.0, 0)
    assert full.size == 64 * MiB + 20 * 1024 and full.payload == 48 * full.size
    assert "64M float8_e4m3fn + 16K float32 + 4K float32" in full.note
    missing = bg.lb_row(bg.LB_ADAPTER, m, 2, members, None, 3, "FAILED: boom")
    assert missing.wrong is None and missing.algbw is None and missing.note.startswith("FAILED: boom, payload")
    assert bg.lb_row(bg.LB_ADAPTER, m, 2, members, None, None).note.startswith("not measured: payload")
    assert "graph replay" in bg.format_table([r, mc, missing]).splitlines()[3]


def test_lb_memory_fits_an_h100_and_counts_masters_and_pools():
    B = sum(n for _, n, _ in bg.LB_MEMBERS)
    need = bg.lb_memory_bytes(*bg.LB_SHAPE, B)
    assert need == 64 * B + 64 * B * 5 // 4 + (1 << 30)
    assert 9 << 30 < need < 11 << 30 < 78 << 30


def test_lb_budget_is_kept_by_the_sections_before_it():
    import time

    g = stub_gpu(deadline=time.monotonic() + 20.0, reserve_s=10.0, lb_reserve_s=15.0)
    assert g.late("relay", "x")  # 10 + 15 > 20
    assert not g.late("lb_prefetch", "y")  # its own share is not kept from itself; copy_engine's is
    assert not g.late("copy_engine", "z", reserve=False)
    assert [r.section for r in g.rows] == ["relay"]


class CpuTimer:
    """Timer stand-in on the CPU: runs the operation (eagerly; graph rows: prepare, then once more)."""

    def __call__(self, fn, reps=None):
        fn()
        fn()
        return 1e-3, False

    def graph(self, fn, per_graph=10, replays=20, prepare=None):
        fn()
        if prepare is not None:
            prepare()
        fn()
        return 5e-4


def cpu_lb_gpu(free=1 << 40, broken=None):
    import types

    import torch

    import ultracomm

    g = stub_gpu(
        torch=torch,
        uc=ultracomm,
        dev=torch.device("cpu"),
        timer=CpuTimer(),
        tma_reason="no GPU here",
        info=dict(sms=4, name="cpu"),
    )
    g.free_bytes = lambda: free
    if broken:
        g.lb_timed = types.MethodType(lambda self, *a, **k: (_ for _ in ()).throw(RuntimeError(broken)), g)
    return g


SMALL = ((4, 2, 4), (("weights", 4096, "float8_e4m3fn"), ("sf0", 256, "float32"), ("sf1", 64, "float32")))


def test_lb_section_on_the_cpu_copies_and_checks_every_byte():
    """run_lb_prefetch on CPU tensors at a small shape: the copy rows (eager and graph) measure and verify
    zero wrong bytes; the tile mover and adapter rows say why they were not measured."""
    g = cpu_lb_gpu()
    g.run_lb_prefetch(*SMALL)
    got = [(r.impl, r.time_s, r.wrong, r.extra.get("timing")) for r in g.rows]
    assert got == [
        (bg.LB_COPIES, 1e-3, 0, "eager"),
        (bg.LB_COPIES, 5e-4, 0, "graph"),
        (bg.LB_MULTICAST, None, None, "eager"),
        (bg.LB_ADAPTER, None, None, "eager"),
    ], g.rows
    assert g.rows[0].note.startswith("36 copies, payload 12 filled slots x 4416 B")  # 12 slots x 3 tensors
    assert g.rows[2].note.startswith("not measured: no GPU here") and not g.errors


def test_lb_section_skips_with_a_note_when_memory_is_short():
    g = cpu_lb_gpu(free=1 << 30)
    g.run_lb_prefetch()
    assert [r.impl for r in g.rows] == [bg.LB_COPIES, bg.LB_MULTICAST, bg.LB_ADAPTER]
    assert all(r.time_s is None and "GiB of device memory, 1.0 GiB free" in r.note for r in g.rows)


def test_lb_section_reports_a_failing_row_and_goes_on():
    g = cpu_lb_gpu(broken="boom")
    g.run_lb_prefetch(*SMALL)
    assert g.rows[0].note.startswith("FAILED: RuntimeError: boom") and g.errors == [
        f"lb_prefetch {bg.LB_COPIES}: RuntimeError: boom"
    ]
    assert [r.impl for r in g.rows] == [bg.LB_COPIES, bg.LB_MULTICAST, bg.LB_ADAPTER]


def test_lb_wrong_counts_bytes_of_filled_and_empty_slots():
    import torch

    m = np.array([[1, -1], [0, -1]], np.int32)  # 2 ranks x 1 expert, 2 slots
    masters = [[torch.arange(8, dtype=torch.uint8).view(1, 8) + 10 * r] for r in range(2)]
    slots = [[torch.full((8,), bg.SENTINEL, dtype=torch.uint8) for _ in range(2)] for _ in range(2)]

    def slot(r, c, k):
        return slots[r][c]

    assert bg.lb_wrong(torch, slot, masters, m, 1) == 16  # the two filled slots: every byte wrong
    slots[0][0].copy_(masters[1][0][0])
    slots[1][0].copy_(masters[0][0][0])
    assert bg.lb_wrong(torch, slot, masters, m, 1) == 0
    slots[0][1][3] = 0
    slots[1][0][0] = 99
    assert bg.lb_wrong(torch, slot, masters, m, 1) == 2
    bg.lb_fill(torch, slot, m, 1, 7)
    assert all(int((s != 7).sum()) == 0 for row in slots for s in row)


def test_lb_domain_arguments_run_bit_exact_on_the_host_executor():
    """LBDomain's per-rank arguments (the ones CudaLoopback.plan gets: masters [local expert x member],
    member offsets, the schedule's tasks, refs and tree) through the host executor (_core.run_host, one
    thread per rank): every filled slot holds its expert's three tensors, every empty slot the sentinel."""
    import threading

    import torch

    import ultracomm as uc
    from ultracomm import _core

    (W, epr, S), members = (4, 2, 4), SMALL[1]
    mapping = bg.lb_mapping(W, epr, S, 0.25, 3)
    dts = [getattr(torch, dt) for _, _, dt in members]
    layout = uc.ExpertLayout(
        tuple(uc.Member(n, (b // dt.itemsize,), dt, grad=False) for (n, b, _), dt in zip(members, dts))
    )
    gen = torch.Generator().manual_seed(5)
    masters = [
        [
            torch.randint(0, 256, (epr, b), dtype=torch.uint8, generator=gen).view(dt)
            for (_, b, _), dt in zip(members, dts)
        ]
        for _ in range(W)
    ]
    d = bg.LBDomain(torch, torch.device("cpu"), layout, masters, mapping, epr, chunk_bytes=1024)
    assert len(d.copy_pairs()) == 3 * int((mapping >= 0).sum())
    bg.lb_fill(torch, d.slot, mapping, 3, bg.SENTINEL)
    assert bg.lb_wrong(torch, d.slot, masters, mapping, epr) > 0
    L, errs = d.wl, {}

    def body(r):
        a = d.rank_args(r)
        try:
            _core.run_host(
                op=int(d.op),
                rank=r,
                world=W,
                epoch=1,
                slots=S,
                weight_slot_bytes=L["weight_slot_bytes"],
                grad_slot_bytes=L["grad_slot_bytes"],
                chunk_bytes=L["chunk_bytes"],
                window_bases=[w.data_ptr() for w in d.windows],
                grad_dtype=0,
                num_workers=2,
                timeout_s=20.0,
                **a,
            )
        except Exception as e:  # noqa: BLE001
            errs[r] = e

    th = [threading.Thread(target=body, args=(r,)) for r in range(W)]
    for t in th:
        t.start()
    for t in th:
        t.join(60)
    assert not errs, errs
    assert bg.lb_wrong(torch, d.slot, masters, mapping, epr) == 0
    # the slots hold the three tensors at the layout's offsets, in the members' dtypes
    assert d.slot(0, 0, 0).dtype == dts[0] and d.slot(0, 0, 2).numel() == 16
    d.close()
    assert d.windows == []


# ----------------------------------------------------------------------------- loopback CTA layout


def cpu_loopback(monkeypatch, launches):
    """CudaLoopback over CPU tensors whose plans only count tasks and whose runner applies the compiled
    CTA rule (the bench's cap and notes go through CudaLoopback.launch_ctas / max_ctas_per_rank)."""
    import types

    import ultracomm.cuda.loopback as cl

    cuda = perf_modules.compiled_cuda()
    runner = types.SimpleNamespace(
        mover="tma",
        max_coresident=lambda dtype=0: 264,  # 2 x 132 SMs
        launch_ctas=lambda plan, c: cuda.launch_ctas(plan.rank_tasks, c),
        max_ctas_per_rank=lambda plan, grid: cuda.max_ctas_per_rank(plan.rank_tasks, grid),
    )

    class CpuLoopback(cl.CudaLoopback):
        def __init__(self, world, wlayout, windows, *, timeout_s=10.0):
            self.world, self.wlayout, self.windows, self.device, self.timeout_s = world, wlayout, windows, 0, timeout_s
            self.runner, self._names = runner, {}

        def plan(self, op, *, tasks, grad_dtype=0, **kw):
            return types.SimpleNamespace(
                op=int(op), rank_tasks=[len(t) for t in tasks], grad_dtype=cl._dtype_code(grad_dtype)
            )

        def launch(self, plan, epoch, *, ctas_per_rank=4, **kw):
            launches.append((plan.op, ctas_per_rank, self.launch_ctas(plan, ctas_per_rank)))

    monkeypatch.setattr(cl, "CudaLoopback", CpuLoopback)


def test_loopback_caps_rank_0_by_the_whole_grid_not_max_coresident_over_world(monkeypatch):
    """k=2: the pushed multicast and the pulled reduce have tasks on rank 0 only, so rank 0 may have
    264 - 2 co-resident CTAs (not 264 // 3 = 88); the notes say the layout, the cap per op and the
    shared ring of a grid beyond the SMs; extra ctas is rank 0's, extra grid the whole launch's."""
    import types

    import torch

    import ultracomm

    launches: list = []
    cpu_loopback(monkeypatch, launches)
    g = types.SimpleNamespace(torch=torch, uc=ultracomm, dev=torch.device("cpu"), info=dict(sms=132, name="x"))
    d = bg.Loopback(
        g, 3, bg.one_expert(2), 3 * 4096, torch.float32, chunk_bytes=4096, multicast_sms=300, reduce_sms=132
    )
    assert [len(d.sched.tasks(d.ops[op], r)) > 0 for op in ("multicast", "reduce") for r in range(3)] == [
        True, False, False, True, False, False,
    ]  # fmt: skip
    assert (d.ctas, d.reduce_ctas, d.capped) == (262, 132, True)
    assert d.cta_note("multicast") == (
        "262 CTAs on rank 0, 1 per idle rank (co-residency cap), grid 264 > 132 SMs: shared ring",
        262,
        264,
    )
    assert d.cta_note("reduce") == ("132 CTAs on rank 0, 1 per idle rank, grid 134 > 132 SMs: shared ring", 132, 134)
    d.run("reduce")
    d.run("multicast")
    assert launches == [(1, 132, [132, 1, 1]), (0, 262, [262, 1, 1])]
    d = bg.Loopback(g, 3, bg.one_expert(2), 3 * 4096, torch.float32, chunk_bytes=4096, multicast_sms=8, reduce_sms=130)
    assert d.cta_note("multicast") == ("8 CTAs on rank 0, 1 per idle rank", 8, 10)
    assert d.cta_note("reduce") == ("130 CTAs on rank 0, 1 per idle rank", 130, 132)  # 132 CTAs: the deep ring


def test_loopback_every_rank_busy_keeps_ctas_per_rank(monkeypatch):
    """Each rank homes an expert replicated on the next: every rank has tasks, the grid is uniform and
    the cap is the old max_coresident // world."""
    import types

    import numpy as np
    import torch

    import ultracomm

    cpu_loopback(monkeypatch, [])
    g = types.SimpleNamespace(torch=torch, uc=ultracomm, dev=torch.device("cpu"), info=dict(sms=132, name="x"))
    ring = np.array([[1], [2], [0]], np.int32)  # rank r holds a replica of rank r+1's expert
    d = bg.Loopback(g, 3, ring, 4096, torch.float32, chunk_bytes=4096, multicast_sms=100, reduce_sms=100)
    assert (d.ctas, d.reduce_ctas) == (88, 88)
    assert d.cta_note("reduce") == ("88 CTAs/rank (co-residency cap), grid 264 > 132 SMs: shared ring", 88, 264)


def test_reduce_rows_carry_rank_0s_ctas_and_the_grid():
    """mover_reduce's row: extra ctas = rank 0's CTAs, extra grid = the launch's, the note the domain's."""

    class Domain:
        def run(self, op):
            pass

        def seed_grads(self):
            return None

        def reduce_wrong(self, want):
            return 0

        def check(self):
            pass

        def close(self):
            pass

        def cta_note(self, op):
            assert op == "reduce"
            return "132 CTAs on rank 0, 1 per idle rank, grid 134 > 132 SMs: shared ring", 132, 134

    g = stub_gpu(timer=lambda fn, **kw: (fn(), (1e-3, False))[1])
    g.domain = lambda *a, **k: Domain()
    r = g.mover_reduce("k=2 fp32 132 CTAs", 2, None, 64 * MiB, "fp32", 132, "hunk")
    assert r.extra == dict(k=2, dtype="fp32", ctas=132, reduce_path="hunk", grid=134)
    assert r.note == "132 CTAs on rank 0, 1 per idle rank, grid 134 > 132 SMs: shared ring"
    assert r.busbw / r.extra["ctas"] == 4 * 64 * MiB / 1e-3 / 132  # per CTA of rank 0, not of the grid


def test_lb_domain_cta_note_says_what_the_launch_runs():
    """LBDomain (lb_prefetch rows): a rank without a task in the multicast gets one CTA (runner.h
    launch_ctas), so the note says how many ranks are idle; the cap is named only when it lowered
    the count."""
    d = object.__new__(bg.LBDomain)
    d.ctas, d.capped, d.idle = 16, False, 0
    assert d.cta_note() == "16 CTAs/rank"
    d.ctas, d.capped, d.idle = 29, True, 2
    assert d.cta_note() == "29 CTAs per rank with tasks, 1 per idle rank (2) (co-residency cap)"
