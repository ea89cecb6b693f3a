"""EPLB (vLLM / DeepSeek) physical->logical maps ``phy2log`` ``[(L,) P]``: the weight moves
between two maps (:func:`moves_from_phy2log`) and the :class:`~ultracomm.plan.ReplicaPlan` of a
home-fixed map (:func:`plan_from_phy2log`)."""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from ..errors import PlanError
from .inputs import ArrayLike, _to_numpy
from .replica_plan import ReplicaPlan

__all__ = ["Move", "moves_from_phy2log", "plan_from_phy2log"]


class Move(NamedTuple):
    """One EPLB weight move: copy ``expert`` from physical slot ``src_phys`` (on
    ``src_rank``) into physical slot ``dst_phys`` (on ``dst_rank``).

    ``src_phys`` and ``dst_phys`` are *global* physical indices into ``phy2log``
    (``rank = phys // physical_per_rank``, local index ``phys % physical_per_rank``).
    """

    expert: int
    src_rank: int
    src_phys: int
    dst_rank: int
    dst_phys: int


def _phy2log_pair(old: ArrayLike, new: ArrayLike, world: int) -> tuple[np.ndarray, np.ndarray, int]:
    o = _to_numpy(old, "old_phy2log")
    n = _to_numpy(new, "new_phy2log")
    if o.shape != n.shape:
        raise PlanError(
            f"old_phy2log has shape {tuple(o.shape)} but new_phy2log has shape "
            f"{tuple(n.shape)}; both must be [P] or [layers, P] with the same P"
        )
    if o.ndim not in (1, 2):
        raise PlanError(f"phy2log must be [P] or [layers, P], got shape {tuple(o.shape)}")
    if world < 1:
        raise PlanError(f"world must be >= 1, got {world}")
    P = o.shape[-1]
    if P % world != 0:
        raise PlanError(
            f"phy2log has P = {P} physical slots, which does not divide by world = {world}; "
            "every rank must have the same number of physical slots"
        )
    for name, a in (("old_phy2log", o), ("new_phy2log", n)):
        if a.size and a.min() < -1:
            idx = tuple(int(v) for v in np.argwhere(a < -1)[0])
            raise PlanError(
                f"{name}[{', '.join(map(str, idx))}] = {int(a[idx])}: logical expert ids "
                "must be >= 0 (-1 marks an unused physical slot)"
            )
    return o, n, P // world


