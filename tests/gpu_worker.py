"""Run a GPU failure worker (tests/mp/*_worker.py) in its own process with a bound: a worker still
running at the bound gets SIGABRT, which ``-X faulthandler`` turns into every thread's Python
stack on its stderr, and the test fails with those stacks -- where a device run hung is then in
the test's report (a plain timeout kill would leave nothing to read)."""
from __future__ import annotations

import os
import signal
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(script: str, *args: str, timeout_s: float = 40.0) -> subprocess.CompletedProcess:
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
        raise AssertionError(f"{script} {' '.join(args)} still ran after {timeout_s:g} s (hung); its threads:\n"
                             f"{err[-6000:]}\nstdout: {out[-1000:]}") from None
    return subprocess.CompletedProcess(cmd, p.returncode, out, err)
