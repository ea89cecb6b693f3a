#!/usr/bin/env bash
# One-shot GPU check for a bare single-GPU machine (torch with CUDA, nvcc, pytest, ninja; maybe no
# cmake; no network).  Steps, each under its own timeout and all under one deadline (8 minutes):
#   1. build: pip + scikit-build-core (no isolation, no index; for this GPU's architecture only) when
#      scikit-build-core, pybind11 and cmake are present; if that is missing or fails, scripts/build_inplace.py (torch's
#      cpp_extension: _core and _cuda) into build/inplace, put on PYTHONPATH
#   2. the `gpu`-marked tests (pytest -m gpu: tma, copy_engine and split incl. their stall, dead-peer
#      and plan-mismatch runs in subprocesses, profiler GPU op times), junit XML + log; one line per
#      test (a hang names its test), tracebacks of a test still running after 60 s, and with
#      pytest-timeout installed a 120 s limit per test.  Order (tests/conftest.py gpu_order): issue 35's
#      seven failure workers first (20 s bound each: all hung still leave ~100 s), then bit-exactness
#      against the host executor, then the control plane against its host builds, then the TMA-staged
#      reduce's bit-exactness cases, then the rest
#   2b. the stall cases again with CUDA_DEVICE_MAX_CONNECTIONS=32 (issue 35: does a blocked
#      internal stream still hold up later work when streams do not share hardware queues?)
#      Every failure run's measurements (named error's delay past its deadline, the synchronize
#      after it) are JSON lines in logs/failure_times.jsonl, also appended to env.txt
#   3. perf/bench_gpu.py, every section (issue 37's lb_prefetch included: DeepEP's lb_prefetch_weights test
#      shape, ~10 GiB of device memory, some 10-20 s; the budget keeps 30 s for it and 30 s for copy_engine):
#      tables, results JSON and the hardware profile JSON (rewritten after each section; --budget-s ends
#      it before the step's timeout)
#   3b. perf/bench_nvlink.py (issue 34's two-GPU row: torchrun over two GPUs where there are two, else
#      its "not measured" rows) and the standalone probes named in GPU_CHECK_PROBES (.cu files,
#      built for this GPU and run while time is left; not project code), output in logs/
#   4. if time is left: the CPU benches (host executor, schedule builder) for the record
# A step that runs out of time gets SIGINT (pytest still writes its XML), SIGKILL 10 s later.
# Results under $OUT (default perf/out/gpu), at most 7 files, so that a machine that returns few
# files returns all: env.txt (versions, build result, the final line), gpu-tests.log,
# gpu-tests.xml, bench_gpu.txt, bench_gpu.json, <date>_<device>_profile.json, and logs.tar.gz
# (every step's own output: build logs, bench stderr, CPU benches; `tar xzf logs.tar.gz`).
# Commit the profile and the tables of a real device under perf/gpu/ (date and device in the name):
# `cp $OUT/*_profile.json perf/gpu/`.
# A shorter rerun (a warm machine keeps the build; e.g. after a fix): GPU_CHECK_STEPS, a comma list of
# tests, stall, bench, nvlink, probes, cpu (default all; the build always runs), GPU_CHECK_PYTEST (more
# pytest arguments for the tests step, e.g. '-k "tma or split"'), GPU_CHECK_BENCH (more bench_gpu.py
# arguments, e.g. '--only control,reduce').  A step left out counts as passed.
# Exit status: 0 when the build, the gpu tests (both steps) and the bench (#wrong = 0) all passed;
# 2 when torch sees no CUDA device (after checking the pip build for sm_90: nothing else runs).
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${OUT:-perf/out/gpu}"
LOGS="$OUT/logs"
mkdir -p "$LOGS"
PY="${PYTHON:-python3}"
export PYTHONUNBUFFERED=1
DEADLINE=$((SECONDS + 470))  # the whole check stays under 8 minutes (each step: + 10 s to die)
exec 3>&1  # progress lines go to the terminal even when a step's output goes to a log

# want STEP: whether GPU_CHECK_STEPS asks for it
want() { case ",${GPU_CHECK_STEPS:-all}," in *,all,* | *",$1,"*) return 0 ;; esac; return 1; }

# step NAME CAP CMD...: run CMD with timeout min(CAP, time left before the deadline); its status
step() {
  local name=$1 cap=$2 left=$((DEADLINE - SECONDS)) t0=$SECONDS rc
  shift 2
  if [ "$left" -lt 10 ]; then echo "gpu_check: $name skipped: out of time" >&3; return 124; fi
  [ "$cap" -gt "$left" ] && cap=$left
  echo "gpu_check: $name (timeout ${cap}s)" >&3
  timeout -s INT -k 10 "$cap" "$@"
  rc=$?
  echo "gpu_check: $name rc=$rc in $((SECONDS - t0))s" >&3
  return $rc
}

