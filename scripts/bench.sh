#!/usr/bin/env bash
# The main job: set up .venv with what the bench needs (scripts/setup.sh: no test-only tools;
# ultracomm._cuda for this machine's GPU only, none without a GPU), build, and run the torchrun
# bandwidth test of weight_sync (multicast) and grad_reduce (reduction) on the best backend
# present (on a CPU machine: the host executor over POSIX shared memory, gloo for setup).
# Prints an nccl-tests-like table and writes perf/out/bench.json.  Extra arguments go to
# `python -m ultracomm.tools.bench`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
NPROC="${NPROC:-4}"
mkdir -p perf/out
exec torchrun --standalone --nproc-per-node "$NPROC" -m ultracomm.tools.bench all --json perf/out/bench.json "$@"
