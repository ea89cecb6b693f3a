"""The p2p (or split) transport with a peer that dies (SIGKILL) and one that stalls (SIGSTOP), over gloo.

``python tests/mp/p2p_faults.py OUT_DIR [split]``: starts 4 ranks (``split``: memory domains {0, 1} and
{2, 3}, so both faulty ranks are across a domain boundary from the survivors) with torch.multiprocessing; after one
good weight_sync every rank reports in, the launcher kills rank 2 and stops rank 3, and only then
lets ranks 0 and 1 call restore().  Each survivor writes ``OUT_DIR/rankR.json`` with the error it
raised and how long it took.  Plan: rank r holds a replica of expert (r + 1) % 4, so rank 1
receives from the dead rank 2 and rank 0 sends to the stopped rank 3.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time

import torch.multiprocessing as mp

TIMEOUT_S = 3.0
WORLD = 4
KILLED, STOPPED = 2, 3


def worker(rank: int, init_file: str, out_dir: str, reported, go, transport: str) -> None:
    import numpy as np
    import torch
    import torch.distributed as dist

    from ultracomm import Context, ExpertLayout, Member, ReplicaPlan, UltracommTimeout

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=WORLD)
    layout = ExpertLayout((Member("w", (64, 64), torch.bfloat16),))
    extra = {"domain": "a,a,b,b"} if transport == "split" else {}
    ctx = Context(
        None,
        layout,
        1,
        1,
        num_layers=1,
        transport=transport,
        timeout_s=TIMEOUT_S,
        relay_mode="off",
        chunk_bytes=4096,
        tile_bytes=4096,
        **extra,
    )
    ctx.register_masters(0, [torch.full((1, 64, 64), float(rank), dtype=torch.bfloat16)], [torch.zeros((1, 64, 64))])
    plan = ReplicaPlan.make(np.array([[(r + 1) % WORLD] for r in range(WORLD)], np.int32), experts_per_rank=1)
    vid = ctx.begin(0)
    ctx.weight_sync(vid, plan)
    ok = torch.equal(ctx.replica_weights[0][0], torch.full((64, 64), float((rank + 1) % WORLD), dtype=torch.bfloat16))
    reported.put((rank, ok))
    go.wait()  # ranks 2 and 3 are killed / stopped while they wait here
    t0 = time.monotonic()
    try:
        ctx.restore(vid)
        result = {"rank": rank, "error": None}
    except UltracommTimeout as e:
        result = {"rank": rank, "error": str(e), "elapsed": time.monotonic() - t0}
    with open(os.path.join(out_dir, f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)  # no teardown: a peer is gone


def main(out_dir: str, transport: str = "p2p") -> int:
    ctx = mp.get_context("spawn")
    # one event per rank: a process killed inside Event.wait() would block a shared event's set()
    reported, go = ctx.Queue(), [ctx.Event() for _ in range(WORLD)]
    init_file = os.path.join(out_dir, "init")
    procs = [ctx.Process(target=worker, args=(r, init_file, out_dir, reported, go[r], transport)) for r in range(WORLD)]
    for p in procs:
        p.start()
    oks = dict(reported.get(timeout=120) for _ in range(WORLD))
    os.kill(procs[KILLED].pid, signal.SIGKILL)
    procs[KILLED].join()
    os.kill(procs[STOPPED].pid, signal.SIGSTOP)
    for g in go[:KILLED]:
        g.set()
    for p in procs[:KILLED]:
        p.join(60)
    os.kill(procs[STOPPED].pid, signal.SIGKILL)
    procs[STOPPED].join()
    print(json.dumps({"weight_sync_ok": oks, "exitcodes": [p.exitcode for p in procs]}))
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
