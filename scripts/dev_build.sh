#!/usr/bin/env bash
# Rebuild the compiled core into the repo's .venv (editable install), serialised with a lock
# so that several developers' builds in one checkout do not collide.
set -uo pipefail
cd "$(dirname "$0")/.."
. .venv/bin/activate
flock /tmp/ultracomm-build.lock pip install -q --no-build-isolation -e . > /tmp/ultracomm-build.$$.log 2>&1
rc=$?
grep -v "^WARNING: Location" /tmp/ultracomm-build.$$.log | tail -60
rm -f /tmp/ultracomm-build.$$.log
exit $rc
