"""Fixed cost of ReplicaManager.step on the host executor (tiny tensors: the control plane).

    torchrun --nproc-per-node 4 perf/bench_step.py [--steps 200]

Side by side in one run, per step (forward only: loads -> plan -> weight_sync):
* ``store``: the loads through the group's store (``all_gather_object``), the host ``quota``
  planner and a plan agreement through the store per weight_sync (``plan_check="agree"``) --
  the manager before issue 19;
* ``window``: the manager's default -- the device control plane's host build: the loads through
  the shared-memory window (``LoadBoard``), its quota planner (``device``), the plan handed over
  as a ``ResidentPlan`` and built by its schedule builder (``portable``), checked through the
  window digests (``plan_check="window"``): no store or ``torch.distributed`` call per step.
Prints the median microseconds per step of the slowest rank and the ratio, plus each planner
alone on the same loads.  Measured on whatever machine runs it (CPU).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist

from ultracomm import ExpertLayout, Member
from ultracomm.moe import ReplicaManager
from ultracomm.planners import get_planner


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--experts-per-rank", type=int, default=8)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    epr, E = a.experts_per_rank, a.experts_per_rank * world
    layout = ExpertLayout((Member("w", (16,), torch.float32),))
    g = torch.Generator().manual_seed(rank)
    logits = torch.randn(64, E, generator=g)
    logits[:, :2] += 3
    rmap = torch.zeros(64, E, dtype=torch.bool).scatter_(1, logits.topk(2, dim=1).indices, True)
    out = {}
    for mode in ("store", "window"):
        mgr = ReplicaManager(
            None,
            layout,
            epr,
            2,
            1,
            transport="host",
            window="host_shm",
            plan_check="agree" if mode == "store" else "window",
            planner="quota" if mode == "store" else "device",
        )
        if mode == "store":
            mgr._board = None
        mgr.register_layer(0, [torch.zeros(epr, 16)])
        times = []
        with torch.no_grad():
            for i in range(a.steps + 10):
                dist.barrier()
                t0 = time.perf_counter()
                mgr.step(0, rmap)
                mgr.ctx.synchronize()
                dt = torch.tensor([time.perf_counter() - t0])
                dist.all_reduce(dt, op=dist.ReduceOp.MAX)
                if i >= 10:
                    times.append(float(dt))
        out[mode] = statistics.median(times) * 1e6
        mgr.close()
    load = np.stack([np.bincount(np.arange(E) % E, minlength=E)] * world) * 37
    for name in ("quota", "device"):
        plan = get_planner(name)
        t = []
        for _ in range(50):
            t0 = time.perf_counter()
            plan(load, mgr.domain, 2)
            t.append(time.perf_counter() - t0)
        out[f"{name}_planner"] = statistics.median(t) * 1e6
    if rank == 0:
        print(
            f"world {world}: step store {out['store']:.0f} us, window {out['window']:.0f} us, "
            f"store/window {out['store'] / out['window']:.2f}x; planners alone: quota {out['quota_planner']:.0f} us, "
            f"device {out['device_planner']:.0f} us",
            flush=True,
        )
        if a.json:
            with open(a.json, "w") as f:
                json.dump({"world": world, **out}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
