#!/usr/bin/env bash
# Set up .venv, build, and run the whole test suite (CPU; `gpu`-marked tests skip without a device).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k schedule`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
export ULTRACOMM_NUM_WORKERS="${ULTRACOMM_NUM_WORKERS:-2}"
exec python -m pytest tests -q "$@"
