"""TAOT phase 3: the Lagrangian auction that assigns each replica slot's tokens to the source
ranks that hold them, exactly (integers)."""

from __future__ import annotations

import numpy as np

from .backend import _core_mod, _use_cpp
from ...errors import InputError

_NEG = -np.inf


def lagrangian_auction(
    n: np.ndarray,
    slot_expert: np.ndarray,
    demand: np.ndarray,
    bonus: np.ndarray,
    price_step: float = 0.05,
    max_iters: int | None = None,
    slot_rank: np.ndarray | None = None,
    backend: str | None = None,
) -> tuple[np.ndarray, int]:
    """Phase 3: assign each spare slot's demand to source ranks, exactly.

    Args:
        n: int ``[R, E]`` tokens each source rank holds per expert (not modified).
        slot_expert: int ``[S]`` expert of each spare slot.
        demand: int ``[S]`` tokens planned for each slot; for every expert the total
            demand must not exceed its tokens.
        bonus: ``[R, S]`` topology bonus of source rank ``r`` for slot ``s``.
        price_step: price increase of a rank per slot it serves.
        max_iters: round cap (default: run until done; each round exhausts a
            ``(rank, expert)`` supply or a slot's demand, so it ends).
        slot_rank: optional ``[S]`` rank of each slot; equal bids then prefer the
            slot's own rank, then the following ranks cyclically (default: lowest
            rank).
        backend: ``"auto"``/``None`` (C++ when built), ``"cpp"`` or ``"numpy"``.

    Returns:
        ``(X, rounds)``: int64 ``[R, S]`` tokens source rank ``r`` sends to slot
        ``s`` (``X.sum(0) == demand``; per rank and expert at most ``n``) and the
        number of rounds run.  If ``max_iters`` stops it early, the rest is filled in
        rank order (still exact).

    Each round: every slot with demand picks ``argmax_r bonus - price`` over ranks
    holding its expert (ties: see ``slot_rank``), ``price_r = price_step * (slots r
    has served so far)``; every picked rank serves all slots that picked it, highest
    net bonus first (ties: lowest slot), each ``min(r's remaining tokens of the slot's
    expert, the slot's remaining demand)`` -- so a slot whose expert's tokens at ``r``
    ran out earlier in the round gets nothing and bids again.  The round's serves then
    raise the prices.  Rounds are bounded by the number of sources a slot draws from
    (not by slots per rank, as with one serve per rank and round).
    """
    n = np.asarray(n, np.int64)
    se = np.asarray(slot_expert, np.int64)
    A = np.asarray(demand, np.int64).copy()
    R, S = n.shape[0], se.size
    X = np.zeros((R, S), np.int64)
    if S == 0:
        return X, 0
    ue, inv = np.unique(se, return_inverse=True)
    inv = inv.reshape(-1)
    supply = n[:, ue].copy()  # [R, U]: remaining tokens per rank and distinct expert
    U = ue.size
    bonus = np.asarray(bonus, np.float64)
    if slot_rank is not None:
        # tie-break: the slot's own rank first, then the next ranks cyclically, so
        # equal bids spread over ranks instead of herding on rank 0
        off = (np.arange(R)[:, None] - np.asarray(slot_rank, np.int64)[None, :]) % R
        bonus = bonus - 1e-9 * off
    cap = max_iters if max_iters is not None else R * U + S + 1
    if _use_cpp(backend):
        X, rounds = _core_mod.taot_auction(
            supply, inv.astype(np.int64), A, np.ascontiguousarray(bonus), float(price_step), int(cap)
        )
        return X, int(rounds)
    cnt = np.zeros(R, np.int64)  # slots each rank has served
    rounds = 0
    while rounds < cap:
        active = np.flatnonzero(A > 0)
        if active.size == 0:
            break
        sup = supply[:, inv[active]]  # [R, a]
        score = np.where(sup > 0, bonus[:, active] - price_step * cnt.astype(np.float64)[:, None], _NEG)
        rstar = np.argmax(score, axis=0)
        best = score[rstar, np.arange(active.size)]
        ok = best > _NEG
        if not ok.all():  # pragma: no cover - demand exceeds supply
            raise InputError("auction demand exceeds the tokens of its expert")
        o = np.lexsort((active, -best, rstar))  # per rank: best net bonus, lowest slot
        r_o = rstar[o]
        s_o = active[o]
        u_o = inv[s_o]
        # consumption of each (rank, expert) supply in that order: exclusive cumsum
        key = r_o * U + u_o
        o2 = np.argsort(key, kind="stable")
        k2 = key[o2]
        a2 = A[s_o[o2]]
        cs = np.cumsum(a2)
        gstart = np.ones(k2.size, bool)
        gstart[1:] = k2[1:] != k2[:-1]
        base = np.maximum.accumulate(np.where(gstart, cs - a2, 0))
        excl = cs - a2 - base
        r2 = r_o[o2]
        s2 = s_o[o2]
        u2 = u_o[o2]
        x = np.minimum(np.maximum(supply[r2, u2] - excl, 0), a2)
        X[r2, s2] += x  # each slot picked one rank: pairs distinct
        np.subtract.at(supply, (r2, u2), x)
        A[s2] -= x
        cnt += np.bincount(r2[x > 0], minlength=R)
        rounds += 1
    if (A > 0).any():  # cap reached: fill the rest in rank order
        for s in np.flatnonzero(A > 0).tolist():
            u = inv[s]
            for r in range(R):
                if A[s] == 0:
                    break
                x = min(int(supply[r, u]), int(A[s]))
                X[r, s] += x
                supply[r, u] -= x
                A[s] -= x
    return X, rounds
