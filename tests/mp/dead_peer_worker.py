"""Worker for the dead-peer test: after one good weight_sync, the last rank exits; the others
call restore() and must get ultracomm's TimeoutError naming the missing rank, in time."""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch
import torch.distributed as dist

from ultracomm import Context, ExpertLayout, Member, ReplicaPlan, UltracommTimeout

TIMEOUT_S = 1.5


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    # the test checks /dev/shm for this run's ranks only (the one that dies included)
    with open(os.path.join(os.environ["DEAD_PEER_RESULTS_DIR"], f"pid{rank}"), "w") as f:
        f.write(str(os.getpid()))
    layout = ExpertLayout((Member("w", (64, 64), torch.bfloat16),))
    ctx = Context(None, layout, 1, 1, num_layers=1, window="host_shm", timeout_s=TIMEOUT_S, relay_mode="off")
    ctx.register_masters(0, [torch.full((1, 64, 64), float(rank), dtype=torch.bfloat16)], [torch.zeros((1, 64, 64))])
    # every rank r holds a replica of expert (r+1) % world: each rank waits on its right neighbour
    plan = ReplicaPlan.make(np.array([[(r + 1) % world] for r in range(world)], np.int32), experts_per_rank=1)
    vid = ctx.begin(0)
    ctx.weight_sync(vid, plan)
    dist.barrier()
    if rank == world - 1:
        os._exit(0)  # dies without a word
    t0 = time.monotonic()
    try:
        ctx.restore(vid)
        result = {"rank": rank, "error": None}
    except UltracommTimeout as e:
        result = {"rank": rank, "error": str(e), "type": type(e).__name__, "elapsed": time.monotonic() - t0}
    # one file per rank: ranks' stdout lines can interleave through the launcher
    with open(os.path.join(os.environ["DEAD_PEER_RESULTS_DIR"], f"rank{rank}.json"), "w") as f:
        json.dump(result, f)
    os._exit(0)


if __name__ == "__main__":
    main()
