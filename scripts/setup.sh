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
quiet pip install -q "scikit-build-core>=0.10" "pybind11>=2.12" ninja "cmake>=3.24" numpy "pytest>=8" "hypothesis>=6" matplotlib
echo "setup: building ultracomm (CMake + Ninja through scikit-build-core)"
quiet pip install -q --no-build-isolation -e .
python -c "import ultracomm, ultracomm._core; print('setup: ultracomm', ultracomm.__version__, 'ready in .venv')"
