"""A rank stopped (SIGSTOP) while it waited on the process group's store, and resumed after its
wait's bound passed, reports what happened -- the ranks that did not arrive -- and not that the
store is unreachable and "likely dead": the store answered while the rank was stopped (issue 23
item 9).  The launcher hosts the store, as torchrun's agent does."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
TIMEOUT_S = 1.0
QUICK_S = 2.0  # ultracomm.comm._QUICK_S: the caller's bound is TIMEOUT_S + QUICK_S


@pytest.mark.slow
def test_resumed_rank_does_not_call_a_live_store_dead():
    import torch.distributed as dist

    from ultracomm import comm

    assert comm._QUICK_S == QUICK_S
    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    env = dict(
        os.environ, PYTHONPATH=os.pathsep.join([os.path.join(HERE, "..", "python"), os.environ.get("PYTHONPATH", "")])
    )
    child = subprocess.Popen(
        [sys.executable, os.path.join(HERE, "mp", "store_stall_worker.py"), str(store.port), str(TIMEOUT_S)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        _, status = os.waitpid(child.pid, os.WUNTRACED)  # it stopped itself once the store answered
        assert os.WIFSTOPPED(status), status
        # keep it stopped until its own bound (TIMEOUT_S + QUICK_S from the call, < TIMEOUT_S ago) has passed:
        # the length of the stall is the scenario, nothing here waits for a race
        time.sleep(TIMEOUT_S + QUICK_S + 1.0)
        os.kill(child.pid, signal.SIGCONT)
        out, err = child.communicate(timeout=60)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert out.strip() == (
        "UltracommTimeout: ultracomm: rank 0 test (stalled exchange) timed out after 1 s: ranks [1] did not arrive "
        "(timeout ULTRACOMM_TIMEOUT_S=1); they are likely stalled or dead, or called a different operation: every "
        "rank must call the same collective operations in the same order"
    ), (out, err[-3000:])
