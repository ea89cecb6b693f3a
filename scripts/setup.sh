#!/usr/bin/env bash
# Set up (or refresh) the project's virtual environment in .venv and build ultracomm into it.
# Safe to run repeatedly; the C++ core is rebuilt incrementally.  Needs Python >= 3.10.
#
#   bash scripts/setup.sh          what scripts/bench.sh (and scripts/report.sh) need: torch, numpy,
#                                  matplotlib (bench --plot, report), the build tools; ultracomm._cuda
#                                  for this machine's GPU(s) only, and none on a machine without a GPU
#   bash scripts/setup.sh --test   also what only the tests need (scripts/test.sh): pytest, hypothesis,
#                                  ruff, import-linter, clang-format,
#                                  nvshmem4py, Playwright + Debian's Chromium (viewer tests; apt-get as
#                                  root), cuobjdump/nvdisasm (SASS checks); _cuda for every architecture of
#                                  csrc/CMakeLists.txt (sm_80/90/100 + PTX) when nvcc is found, GPU or not
#
# Overrides: ULTRACOMM_BUILD_CUDA=OFF|ON|AUTO (build _cuda or not), or
# SKBUILD_CMAKE_DEFINE="ULTRACOMM_CUDA_ARCHITECTURES=90-real" (its architectures).
set -euo pipefail
cd "$(dirname "$0")/.."
MODE=bench
case "${1:-}" in
  "") ;;
  --test) MODE=test ;;
  *) echo "usage: bash scripts/setup.sh [--test]" >&2; exit 2 ;;
esac
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
quiet pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" ninja "cmake>=3.26" numpy matplotlib

if [ "$MODE" = test ]; then
  quiet pip install -q "pytest>=8" "hypothesis>=6"
  # the house's checks (scripts/test.sh): lint, the import layers (pyproject.toml), the C++ format
  quiet pip install -q "ruff>=0.6" "import-linter>=2.1" "clang-format>=18"
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
  # SASS checks of the CUDA kernels without a GPU (tests/cuda/test_cuda_build.py): cuobjdump / nvdisasm
  quiet pip install -q nvidia-cuda-cuobjdump nvidia-cuda-nvdisasm
fi

# Which CUDA architectures _cuda is built for.  Always passed explicitly: CMake caches the value
# in build/, so a build for one GPU would otherwise stay narrowed for the next (CI) build.
ARCHS=$(sed -n 's/^set(ULTRACOMM_CUDA_ARCHITECTURES "\([^"]*\)".*/\1/p' csrc/CMakeLists.txt)  # CI: 80;90;100
what="_cuda for $ARCHS where nvcc is found"
if [ "$MODE" = bench ] && [ -z "${ULTRACOMM_BUILD_CUDA:-}" ]; then
  # this machine's GPUs: torch's view, else nvidia-smi's (a CPU torch wheel on a GPU machine)
  local_archs=$(python -c "import torch
if torch.cuda.is_available():
    print(';'.join(sorted({'%d%d-real' % torch.cuda.get_device_capability(i) for i in range(torch.cuda.device_count())})))" \
    2>/dev/null || true)
  if [ -z "$local_archs" ] && command -v nvidia-smi >/dev/null; then
    local_archs=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | tr -d '. ' | grep -E '^[0-9]+$' \
      | sort -u | sed 's/$/-real/' | paste -sd';' || true)
  fi
  if [ -n "$local_archs" ]; then
    ARCHS=$local_archs
    what="_cuda for this machine's GPU ($ARCHS) where nvcc is found"
  else
    export ULTRACOMM_BUILD_CUDA=OFF  # pyproject.toml passes it to CMake as ULTRACOMM_CUDA
    what="the host module only: no GPU here (scripts/test.sh builds _cuda where nvcc is found)"
  fi
fi
case "${ULTRACOMM_BUILD_CUDA:-AUTO}:$what" in
  OFF:"the host module only"*) ;;
  OFF:*) what="the host module only (ULTRACOMM_BUILD_CUDA=OFF)" ;;
esac
build_opts=()
case "${SKBUILD_CMAKE_DEFINE:-}" in
  *ULTRACOMM_CUDA_ARCHITECTURES=*) ;;  # the caller's choice
  *) build_opts+=(--config-settings="cmake.define.ULTRACOMM_CUDA_ARCHITECTURES=$ARCHS") ;;
esac
echo "setup: building ultracomm (CMake + Ninja through scikit-build-core): $what"
quiet pip install -q --no-build-isolation ${build_opts[@]+"${build_opts[@]}"} -e .
python -c "import importlib.util as u, ultracomm, ultracomm._core
print('setup: ultracomm', ultracomm.__version__, 'ready in .venv;', '_cuda built' if u.find_spec('ultracomm._cuda') else 'no _cuda')"
