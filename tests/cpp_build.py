"""Builds the host-side C++ probes of tests/cpp/ with g++ (-std=c++20, warnings as errors), the
one way every probe test compiles them: sources relative to the repository root, the project's
include folders, optional CUDA toolkit headers (for the stub-runtime probes) and extra objects."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path
from typing import Optional, Sequence

from cuda_build import find_nvcc

ROOT = Path(__file__).resolve().parents[1]
CXX = shutil.which("g++")
INCLUDES = ("include", "csrc", "csrc/cuda")
# The host side of _cuda's launches (plans, plan arena, runner) and what it validates with: what a
# stub-CUDA-runtime probe links beside its own source.
CUDA_HOST_SOURCES = (
    "csrc/cuda/device_plan.cpp",
    "csrc/cuda/plan_arena.cpp",
    "csrc/cuda/runner.cpp",
    "csrc/host/host_executor.cpp",
    "csrc/host/validate_exec.cpp",
    "csrc/host/error_text.cpp",
)


def cuda_include() -> Optional[Path]:
    """The CUDA toolkit's include folder (cuda_runtime_api.h), or None without a toolkit."""
    nvcc = find_nvcc()
    cands = []
    if nvcc:
        top = Path(os.path.realpath(nvcc)).parent.parent
        cands += [top / "include", top / "targets" / "x86_64-linux" / "include"]
    cands.append(Path("/usr/local/cuda/include"))
    return next((c for c in cands if (c / "cuda_runtime_api.h").exists()), None)


def build_probe(
    exe: Path, sources: Sequence[str], *, opt: str = "-O1", cuda_headers: bool = False, objects: Sequence[str] = ()
) -> Path:
    """g++ ``sources`` (paths relative to the repository root) and ``objects`` into ``exe``; the
    compiler's errors (the last 4000 characters) are the assertion message when it fails."""
    assert CXX is not None, "needs g++"
    incs = [f"-I{ROOT / i}" for i in INCLUDES]
    if cuda_headers:
        inc = cuda_include()
        assert inc is not None, "needs the CUDA toolkit headers"
        incs.append(f"-I{inc}")
    cmd = [CXX, "-std=c++20", opt, "-Wall", "-Wextra", "-Werror", "-pthread", *incs]
    cmd += [str(ROOT / s) for s in sources] + [str(o) for o in objects] + ["-o", str(exe)]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, r.stderr[-4000:]
    return exe
