"""TAOT phase 2: the column-first matching of spilling experts to cold ranks (which expert gets a
replica where, and how many tokens it takes), and the paper's fixed per-expert spill."""

from __future__ import annotations

import numpy as np

from .backend import _core_mod, _use_cpp

_NEG = -np.inf


def spill_of(expert_load: np.ndarray, experts_per_rank: int, target: int) -> np.ndarray:
    """int64 ``[E]``: tokens each expert can spill: per rank, experts sorted by
    ascending load, ``sigma_k = max(cumsum_k - target, 0)``, ``spill = diff(sigma)``.
    Sums to each rank's excess over ``target``."""
    W = expert_load.size // experts_per_rank
    x = expert_load.reshape(W, experts_per_rank)
    order = np.argsort(x, axis=1, kind="stable")
    xs = np.take_along_axis(x, order, axis=1)
    sig = np.maximum(np.cumsum(xs, axis=1) - target, 0)
    sp = np.diff(sig, axis=1, prepend=0)
    out = np.empty_like(x)
    np.put_along_axis(out, order, sp, axis=1)
    return out.reshape(-1)


def _match(
    sp_e: np.ndarray,
    grp: np.ndarray,
    exc: np.ndarray,
    sp_r: np.ndarray,
    static: np.ndarray,
    allowed: np.ndarray,
    K: int,
    n_inner: int,
    min_gain: int,
    mutual: bool,
    two_pass: bool,
    backend: str | None,
) -> tuple[np.ndarray, np.ndarray]:
    """Phase 2 on the compacted problem (candidate experts x cold ranks); see
    :func:`column_first_matching`.  ``sp_e``/``exc``/``sp_r`` are consumed (numpy path).
    ``allowed``: uint8, 0 never, 1 in the last pass, 2 in every pass."""
    mg = max(int(min_gain), 1)
    if _use_cpp(backend):
        return _core_mod.taot_matching(
            sp_e,
            grp,
            exc,
            sp_r,
            np.ascontiguousarray(static),
            allowed,
            int(K),
            int(n_inner),
            mg,
            bool(mutual),
            bool(two_pass),
        )
    ne, nr = static.shape
    gs = np.zeros((ne, nr), np.int64)
    rs = np.full((ne, nr), -1, np.int64)
    used = np.zeros((ne, nr), bool)
    slots = np.full(nr, int(K), np.int64)
    cols = np.arange(nr)
    for p in range(2 if two_pass else 1):
        okp = allowed >= (2 if two_pass and p == 0 else 1)
        for k in range(int(K)):
            matched = slots <= 0
            for _ in range(n_inner):
                sp = np.minimum(sp_e, exc[grp])
                gain = np.minimum(sp[:, None], sp_r[None, :])
                ok = okp & ~used & ~matched[None, :] & (gain >= mg)
                if not ok.any():
                    break
                score = np.where(ok, gain + static, _NEG)
                best = np.argmax(score, axis=0)  # each cold rank's proposal
                bsc = score[best, cols]
                prop = np.flatnonzero(bsc > _NEG)
                if mutual:  # ... accepted only if the rank is also the expert's best
                    prop = prop[np.argmax(score, axis=1)[best[prop]] == prop]
                if prop.size == 0:  # pragma: no cover - the global best pair is mutual
                    break
                pe = best[prop]
                # arbitration: per expert, the highest score, then the lowest rank
                o = np.lexsort((prop, -bsc[prop], pe))
                pe_o = pe[o]
                first = np.ones(o.size, bool)
                first[1:] = pe_o[1:] != pe_o[:-1]
                win_r = prop[o[first]]
                win_e = pe_o[first]
                win_s = bsc[win_r]
                for i in np.lexsort((win_e, -win_s)).tolist():
                    e, r = int(win_e[i]), int(win_r[i])
                    amt = min(int(sp_e[e]), int(exc[grp[e]]), int(sp_r[r]))
                    if amt < mg:
                        continue
                    gs[e, r] = amt
                    rs[e, r] = p * int(K) + k
                    sp_e[e] -= amt
                    exc[grp[e]] -= amt
                    sp_r[r] -= amt
                    used[e, r] = True
                    matched[r] = True
                    slots[r] -= 1
    return gs, rs


