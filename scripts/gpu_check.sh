#!/usr/bin/env bash
# One-shot GPU check for a bare single-GPU machine that has torch, nvcc, pytest and ninja but
# no network: builds ultracomm in place (no venv, no downloads), runs the `gpu`-marked tests
# and the microbenchmarks, and writes logs and JSON under $OUT (default: perf/out/gpu).
# Budget: well under 8 minutes.
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-perf/out/gpu}"
mkdir -p "$OUT"
PY="${PYTHON:-python3}"
{
  date -u; nvidia-smi -L 2>&1 || true; nvcc --version 2>&1 | tail -1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1
echo "gpu_check: building (no build isolation, no network)"
timeout 300 "$PY" -m pip install --no-build-isolation --no-deps --no-index -e . > "$OUT/build.log" 2>&1
rc_build=$?
echo "gpu_check: build rc=$rc_build"
timeout 180 "$PY" -m pytest tests -q -m gpu --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
rc_test=$?
[ "$rc_test" = 5 ] && rc_test=0  # no gpu-marked test collected yet
tail -3 "$OUT/gpu-tests.log"
timeout 120 "$PY" perf/bench_host.py --json "$OUT/bench_host.json" > "$OUT/bench_host.log" 2>&1 || true
timeout 60 "$PY" perf/bench_schedule.py --json "$OUT/bench_schedule.json" > "$OUT/bench_schedule.log" 2>&1 || true
echo "gpu_check: build=$rc_build tests=$rc_test; results in $OUT"
[ "$rc_build" = 0 ] && [ "$rc_test" = 0 ]
