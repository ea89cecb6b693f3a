"""Malformed traces and options given to the trace tools (issue 20 part 2): every case ends with
one clear line naming the file or option and what is wrong, exit status 2, in bounded time (a
per-case subprocess timeout: FIFOs, decompression bombs and huge counts once hung)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import zipfile

import numpy as np
import pytest

from ultracomm.profile import Profiler, load_trace
from ultracomm.profile.trace_checks import TraceError, load_npz

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
W, E = 4, 8


def good_trace(path) -> str:
    with Profiler(path, meta={"model": "qwen3-30b-a3b"}) as prof:
        prof.set_domain(W, E // W)
        for layer in range(2):
            prof.record(layer, load=np.full((W, E), 3, np.int64) + np.eye(W, E, dtype=np.int64) * 40)
    return str(path)


def index_of(path) -> dict:
    with open(os.path.join(path, "index.json")) as f:
        return json.load(f)


def write_index(path, idx) -> None:
    with open(os.path.join(path, "index.json"), "w") as f:
        json.dump(idx, f)


def make(tmp_path, kind: str) -> str:
    """A trace (directory or .npy) broken in way ``kind``."""
    t = str(tmp_path / "t")
    if kind.startswith("npy:"):
        p = str(tmp_path / "counts.npy")
        arrays = {
            "npy:huge": np.full((2, 2, E), (1 << 63) - 1, np.int64),
            "npy:negative": np.full((2, 2, E), -1, np.int64),
            "npy:float": np.full((2, 2, E), 0.5),
            "npy:uint64": np.full((2, 2, E), (1 << 64) - 1, np.uint64),
        }
        if kind == "npy:pickled":
            np.save(p, np.array([{"a": 1}], dtype=object), allow_pickle=True)
        elif kind == "npy:fifo":
            os.mkfifo(p)
        elif kind == "npy:lying-header":  # 10**12 elements claimed, 16 bytes held
            with open(p, "wb") as f:
                np.lib.format.write_array_header_1_0(
                    f, {"descr": "<i8", "fortran_order": False, "shape": (10**6, 10**6)}
                )
                f.write(bytes(16))
        elif kind == "npy:truncated":
            np.save(p, np.zeros((2, 2, E), np.int64))
            with open(p, "r+b") as f:
                f.truncate(100)
        else:
            np.save(p, arrays[kind])
        return p
    good_trace(t)
    idx = index_of(t)
    first = idx["files"][0]["file"]
    if kind == "index-list":
        write_index(t, [1, 2])
    elif kind == "files-int":
        write_index(t, {**idx, "files": 3})
    elif kind == "files-str":
        write_index(t, {**idx, "files": "abc"})
    elif kind == "missing-file":
        os.remove(os.path.join(t, first))
    elif kind == "dotdot":
        outside = tmp_path / "outside"
        outside.mkdir()
        os.rename(os.path.join(t, first), outside / "secret.npz")
        write_index(t, {**idx, "files": [{**idx["files"][0], "file": "../outside/secret.npz"}]})
    elif kind == "absolute":
        write_index(t, {**idx, "files": [{**idx["files"][0], "file": os.path.join(t, first)}]})
    elif kind == "symlink-out":
        outside = tmp_path / "outside.npz"
        os.rename(os.path.join(t, first), outside)
        os.symlink(outside, os.path.join(t, first))
    elif kind == "world-0":
        write_index(t, {**idx, "world": 0})
    elif kind == "world-huge":
        write_index(t, {**idx, "world": 10**12})
    elif kind == "world-disagrees":
        write_index(t, {**idx, "world": 2, "experts_per_rank": 4})
    elif kind == "garbage-index":
        with open(os.path.join(t, "index.json"), "wb") as f:
            f.write(b"\x00\xff{not json")
    elif kind == "fifo-index":
        os.remove(os.path.join(t, "index.json"))
        os.mkfifo(os.path.join(t, "index.json"))
    elif kind == "fifo-npz":
        os.remove(os.path.join(t, first))
        os.mkfifo(os.path.join(t, first))
    elif kind == "empty-npz":
        with zipfile.ZipFile(os.path.join(t, first), "w"):
            pass
    elif kind == "truncated-npz":
        with open(os.path.join(t, first), "r+b") as f:
            f.truncate(40)
    elif kind in ("no-expert_load", "no-has_plan"):
        with np.load(os.path.join(t, first)) as z:
            d = {k: z[k] for k in z.files if k != kind[3:]}
        np.savez(os.path.join(t, first), **d)
    elif kind == "lying-npz":  # member 'step.npy' claims 10**12 records in 8 bytes
        with np.load(os.path.join(t, first)) as z:
            d = {k: z[k] for k in z.files}
        with zipfile.ZipFile(os.path.join(t, first), "w") as zf:
            for k, v in d.items():
                with zf.open(k + ".npy", "w") as f:
                    if k == "step":
                        np.lib.format.write_array_header_1_0(
                            f, {"descr": "<i8", "fortran_order": False, "shape": (10**12,)}
                        )
                        f.write(bytes(8))
                    else:
                        np.lib.format.write_array(f, v)
    elif kind == "huge-counts":
        with np.load(os.path.join(t, first)) as z:
            d = {k: z[k] for k in z.files}
        d["expert_load"] = np.full_like(d["expert_load"], 1 << 62)
        np.savez(os.path.join(t, first), **d)
    else:
        raise AssertionError(kind)
    return t


# kind, extra options, the error text (after "error: "), tools it applies to
CASES = [
    ("index-list", [], "index.json must be a JSON object, got list"),
    ("files-int", [], "index.json: 'files' must be a list of {\"file\": name, ...} objects, got int"),
    ("files-str", [], "index.json: 'files' must be a list of {\"file\": name, ...} objects, got str"),
    ("missing-file", [], "a records file does not exist"),
    (
        "dotdot",
        [],
        "a listed records file '../outside/secret.npz' leaves the trace directory (absolute or '..'); "
        "a trace's files stay inside it",
    ),
    ("absolute", [], "leaves the trace directory (absolute or '..')"),
    ("symlink-out", [], "is a symlink that leaves the trace directory"),
    ("world-0", [], "a trace with records needs world >= 1 and num_experts >= 1, got 0 and 8"),
    ("world-huge", [], "'world' must be an integer in [0, 65536], got 1000000000000"),
    (
        "world-disagrees",
        [],
        "array 'slot_src' has shape (2, 4, 0), but the index says (2, 2, 0) (world 2, 8 experts, 0 slots)",
    ),
    ("garbage-index", [], "index.json is not valid JSON"),
    ("fifo-index", [], "index.json is not a regular file"),
    ("fifo-npz", [], "a records file is not a regular file"),
    ("empty-npz", [], "has no 'step' array: not an ultracomm trace file"),
    ("truncated-npz", [], "a records file is not a readable .npz"),
    (
        "no-expert_load",
        [],
        "000000_step0.npz lacks the array(s) 'expert_load' that every ultracomm records file "
        "holds; the file is damaged or not from ultracomm.profile: record or import the trace "
        "again",
    ),
    (
        "no-has_plan",
        [],
        "000000_step0.npz lacks the array(s) 'has_plan' that every ultracomm records file holds; "
        "the file is damaged or not from ultracomm.profile: record or import the trace again",
    ),
    (
        "lying-npz",
        [],
        "000000_step0.npz: a records file member 'step.npy' has a .npy header that claims shape "
        "(1000000000000,) int64 (8000000000000 bytes) but only 8 bytes follow it; the file is truncated "
        "or damaged: write it again (numpy.save)",
    ),
    ("huge-counts", [], "array 'expert_load' holds a count of 4611686018427387904, more than 281474976710656 (2**48)"),
    ("npy:huge", ["--ep", "4"], "holds a count of 9223372036854775807, more than 281474976710656 (2**48)"),
    ("npy:uint64", ["--ep", "4"], "holds a count of 18446744073709551615, more than 281474976710656 (2**48)"),
    ("npy:negative", ["--ep", "4"], "holds a negative count (-1)"),
    ("npy:float", ["--ep", "4"], "must hold integer token counts, got dtype float64"),
    ("npy:pickled", ["--ep", "4"], "the routing-statistics file is not a valid .npy array"),
    ("npy:fifo", ["--ep", "4"], "the routing-statistics file is not a regular file"),
    (
        "npy:lying-header",
        ["--ep", "4"],
        "counts.npy: the routing-statistics file has a .npy header that claims shape "
        "(1000000, 1000000) int64 (8000000000000 bytes) but only 16 bytes follow it; "
        "the file is truncated or damaged: write it again (numpy.save)",
    ),
    ("npy:truncated", ["--ep", "4"], "the routing-statistics file is not a valid .npy array"),
    ("npy:huge", ["--ep", "1000000000000"], "--ep 1000000000000: EP ranks must be in [1, 65536]"),
]

OPTION_CASES = [  # (tool, options, error text); the trace itself is good
    ("whatif", ["--ep", "0"], "--ep 0: EP ranks must be in [1, 65536]"),
    ("whatif", ["--max-records", "-1"], "--max-records -1: must be 0 (no limit) or a positive count"),
    ("whatif", ["--max-chunks", "-3"], "--max-chunks -3: must be 0 (no limit) or a positive count"),
    ("whatif", ["--planner", ","], "--planner ',': name at least one of quota, taot, greedy, lpt, device, recorded"),
    ("whatif", ["--tflops", "1e-300"], "--tflops 1e-300: achieved TFLOP/s must be a number in [0.001, 1e7]"),
    ("whatif", ["--slots", "0"], "--slots 0: replica slots per rank must be in [1, 1024]"),
    (
        "whatif",
        ["--domain", "99999999999x8-rdma"],
        "--domain 99999999999x8-rdma: at most 8192 nodes of 8 (65536 ranks)",
    ),
    (
        "whatif",
        ["--json", "{tmp}/missing/out.json"],
        "--json {tmp}/missing/out.json: the directory {tmp}/missing does not exist",
    ),
    ("whatif", ["--json", "{tmp}"], "--json {tmp}: is a directory; give a file name"),
    ("viewer", ["--ep", "0"], "--ep 0: EP ranks must be in [1, 65536]"),
    ("viewer", ["--max-cells", "-1"], "--max-cells -1: must be a positive count"),
    ("viewer", ["--max-detail", "-5"], "--max-detail -5: must be a positive count"),
    ("viewer", ["--max-points", "0"], "--max-points 0: must be a positive count"),
    (
        "viewer",
        ["--screenshot", "{tmp}/missing/x.png"],
        "--screenshot {tmp}/missing/x.png: the directory {tmp}/missing does not exist",
    ),
    ("viewer", ["-o", "{tmp}"], "-o/--out {tmp}: is a directory; give a file name"),
]


def run_tool(tool: str, args: list, cwd) -> subprocess.CompletedProcess:
    mod = {"whatif": "ultracomm.tools.whatif", "viewer": "ultracomm.viewer", "profile": "ultracomm.profile"}[tool]
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([os.path.join(ROOT, "python"), os.environ.get("PYTHONPATH", "")]),
    }
    return subprocess.run(
        [sys.executable, "-m", mod, *args], capture_output=True, text=True, timeout=60, cwd=cwd, env=env
    )


def one_error_line(p: subprocess.CompletedProcess, text: str) -> None:
    assert p.returncode == 2, (p.returncode, p.stdout[-2000:], p.stderr[-2000:])
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: ") and "Traceback" not in p.stderr, p.stderr[-3000:]
    assert text in lines[0], lines[0]


@pytest.mark.parametrize("tool", ["whatif", "viewer"])
@pytest.mark.parametrize("kind, extra, text", CASES, ids=[f"{c[0]}{''.join(c[1])}" for c in CASES])
def test_malformed_traces_give_one_clear_line(tmp_path, tool, kind, extra, text):
    path = make(tmp_path, kind)
    out = ["-o", str(tmp_path / "r.html")] if tool == "viewer" else []
    one_error_line(run_tool(tool, [path, *extra, *out], tmp_path), text)


@pytest.mark.parametrize("tool, opts, text", OPTION_CASES, ids=[f"{c[0]}{''.join(c[1])}" for c in OPTION_CASES])
def test_bad_options_give_one_clear_line(tmp_path, tool, opts, text):
    path = good_trace(tmp_path / "t")
    opts = [o.replace("{tmp}", str(tmp_path)) for o in opts]
    out = ["-o", str(tmp_path / "r.html")] if tool == "viewer" and "-o" not in opts else []
    one_error_line(run_tool(tool, [path, *opts, *out], tmp_path), text.replace("{tmp}", str(tmp_path)))


def test_load_trace_raises_the_same_errors_in_process(tmp_path):
    with pytest.raises(TraceError, match="leaves the trace directory"):
        load_trace(make(tmp_path, "dotdot"))


@pytest.mark.parametrize("kind", ["no-expert_load", "no-has_plan", "lying-npz", "npy:lying-header"])
def test_load_trace_and_profile_show_refuse_what_once_raised_key_or_memory_errors(tmp_path, kind):
    """These ended in KeyError (an array the readers index) or numpy's MemoryError (a header
    claiming 10**12 elements is allocated before the data is read)."""
    path = make(tmp_path, kind)
    text = dict((c[0], c[2]) for c in CASES)[kind]
    with pytest.raises(TraceError) as err:
        load_trace(path, world=W)
    assert str(err.value).endswith(text), str(err.value)
    one_error_line(run_tool("profile", ["show", path, "--ep", str(W)], tmp_path), text)


def test_a_decompression_bomb_is_refused_before_inflating(tmp_path):
    p = tmp_path / "bomb.npz"
    np.savez_compressed(p, step=np.zeros(1 << 22, np.int64))  # 32 MiB of zeros in a few KiB
    assert os.path.getsize(p) < 1 << 20
    with pytest.raises(TraceError) as err:
        load_npz(p, "a records file", limit=1 << 20)
    assert str(err.value) == (
        f"ultracomm.profile: {p}: a records file would decompress to {(1 << 25) + 128} bytes, more than the {1 << 20} this reader accepts"
    )


def test_the_viewer_escapes_what_a_trace_says(tmp_path):
    path = str(tmp_path / "t")
    with Profiler(path, meta={"model": "</script><script>alert(1)</script>"}) as prof:
        prof.set_domain(W, E // W)
        prof.record(0, load=np.full((W, E), 3, np.int64))
    out = tmp_path / "r.html"
    p = run_tool(
        "viewer",
        [path, "-o", str(out), "--title", "<img src=x onerror=alert(2)>", "--model", "qwen3-30b-a3b"],
        tmp_path,
    )
    assert p.returncode == 0, p.stderr
    html = out.read_text()
    assert "<img" not in html and "<title>&lt;img src=x onerror=alert(2)></title>" in html
    assert "<script>alert(1)</script>" not in html
