"""One failure of the GPU split transport on a one-GPU loopback domain of 4 ranks (domains {0, 1}
and {2, 3}), issue 35: does the failed weight_sync return a named error within 10 ms of its
deadline (operation start + timeout), and does a ``torch.cuda.synchronize()`` after it return
(the side stream's gates released, nothing left blocked)?  Prints one JSON line.

    python split_cuda_release_worker.py stall|dead|mismatch

Each case first runs one good weight_sync (same shapes: the gate kernel's JIT, the plan arena and
the caches are warm, so the failed operation's start is the launching rank's call, not a cold
start).  Then, with rank 0 the home of expert 0 and its replicas on ranks 2 and 3 (across):

* stall: rank 0's kernel share runs with its task list withheld -- it joins (ready, digest) but
  never copies expert 0 into its shadows, so the side stream's wait gate for that chunk never
  passes (released by the watchdog's ``open`` word) and the kernels of ranks 2 and 3 time out
  waiting for rank 0's chunk;
* dead: rank 0's kernel runs in full, but the crossings from rank 0 never arrive: each copy out
  of rank 0 in the side stream's merged sequence is replaced by a wait for a word nobody writes
  (what a receive whose sender died is to the side stream: only a local release ends it); the
  flag writes behind it stay (write gates, skipped after the release);
* mismatch: rank 3 passes another plan (found before anything is enqueued: PlanMismatchError on
  every rank, before the deadline).
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
from ultracomm.transports.split import cuda as split_cuda
from ultracomm.transports.split.cuda_movers import Spaces
from ultracomm.transports.split.stream import COPY, OWN, WAIT_GE, Ref, StreamOp

LAYOUT = ExpertLayout((Member("fc1", (40, 24), torch.float32), Member("fc2", (56,), torch.float32)))
TIMEOUT_S = 2.0
from release_common import SYNC_BOUND_S, describe, device_sync  # noqa: E402,F401 - shared with the other release worker

DEAD = -7  # the spaces key of the word nobody writes (dead case)
PLAN = ReplicaPlan.make(np.array([[-1], [-1], [0], [0]], np.int32), experts_per_rank=1)
OTHER = ReplicaPlan.make(np.array([[-1], [-1], [0], [-1]], np.int32), experts_per_rank=1)


def contexts(timeout_s: float = TIMEOUT_S):
    ctxs = LoopbackDomain(4).run(
        lambda g: Context(
            g,
            LAYOUT,
            1,
            1,
            num_layers=1,
            transport="split",
            window="cuda_local",
            device="cuda:0",
            domain="a,a,b,b",
            node_of=[0, 0, 1, 1],
            relay_mode="off",
            chunk_bytes=1024,
            tile_bytes=256,
            timeout_s=timeout_s,
        )
    )
    for c in ctxs:
        w = [torch.full((1, *m.shape), float(c.rank + 1), device="cuda:0") for m in LAYOUT.members]
        c.register_masters(0, w, [torch.zeros_like(t) for t in w])
    return ctxs


def warm_up(ctxs) -> None:
    for c in ctxs:
        c.weight_sync(c.begin(0), PLAN)
    for c in ctxs:
        c.synchronize()


def withhold_rank0(ctxs) -> None:
    tma0 = ctxs[0].transport.tma
    rank_args = tma0._rank_args

    def withheld(*args):
        key, make = rank_args(*args)

        def make_empty() -> dict:
            d = make()
            d["tasks"] = d["tasks"][:0]
            return d

        return key + ("withheld",), make_empty

    tma0._rank_args = withheld


def kill_rank0_crossings(ctxs) -> torch.Tensor:
    """The side stream's copies out of rank 0 become waits for a word nobody writes."""
    word = torch.zeros(16, dtype=torch.uint8, device="cuda:0")
    for c in ctxs:
        c.transport._spaces_of[DEAD] = Spaces(word, None)
        c.transport._seqs.clear()  # the warm-up's sequence is cached per op digest
    merge = split_cuda.loopback_sequence

    def dead_sequence(progs, wlayout):
        return [
            StreamOp(WAIT_GE, Ref(OWN, 0), key=o.key, what=f"{o.what} (rank 0 dead)", rank=DEAD)
            if o.kind == COPY and o.peer == 0
            else o
            for o in merge(progs, wlayout)
        ]

    split_cuda.loopback_sequence = dead_sequence
    return word


def lost_peer(case: str) -> dict:
    ctxs = contexts()
    warm_up(ctxs)
    keep = withhold_rank0(ctxs) if case == "stall" else kill_rank0_crossings(ctxs)  # noqa: F841 - keep the word
    stream = torch.cuda.current_stream()
    vids = [c.begin(0) for c in ctxs]
    for c, v in zip(ctxs[:3], vids):
        c.weight_sync(v, PLAN)  # deposits: the set launches at the last rank's call
    start = time.monotonic()
    ctxs[3].weight_sync(vids[3], PLAN)
    enqueued = time.monotonic() - start
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()  # released by the watchdog (the join) and the kernels' own deadlines
    # each Context's view, as Work.wait() / synchronize() raise it: ranks named by evidence (issue 35)
    errors = [c._streams.check() for c in ctxs]
    returned = time.monotonic()
    named = [e for e in errors if e is not None]
    synced, sync_s = device_sync()
    later = bool(torch.ones(4, device="cuda:0").sum().item() == 4.0) if synced else False
    out = dict(
        describe(named[0] if named else None),
        errors=[describe(e) for e in errors],
        enqueue_s=enqueued,
        late_s=returned - (start + TIMEOUT_S),
        synced=synced,
        sync_s=sync_s,
        later_work=later,
        released=[bool(c.transport.dog.released()) for c in ctxs],
        abandoned=[c.transport.abandoned_streams() for c in ctxs],
    )
    for c in ctxs:
        c.close()  # must not hang
    out["closed"] = True
    return out


def mismatch() -> dict:
    ctxs = contexts()
    warm_up(ctxs)
    vids = [c.begin(0) for c in ctxs]
    errors: list = [None] * 4
    start = time.monotonic()
    for c, v in zip(ctxs, vids):
        try:
            c.weight_sync(v, OTHER if c.rank == 3 else PLAN)
        except Exception as e:  # noqa: BLE001 - reported
            errors[c.rank] = e
    for c in ctxs:
        try:
            c.synchronize()
        except Exception as e:  # noqa: BLE001 - reported
            errors[c.rank] = errors[c.rank] or e
    waited = time.monotonic() - start
    synced, sync_s = device_sync()
    out = dict(
        errors=[describe(e) for e in errors], waited=waited, late_s=waited - TIMEOUT_S, synced=synced, sync_s=sync_s
    )
    for c in ctxs:
        c.close()
    out["closed"] = True
    return out


if __name__ == "__main__":
    rc = 0
    try:
        case = sys.argv[1]
        fn = {"stall": lambda: lost_peer("stall"), "dead": lambda: lost_peer("dead"), "mismatch": mismatch}[case]
        print(json.dumps(dict(case=case, **fn())), flush=True)
    except BaseException:  # noqa: BLE001 - reported, then the same exit as below
        traceback.print_exc()
        rc = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(rc)  # no interpreter teardown (a failure's CUDA cleanup must not decide the exit)
