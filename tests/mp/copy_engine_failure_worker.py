"""One copy_engine failure on a one-GPU loopback domain of 2 ranks, in its own process (its
internal streams stay blocked for good after the failure, which would hang any later device-wide
synchronize of a test process).  Prints one JSON line with what the test checks.

    python copy_engine_failure_worker.py stalled|mismatch
"""

from __future__ import annotations

import json
import os
import sys
import time
import traceback

import numpy as np
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.records import Op
from ultracomm.transports.host import op_digest

LAYOUT = ExpertLayout((Member("fc1", (40, 24), torch.float32), Member("fc2", (56,), torch.float32)))
TIMEOUT_S = 2.0


def contexts():
    ctxs = LoopbackDomain(2).run(
        lambda g: Context(
            g,
            LAYOUT,
            1,
            1,
            num_layers=1,
            transport="copy_engine",
            window="cuda_local",
            device="cuda:0",
            chunk_bytes=1024,
            tile_bytes=256,
            timeout_s=TIMEOUT_S,
        )
    )
    for c in ctxs:
        w = [torch.full((1, *m.shape), float(c.rank + 1), device="cuda:0") for m in LAYOUT.members]
        c.register_masters(0, w, [torch.zeros_like(t) for t in w])
    return ctxs


def slots_of(ctx) -> list:
    end = ctx.wlayout["ready_off"]
    return ctx.window.local[:end].cpu().tolist()  # a copy on the caller's stream: no device-wide sync


def stalled() -> dict:
    """Rank 0 runs weight_sync alone (enqueued below the Context, as its share of a set rank 1
    never joins): rank 1 never publishes ready; rank 0's watchdog times out."""
    ctxs = contexts()
    plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)
    c0, t0 = ctxs[0], ctxs[0].transport
    before = slots_of(ctxs[1])
    sched = c0.schedule_for(plan)
    epoch = c0._queue.epoch + 1
    cmds = t0.commands(sched, c0._masters[0], plan.slot_src[0].tolist(), plan.local_index_of.tolist())
    stream = torch.cuda.current_stream()
    t0_ = time.monotonic()
    with torch.cuda.device(0):
        t0._enqueue(
            [(t0, cmds, t0._pending(cmds, epoch, op_digest(sched.digest, Op.MULTICAST), "weight_sync"))],
            epoch,
            stream.cuda_stream,
        )
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()  # the caller's stream is released by the watchdog's abort
    waited = time.monotonic() - t0_
    after_ok = bool(torch.ones(4, device="cuda:0").sum().item() == 4.0)  # later work on the stream runs
    try:
        t0.check_error()
        err = None
    except Exception as e:  # noqa: BLE001 - reported
        err = f"{type(e).__name__}: {e}"
    out = dict(
        error=err,
        waited=waited,
        later_work=after_ok,
        untouched=slots_of(ctxs[1]) == before,
        abandoned=t0.abandoned_streams(),
    )
    for c in ctxs:
        c.close()  # must not hang on the blocked internal streams
    out["closed"] = True
    return out


def mismatched_weight_sync(ctxs) -> tuple[list, float, list]:
    """Rank 0 weight_syncs plan A, rank 1 plan B; each rank's error from synchronize() (or None),
    the seconds that took, and each rank's slots before."""
    plans = [
        ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1),
        ReplicaPlan.make(np.array([[1], [-1]], np.int32), experts_per_rank=1),
    ]
    before = [slots_of(c) for c in ctxs]
    start = time.monotonic()
    for c, p in zip(ctxs, plans):
        c.weight_sync(c.begin(0), p)
    errs = []
    for c in ctxs:
        try:
            c.synchronize()
            errs.append(None)
        except Exception as e:  # noqa: BLE001 - reported
            errs.append(e)
    return errs, time.monotonic() - start, before


def mismatch() -> dict:
    """Rank 0 passes plan A, rank 1 plan B (a stream-ordered Context agrees nothing on the CPU):
    the digest-equality waits keep every copy out, the watchdogs raise PlanError."""
    ctxs = contexts()
    errs, waited, before = mismatched_weight_sync(ctxs)
    out = dict(
        errors=[None if e is None else f"{type(e).__name__}: {e}" for e in errs],
        waited=waited,
        untouched=[slots_of(c) == b for c, b in zip(ctxs, before)],
    )
    for c in ctxs:
        c.close()
    out["closed"] = True
    return out


if __name__ == "__main__":
    rc = 0
    try:
        print(json.dumps({"stalled": stalled, "mismatch": mismatch}[sys.argv[1]]()), flush=True)
    except BaseException:  # noqa: BLE001 - reported, then the same exit as below
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    # no interpreter teardown: its CUDA cleanup (a cudaFree, a context release) could wait for the
    # internal streams the failure left blocked for good, and the test would see a timeout
    os._exit(rc)
