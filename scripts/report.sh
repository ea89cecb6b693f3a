#!/usr/bin/env bash
# Regenerate perf/README.md (simulated + measured tables and plots) in one command.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
. .venv/bin/activate
exec python perf/report.py "$@"
