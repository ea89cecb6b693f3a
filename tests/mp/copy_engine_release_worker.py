"""One copy_engine failure on a one-GPU loopback domain of 2 ranks (issue 35): does the failed
operation return a named error within 10 ms of its deadline (start + timeout), and does a
``torch.cuda.synchronize()`` after it return (the gates released, no internal stream left
blocked)?  Prints one JSON line.

    python copy_engine_release_worker.py stall|stall_stream|dead|mismatch

stall: rank 1 never joins (its ready flag never rises); dead: rank 1 publishes its digest and
ready flag, then does nothing more (died after joining: rank 0's copies into it run, its copy to
rank 0 never comes); mismatch: the ranks pass different plans.
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np
import torch

from ultracomm import ReplicaPlan
from ultracomm.records import Op
from ultracomm.transports.host import op_digest

# the failure worker's Contexts (two loopback ranks on cuda:0, copy_engine), slots and mismatch
from copy_engine_failure_worker import TIMEOUT_S, contexts, mismatched_weight_sync, slots_of  # noqa: E402

from release_common import SYNC_BOUND_S, describe, device_sync  # noqa: E402,F401 - shared with the other release worker


def lost_peer(dead: bool) -> dict:
    ctxs = contexts()
    plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)
    c0, t0, c1, t1 = ctxs[0], ctxs[0].transport, ctxs[1], ctxs[1].transport
    epoch = max(c._queue.epoch for c in ctxs) + 1
    stream = torch.cuda.current_stream()
    cmds = [
        t.commands(c.schedule_for(plan), c._masters[0], plan.slot_src[c.rank].tolist(), plan.local_index_of.tolist())
        for c, t in zip(ctxs, (t0, t1))
    ]
    before = slots_of(c1) if not dead else None
    with torch.cuda.device(0):
        if dead:  # rank 1 joins (digest, ready) and dies
            t1._enqueue([(t1, [x for x in cmds[1] if x.what in ("digest", "ready")], None)], epoch, stream.cuda_stream)
            torch.cuda.current_stream().synchronize()
        start = time.monotonic()
        digest = op_digest(c0.schedule_for(plan).digest, Op.MULTICAST)
        t0._enqueue([(t0, cmds[0], t0._pending(cmds[0], epoch, digest, "weight_sync"))], epoch, stream.cuda_stream)
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()  # the caller's stream: released by the watchdog's abort
    err = c0._streams.check()  # the Context's view, as Work.wait() / synchronize() raise it: ranks by evidence
    returned = time.monotonic()
    synced, sync_s = device_sync()
    out = dict(
        describe(err),
        late_s=returned - (start + TIMEOUT_S),
        synced=synced,
        sync_s=sync_s,
        untouched=True if dead else slots_of(c1) == before,
        later_work=bool(torch.ones(4, device="cuda:0").sum().item() == 4.0) if synced else False,
    )
    for c in ctxs:
        c.close()
    out["closed"] = True
    return out


def fresh_stream_stall() -> dict:
    """The stall, every call of it (the operation, the event, the later work) on a new
    non-blocking stream made current (torch's streams are cudaStreamNonBlocking)."""
    with torch.cuda.device(0), torch.cuda.stream(torch.cuda.Stream()):
        return dict(lost_peer(False), stream="fresh non-blocking")


def mismatch() -> dict:
    ctxs = contexts()
    errs, waited, before = mismatched_weight_sync(ctxs)
    synced, sync_s = device_sync()
    out = dict(
        errors=[describe(e) for e in errs],
        waited=waited,
        late_s=waited - TIMEOUT_S,
        synced=synced,
        sync_s=sync_s,
        untouched=[slots_of(c) == b for c, b in zip(ctxs, before)] if synced else None,
    )
    for c in ctxs:
        c.close()
    out["closed"] = True
    return out


if __name__ == "__main__":
    rc = 0
    try:
        case = sys.argv[1]
        fn = {
            "stall": lambda: lost_peer(False),
            "dead": lambda: lost_peer(True),
            "mismatch": mismatch,
            "stall_stream": fresh_stream_stall,
        }[case]
        print(json.dumps(dict(case=case, **fn())), flush=True)
    except BaseException:  # noqa: BLE001 - reported, then the same exit as below
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no interpreter teardown (a failure's CUDA cleanup must not decide the exit)
