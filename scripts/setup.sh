#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv and build ultracomm into it.
# Safe to run repeatedly; the C++ core is rebuilt incrementally.  Needs Python >= 3.10.
set -euo pipefail
cd "$(dirname "$0")/.."
PY="${PYTHON:-}"
if [ -z "$PY" ]; then
  for c in python3.11 python3; do command -v "$c" >/dev/null && { PY="$c"; break; }; done
fi
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
quiet() { "$@" 2>&1 | grep -vE "^WARNING: Location|^\s*$" || true; return "${PIPESTATUS[0]}"; }
# torch: the CPU 2.13.0 wheel on machines that carry it on local disk; any installed torch >= 2.4 is kept.
if ! python -c "import torch, sys; sys.exit(0 if tuple(map(int, torch.__version__.split('+')[0].split('.')[:2])) >= (2, 4) else 1)" 2>/dev/null; then
  quiet pip install -q "torch==2.13.0" || quiet pip install -q "torch>=2.4"
fi
quiet pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" ninja "cmake>=3.26" numpy "pytest>=8" "hypothesis>=6" matplotlib
# optional extra ultracomm[nvshmem]: its import check runs where it installs (it imports without a GPU)
python -c "import nvshmem.core" 2>/dev/null || quiet pip install -q "nvshmem4py-cu13" || \
  echo "setup: nvshmem4py-cu13 not installed (optional; the nvshmem import check skips)"
# The viewer's browser tests: Playwright's Python API driving the distribution's Chromium (never
# Playwright's own browser downloads).  Guarded: without root, apt-get or network they skip, saying why.
quiet pip install -q playwright || echo "setup: playwright not installed; the viewer's browser tests will skip"
if ! command -v chromium >/dev/null && ! command -v chromium-browser >/dev/null; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null; then
    echo "setup: installing Debian's chromium for the viewer's browser tests"
    export DEBIAN_FRONTEND=noninteractive
    { timeout 900 apt-get install -y -q chromium >/dev/null 2>&1 \
      || { timeout 600 apt-get update -q >/dev/null 2>&1 && timeout 900 apt-get install -y -q chromium >/dev/null 2>&1; }; } \
      || echo "setup: could not install chromium; the viewer's browser tests will skip"
  else
    echo "setup: no chromium, and no root apt-get to install it; the viewer's browser tests will skip"
  fi
fi
# SASS checks of the CUDA kernels without a GPU (tests/test_cuda_build.py): cuobjdump / nvdisasm
quiet pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
echo "setup: building ultracomm (CMake + Ninja through scikit-build-core)"
quiet pip install -q --no-build-isolation -e .
python -c "import ultracomm, ultracomm._core; print('setup: ultracomm', ultracomm.__version__, 'ready in .venv')"