# pack: every step's own output into one archive beside the results (also on an early exit)
pack() {
  if [ -d "$LOGS" ] && tar -czf "$OUT/logs.tar.gz" -C "$OUT" logs; then rm -rf "$LOGS"; fi
}
trap pack EXIT

{
  date -u; nvidia-smi -L 2>&1 || true; nvcc --version 2>&1 | tail -1; cmake --version 2>&1 | head -1
  "$PY" -c "import torch; print('torch', torch.__version__, 'cuda', torch.version.cuda, torch.cuda.is_available())"
} > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"

# no CUDA device for torch (a CPU machine, a broken driver): nothing here can run; the pip build is
# still checked (for sm_90, the lent H100/H200's), then the script ends with status 2 -- no fallback
# build (it uninstalls ultracomm first), no test or bench step
has_gpu=$("$PY" -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null | tail -1)
rc_build=1
# only this GPU's architecture (a third of the compile; the wheel's default builds every CI target)
if [ -z "${SKBUILD_CMAKE_DEFINE:-}" ]; then
  cc=$("$PY" -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}')" 2>/dev/null) \
    && [ -n "$cc" ] && export SKBUILD_CMAKE_DEFINE="ULTRACOMM_CUDA_ARCHITECTURES=${cc}-real"
  [ "$has_gpu" = 1 ] || export SKBUILD_CMAKE_DEFINE="ULTRACOMM_CUDA_ARCHITECTURES=90-real"
fi
export CUDAFLAGS="${CUDAFLAGS:+$CUDAFLAGS }--threads 0"  # CMake's nvcc: a file's architectures in parallel
if [ -z "${CUDACXX:-}" ]; then  # CMake may miss an nvcc off PATH (build_inplace.py also tries /usr/local/cuda)
  for c in "$(command -v nvcc)" /usr/local/cuda/bin/nvcc; do [ -x "$c" ] && { export CUDACXX="$c"; break; }; done
fi
if "$PY" -c "import scikit_build_core, pybind11" 2>/dev/null && command -v cmake >/dev/null; then
  step build-pip 240 "$PY" -m pip install -v --no-build-isolation --no-deps --no-index -e . > "$LOGS/build.log" 2>&1
  rc_build=$?
  [ "$rc_build" = 0 ] || { echo "gpu_check: pip build failed (rc=$rc_build):"; tail -15 "$LOGS/build.log"; }
else
  echo "gpu_check: no scikit-build-core/pybind11/cmake: skipping the pip build" | tee "$LOGS/build.log"
fi
if [ "$has_gpu" != 1 ]; then
  echo "gpu_check: torch sees no CUDA device: build checked (rc=$rc_build, ${SKBUILD_CMAKE_DEFINE:-}), no gpu" \
    "test or bench run, in ${SECONDS}s" | tee -a "$OUT/env.txt"
  exit 2
fi
if [ "$rc_build" = 0 ] && ! "$PY" -c "import ultracomm._cuda" 2>/dev/null; then
  echo "gpu_check: the pip build has no ultracomm._cuda (CMake found no nvcc?): uninstalling it, trying the fallback build"
  rc_build=1
fi
if [ "$rc_build" != 0 ]; then
  # an editable install's import hook comes before PYTHONPATH and would shadow build/inplace
  "$PY" -m pip uninstall -y ultracomm >> "$LOGS/build.log" 2>&1
  step build-inplace 200 "$PY" scripts/build_inplace.py > "$LOGS/build_inplace.out" 2> "$LOGS/build_inplace.log"
  rc_build=$?
  dir=$(tail -1 "$LOGS/build_inplace.out" 2>/dev/null)
  [ "$rc_build" = 0 ] && export PYTHONPATH="$dir${PYTHONPATH:+:$PYTHONPATH}"
  [ "$rc_build" = 0 ] || { echo "gpu_check: fallback build failed (rc=$rc_build):"; tail -30 "$LOGS/build_inplace.log"; }
fi
"$PY" -c "import ultracomm, ultracomm._core; from ultracomm.cuda.support import cuda_module_reason as r; \
print('gpu_check: ultracomm from', ultracomm.__file__, '; _cuda:', r() or 'loads')" 2>&1 | tee -a "$OUT/env.txt"

per_test=()
"$PY" -c "import pytest_timeout" 2>/dev/null && per_test=(--timeout=120)
export GPU_CHECK_RECORDS="$LOGS/failure_times.jsonl"  # tests/gpu_worker.py's record(): issue 35's delays
rc_test=0
if want tests; then
  eval "extra=(${GPU_CHECK_PYTEST:-})"  # the caller's words, quotes kept
  step gpu-tests 240 "$PY" -m pytest tests -v -m gpu --continue-on-collection-errors -p no:cacheprovider \
    -o faulthandler_timeout=60 ${per_test[@]+"${per_test[@]}"} ${extra[@]+"${extra[@]}"} \
    --junitxml="$OUT/gpu-tests.xml" > "$OUT/gpu-tests.log" 2>&1
  rc_test=$?
  [ "$rc_test" = 5 ] && rc_test=0  # no gpu-marked test collected
  tail -15 "$OUT/gpu-tests.log"
