"""Loads built around a known quota plan, to check that the quota planner finds plans
that provably exist (tests/planners/test_planners.py, perf/planners.md via
:mod:`ultracomm.tools.planner_eval`)."""

from __future__ import annotations

import numpy as np

__all__ = ["planted_load", "planted_family", "planted_table"]


def planted_load(
    seed: int, world: int, epr: int, K: int, n_hot: int, mean: int = 10_000
) -> tuple[np.ndarray, int, list[tuple[int, int, int]]]:
    """A load with a plan meeting T = mean - 1 + mean // 100 -- the first threshold quota
    probes (1.01 x mean) -- in which every non-hot rank ends exactly at T: each takes K
    replicas of hot ranks' experts (30-95 % of its final load) and the hot ranks end with
    the rest of the tokens, evenly.  Returns (load [world, world * epr], T, replicas
    [(expert, rank, tokens)])."""
    rng = np.random.default_rng(seed)
    E = world * epr
    T = mean - 1 + mean // 100
    hot = np.sort(rng.choice(world, size=n_hot, replace=False))
    recv = np.setdiff1d(np.arange(world), hot)
    final = np.full(world, T, np.int64)
    rest = world * mean - recv.size * T
    final[hot] = rest // n_hot
    final[hot[: rest % n_hot]] += 1
    hot_experts = (hot[:, None] * epr + np.arange(epr)).ravel()
    el = np.zeros(E, np.int64)
    got = np.zeros(world, np.int64)
    reps = []
    for j in recv.tolist():
        es = rng.choice(hot_experts, size=min(K, hot_experts.size), replace=False)
        tot = int(T * rng.uniform(0.3, 0.95))
        cuts = np.sort(rng.integers(1, tot, size=es.size - 1))
        for e, a in zip(es.tolist(), np.diff(np.concatenate(([0], cuts, [tot]))).tolist()):
            el[e] += a
            got[j] += a
            reps.append((e, j, a))
    for r in range(world):  # what each rank computes of its own experts
        own = int(final[r] - got[r])
        cuts = np.sort(rng.integers(0, own + 1, size=epr - 1))
        el[r * epr : (r + 1) * epr] += np.diff(np.concatenate(([0], cuts, [own])))
    load = np.zeros((world, E), np.int64)
    load[rng.integers(0, world, size=E), np.arange(E)] = el  # each expert from one sender
    return load, T, reps


def planted_family(
    cases: int = 200, slots: tuple[int, ...] = (1, 2, 3), worlds: tuple[int, ...] = (8, 16, 32, 64)
) -> list[dict]:
    """quota on the planted family: per (slots per rank, world), how many loads it met at
    their planted threshold, its copies against the planted plan's, and the time per
    :func:`~ultracomm.planners.quota.plan` call (CPU ms).  Two seed families
    (``10000 + i`` and ``20000 + i`` pick world, experts per rank and hot ranks), ``cases``
    loads each per slots value.  Times are this process's CPU time
    (``time.process_time``), so that other work on a shared machine does not inflate them
    (it still slows them through the caches)."""
    import time

    from ..planners import Domain, get_planner

    out = []
    for K in slots:
        by_w: dict[int, list[tuple[bool, float, int, int]]] = {}
        for base in (10_000, 20_000):
            for seed in range(cases):
                rng = np.random.default_rng(base + seed)
                W = int(rng.choice(worlds))
                epr = int(rng.choice([2, 4, 8]))
                n_hot = int(rng.integers(1, W // 2 + 1))
                load, T, reps = planted_load(seed, W, epr, K, n_hot)
                d = Domain.flat(W, epr)
                t0 = time.process_time()
                res = get_planner("quota")(load, d, K)
                ms = (time.process_time() - t0) * 1e3
                by_w.setdefault(W, []).append(
                    (bool(res.rank_load.max() <= T), ms, int((res.slot_src >= 0).sum()), len(reps))
                )
        for W in sorted(by_w):
            rows = by_w[W]
            ts = np.array([r[1] for r in rows])
            out.append(
                dict(
                    slots=K,
                    world=W,
                    met=sum(r[0] for r in rows),
                    loads=len(rows),
                    copies=sum(r[2] for r in rows),
                    planted=sum(r[3] for r in rows),
                    ms_median=float(np.median(ts)),
                    ms_p90=float(np.percentile(ts, 90)),
                    ms_max=float(ts.max()),
                )
            )
    return out


def planted_table(rows: list[dict]) -> str:
    """Markdown table of :func:`planted_family`'s rows."""
    h = (
        "| slots/rank | world | met at the planted threshold | copies (quota / planted) | "
        "CPU ms median | CPU ms p90 | CPU ms max |"
    )
    lines = [h, "|" + "|".join(["---"] * (h.count("|") - 1)) + "|"]
    for r in rows:
        lines.append(
            f"| {r['slots']} | {r['world']} | {r['met']}/{r['loads']} | {r['copies']} / "
            f"{r['planted']} | {r['ms_median']:.2f} | {r['ms_p90']:.2f} | "
            f"{r['ms_max']:.2f} |"
        )
    return "\n".join(lines)
