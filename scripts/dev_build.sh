#!/usr/bin/env bash
# Rebuild the compiled core into the repo's .venv (editable install), serialised with a lock
# so that several developers' builds in one checkout do not collide.
set -euo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
exec flock /tmp/ultracomm-build.lock pip install -q --no-build-isolation -e . 2>&1 | grep -v "^WARNING: Location" || true
