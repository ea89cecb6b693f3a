"""The device control plane's quota planner, host build, beside the host ``quota`` planner.

    python perf/bench_planner_device.py [--reps 200] [--json out.json]

Side by side in one run on the planner evaluation loads (EP64 flat, EP16 / EP32 on nodes;
planners/eval.py): per call, the median microseconds of

* ``quota``: ``planners.quota.plan`` (C++ search, numpy around it), and ``quota core``: its
  C++ call alone (``_core.quota_search``);
* ``device``: ``planners.device.plan`` and ``device core``: ``_core.quota_device`` alone --
  quota::plan() of include/ultracomm/impl/quota_plan.h, the code the GPU kernel compiles, run on one
  host thread (one probe group: a round's thresholds in turn, stopping at the first feasible
  one, whose plan is kept);

with each plan's max:mean rank load and replica copies, the device planner's threshold search
(``probes``: thresholds scheduled -- what the GPU's 8 warps run --, ``rounds``), and a closing
check of issue 33's bar: max:mean <= 1.02 and copies at most 5% above ``quota``'s on every row.
CPU figures from whatever machine runs it; the GPU kernel's time is perf/bench_gpu.py's (needs a
device).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import numpy as np

from ultracomm import _core  # noqa: E402
from ultracomm.planners import get_planner, max_mean  # noqa: E402
from ultracomm.tools import planner_eval as ev  # noqa: E402
from ultracomm.planners import quota as quota_mod  # noqa: E402


def cases():
    """The evaluation's EP64 loads (hot-rank: 30% and 90%) and its TAOT cases at 50% imbalance."""
    keep = ("EP64 zipf", "EP64 blocked", "EP64 hot 30%", "EP64 hot 90%", "EP16 50%", "EP32 50%")
    named = [(f"{case} {lname}", dom, load) for case, lname, dom, load in ev.evaluation_loads()]
    return [c for c in named if c[0].startswith(keep)]


def median_us(fn, reps: int) -> float:
    fn()
    ts = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return 1e6 * statistics.median(ts)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=200)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    quota, device = get_planner("quota"), get_planner("device")
    rows = []
    print(
        f"{'load':18s} {'K':>2s} {'quota us':>9s} {'core':>7s} {'device us':>10s} {'core':>7s} "
        f"{'q max:mean':>10s} {'d max:mean':>10s} {'q copies':>8s} {'d copies':>8s} {'probes':>6s} {'rounds':>6s}"
    )
    for name, dom, load in cases():
        for K in (1, 2):
            W, epr = dom.world, dom.experts_per_rank
            q, d = quota(load, dom, K), device(load, dom, K)
            _, el, L, order, _ = quota_mod._inputs(load, dom, False)
            tol = max(1, int(0.01 * L.sum() / W))
            elx = np.ascontiguousarray(load.sum(0), np.int64)
            row = dict(
                load=name,
                world=W,
                experts=W * epr,
                slots=K,
                quota_us=median_us(lambda: quota(load, dom, K), a.reps),
                quota_core_us=median_us(
                    lambda: _core.quota_search(
                        L, el, order, None, K, 1, tol, quota_mod.SEARCH_BUDGET, quota_mod.COVER_BUDGET
                    ),
                    a.reps,
                ),
                device_us=median_us(lambda: device(load, dom, K), a.reps),
                device_core_us=median_us(lambda: _core.quota_device(elx, None, W, epr, K, 1, 0, 100), a.reps),
                quota_max_mean=round(max_mean(q.rank_load), 4),
                device_max_mean=round(max_mean(d.rank_load), 4),
                quota_copies=sum(q.copies),
                device_copies=sum(d.copies),
                device_probes=d.info["probes"],
                device_rounds=d.info["rounds"],
            )
            rows.append(row)
            print(
                f"{name:18s} {K:2d} {row['quota_us']:9.0f} {row['quota_core_us']:7.0f} {row['device_us']:10.0f} "
                f"{row['device_core_us']:7.0f} {row['quota_max_mean']:10.4f} {row['device_max_mean']:10.4f} "
                f"{row['quota_copies']:8d} {row['device_copies']:8d} {row['device_probes']:6d} "
                f"{row['device_rounds']:6d}",
                flush=True,
            )
    worst_balance = max(r["device_max_mean"] for r in rows)
    worst_copies = max(r["device_copies"] / r["quota_copies"] - 1 for r in rows)
    check = dict(
        max_mean_le_1_02=worst_balance <= 1.02,
        copies_le_5pct=worst_copies <= 0.05,
        worst_max_mean=worst_balance,
        worst_copies_over_quota=round(worst_copies, 4),
    )
    print(
        f"device max:mean <= 1.02 on {sum(r['device_max_mean'] <= 1.02 for r in rows)} of {len(rows)} rows "
        f"(worst {worst_balance:.4f}); copies at most {100 * worst_copies:.1f}% above quota's "
        f"(fewer on {sum(r['device_copies'] < r['quota_copies'] for r in rows)} rows): "
        f"{'meets' if check['max_mean_le_1_02'] and check['copies_le_5pct'] else 'MISSES'} issue 33's bar"
    )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(machine=os.uname().nodename, cpus=os.cpu_count(), reps=a.reps, rows=rows, check=check), f, indent=1
            )


if __name__ == "__main__":
    main()
