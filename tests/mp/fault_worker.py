"""Worker of the fault-injection suite (tests/test_faults_mp.py): one rank of a gloo group whose
store the launcher hosts, so that killing or stopping any rank leaves the store up.

The last rank is the victim: depending on the scenario it SIGKILLs or SIGSTOPs itself at a
chosen point, skips an operation or calls a different one.  Every rank writes what happened
to ``rank<R>.json``: the error it raised (type, text), how long the operation under test took
from its start (``elapsed``) and the wall-clock time it raised (``raised_at``).
"""

from __future__ import annotations

import datetime
import json
import os
import signal
import threading
import time
import traceback

SCENARIOS = (
    "setup_kill",
    "setup_stop",
    "between_kill",
    "between_stop",
    "weight_sync_kill",
    "weight_sync_stop",
    "grad_reduce_kill",
    "grad_reduce_stop",
    "skip_op",
    "different_collective",
    "different_ops",
    "store_host_kill",
    "store_host_stop",
)
# in these the victim hosts the group's store itself (as rank 0 does under init_method=tcp://)
STORE_ON_VICTIM = ("store_host_kill", "store_host_stop")


def fault(kind: str) -> None:
    # thread-directed: the calling thread stops (or dies) before it returns to Python; a
    # process-directed kill() lets it run on for a moment
    signal.pthread_kill(threading.get_ident(), signal.SIGKILL if kind == "kill" else signal.SIGSTOP)


def main(rank: int, world: int, port: int, scenario: str, out_dir: str, timeout_s: float) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from ultracomm import Context, ExpertLayout, Member, ReplicaPlan
    from ultracomm.records import Op
    from ultracomm.windows import host_shm

    victim = rank == world - 1
    store = dist.TCPStore(
        "127.0.0.1",
        port,
        world,
        is_master=victim and scenario in STORE_ON_VICTIM,
        timeout=datetime.timedelta(seconds=120),
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    phase, _, kind = scenario.rpartition("_")  # kind: kill | stop for the signal scenarios
    layout = ExpertLayout((Member("w", (64, 64), torch.bfloat16),))
    # rank r holds a replica of expert r+1: every rank depends on its right neighbour
    plan = ReplicaPlan.make(np.array([[(r + 1) % world] for r in range(world)], np.int32), experts_per_rank=1)
    result: dict = {"rank": rank, "pid": os.getpid(), "error": None, "type": None}
    t0 = time.monotonic()

    def under_test() -> None:  # the operation the survivors are timed on starts here
        nonlocal t0
        t0 = time.monotonic()

    try:
        if phase == "setup" and victim:
            real_map = host_shm._map

            def map_then_fault(path, nbytes, create):
                m = real_map(path, nbytes, create)
                if create:  # its segment exists, its name was exchanged: then it dies or stalls
                    fault(kind)
                return m

            host_shm._map = map_then_fault
        under_test()
        # the plan agreement (a store collective per weight_sync) is what the between/skip/store scenarios
        # fault; the host transport's default is the window check since issue 32
        ctx = Context(
            None,
            layout,
            1,
            1,
            num_layers=1,
            max_microbatches=2,
            window="host_shm",
            timeout_s=timeout_s,
            relay_mode="off",
            num_workers=1,
            plan_check="agree",
        )
        ctx.register_masters(
            0, [torch.full((1, 64, 64), float(rank + 1), dtype=torch.bfloat16)], [torch.zeros((1, 64, 64))]
        )
        vid1 = ctx.begin(0)
        ctx.weight_sync(vid1, plan)  # one good operation first
        assert torch.equal(
            ctx.replica_weights[0][0], torch.full((64, 64), float((rank + 1) % world + 1), dtype=torch.bfloat16)
        )
        if victim and phase in ("weight_sync", "grad_reduce"):
            real_run = ctx.transport.run
            target = Op.MULTICAST if phase == "weight_sync" else Op.REDUCE

            def run_then_fault(op, *args, **kw):
                if op == target:
                    fault(kind)
                return real_run(op, *args, **kw)

            ctx.transport.run = run_then_fault
        if victim and phase in ("between", "store_host"):
            fault(kind)
        under_test()
        if phase == "grad_reduce":
            ctx.grad_reduce(vid1)
        elif victim and scenario == "skip_op":
            ctx.grad_reduce(vid1)  # skipped the weight_sync the others are in
        elif victim and scenario == "different_collective":
            Context(None, layout, 1, 1, num_layers=1, window="host_shm", timeout_s=timeout_s, plan_check="agree")
        elif scenario == "different_ops":  # the others reduce while the victim restores
            if victim:
                ctx.restore(vid1)
            else:
                ctx.grad_reduce(vid1)
        else:
            ctx.weight_sync(ctx.begin(0), plan)
        # a survivor whose own operation did not need the victim meets it in the next one
        ctx.weight_sync(ctx.begin(0), plan)
    except Exception as e:  # noqa: BLE001 - the outcome under test
        record_error(result, e)
    report(result, t0, out_dir, rank)


def record_error(result: dict, e: BaseException) -> None:
    """What a survivor raised: text, type, its classes (UltracommTimeout? PlanError?) and where."""
    result.update(
        error=str(e),
        type=type(e).__name__,
        mro=[c.__name__ for c in type(e).__mro__],
        trace=traceback.format_exc()[-3000:],
    )


def report(result: dict, t0: float, out_dir: str, rank: int) -> None:
    """Write ``rank``'s outcome (with its time from ``t0`` and when it raised) and exit at once."""
    result["elapsed"] = time.monotonic() - t0
    result["raised_at"] = time.time()
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # no gloo teardown with a dead peer
