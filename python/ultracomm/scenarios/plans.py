"""Replica plans for workloads: the greedy planner, one hot expert's plan, Zipf-filled slots, and the
max:mean rank load a plan leaves."""

from __future__ import annotations

import numpy as np

from ..plan import ReplicaPlan
from .loads import LoadLike, _as_load, _check_int, _expert_load_f
from ..errors import InputError

__all__ = ["max_mean_after", "greedy_replicas", "zipf_slot_src", "hot_plan"]


def _rank_loads(L: np.ndarray, plan: ReplicaPlan) -> np.ndarray:
    """float64 ``[world]``: each rank's load when every expert's load is split evenly
    over its home and its replicas."""
    inst = 1.0 + plan.num_replicas.numpy().astype(np.float64)
    share = L / inst
    R = np.bincount(plan.home_of.numpy(), weights=share, minlength=plan.world)
    src = plan.slot_src.numpy()
    filled = src >= 0
    R += np.where(filled, share[np.where(filled, src, 0)], 0.0).sum(axis=1)
    return R


def max_mean_after(load: LoadLike, plan: ReplicaPlan) -> float:
    """Max:mean rank load when each expert's load (``load [world, E]`` summed over senders,
    or ``[E]``) is split evenly across its home and its replicas in ``plan``; 1.0 for an
    all-zero load."""
    L = _expert_load_f(load, plan.num_experts)
    R = _rank_loads(L, plan)
    m = R.mean()
    return float(R.max() / m) if m > 0 else 1.0


def greedy_replicas(
    load: LoadLike, world: int, slots_per_rank: int, experts_per_rank: int, min_tokens: float = 1
) -> ReplicaPlan:
    """Fill replica slots greedily to lower the most loaded rank's estimated load.

    A rank's estimated load is the sum over the expert instances it holds (home or
    replica) of ``L[e] / instances(e)``.  Each step walks the experts by load per
    instance (``L[e] / (1 + replicas(e))``, highest first, ties to the lowest index),
    considering only experts with an instance on a most-loaded rank and whose per-instance
    share after one more replica is still ``>= min_tokens``; the expert gets a replica on
    the least-loaded rank (ties: lowest index) that has a free slot, is not its home and
    does not already hold it.  The first such move that strictly lowers the maximum rank
    load is taken.  Stops when the slots run out or no move lowers the maximum (in
    particular when two ranks share it), so every replica placed lowered the maximum.

    Args:
        load: int ``[world, E]`` (or ``[E]`` expert loads), E = ``world * experts_per_rank``.
        world, slots_per_rank, experts_per_rank: plan shape; experts homed
            ``e // experts_per_rank``.
        min_tokens: smallest per-instance share worth a replica.

    Returns:
        A validated :class:`ReplicaPlan` (``slot_src`` int32 ``[world, slots_per_rank]``;
        each rank's slots filled from slot 0 in the order the replicas were added).
    """
    _check_int("world", world)
    spr = _check_int("slots_per_rank", slots_per_rank, 0)
    epr = _check_int("experts_per_rank", experts_per_rank)
    E = world * epr
    L = _expert_load_f(load, E)
    a = _as_load(load)
    if a.ndim == 2 and a.shape[0] != world:
        raise InputError(f"load has {a.shape[0]} sender rows but world = {world}")
    home = np.arange(E) // epr
    ids = np.arange(E)
    slot_src = np.full((world, spr), -1, dtype=np.int64)
    used = np.zeros(world, dtype=np.int64)
    holds = np.zeros((world, E), dtype=bool)
    holds[home, ids] = True
    inst = np.ones(E, dtype=np.float64)
    R = np.bincount(home, weights=L, minlength=world)
    tol_scale = max(float(L.sum()), 1.0) * 1e-12

    while (used < spr).any():
        M = R.max()
        at_max = R >= M - tol_scale
        if at_max.sum() > 1:  # no single move lowers a maximum shared by two ranks
            break
        per_inst = L / inst
        cand = holds[at_max].any(axis=0) & (L / (inst + 1) >= min_tokens) & (inst < world)
        order = np.lexsort((ids, -per_inst))
        order = order[cand[order]]
        free = used < spr
        moved = False
        for e in order:
            elig = free & ~holds[:, e]
            if not elig.any():
                continue
            t = int(np.argmin(np.where(elig, R, np.inf)))
            old, new = L[e] / inst[e], L[e] / (inst[e] + 1)
            R2 = R - np.where(holds[:, e], old - new, 0.0)
            R2[t] += new
            M2 = R2.max()
            if M2 < M - tol_scale:
                slot_src[t, used[t]] = e
                used[t] += 1
                holds[t, e] = True
                inst[e] += 1
                R = R2
                moved = True
                break
        if not moved:
            break
    return ReplicaPlan.make(slot_src, num_experts=E, experts_per_rank=epr)


def zipf_slot_src(
    seed: int, world: int, slots: int, experts: int, skew: float = 1.2, fill: float = 0.9
) -> tuple[np.ndarray, np.ndarray]:
    """Replica slots filled by Zipf-like popularity (``1 / rank**skew`` over a seeded permutation
    of the experts): a few hot experts replicated on many ranks, the tail on few; each slot is
    filled with probability ``fill``.  Valid (no replica at home, none twice on a rank).

    Returns ``(slot_src int32 [world, slots], home_of int32 [experts])`` with expert ``e`` homed
    on ``e * world // experts``.  The skewed plans of the schedule-build benchmark.
    """
    rng = np.random.default_rng(seed)
    home_of = (np.arange(experts) * world // experts).astype(np.int32)
    w = 1.0 / np.arange(1, experts + 1) ** skew
    w = w[rng.permutation(experts)]
    w /= w.sum()
    slot_src = np.full((world, slots), -1, np.int32)
    for r in range(world):
        order = rng.choice(experts, size=min(experts, slots * 4 + 8), replace=False, p=w)
        picks = [int(e) for e in order if home_of[e] != r][:slots]
        for s, e in enumerate(picks):
            if rng.random() < fill:
                slot_src[r, s] = e
    return slot_src, home_of


def hot_plan(world: int, slots_per_rank: int, experts_per_rank: int, expert: int, replicas: int) -> ReplicaPlan:
    """``expert`` replicated onto ``replicas`` other ranks: slot 0 of ranks
    ``home+1, home+2, ...`` (mod ``world``), other slots empty -- e.g. one hot expert on
    60 of 64 ranks."""
    _check_int("world", world)
    spr = _check_int("slots_per_rank", slots_per_rank, 0)
    epr = _check_int("experts_per_rank", experts_per_rank)
    E = world * epr
    if not isinstance(expert, (int, np.integer)) or not 0 <= expert < E:
        raise InputError(f"expert must be in 0..{E - 1}, got {expert!r}")
    n = _check_int("replicas", replicas, 0)
    if n > world - 1:
        raise InputError(f"replicas = {n} exceeds the {world - 1} ranks other than the home")
    if n and spr < 1:
        raise InputError("slots_per_rank must be >= 1 to hold a replica")
    home = int(expert) // epr
    src = np.full((world, spr), -1, dtype=np.int64)
    src[(home + 1 + np.arange(n)) % world, 0] = expert
    return ReplicaPlan.make(src, num_experts=E, experts_per_rank=epr)
