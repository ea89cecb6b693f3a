#!/usr/bin/env bash
# One-shot GPU check for a bare single-GPU machine that has torch, nvcc, pytest and ninja but
# no network: builds ultracomm (pip + scikit-build-core when present, else the
# torch.utils.cpp_extension fallback in scripts/build_inplace.py), runs the `gpu`-marked
# tests and the microbenchmarks, and writes logs and JSON under $OUT (default perf/out/gpu).
# Budget: well under 8 minutes (each step has its own timeout).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-perf/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
{
  date -u; nvidia-smi -L 2>&1 || true; nvcc --version 2>&1 | tail -1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
if "$PY" -c "import scikit_build_core, pybind11" 2>/dev/null; then
  echo "gpu_check: building with pip + scikit-build-core (no isolation, no network)"
  timeout 300 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1
  rc_build=$?
else
  echo "gpu_check: no scikit-build-core/pybind11: building with torch.utils.cpp_extension"
  dir=$(timeout 300 "$PY" scripts/build_inplace.py 2> "$OUT/build.log" | tail -1)
  rc_build=$?
  export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
fi
echo "gpu_check: build rc=$rc_build"
[ "$rc_build" = 0 ] || tail -30 "$OUT/build.log"
timeout 240 "$PY" -m pytest tests -q -m gpu --continue-on-collection-errors -p no:cacheprovider \
  --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
rc_test=$?
[ "$rc_test" = 5 ] && rc_test=0  # no gpu-marked test collected
tail -5 "$OUT/gpu-tests.log"
timeout 90 "$PY" perf/bench_host.py --json "$OUT/bench_host.json" > "$OUT/bench_host.log" 2>&1 || echo "bench_host failed"
timeout 60 "$PY" perf/bench_schedule.py --json "$OUT/bench_schedule.json" > "$OUT/bench_schedule.log" 2>&1 || echo "bench_schedule failed"
echo "gpu_check: build=$rc_build tests=$rc_test; results in $OUT"
[ "$rc_build" = 0 ] && [ "$rc_test" = 0 ]
