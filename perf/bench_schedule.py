"""Schedule builder benchmark: build time and tree quality on skewed (Zipf-like) plans.

    python perf/bench_schedule.py [--json FILE] [--iters N] [--quick]

Times are CPU wall time of one build on this machine: `us_all` / `us_one` = median of a C++
loop (_core.time_build, no Python overhead) building every rank's / rank 0's task lists,
`py_one` = median of the Python wrapper call for rank 0.  The last line checks the issue's goal:
a one-rank build at world 64 (one node, 2-4 slots, 128-384 experts, auto) under 50 us.  Wall
times move with the machine's load (a busy 2-CPU box doubles them); for repeatable numbers
count instructions, e.g. `valgrind --tool=callgrind --toggle-collect='ultracomm::build_schedule*'`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # idle BLAS threads steal the 2 CPUs

import numpy as np  # noqa: E402

from ultracomm import _core  # noqa: E402
from ultracomm.schedule import build_schedule  # noqa: E402
from ultracomm.scenarios import zipf_slot_src  # noqa: E402


class Plan:
    def __init__(self, slot_src, home_of):
        self.slot_src = slot_src
        self.home_of = home_of
        self.world, self.slots_per_rank = slot_src.shape
        self.num_experts = len(home_of)


def zipf_plan(seed: int, world: int, slots: int, experts: int, skew: float = 1.2, fill: float = 0.9) -> Plan:
    """The skewed plans of this benchmark: :func:`ultracomm.scenarios.zipf_slot_src`."""
    return Plan(*zipf_slot_src(seed, world, slots, experts, skew, fill))


MAX_DEPTH = 8  # the builder's default (ULTRACOMM_RELAY_MAX_DEPTH may set another)


def core_args(plan, wb, gb, chunk, mode, node_of):
    return (
        plan.world,
        plan.slots_per_rank,
        plan.num_experts,
        plan.slot_src.reshape(-1),
        plan.home_of,
        node_of,
        wb,
        gb,
        chunk,
        mode,
        MAX_DEPTH,
        370e9,
        50e9,
    )


def run(cases, iters, py_iters):
    rows = []
    for world, slots, experts, nodes in cases:
        plan = zipf_plan(world * 1000 + slots, world, slots, experts)
        node_of = None if nodes == 1 else (np.arange(world) * nodes // world).astype(np.int32)
        wb, gb, chunk = 3 * 2048 * 1024 * 2, 3 * 2048 * 1024 * 4, 1 << 20  # bf16 weights, fp32 grads
        reps = int((plan.slot_src >= 0).sum())
        hot = int(np.bincount(plan.slot_src[plan.slot_src >= 0], minlength=experts).max()) if reps else 0
        direct = build_schedule(plan, wb, gb, node_of=node_of, chunk_bytes=chunk, relay_mode="off")
        for mode in ("off", "auto", "force"):
            args = core_args(plan, wb, gb, chunk, mode, node_of)
            all_ns = _core.time_build(*args, -1, iters)
            one_ns = _core.time_build(*args, 0, iters)
            ts = []
            for _ in range(py_iters):
                t0 = time.perf_counter_ns()
                build_schedule(
                    plan, wb, gb, node_of=node_of, chunk_bytes=chunk, relay_mode=mode, rank=0, max_depth=MAX_DEPTH
                )
                ts.append(time.perf_counter_ns() - t0)
            s = build_schedule(plan, wb, gb, node_of=node_of, chunk_bytes=chunk, relay_mode=mode, max_depth=MAX_DEPTH)
            m, r = s.stats("multicast"), s.stats("reduce")
            rows.append(
                dict(
                    world=world,
                    slots=slots,
                    experts=experts,
                    nodes=nodes,
                    replicas=reps,
                    hottest=hot,
                    mode=mode,
                    us_all=float(np.median(all_ns)) / 1e3,
                    us_one=float(np.median(one_ns)) / 1e3,
                    us_py_one=statistics.median(ts) / 1e3,
                    tasks_total=int(sum(m["num_tasks"]) + sum(r["num_tasks"])),
                    mc_depth=m["depth"],
                    mc_max_egress=m["max_egress"],
                    mc_direct_egress=direct.stats("multicast")["max_egress"],
                    mc_pred_over_lb=m["predicted_s"] / m["lower_bound_s"] if m["lower_bound_s"] else 1.0,
                    rd_depth=r["depth"],
                    rd_max_ingress=r["max_ingress"],
                    rd_direct_ingress=direct.stats("reduce")["max_ingress"],
                    rd_pred_over_lb=r["predicted_s"] / r["lower_bound_s"] if r["lower_bound_s"] else 1.0,
                    direct_pred_over_lb=(
                        direct.stats("multicast")["predicted_s"] / m["lower_bound_s"] if m["lower_bound_s"] else 1.0
                    ),
                )
            )
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--json", default=None)
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--py-iters", type=int, default=100)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--max-depth", type=int, default=MAX_DEPTH)
    a = ap.parse_args()
    globals()["MAX_DEPTH"] = a.max_depth
    cases = [
        (8, 2, 128, 1),
        (16, 3, 128, 1),
        (64, 2, 256, 1),
        (64, 3, 256, 1),
        (64, 4, 256, 1),
        (64, 3, 128, 1),
        (64, 4, 384, 1),
        (64, 4, 256, 8),
        (72, 4, 288, 1),
        (128, 2, 384, 1),
        (128, 4, 384, 16),
    ]
    if a.quick:
        cases = [(8, 2, 128, 1), (64, 4, 256, 1)]
        a.iters, a.py_iters = 50, 20
    t0 = time.time()
    rows = run(cases, a.iters, a.py_iters)
    hdr = (
        f"{'world':>5} {'slots':>5} {'E':>4} {'nodes':>5} {'reps':>5} {'hot':>4} {'mode':>5} "
        f"{'us_all':>8} {'us_one':>8} {'py_one':>8} {'tasks':>6} {'mc_d':>4} {'egress r/d (MiB)':>18} "
        f"{'mc p/lb':>7} {'rd_d':>4} {'ingress r/d (MiB)':>18} {'rd p/lb':>7} {'dir p/lb':>8}"
    )
    print(hdr)
    for x in rows:
        print(
            f"{x['world']:>5} {x['slots']:>5} {x['experts']:>4} {x['nodes']:>5} {x['replicas']:>5} {x['hottest']:>4} "
            f"{x['mode']:>5} {x['us_all']:>8.1f} {x['us_one']:>8.1f} {x['us_py_one']:>8.1f} {x['tasks_total']:>6} "
            f"{x['mc_depth']:>4} {x['mc_max_egress'] / 2**20:>8.0f}/{x['mc_direct_egress'] / 2**20:<9.0f} "
            f"{x['mc_pred_over_lb']:>7.2f} {x['rd_depth']:>4} "
            f"{x['rd_max_ingress'] / 2**20:>8.0f}/{x['rd_direct_ingress'] / 2**20:<9.0f} {x['rd_pred_over_lb']:>7.2f} "
            f"{x['direct_pred_over_lb']:>8.2f}"
        )
    goal = [x for x in rows if x["world"] == 64 and x["nodes"] == 1 and x["mode"] == "auto"]
    if goal:
        worst = max(goal, key=lambda x: x["us_one"])
        print(
            f"# goal: world 64 one-rank build (auto, one node) < 50 us: max us_one {worst['us_one']:.1f} "
            f"(slots {worst['slots']}, E={worst['experts']}), max py_one {max(x['us_py_one'] for x in goal):.1f}"
        )
    print(f"# CPU build times on {platform.node()} ({os.cpu_count()} CPUs), {time.time() - t0:.1f} s total")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(
                    machine=platform.node(),
                    cpus=os.cpu_count(),
                    processor=platform.processor(),
                    weight_bytes=3 * 2048 * 1024 * 2,
                    grad_bytes=3 * 2048 * 1024 * 4,
                    chunk_bytes=1 << 20,
                    rows=rows,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
