"""Fault injection across real processes: one of three gloo ranks is SIGKILLed or SIGSTOPped
during setup, between operations, in weight_sync or in grad_reduce, skips an operation or calls
a different one.  Every survivor raises ``UltracommTimeout`` (or, for ranks in different
collectives, the clear error) within the timeout plus a small margin, a stopped rank that is
resumed raises too, and /dev/shm is clean afterwards.

The launcher (this process) hosts the group's TCPStore, as torchrun's agent does, so that a
killed or stopped rank never takes the store with it.  Workers are forked from a forkserver
that has torch and ultracomm imported already, which keeps a scenario to a few seconds.
"""

from __future__ import annotations

import json
import multiprocessing
import contextlib
import os
import signal
import socket
import sys
import time

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "mp"))
from conftest import leftover_segments, shm_segments  # noqa: E402

import fault_worker  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory (/dev/shm)"),
]

WORLD = 3
TIMEOUT_S = 2.0
# start-up of the executor, Python and a loaded 2-core CI machine; a silent store host adds
# ultracomm.comm._QUICK_S (2 s) on top of the timeout
MARGIN_S = 4.0

_CTX = None


def _mp():
    global _CTX
    if _CTX is None:
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(["torch", "torch.distributed", "ultracomm.context", "fault_worker"])
    return _CTX