fi

# the stall cases (copy_engine: default stream and a fresh non-blocking one; split) with 32 hardware queues
rc_stall=0
if want stall; then
  step stall-cdmc32 90 env CUDA_DEVICE_MAX_CONNECTIONS=32 "$PY" -m pytest tests/transports/test_copy_engine_gpu.py \
    tests/transports/test_split_cuda_gpu.py -v -m gpu -k "near_its_deadline and stall" -p no:cacheprovider \
    -o faulthandler_timeout=60 ${per_test[@]+"${per_test[@]}"} > "$LOGS/stall-cdmc32.log" 2>&1
  rc_stall=$?
  tail -5 "$LOGS/stall-cdmc32.log"
fi
{ echo "failure timings (issue 35; late_s: the named error past its deadline, sync_s: the synchronize after it):"
  cat "$GPU_CHECK_RECORDS" 2>/dev/null || echo "(none recorded)"; } >> "$OUT/env.txt"

rc_bench=0
if want bench; then
  left=$((DEADLINE - SECONDS))
  budget=$(( (left < 180 ? left : 180) - 25 ))  # the bench stops starting rows in time to print and write
  eval "extra=(${GPU_CHECK_BENCH:-})"
  step bench-gpu 180 "$PY" perf/bench_gpu.py --out "$OUT" --budget-s "$budget" ${extra[@]+"${extra[@]}"} \
    > "$OUT/bench_gpu.txt" 2> "$LOGS/bench_gpu.log"
  rc_bench=$?
  cat "$OUT/bench_gpu.txt"
  [ "$rc_bench" = 0 ] || { echo "gpu_check: bench_gpu rc=$rc_bench"; tail -20 "$LOGS/bench_gpu.log"; }
fi

# issue 34's two-GPU row (tile mover vs peer cudaMemcpyAsync over NVLink, perf/bench_nvlink.py): one rank
# per GPU under torchrun where two GPUs are visible; else its "not measured" rows.  Output in logs/
ngpu=$("$PY" -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
if ! want nvlink; then
  :
elif [ "${ngpu:-0}" -ge 2 ]; then
  step bench-nvlink 150 "$PY" -m torch.distributed.run --standalone --nproc-per-node 2 perf/bench_nvlink.py \
    --out "$LOGS/nvlink" > "$LOGS/bench_nvlink.txt" 2>&1
  echo "gpu_check: bench_nvlink rc=$?"; tail -30 "$LOGS/bench_nvlink.txt"
else
  "$PY" perf/bench_nvlink.py --out "$LOGS/nvlink" > "$LOGS/bench_nvlink.txt" 2>&1
  echo "gpu_check: bench_nvlink: $(head -1 "$LOGS/bench_nvlink.txt")"
fi

# standalone probes (not project code; e.g. ../shared/probes/tma_ladder.cu copied into the tree for
# the device call) named in GPU_CHECK_PROBES: built for this GPU and run while time is left
arch=$("$PY" -c "import torch; M, m = torch.cuda.get_device_capability(); print(f'{M}{m}')" 2>/dev/null)
want probes || GPU_CHECK_PROBES=
for probe in ${GPU_CHECK_PROBES:-}; do
  name=$(basename "$probe" .cu)
  step "probe-$name-build" 60 nvcc -std=c++17 -O3 -arch="sm_${arch:-90}" -o "$LOGS/$name" "$probe" \
    > "$LOGS/probe_$name.txt" 2>&1 && step "probe-$name" 60 "$LOGS/$name" >> "$LOGS/probe_$name.txt" 2>&1
  tail -40 "$LOGS/probe_$name.txt"
done

if want cpu; then
  step bench-host 40 "$PY" perf/bench_host.py --json "$LOGS/bench_host.json" > "$LOGS/bench_host.log" 2>&1 \
    || echo "gpu_check: bench_host did not finish"
  step bench-schedule 30 "$PY" perf/bench_schedule.py --json "$LOGS/bench_schedule.json" \
    > "$LOGS/bench_schedule.log" 2>&1 || echo "gpu_check: bench_schedule did not finish"
fi
echo "gpu_check: build=$rc_build tests=$rc_test stall-cdmc32=$rc_stall bench=$rc_bench in ${SECONDS}s; results in $OUT" \
  | tee -a "$OUT/env.txt"
[ "$rc_build" = 0 ] && [ "$rc_test" = 0 ] && [ "$rc_stall" = 0 ] && [ "$rc_bench" = 0 ]
