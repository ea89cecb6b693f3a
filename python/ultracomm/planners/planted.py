"""Loads built around a known quota plan, to check that the quota planner finds plans
that provably exist (tests/test_planners.py, perf/bench_quota_planted.py)."""
from __future__ import annotations

import numpy as np

__all__ = ["planted_load"]


def planted_load(seed: int, world: int, epr: int, K: int, n_hot: int,
                 mean: int = 10_000) -> tuple[np.ndarray, int, list[tuple[int, int, int]]]:
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
        el[r * epr:(r + 1) * epr] += np.diff(np.concatenate(([0], cuts, [own])))
    load = np.zeros((world, E), np.int64)
    load[rng.integers(0, world, size=E), np.arange(E)] = el  # each expert from one sender
    return load, T, reps