def column_first_matching(
    spill: np.ndarray,
    spare: np.ndarray,
    bonus: np.ndarray,
    hint: np.ndarray,
    home_of: np.ndarray,
    K: int,
    alpha: float,
    inner_iters: int | None = None,
    backend: str | None = None,
    *,
    home_excess: np.ndarray | None = None,
    min_gain: int = 1,
    mutual: bool = False,
    first_pass: np.ndarray | None = None,
) -> tuple[np.ndarray, np.ndarray]:
    """Phase 2: column-first iterative matching.

    Args:
        spill: int ``[E]`` tokens each expert may shed.
        spare: int ``[R]`` capacity of each cold rank.
        bonus: ``[E, R]`` topology preference ``B`` (1 intra, ``w_inter`` inter, 0 home).
        hint: ``[E, R]`` normalised OT hint.
        home_of: ``[E]`` home rank (a rank never takes its own expert).
        K: rounds (replica slots per rank).
        alpha: weight of ``B`` (``0.1 * alpha`` for the hint).
        inner_iters: inner iterations per round (default: number of cold ranks; the
            loop also stops once no cold rank has a candidate).
        backend: ``"auto"``/``None`` (C++ when built), ``"cpp"`` or ``"numpy"``.
        home_excess: refinement (*dynamic spill*): int ``[R]`` excess of each home rank;
            the spill of ``e`` is then ``min(spill_e, home_excess[home_e])``, both
            decremented by every match, so a hot rank's excess may be shed by any of its
            experts (``spill`` is then each expert's whole load).  ``None``: the paper's
            fixed per-expert spill.
        min_gain: refinement: no match moves fewer tokens (1 = the paper).
        mutual: refinement: a cold rank's proposal is only accepted if that rank is also
            the expert's best available rank (same score), so small-spare ranks do not
            take slices of a spill a larger-spare rank could take whole.
        first_pass: refinement: bool ``[E, R]`` pairs to match first (intra-node); after
            its ``K`` rounds a second pass of ``K`` rounds allows every pair, with the
            slots left (at most ``K`` replicas per rank overall).

    Returns:
        ``(g, rnd)``: int64 ``[E, R]`` tokens planned from expert ``e`` to rank ``r``,
        and int64 ``[E, R]`` round in which the pair matched (-1 = not matched; the
        second pass numbers its rounds ``K..2K-1``).

    Arbitration: when several cold ranks propose the same expert, the highest score
    wins; ties go to the lowest rank id.  Each cold rank proposes the highest-scoring
    expert; ties go to the lowest expert id.  Winners are applied highest score first
    (then lowest expert id); a winner whose spill a previous winner of the same home
    used up (``home_excess``) below ``min_gain`` is dropped and its rank proposes again.
    With the defaults this is the paper's Algorithm 2.
    """
    spill = np.asarray(spill, np.int64)
    spare = np.asarray(spare, np.int64)
    home_of = np.asarray(home_of, np.int64)
    E, R = bonus.shape
    g = np.zeros((E, R), np.int64)
    rnd = np.full((E, R), -1, np.int64)
    ok_e = spill > 0
    if home_excess is not None:
        home_excess = np.asarray(home_excess, np.int64)
        ok_e &= home_excess[home_of] > 0
    ei = np.flatnonzero(ok_e)
    ri = np.flatnonzero(spare > 0)
    if ei.size == 0 or ri.size == 0 or K <= 0:
        return g, rnd
    sp_e = spill[ei].copy()
    sp_r = spare[ri].copy()
    if home_excess is not None:  # groups: the distinct home ranks
        hu, grp = np.unique(home_of[ei], return_inverse=True)
        exc = home_excess[hu].copy()
    else:  # each expert its own group, capped by its own spill
        grp = np.arange(ei.size)
        exc = sp_e.copy()
    grp = np.ascontiguousarray(grp.reshape(-1), dtype=np.int64)
    static = alpha * bonus[np.ix_(ei, ri)] + 0.1 * alpha * hint[np.ix_(ei, ri)]
    allowed = (home_of[ei][:, None] != ri[None, :]).astype(np.uint8)
    two_pass = first_pass is not None
    if two_pass:
        allowed += allowed & np.asarray(first_pass, bool)[np.ix_(ei, ri)]
    n_inner = ri.size if inner_iters is None else int(inner_iters)
    gs, rs = _match(sp_e, grp, exc, sp_r, static, allowed, K, n_inner, min_gain, mutual, two_pass, backend)
    g[np.ix_(ei, ri)] = gs
    rnd[np.ix_(ei, ri)] = rs
    return g, rnd