def _moves_1d(o: np.ndarray, n: np.ndarray, ppr: int, layer: int | None) -> list[Move]:
    holders: dict[int, dict[int, int]] = {}  # expert -> {rank: lowest phys}
    for p, e in enumerate(o.tolist()):
        if e >= 0:
            holders.setdefault(e, {}).setdefault(p // ppr, p)
    moves: list[Move] = []
    for p in np.flatnonzero(o != n).tolist():
        e = int(n[p])
        if e < 0:
            continue  # slot becomes unused: nothing to copy
        dst_rank = p // ppr
        h = holders.get(e)
        if not h:
            where = f"layer {layer}: " if layer is not None else ""
            raise PlanError(
                f"{where}physical slot {p} (rank {dst_rank}) needs expert {e}, which no "
                "physical slot holds in old_phy2log; load it from a checkpoint first, or "
                "check that old and new maps describe the same layer"
            )
        src_rank = dst_rank if dst_rank in h else min(h)
        moves.append(Move(e, src_rank, h[src_rank], dst_rank, p))
    return moves


def moves_from_phy2log(old_phy2log: ArrayLike, new_phy2log: ArrayLike, world: int) -> list[Move] | list[list[Move]]:
    """Weight moves that turn an EPLB ``old_phy2log`` into ``new_phy2log``.

    Args:
        old_phy2log, new_phy2log: integer ``[P]`` or ``[layers, P]`` physical→logical
            maps (vLLM / DeepSeek EPLB), ``P = world * physical_per_rank``; rank ``r``
            owns physical slots ``r*ppr .. (r+1)*ppr - 1``; ``-1`` = unused slot.
        world: number of EP ranks.

    Returns:
        For ``[P]``: a list of :class:`Move`, one per physical slot whose logical
        expert changed (slots that become ``-1`` need no move), sorted by ``dst_phys``.
        For ``[layers, P]``: one such list per layer.

    The source is a slot that held the expert in the OLD map: on the destination rank
    if it held it (a local copy), else on the lowest-numbered holder rank; on that
    rank, its lowest physical slot.  All moves read OLD contents: apply them from a
    snapshot (or into a separate buffer), not one by one in place.

    Raises:
        PlanError: shapes differ, P not divisible by world, ids < -1, or an expert in
        the new map that no slot held in the old map.
    """
    o, n, ppr = _phy2log_pair(old_phy2log, new_phy2log, world)
    if o.ndim == 1:
        return _moves_1d(o, n, ppr, None)
    return [_moves_1d(o[l], n[l], ppr, l) for l in range(o.shape[0])]


def plan_from_phy2log(
    new_phy2log: ArrayLike,
    world: int,
    num_experts: int,
    experts_per_rank: int | None = None,
    home_of: ArrayLike | None = None,
) -> ReplicaPlan | list[ReplicaPlan]:
    """ReplicaPlan(s) from a *home-fixed* EPLB ``phy2log`` ``[P]`` or ``[layers, P]``.

    Only maps where each rank's first ``experts_per_rank`` physical slots hold that
    rank's home experts (in expert order) convert: the remaining
    ``physical_per_rank - experts_per_rank`` slots per rank become replica slots.  A
    redundant slot holding an expert whose home is elsewhere becomes a replica of it;
    one holding ``-1`` or an expert homed on the same rank (a useless second copy)
    becomes an empty slot.  General rearrangements (experts leaving their home) have
    no home/replica split: use :func:`moves_from_phy2log` for those.

    Raises:
        PlanError: a home slot holds the wrong expert, sizes do not fit, or the
        resulting plan is invalid (e.g. an expert twice on one rank).
    """
    n = _to_numpy(new_phy2log, "new_phy2log")
    if n.ndim == 2:
        return [
            plan_from_phy2log(n[l], world, num_experts, experts_per_rank, home_of)  # type: ignore[misc]
            for l in range(n.shape[0])
        ]
    if n.ndim != 1:
        raise PlanError(f"new_phy2log must be [P] or [layers, P], got shape {tuple(n.shape)}")
    if world < 1:
        raise PlanError(f"world must be >= 1, got {world}")
    P = n.shape[0]
    if P % world != 0:
        raise PlanError(f"phy2log has P = {P} physical slots, which does not divide by world = {world}")
    ppr = P // world
    base = ReplicaPlan.make(np.zeros((world, 0), np.int32), num_experts, home_of, experts_per_rank)
    hn = base.home_of.numpy()
    homes = [base.experts_homed_on(r) for r in range(world)]
    nhome = max(len(h) for h in homes)
    if ppr < nhome:
        raise PlanError(
            f"phy2log has {ppr} physical slots per rank but a rank hosts {nhome} home "
            "experts; P must be at least world * experts_per_rank"
        )
    if any(len(h) != nhome for h in homes):
        raise PlanError(
            "plan_from_phy2log needs the same number of home experts on every rank; "
            "pass a uniform home_of or experts_per_rank"
        )
    spr = ppr - nhome
    src = np.full((world, spr), -1, dtype=np.int64)
    for r in range(world):
        row = n[r * ppr : (r + 1) * ppr]
        for i, e in enumerate(homes[r]):
            if int(row[i]) != e:
                raise PlanError(
                    f"new_phy2log[{r * ppr + i}] (rank {r}, local slot {i}) = {int(row[i])}, "
                    f"but plan_from_phy2log expects the first {nhome} physical slots of each "
                    f"rank to hold its home experts in order (expected expert {e}); for a "
                    "general rearrangement use moves_from_phy2log()"
                )
        for k in range(spr):
            e = int(row[nhome + k])
            if e >= num_experts:
                raise PlanError(
                    f"new_phy2log[{r * ppr + nhome + k}] = {e} is out of range: experts are 0..{num_experts - 1}"
                )
            if e >= 0 and hn[e] != r:
                src[r, k] = e
    return ReplicaPlan.make(src, num_experts, base.home_of, experts_per_rank)
