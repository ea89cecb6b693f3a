"""README.md's ``Context`` and FP8 snippets run as written, in a gloo world of 2 (torchrun); the
"Using it" snippet is examples/quickstart.py's key lines (tests/moe/test_example_quickstart.py)."""

from __future__ import annotations

import re

import pytest

from conftest import leftover_segments, shm_segments
from test_multiprocess import torchrun


@pytest.mark.slow
def test_readme_context_and_fp8_snippets_run():
    before = shm_segments()
    p = torchrun("readme_snippets_worker.py", 2)
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    assert "rank 0 OK" in p.stdout and "rank 1 OK" in p.stdout
    pids = {int(x) for x in re.findall(r"rank \d OK \(pid (\d+)\)", p.stdout)}
    assert len(pids) == 2 and not leftover_segments(before, pids), "host_shm segments left in /dev/shm"
