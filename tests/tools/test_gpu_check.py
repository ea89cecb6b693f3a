"""scripts/gpu_check.sh run whole with a stub interpreter (no torch, no GPU, no real build): what it
does where torch sees no CUDA device.  (test_bench_gpu.py checks its structure and steps.)"""

from __future__ import annotations

import os
import subprocess
import tarfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# the interpreter gpu_check.sh calls ($PYTHON): torch without a device; the pip build logs its
# architecture; anything else succeeds silently
STUB = """#!/bin/bash
case "$*" in
  *"torch.cuda.is_available())"*) echo 0 ;;
  *"get_device_capability"*) exit 1 ;;
  *"-m pip install"*) echo "stub pip build for $SKBUILD_CMAKE_DEFINE"; exit 0 ;;
  *"-m pip uninstall"*) echo "UNINSTALLED" >> "$STUB_LOG" ;;
  *"-m pytest"*|*bench_*) echo "RAN $*" >> "$STUB_LOG" ;;
esac
exit 0
"""


def test_no_cuda_device_builds_for_sm90_then_exits_2_without_tests_or_benches(tmp_path):
    stub = tmp_path / "python"
    stub.write_text(STUB)
    stub.chmod(0o755)
    for tool in ("cmake", "nvcc", "nvidia-smi"):  # present, harmless
        (tmp_path / tool).write_text("#!/bin/bash\necho stub\n")
        (tmp_path / tool).chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "stub.log"
    env = dict(os.environ, PYTHON=str(stub), OUT=str(out), STUB_LOG=str(log), PATH=f"{tmp_path}:{os.environ['PATH']}")
    env.pop("SKBUILD_CMAKE_DEFINE", None)
    t = time.monotonic()
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    took = time.monotonic() - t
    assert p.returncode == 2, p.stdout + p.stderr
    assert took < 30, took  # no step waits out a timeout
    assert "gpu_check: torch sees no CUDA device: build checked (rc=0, ULTRACOMM_CUDA_ARCHITECTURES=90-real)" in (
        p.stdout
    ), p.stdout
    assert not log.exists(), log.read_text()  # no uninstall, no pytest, no bench
    assert "gpu-tests" not in p.stdout and "bench-gpu" not in p.stdout
    assert "torch sees no CUDA device" in (out / "env.txt").read_text()
    with tarfile.open(out / "logs.tar.gz") as tar:  # the logs are packed on this exit too
        build = tar.extractfile("logs/build.log").read().decode()
    assert "stub pip build for ULTRACOMM_CUDA_ARCHITECTURES=90-real" in build


# the same, for a machine whose torch sees a device: every python call it makes is logged
STUB_GPU = """#!/bin/bash
echo "CALL $*" >> "$STUB_LOG"
for a in "$@"; do echo "ARG[$a]" >> "$STUB_LOG"; done
case "$*" in
  *"torch.cuda.is_available())"*) echo 1 ;;
  *"get_device_capability"*) echo 90 ;;
  *"device_count"*) echo 1 ;;
esac
exit 0
"""


