"""Record a small load profile through real Contexts and render the viewer (the README's picture).

    python perf/viewer_demo.py [--out perf/out/demo] [--screenshot perf/viewer.png]

16 ranks as threads of this process (a loopback domain; two "nodes" of 8 for topology-aware
trees), 64 experts, 2 replica slots per rank, 4 MoE layers, 24 steps of skewed loads whose hot
experts drift (layer 0: one very hot expert, which the planner replicates widely).  Per (step, layer): the quota planner balances the load, the Profiler records
load and plan, and the Context runs weight_sync, restore and grad_reduce on the host executor,
recording the plan's schedule stats and the measured op times (host wall time, CPU, small
experts: these are not GPU figures).  Rank 0's trace is rendered.

The experts are 6,144 B, 1/1536 of a Qwen3-30B-A3B expert (9,437,184 B), so the schedule's cost
model is given 1/1536 of NVLink4's and RDMA's bandwidths (370 GB/s, 50 GB/s) and of the 1 MiB
chunk: relay-or-direct decisions, depths and predicted times are those the builder makes for
the real expert on H200 nodes with 400 Gb/s RDMA.
"""

from __future__ import annotations

import argparse
import shutil
import sys
import time
from pathlib import Path

import numpy as np
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member
from ultracomm.planners import Domain, get_planner
from ultracomm.profile import Profiler, load_trace
from ultracomm.viewer import write_html
from ultracomm.scenarios import hot_rank_load, zipf_load

WORLD, EPR, SLOTS, LAYERS, STEPS = 16, 4, 2, 4, 24
NODE_OF = [r // 8 for r in range(WORLD)]
LAYOUT = ExpertLayout((Member("fc1", (64, 32), torch.bfloat16), Member("fc2", (32, 32), torch.bfloat16)))
SCALE = 9437184 // LAYOUT.weight_bytes  # 1536: the real expert over the demo's


def load_for(step: int, layer: int) -> np.ndarray:
    if layer == 0:  # one very hot expert (LLEP-style), moving to another rank every 6 steps
        frac = 0.08 + 0.04 * np.sin(step / 3.0)
        return hot_rank_load(
            WORLD,
            WORLD * EPR,
            1024,
            8,
            float(frac),
            step,
            hot_rank=(5 * (step // 6)) % WORLD,
            hot_experts=1,
            rest_over_all=True,
        )
    target = 1.6 + 0.5 * layer + 0.4 * np.sin(step / 4.0 + layer)
    return zipf_load(WORLD, WORLD * EPR, 1024, 8, float(target), 1000 * layer + step // 6, EPR)


def run(out: Path) -> float:
    shutil.rmtree(out, ignore_errors=True)
    dom = Domain(WORLD, np.asarray(NODE_OF, np.int64), EPR)

    def body(group):
        prof = Profiler(out / f"rank{group.rank}", meta={"model": "qwen3-30b-a3b", "demo": "perf/viewer_demo.py"})
        with Context(
            group,
            LAYOUT,
            EPR,
            SLOTS,
            num_layers=LAYERS,
            max_microbatches=LAYERS,
            node_of=NODE_OF,
            num_workers=1,
            chunk_bytes=1024,
            tile_bytes=256,
            intra_bw=370e9 / SCALE,
            inter_bw=50e9 / SCALE,
            profile=prof,
        ) as ctx:
            for layer in range(LAYERS):
                w = [torch.randn((EPR, *m.shape)).to(m.dtype) for m in LAYOUT.members]
                g = [torch.zeros((EPR, *m.shape)) for m in LAYOUT.members]
                ctx.register_masters(layer, w, g)
            for step in range(STEPS):
                vids = []
                for layer in range(LAYERS):  # forward
                    load = load_for(step, layer)
                    res = get_planner("quota")(load, dom, SLOTS)
                    prof.record(layer, load=load, plan=res)
                    vid = ctx.begin(layer)
                    ctx.weight_sync(vid, res.plan)
                    vids.append(vid)
                for vid in reversed(vids):  # backward
                    ctx.restore(vid)
                    for t in ctx.replica_grads:
                        t.fill_(1.0)
                    ctx.grad_reduce(vid)
                prof.step()
        prof.close()

    t0 = time.perf_counter()
    LoopbackDomain(WORLD).run(body, timeout=1800)
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default="perf/out/demo", help="trace directory (one rank<r> per rank)")
    ap.add_argument("--html", default="perf/out/viewer_demo.html")
    ap.add_argument("--screenshot", default=None, help="PNG to write (e.g. perf/viewer.png)")
    a = ap.parse_args()
    secs = run(Path(a.out))
    trace = load_trace(a.out, rank=0)
    print(f"recorded {len(trace)} records in {secs:.1f} s; " + trace.summary().replace("\n", "; "))
    size = write_html(trace, a.html, title="demo: 16 ranks (2 nodes x 8), 64 experts, quota planner, host executor")
    print(f"wrote {a.html} ({size / 1e3:.0f} kB)")
    if a.screenshot:
        from ultracomm.viewer.browser import screenshot

        msgs = screenshot(a.html, a.screenshot)
        print(f"wrote {a.screenshot}" + (f"; page messages: {msgs}" if msgs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
