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