def test_a_shorter_rerun_runs_only_the_steps_asked_for_with_their_arguments(tmp_path):
    """GPU_CHECK_STEPS / GPU_CHECK_PYTEST / GPU_CHECK_BENCH: the build, then only the steps named,
    the caller's extra arguments reaching pytest and the bench as the words they wrote."""
    stub = tmp_path / "python"
    stub.write_text(STUB_GPU)
    stub.chmod(0o755)
    for tool in ("cmake", "nvcc", "nvidia-smi"):
        (tmp_path / tool).write_text("#!/bin/bash\necho stub\n")
        (tmp_path / tool).chmod(0o755)
    out, log = tmp_path / "out", tmp_path / "stub.log"
    env = dict(
        os.environ,
        PYTHON=str(stub),
        OUT=str(out),
        STUB_LOG=str(log),
        PATH=f"{tmp_path}:{os.environ['PATH']}",
        GPU_CHECK_STEPS="tests,bench",
        GPU_CHECK_PYTEST='-k "tma or split"',
        GPU_CHECK_BENCH="--only control,reduce",
    )
    p = subprocess.run(
        ["bash", os.path.join(ROOT, "scripts", "gpu_check.sh")], env=env, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 0, p.stdout + p.stderr
    calls = [line for line in log.read_text().splitlines() if line.startswith("CALL ")]
    args = log.read_text().splitlines()
    assert any("-m pip install" in c for c in calls)  # the build always runs
    tests = [c for c in calls if "-m pytest" in c]
    assert len(tests) == 1 and "-m gpu" in tests[0]  # the tests step, not the stall rerun
    assert "ARG[tma or split]" in args and "ARG[-k]" in args  # one word, as quoted
    bench = [c for c in calls if "bench_" in c]
    assert len(bench) == 1 and "perf/bench_gpu.py" in bench[0] and "--only control,reduce" in bench[0]
    assert "gpu_check: stall-cdmc32 (timeout" not in p.stdout and "bench-host" not in p.stdout
    assert "did not finish" not in p.stdout
    assert "gpu_check: build=0 tests=0 stall-cdmc32=0 bench=0" in p.stdout


def _gpu_test_ids() -> list[str]:
    """Node ids of the gpu tests (collected from the files that mark tests gpu, as -m gpu selects)."""
    import glob
    import sys

    files = sorted(
        os.path.relpath(f, ROOT)
        for f in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
        if "pytest.mark." + "gpu" in open(f).read()
    )
    p = subprocess.run(
        [sys.executable, "-m", "pytest", *files, "-m", "gpu", "--collect-only", "-q", "-p", "no:cacheprovider"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    return [line for line in p.stdout.splitlines() if "::" in line]


def test_a_device_run_starts_with_the_failure_workers_then_bit_exactness_then_the_control_plane():
    """conftest.gpu_order on the gpu tests: issue 35's failure workers first, then the data plane
    bit for bit, then the control plane against its host builds, then the rest; and the workers'
    bound keeps even all of them hung inside gpu_check.sh's test step, with time left for the rest."""
    import ast
    import re
    import types

    import conftest
    import gpu_worker

    ids = _gpu_test_ids()
    items = [types.SimpleNamespace(nodeid=i, keywords={}) for i in ids]
    order = [x.nodeid for x in sorted(items, key=conftest.gpu_order)]
    groups = [conftest.gpu_order(types.SimpleNamespace(nodeid=i, keywords={}))[1] for i in order]
    assert groups == sorted(groups)
    workers = [i for i in order if "near_its_deadline" in i]
    assert len(workers) == 7 and order[:7] == workers, order[:10]  # copy_engine x 4, split x 3
    exact = [i for i in order if conftest.gpu_order(types.SimpleNamespace(nodeid=i, keywords={}))[1] == 1]
    assert {i.split("::")[0].split("/")[-1] for i in exact} == {
        "test_cuda_loopback.py",
        "test_gpu_context.py",
        "test_copy_engine_gpu.py",
        "test_split_cuda_gpu.py",
    }
    assert order[7 : 7 + len(exact)] == exact
    control = [i for i in order if conftest.gpu_order(types.SimpleNamespace(nodeid=i, keywords={}))[1] == 2]
    assert any("test_planner_device.py" in i for i in control) and any("test_reroute_device.py" in i for i in control)
    # the TMA-staged reduce's bit-exactness cases: after the control plane, before the rest
    staged = [
        i
        for i in order
        if conftest.gpu_order(types.SimpleNamespace(nodeid=i, keywords={}))[1] == len(conftest.GPU_FIRST) - 0.5
    ]
    assert staged and all("test_cuda_loopback.py" in i and "tma" in i.split("[")[1] for i in staged), staged
    assert not any("tma" in i.split("[")[1] for i in exact if "test_cuda_loopback.py" in i and "[" in i)
    k = order.index(staged[0])
    assert order[k - 1] in control and order[k : k + len(staged)] == staged
    # every test that runs a failure worker is one of those first seven
    for f in {i.split("::")[0] for i in ids}:
        for fn in ast.walk(ast.parse(open(os.path.join(ROOT, f)).read())):
            if isinstance(fn, ast.FunctionDef) and fn.name.startswith("test_") and "run_worker(" in ast.unparse(fn):
                assert "near_its_deadline" in fn.name, (f, fn.name)
    # all seven hung (bound, then stacks on SIGABRT within 10 s) still leave the step time to run the rest
    cap = int(re.search(r"step gpu-tests (\d+) ", open(os.path.join(ROOT, "scripts", "gpu_check.sh")).read()).group(1))
    assert len(workers) * (gpu_worker.TIMEOUT_S + 10) <= cap - 30, (len(workers), gpu_worker.TIMEOUT_S, cap)


def _bench():
    import perf_modules

    return perf_modules.load("bench_gpu")


def test_bench_prints_each_section_as_it_completes_and_keeps_them_when_interrupted(monkeypatch, tmp_path, capsys):
    """gpu_check.sh stops a bench that runs out of its step's time with SIGINT, SIGKILL 10 s later:
    the sections measured so far must be in bench_gpu.txt (printed as each completes; they were
    all printed at the end, so a stopped run's text held nothing) and in the JSON, and the
    interrupted section says so."""
    import json

    bg = _bench()

    class FakeGpu:
        def __init__(self, *args):
            self.info = dict(name="Fake GPU", cc="9.0", sms=132, torch="t", cuda="c")
            self.rows, self.errors, self.poisoned = [], [], None
            self.tma_reason = self.ce_reason = None

        def section(self, name, fn):  # as Gpu.section: it catches Exception, not KeyboardInterrupt
            try:
                fn()
            except Exception as e:  # noqa: BLE001
                self.errors.append(f"{name}: {e}")

        def run_launch(self):
            self.rows.append(bg.Row("launch", "floor", "empty kernel", 0, 1e-5, 0, 0, 0))
            print("bench_gpu: launch done")

        def run_flag(self):
            raise KeyboardInterrupt

        def run_control(self):
            raise AssertionError("a section ran after the interrupt")

    monkeypatch.setattr(bg, "unavailable_reason", lambda: None)
    monkeypatch.setattr(bg, "Gpu", FakeGpu)
    try:
        rc = bg.main(["--only", "launch,flag,control", "--out", str(tmp_path)])
    except KeyboardInterrupt:
        raise AssertionError("the interrupt left bench_gpu.main without its tables") from None
    out = capsys.readouterr().out
    assert rc == 1
    assert out.index("bench_gpu: launch done") < out.index("## launch") < out.index("## flag")
    assert "interrupted (SIGINT): the rest not measured" in out and "## control" not in out
    rec = json.load(open(tmp_path / "bench_gpu.json"))
    assert [(r["section"], r["case"]) for r in rec["rows"]] == [("launch", "floor"), ("flag", "-")]
    assert rec["errors"] == ["flag: interrupted (SIGINT); later sections not run"]
