"""What the load profiler costs: off (the Context's one ``is not None`` test per op), on (plan,
stats and a host timer per op), and a standalone ``Profiler.record`` per (layer, micro-batch).

    python perf/bench_profile.py [--quick]

Figures are wall-clock and process CPU time (all threads: both ranks, their operation threads,
the profile writer) on this machine (CPU, host executor, loopback ranks as threads); the
profile-off/on comparison is the median of interleaved repetitions, so machine noise hits
both alike; on a shared, loaded machine the wall figures swing by 2-3x between repetitions.  This is a benchmark, not a test: it prints, it does not assert.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
import timeit

import numpy as np
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, build_schedule
from ultracomm.planners import Domain, get_planner
from ultracomm.profile import Profiler
from ultracomm.scenarios import zipf_load

LAYOUT = ExpertLayout((Member("fc1", (128, 64), torch.bfloat16), Member("fc2", (64, 64), torch.bfloat16)))


def guard_ns(n: int) -> float:
    """ns per ``if self._profiler is not None`` (what a Context with the profile off pays per op)."""

    class Holder:
        _profiler = None

    h = Holder()
    stmt = "if h._profiler is not None:\n    pass"
    best = min(timeit.repeat(stmt, globals={"h": h}, number=n, repeat=5))
    empty = min(timeit.repeat("pass", number=n, repeat=5))
    return max(0.0, best - empty) / n * 1e9


LAYERS = 8


def context_op_us(iters: int, reps: int, tmp: str) -> dict:
    """Median us per layer (weight_sync + restore + grad_reduce) on 2 loopback ranks, profile off
    and on; a step is 8 layers' forward (weight_sync) then backward (restore, grad_reduce), one
    file per step."""
    world, epr, slots = 2, 2, 1
    load = np.array([[90, 5, 3, 2], [80, 6, 2, 1]], np.int64)
    res = get_planner("quota")(load, Domain.flat(world, epr), slots)
    out: dict = {"off": [], "on": [], "off_cpu": [], "on_cpu": []}

    def body(group, profile):
        with Context(
            group, LAYOUT, epr, slots, num_layers=LAYERS, max_microbatches=LAYERS, num_workers=1, profile=profile
        ) as ctx:
            for layer in range(LAYERS):
                w = [torch.zeros((epr, *m.shape), dtype=m.dtype) for m in LAYOUT.members]
                g = [torch.zeros((epr, *m.shape)) for m in LAYOUT.members]
                ctx.register_masters(layer, w, g)

            def step():
                vids = []
                for layer in range(LAYERS):
                    vids.append(ctx.begin(layer))
                    ctx.weight_sync(vids[-1], res.plan)
                for vid in reversed(vids):
                    ctx.restore(vid)  # the slots hold the last layer's experts
                    ctx.grad_reduce(vid)

            step()  # warm-up: schedule cache, threads
            group.barrier()
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                step()
            group.barrier()
            n = iters * LAYERS
            return (time.perf_counter() - t0) / n * 1e6, (time.process_time() - c0) / n * 1e6

    for rep in range(reps):
        for mode in ("off", "on"):  # interleaved
            prof = False if mode == "off" else None
            if mode == "on":

                def run(group, rep=rep):
                    return body(group, f"{tmp}/ctx{rep}")
            else:

                def run(group):
                    return body(group, prof)

            wall, cpu = LoopbackDomain(world).run(run)[0]  # rank 0 (after a barrier: both ranks done)
            out[mode].append(wall)
            out[mode + "_cpu"].append(cpu)
    return {k: statistics.median(v) for k, v in out.items()}


def record_us(n: int, tmp: str, world: int = 64, experts: int = 128) -> dict:
    """us per Profiler.record of an EP64 layer (load [64, 128], plan, schedule), both details."""
    epr = experts // world
    load = zipf_load(world, experts, 8192, 8, 2.0, 0, epr)
    res = get_planner("quota")(load, Domain.flat(world, epr), 2)
    sched = build_schedule(res.plan, 37748736, 75497472)
    out = {}
    for detail in ("full", "experts"):
        with Profiler(f"{tmp}/rec-{detail}", detail=detail, steps="manual") as prof:
            t0 = time.perf_counter()
            for i in range(n):
                prof.record(i % 94, load=load, plan=res, schedule=sched)
                if i % 94 == 93:
                    prof.step()
            out[detail] = (time.perf_counter() - t0) / n * 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (a smoke run)")
    a = ap.parse_args(argv)
    iters, reps, n = (4, 2, 94) if a.quick else (40, 7, 940)
    with tempfile.TemporaryDirectory() as tmp:
        g = guard_ns(200_000 if a.quick else 5_000_000)
        ops = context_op_us(iters, reps, tmp)
        rec = record_us(n, tmp)
    print("# ultracomm.profile cost (CPU, host executor; wall clock on this machine)")
    print(f"profile off: guard per op                          {g:8.1f} ns")
    print(
        f"Context weight_sync+restore+grad_reduce, off       {ops['off']:8.1f} us wall, {ops['off_cpu']:8.1f} us "
        f"process CPU per layer (medians of {reps})"
    )
    print(
        f"Context weight_sync+restore+grad_reduce, on        {ops['on']:8.1f} us wall, {ops['on_cpu']:8.1f} us "
        f"process CPU per layer (wall {(ops['on'] / ops['off'] - 1) * 100:+.1f} %, CPU "
        f"{(ops['on_cpu'] / ops['off_cpu'] - 1) * 100:+.1f} %)"
    )
    print(f"Profiler.record, EP64 layer, detail=full           {rec['full']:8.1f} us per record")
    print(f"Profiler.record, EP64 layer, detail=experts        {rec['experts']:8.1f} us per record")
    return 0


if __name__ == "__main__":
    sys.exit(main())
