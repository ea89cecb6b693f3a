#!/usr/bin/env bash
# Set up .venv with the test-only tools too (scripts/setup.sh --test: pytest, hypothesis, ruff,
# import-linter, clang-format, nvshmem4py, Playwright + Chromium, cuobjdump/nvdisasm), build _cuda for
# every CI architecture (sm_80/90/100) where nvcc is found, check the house (lint, the import layers
# of pyproject.toml), and run the whole test suite (CPU; `gpu`-marked tests skip without a device).
# Extra arguments go to pytest, e.g. `bash scripts/test.sh -k schedule`.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh --test
. .venv/bin/activate
echo "== ruff check (pyflakes errors) and ruff format --check (pyproject.toml [tool.ruff])"
ruff check python tests perf examples scripts
ruff format --check python tests perf examples scripts
echo "== clang-format --dry-run --Werror (.clang-format) on csrc/, include/, tests/cpp/"
git ls-files 'csrc/**.h' 'csrc/**.cpp' 'csrc/**.cu' 'csrc/**.cuh' 'include/**.h' 'tests/cpp/*.cpp' \
  | xargs clang-format --dry-run --Werror
echo "== lint-imports (the package's layers and no import cycles; pyproject.toml [tool.importlinter])"
lint-imports --no-cache
export ULTRACOMM_NUM_WORKERS="${ULTRACOMM_NUM_WORKERS:-2}"
exec python -m pytest tests -q "$@"
