"""Bandwidth test of weight_sync (multicast) and grad_reduce (reduction), nccl-tests style.

    torchrun --nproc-per-node 4 -m ultracomm.bench all [--min-bytes 1M --max-bytes 64M --factor 4]

Workload ``hot-rank`` (default): rank 0's experts are replicated into every replica slot
of every other rank, the pattern that makes the home's link the bottleneck of a direct
multicast.  ``random``: each slot holds a random expert of another rank.

Columns (bytes are counted as follows):

* ``size``: bytes of one expert (weights for weight_sync; fp32 grads for grad_reduce).
* ``replicas``: replica slots filled by the plan; ``moved`` = replicas × size.
* ``time``: median (and p90) over ``--iters`` of the slowest rank's time for one operation.
* ``algbw`` = size / time; ``busbw`` = algbw × 1 (like broadcast / reduce, one copy per
  receiver); ``cpbw`` (critical path) = the busiest rank's egress (multicast) or ingress
  (reduce) bytes in the schedule / time; ``lb`` = the busiest rank's bytes / the lower
  bound of DESIGN.md (1.00 = optimal traffic).
* ``#wrong``: elements that differ from the expected result, checked after every run.

Each row is measured for the direct schedule (relay off) and the relay schedule (auto) in
the same run.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np
import torch
import torch.distributed as dist


def parse_size(s: str) -> int:
    mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}
    s = s.strip().upper().rstrip("B")
    return int(float(s[:-1]) * mult[s[-1]]) if s and s[-1] in mult else int(s)


def make_plan(workload: str, world: int, slots: int, epr: int, seed: int = 0):
    from .plan import ReplicaPlan

    src = np.full((world, slots), -1, dtype=np.int32)
    rng = np.random.default_rng(seed)
    for r in range(world):
        if workload == "hot-rank":
            if r != 0:
                src[r, :] = np.arange(min(slots, epr))[: slots].tolist() + [-1] * max(0, slots - epr)
        elif workload == "random":
            cands = [e for e in range(world * epr) if e // epr != r]
            src[r, :] = rng.choice(cands, size=slots, replace=False)
        else:
            raise SystemExit(f"unknown workload {workload!r}: use hot-rank or random")
    return ReplicaPlan.make(src, experts_per_rank=epr)


def _times(fn, iters: int, warmup: int, group, setup=None) -> list[float]:
    """Slowest rank's time of ``fn()`` per iteration (``setup()`` runs untimed before it)."""
    out = []
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        dist.barrier(group)
        t0 = time.perf_counter()
        fn()
        dt = time.perf_counter() - t0
        t = torch.tensor([dt], dtype=torch.float64)
        dist.all_reduce(t, op=dist.ReduceOp.MAX, group=group)
        if i >= warmup:
            out.append(float(t))
    return out


