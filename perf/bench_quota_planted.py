"""quota on loads with a known plan at 1.01 x mean (ultracomm.planners.planted): how often
it meets that threshold, copies against the planted plan's, and the time per plan() call
(median / p90 / max per world size).  Two seed families (the tests' 10000+ and 20000+),
slots per rank 1..3, world 8/16/32/64.  CPU wall-clock on whatever machine runs it.

    python perf/bench_quota_planted.py [--cases N]
"""
from __future__ import annotations

import argparse
import time

import numpy as np

from ultracomm.planners import Domain, get_planner
from ultracomm.planners.planted import planted_load


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", type=int, default=200, help="cases per seed family and K")
    args = ap.parse_args()
    print("| slots/rank | world | met | copies (quota / planted) | ms median | ms p90 | ms max |")
    print("|---|---|---|---|---|---|---|")
    for K in (1, 2, 3):
        by_w: dict[int, list[tuple[bool, float, int, int]]] = {}
        for base in (10_000, 20_000):
            for seed in range(args.cases):
                rng = np.random.default_rng(base + seed)
                W = int(rng.choice([8, 16, 32, 64]))
                epr = int(rng.choice([2, 4, 8]))
                n_hot = int(rng.integers(1, W // 2 + 1))
                load, T, reps = planted_load(seed, W, epr, K, n_hot)
                d = Domain.flat(W, epr)
                t0 = time.perf_counter()
                res = get_planner("quota")(load, d, K)
                dt = (time.perf_counter() - t0) * 1e3
                by_w.setdefault(W, []).append((bool(res.rank_load.max() <= T), dt,
                                               int((res.slot_src >= 0).sum()), len(reps)))
        for W in sorted(by_w):
            rows = by_w[W]
            ts = np.array([r[1] for r in rows])
            print(f"| {K} | {W} | {sum(r[0] for r in rows)}/{len(rows)} | "
                  f"{sum(r[2] for r in rows)} / {sum(r[3] for r in rows)} | "
                  f"{np.median(ts):.2f} | {np.percentile(ts, 90):.2f} | {ts.max():.2f} |", flush=True)


if __name__ == "__main__":
    main()