def _launch(scenario: str, out_dir: str) -> tuple[list[dict], dict, float | None]:
    import torch.distributed as dist

    if scenario in fault_worker.STORE_ON_VICTIM:
        store = None
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
    else:
        store = dist.TCPStore("127.0.0.1", 0, WORLD, is_master=True, wait_for_workers=False)
        port = store.port
    ctx = _mp()
    env_before = os.environ.get("OMP_NUM_THREADS")
    procs = [
        ctx.Process(target=fault_worker.main, args=(r, WORLD, port, scenario, out_dir, TIMEOUT_S)) for r in range(WORLD)
    ]
    for p in procs:
        p.start()
    victim = procs[-1]
    deadline = time.monotonic() + 120
    for p in procs[:-1]:
        p.join(max(1.0, deadline - time.monotonic()))
    resumed_at = None
    if victim.is_alive() and victim.pid is not None:
        # a stopped victim is resumed once the survivors are done: it must raise too
        resumed_at = time.time()
        with contextlib.suppress(ProcessLookupError):  # it may have exited since is_alive()
            os.kill(victim.pid, signal.SIGCONT)
    victim.join(max(1.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.kill()
            p.join()
    del store
    if env_before is None:
        os.environ.pop("OMP_NUM_THREADS", None)
    results = {}
    for r in range(WORLD):
        path = os.path.join(out_dir, f"rank{r}.json")
        if os.path.exists(path):
            with open(path) as f:
                results[r] = json.load(f)
    codes = [p.exitcode for p in procs]
    return [results.get(r) for r in range(WORLD)], {"exitcodes": codes, "pids": {p.pid for p in procs}}, resumed_at


# the executor's own timeout: names the rank awaited, and that its ready flag shows it never started
_EXECUTOR = r"rank {{r}} {op} epoch 2 timed out after 2 s waiting for rank 2.*rank 2 has not started this operation"
# scenario -> (what each survivor's error must say, what the victim's must say or "killed")
EXPECT = {
    "setup_kill": (
        r"rank {r} Context setup \(host_shm segment creation\) timed out after 2 s: ranks \[2\] did not "
        r"arrive",
        "killed",
    ),
    "setup_stop": (
        r"rank {r} Context setup \(host_shm segment creation\) timed out after 2 s: ranks \[2\] did not "
        r"arrive",
        r"rank 2 Context setup \(host_shm segment creation\): ranks \[0, 1\] had already timed "
        r"out waiting for this rank",
    ),
    "between_kill": (
        r"rank {r} weight_sync \(plan agreement\) timed out after 2 s: ranks \[2\] did not arrive",
        "killed",
    ),
    "between_stop": (
        r"rank {r} weight_sync \(plan agreement\) timed out after 2 s: ranks \[2\] did not arrive",
        r"rank 2 weight_sync \(plan agreement\): ranks \[0, 1\] had already timed out",
    ),
    "weight_sync_kill": (_EXECUTOR.format(op=r"weight_sync \(multicast\)"), "killed"),
    "weight_sync_stop": (
        _EXECUTOR.format(op=r"weight_sync \(multicast\)"),
        r"rank 2 weight_sync \(multicast\) epoch 2 timed out after 2 s",
    ),
    "grad_reduce_kill": (_EXECUTOR.format(op=r"grad_reduce \(reduce\)"), "killed"),
    "grad_reduce_stop": (
        _EXECUTOR.format(op=r"grad_reduce \(reduce\)"),
        r"rank 2 grad_reduce \(reduce\) epoch 2 timed out after 2 s",
    ),
    "skip_op": (
        r"rank {r} weight_sync \(plan agreement\) timed out after 2 s: ranks \[2\] did not arrive",
        r"rank 2 grad_reduce \(reduce\) epoch 2 timed out after 2 s",
    ),
    "different_collective": (
        r"rank {r} weight_sync \(plan agreement\): ranks called different operations \(rank 2 "
        r"posted Context setup \(configuration\)\)",
        r"rank 2 Context setup \(configuration\): ranks called different operations \(ranks "
        r"\[0, 1\] posted weight_sync \(plan agreement\)\)",
    ),
    "different_ops": (
        _EXECUTOR.format(op=r"grad_reduce \(reduce\)"),
        r"rank 2 restore \(multicast\) epoch 2 timed out after 2 s",
    ),
    # the store went with its host: unreachable at once (killed) or silent (stopped)
    "store_host_kill": (r"rank {r} weight_sync \(plan agreement\): the process group's store is unreachable", "killed"),
    "store_host_stop": (
        r"rank {r} weight_sync \(plan agreement\)(: the process group's store is unreachable| timed "
        r"out after 2 s: ranks \[2\] did not arrive)",
        r"rank 2 weight_sync",
    ),
}


@pytest.mark.parametrize("scenario", fault_worker.SCENARIOS)
def test_every_survivor_raises_within_the_timeout(scenario, tmp_path):
    import re

    assert set(EXPECT) == set(fault_worker.SCENARIOS)
    before = shm_segments()
    results, info, resumed_at = _launch(scenario, str(tmp_path))
    detail = json.dumps(results, indent=1)[-6000:]
    survivor_pattern, victim_pattern = EXPECT[scenario]
    for r in range(WORLD - 1):
        res = results[r]
        assert res is not None, f"rank {r} reported nothing: {info} {detail}"
        assert res["error"] is not None, f"rank {r} did not raise: {detail}"
        want_type = "PlanMismatchError" if scenario == "different_collective" else "UltracommTimeout"
        assert want_type in res["mro"], detail
        assert re.search(survivor_pattern.format(r=r), res["error"]), detail
        bound = TIMEOUT_S + MARGIN_S
        if scenario == "different_collective":
            bound = MARGIN_S  # nobody waits for the timeout: they see it at once
        assert res["elapsed"] <= bound, (r, res["elapsed"], detail)
    victim = results[WORLD - 1]
    if victim_pattern == "killed":
        assert victim is None and info["exitcodes"][-1] == -signal.SIGKILL, (info, detail)
    else:
        assert victim is not None and victim["error"] is not None, (info, detail)
        assert re.search(victim_pattern, victim["error"]), detail
        if resumed_at is not None:  # a resumed rank raises within the timeout too
            assert victim["raised_at"] - resumed_at <= TIMEOUT_S + MARGIN_S, detail
        else:
            assert victim["elapsed"] <= TIMEOUT_S + MARGIN_S, detail
    assert not leftover_segments(before, info["pids"]), "host_shm segments left in /dev/shm"
