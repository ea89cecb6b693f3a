"""TAOT's consolidation (between phases 2 and 3): drop the replicas whose tokens fit into the
home's other replicas or back home, within the balance target."""

from __future__ import annotations

import numpy as np

from .backend import _core_mod, _use_cpp


def consolidate_replicas(
    home: np.ndarray,
    rank: np.ndarray,
    expert: np.ndarray,
    inter: np.ndarray,
    amt: np.ndarray,
    left: np.ndarray,
    room: np.ndarray,
    backend: str | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Refinement after phase 2: drop replicas whose tokens fit elsewhere.

    Args:
        home: int ``[n]`` home rank of each replica's expert.
        rank: int ``[n]`` rank holding each replica.
        expert: int ``[n]`` expert index of each replica into ``left``.
        inter: bool ``[n]`` inter-node replica.
        amt: int ``[n]`` tokens planned for each replica.
        left: int ``[U]`` tokens of each expert still computed at home.
        room: int ``[W]`` tokens each rank may still take (``T`` minus its planned load,
            at least 0).
        backend: ``"auto"``/``None`` (C++ when built), ``"cpp"`` or ``"numpy"``.

    Returns:
        ``(keep, amt)``: bool ``[n]`` replicas kept and their new token counts.

    Replicas are visited inter-node first, then smallest first (then index).  Replica
    ``p`` of home ``h`` is dropped if its ``amt`` fits into (a) the other kept replicas of
    ``h``'s experts -- each up to its rank's room and its expert's tokens left at home
    (``p``'s own tokens count as left) -- in replica order, then (b) the room of ``h``
    itself (the tokens stay home).  No new copy, no rank above ``T``: the balance target
    still holds and one copy fewer is made.
    """
    home = np.asarray(home, np.int64)
    rank = np.asarray(rank, np.int64)
    expert = np.asarray(expert, np.int64)
    inter = np.asarray(inter, bool)
    amt = np.array(amt, np.int64)
    left = np.array(left, np.int64)
    room = np.array(room, np.int64)
    n = amt.size
    if _use_cpp(backend) and hasattr(_core_mod, "taot_consolidate"):
        keep = _core_mod.taot_consolidate(home, rank, expert, inter.astype(np.uint8), amt, left, room)
        return keep.astype(bool), amt
    keep = np.ones(n, bool)
    order = np.lexsort((np.arange(n), amt, ~inter))  # inter first, then smallest
    for p in order.tolist():
        h, a, e = int(home[p]), int(amt[p]), int(expert[p])
        others = [q for q in range(n) if q != p and keep[q] and home[q] == h]
        caps = [min(int(room[rank[q]]), int(left[expert[q]]) + (a if expert[q] == e else 0)) for q in others]
        if int(room[h]) + sum(caps) < a:
            continue
        keep[p] = False
        left[e] += a
        room[rank[p]] += a
        rest = a
        for q, c in zip(others, caps):
            if rest == 0:
                break
            eq, rq = int(expert[q]), int(rank[q])
            x = min(c, rest, int(room[rq]), int(left[eq]))
            if x <= 0:
                continue
            amt[q] += x
            left[eq] -= x
            room[rq] -= x
            rest -= x
        room[h] -= rest  # the rest stays home
        amt[p] = 0
    return keep, amt
