"""tests/gpu_worker.py: a GPU failure worker that hangs fails its test with every thread's stack
(the device runs of 2026-12-04 lost two hung workers' whereabouts to a plain timeout kill)."""

from __future__ import annotations

import pytest

import gpu_worker


def test_a_hung_worker_reports_every_threads_stack(tmp_path):
    script = tmp_path / "hangs.py"
    script.write_text(
        "import threading, time\n"
        "def blocked_in_a_side_thread():\n    time.sleep(60)\n"
        "threading.Thread(target=blocked_in_a_side_thread, daemon=True).start()\n"
        "print('started', flush=True)\n"
        "time.sleep(60)\n"
    )
    with pytest.raises(AssertionError) as e:
        gpu_worker.run_worker(str(script), timeout_s=2.0)
    msg = str(e.value)
    assert "still ran after 2 s (hung)" in msg
    assert "in blocked_in_a_side_thread" in msg and f'File "{script}", line 6 in <module>' in msg
    assert "stdout: started" in msg


def test_a_finished_worker_returns_its_output(tmp_path):
    script = tmp_path / "done.py"
    script.write_text("import sys\nprint('out', sys.argv[1:])\nsys.exit(3)\n")
    p = gpu_worker.run_worker(str(script), "a", "b", timeout_s=30.0)
    assert (p.returncode, p.stdout) == (3, "out ['a', 'b']\n")