def run_case(op: str, size: int, args, rank: int, world: int) -> list[dict]:
    from .context import Context
    from .layout import ExpertLayout, Member

    n = max(1, size // 2)
    layout = ExpertLayout((Member("w", (n,), torch.bfloat16),), grad_dtype=torch.float32)
    epr, slots = args.experts_per_rank, args.slots
    plan = make_plan(args.workload, world, slots, epr)
    rows = []
    for mode in ("off", "auto"):
        ctx = Context(None, layout, epr, slots, num_layers=1, relay_mode=mode, chunk_bytes=args.chunk_bytes,
                      transport=args.transport)
        w = torch.arange(epr * n, dtype=torch.float32).reshape(epr, n).add_(rank * 7).to(torch.bfloat16)
        g = torch.zeros((epr, n), dtype=torch.float32)
        ctx.register_masters(0, [w], [g])
        sched = ctx.schedule_for(plan)
        st = sched.stats("multicast" if op == "weight_sync" else "reduce")
        wrong = 0
        vid = ctx.begin(0)
        ctx.weight_sync(vid, plan)
        if op == "weight_sync":
            times = _times(lambda: ctx.restore(vid), args.iters, args.warmup, None)
            for s, e in enumerate(plan.slot_src[rank].tolist()):
                if e >= 0:
                    home = e // epr
                    want = torch.arange(n, dtype=torch.float32).add_((e % epr) * n + home * 7).to(torch.bfloat16)
                    wrong += int((ctx.replica_weights[0][s] != want).sum())
            ctx.end(vid)
            moved_size = layout.weight_bytes
        else:
            ctx.end(vid)
            state = {}

            def setup():  # untimed: fresh inputs (relays overwrite their slot with the partial)
                g.zero_()
                ctx.replica_grads[0].fill_(1.0)  # small integers: exact in any order, so checkable
                state["vid"] = ctx.begin(0)
                ctx.weight_sync(state["vid"], plan)

            times = _times(lambda: ctx.grad_reduce(state["vid"]), args.iters, args.warmup, None, setup)
            counts = plan.num_replicas
            for i, e in enumerate(range(rank * epr, (rank + 1) * epr)):
                wrong += int((g[i] != float(counts[e])).sum())
            moved_size = layout.grad_bytes
        wrong_t = torch.tensor([wrong], dtype=torch.int64)
        dist.all_reduce(wrong_t)
        ctx.close()
        med = statistics.median(times)
        p90 = sorted(times)[min(len(times) - 1, int(0.9 * len(times)))]
        busiest = st["max_egress"] if op == "weight_sync" else st["max_ingress"]
        replicas = int((plan.slot_src >= 0).sum())
        rows.append({
            "op": op, "mode": mode, "size": moved_size, "replicas": replicas, "moved_bytes": replicas * moved_size,
            "time_us": med * 1e6, "p90_us": p90 * 1e6, "algbw_GBps": moved_size / med / 1e9,
            "busbw_GBps": moved_size / med / 1e9, "cpbw_GBps": busiest / med / 1e9,
            "lb_ratio": busiest / max(1, st["lower_bound_bytes"]), "depth": st["depth"], "wrong": int(wrong_t),
        })
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ultracomm.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("op", choices=["weight_sync", "grad_reduce", "all"])
    p.add_argument("--transport", default=None, help="transport (default: ULTRACOMM_TRANSPORT / auto)")
    p.add_argument("--workload", default="hot-rank", choices=["hot-rank", "random"])
    p.add_argument("--min-bytes", default="1M")
    p.add_argument("--max-bytes", default="16M")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--chunk-bytes", type=parse_size, default=parse_size("256K"))
    p.add_argument("--json", default=None, help="write the rows as JSON to this file (rank 0)")
    args = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = ["weight_sync", "grad_reduce"] if args.op == "all" else [args.op]
    sizes, s = [], parse_size(args.min_bytes)
    while s <= parse_size(args.max_bytes):
        sizes.append(s)
        s *= args.factor
    rows = []
    if rank == 0:
        print(f"# ultracomm bench: world {world}, transport host (CPU threads over host_shm), workload "
              f"{args.workload}, {args.slots} slots/rank, {args.experts_per_rank} experts/rank, chunk "
              f"{args.chunk_bytes} B, iters {args.iters}")
        print(f"# {'op':>11} {'mode':>4} {'size(B)':>10} {'repl':>4} {'dep':>3} {'time(us)':>10} {'p90(us)':>10} "
              f"{'algbw':>7} {'busbw':>7} {'cpbw':>7} {'lb':>5} {'#wrong':>6}")
    for op in ops:
        for size in sizes:
            for row in run_case(op, size, args, rank, world):
                rows.append(row)
                if rank == 0:
                    print(f"  {row['op']:>11} {row['mode']:>4} {row['size']:>10} {row['replicas']:>4} "
                          f"{row['depth']:>3} {row['time_us']:>10.1f} {row['p90_us']:>10.1f} "
                          f"{row['algbw_GBps']:>7.2f} {row['busbw_GBps']:>7.2f} {row['cpbw_GBps']:>7.2f} "
                          f"{row['lb_ratio']:>5.2f} {row['wrong']:>6}", flush=True)
    if rank == 0:
        wrong = sum(r["wrong"] for r in rows)
        print(f"# bandwidths in GB/s; out of bounds values: {wrong} (#wrong summed over all rows)")
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"world": world, "transport": "host", "window": "host_shm", "workload": args.workload,
                           "rows": rows}, f, indent=1)
    dist.destroy_process_group()
    return 1 if any(r["wrong"] for r in rows) else 0


if __name__ == "__main__":
    raise SystemExit(main())
