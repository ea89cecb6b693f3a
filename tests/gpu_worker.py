"""Run a GPU failure worker (tests/mp/*_worker.py) in its own process with a bound: a worker still
running at the bound (:data:`TIMEOUT_S`) gets SIGABRT, which ``-X faulthandler`` turns into every thread's Python
stack on its stderr, and the test fails with those stacks -- where a device run hung is then in
the test's report (a plain timeout kill would leave nothing to read)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


#: a worker's bound: a passing one takes some 3-10 s on an H200 (interpreter and CUDA start, its
#: Contexts, the 2 s timeout it provokes, a synchronize bounded at 5 s); a hung one costs the bound
#: + its stacks, out of gpu_check.sh's capped test step (seven of them at 40 s filled it)
TIMEOUT_S = 20.0


def run_worker(script: str, *args: str, timeout_s: float = TIMEOUT_S) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-X", "faulthandler", os.path.join(ROOT, "tests", "mp", script), *args]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        out, err = p.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.send_signal(signal.SIGABRT)  # faulthandler: every thread's stack to stderr, then the abort
        try:
            out, err = p.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
            out, err = p.communicate()
        raise AssertionError(
            f"{script} {' '.join(args)} still ran after {timeout_s:g} s (hung); its threads:\n"
            f"{err[-6000:]}\nstdout: {out[-1000:]}"
        ) from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)


def record(test: str, out: dict) -> None:
    """Append one failure run's measurements (``out``: its worker's JSON) as a JSON line to the file
    ``GPU_CHECK_RECORDS`` names (scripts/gpu_check.sh sets it under its $OUT; unset: nothing),
    with the CUDA_DEVICE_MAX_CONNECTIONS it ran under -- the issue-35 delays of a device run."""
    import json

    path = os.environ.get("GPU_CHECK_RECORDS")
    if not path:
        return
    row = dict(test=test, cuda_device_max_connections=os.environ.get("CUDA_DEVICE_MAX_CONNECTIONS"), **out)
    with open(path, "a") as f:
        f.write(json.dumps(row, default=str) + "\n")
