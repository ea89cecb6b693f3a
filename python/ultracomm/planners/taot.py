"""TAOT: topology-aware optimal transport replica placement (three phases + refinements).

Balance target: ``T = ceil(mean) + floor(tol * mean)`` tokens per rank (``tol`` = 1 %,
the same tolerance as the quota planner's ``eps``); ``m = max(1, floor(min_gain_frac *
tol * mean))``.  Hot ranks shed down to ``T - m + 1`` (``excess_r = max(L_r - T + m - 1,
0)``), cold ranks fill up to ``T`` (``spare_r = max(T - L_r, 0)``); what a hot rank keeps
(``< m``) still ends within ``T``.

1. :func:`sinkhorn` -- rank-level balanced entropic OT from excess to spare under the
   topology cost (1 intra-node, ``lam`` inter-node), ``eps = lam`` by default; the
   plan ``T [world, world]`` is a *hint*, expanded to experts by home rank and
   normalised by the home's excess.
2. :func:`column_first_matching` -- each round every cold rank proposes its best
   expert by ``min(spill_e, spare_r) + alpha*B_er + 0.1*alpha*hint_er``; conflicts
   (several ranks proposing one expert) go to the highest score, ties to the lowest
   rank id; losers propose again in the next inner iteration.  ``K`` rounds, so at
   most ``K`` replicas per rank.
3. :func:`lagrangian_auction` -- each round every spare slot with demand bids for
   the source rank with the best ``bonus - price`` (among ranks still holding its
   expert's tokens); every picked rank serves *all* slots that picked it, best net
   bonus first (ties: lowest slot), each ``min(its remaining tokens of the slot's
   expert, slot's remaining demand)``, and its price rises by ``price_step`` per slot
   served.  Runs until every demand is met (exact integers); the home instance gets
   every token not auctioned.

Deviations from the paper (each switchable in :func:`plan`; ``tol=0, min_gain_frac=0,
spill="paper", mutual=False, intra_first=False, consolidate=False`` is the paper's
algorithm), and why -- measured on the EP16/EP32 evaluation loads, see perf/planners.md:

* **Balance tolerance** (``tol``): the paper balances to the exact mean.  The last
  percent of balance costs many copies (every hot rank must be split over ranks whose
  spare is the few tokens they are below the mean), and quota stops at 1 % too.
* **Dynamic spill** (``spill="dynamic"``): the paper fixes each expert's spill once by
  cumulative-excess differencing over the home's experts.  Here the spill of ``e`` is
  ``min(tokens of e still at home, home's remaining excess)``, recomputed after every
  match, so when one cold rank takes part of the top expert's spill the rest of the
  home's excess can go with *any* expert in one more copy instead of one copy per
  expert that was assigned a slice (phase-1 hint and scores unchanged).
* **Minimum gain** (``min_gain_frac``): no match moves fewer than ``m`` tokens.  In the
  paper every cold rank gets a pick each round, so ranks with a few tokens of spare
  take slivers of spills (a copy each; 4- and 58-token replicas at EP32 20 %).
* **Mutual acceptance** (``mutual``): a cold rank's proposal is only accepted when
  that rank is also the expert's best free rank; otherwise a small-spare rank whose
  favourite expert no large-spare rank proposed this iteration takes a slice of it and
  the rest needs another copy.
* **Intra-node first** (``intra_first``): ``K`` rounds over intra-node pairs, then ``K``
  rounds over all pairs with the slots left.  With ``alpha = mean * R / E`` (one mean
  expert load) the topology term is worth ``alpha * (1 - w_inter)`` = half a mean expert
  of gain, which does not keep cold ranks of an under-loaded node from taking slices
  of another node's experts while that node's own cold ranks are still free; the
  phase-1 hint (``0.1 * alpha``) is too weak to steer it.  When the intra-node-first
  plan misses the balance target ``T`` (its first pass spends slots on small intra-node
  pieces that the global matching would have spent on the big spills: EP16 at initial
  max:mean 1.5 / 2.0 ended 1.028 / 1.115), :func:`plan` runs the global matching too
  and returns it if it is better balanced, saying so in ``info["intra_first"]``: the
  default never gives up more than the tolerance of balance for locality.
* **Consolidation** (:func:`consolidate_replicas`, a refinement step between phases 2
  and 3): a replica whose tokens fit into the other replicas of its home's experts
  (within ``T``) or back into the home's own room is dropped -- inter-node replicas
  first, then the smallest.  One copy fewer, no rank above ``T``.
* **Sinkhorn demand scaling**: the demand is scaled like the paper scales the supply
  (``min(1, sum(s) / sum(d))``), so the OT stays balanced when the spare exceeds the
  excess (always, under the tolerance); without it Sinkhorn never met its row
  tolerance and ran all iterations.

Phases 2, 3 and the consolidation run in C++ (``ultracomm._core.taot_matching`` /
``taot_auction`` / ``taot_consolidate``, csrc/planners/taot.cpp); :func:`plan` runs everything
after phase 1 -- the compacted phase-2 inputs and scores, matching, consolidation, slot order,
auction, the plan's quotas -- in one call (``taot_run``, csrc/planners/taot_run.cpp and
taot_finish.cpp) when the compiled core has them.  The numpy implementations here are the
reference (``backend="numpy"``) and give bit-identical plans.
"""
from __future__ import annotations

import math
import weakref
from typing import Any

import numpy as np

from .base import Domain, PlannerResult, as_load, build_result, check_slots, home_rank_load

try:  # compiled loops (csrc/planners/taot.cpp); numpy reference otherwise
    from .. import _core as _core_mod

    _HAVE_CPP = all(hasattr(_core_mod, f) for f in ("taot_auction", "taot_matching", "taot_run"))
except ImportError:  # pragma: no cover - core not built
    _core_mod = None
    _HAVE_CPP = False


def _use_cpp(backend: str | None) -> bool:
    if backend is None or backend == "auto":
        return _HAVE_CPP
    if backend == "cpp":
        if not _HAVE_CPP:
            raise RuntimeError("ultracomm._core has no TAOT loops; rebuild the core")
        return True
    if backend == "numpy":
        return False
    raise ValueError(f"backend must be 'auto', 'cpp' or 'numpy', got {backend!r}")

__all__ = [
    "plan",
    "topology_cost",
    "sinkhorn",
    "spill_of",
    "column_first_matching",
    "consolidate_replicas",
    "lagrangian_auction",
]

_NEG = -np.inf


def topology_cost(domain: Domain, lam: float = 3.0) -> np.ndarray:
    """float64 ``[world, world]``: 1 between ranks of one node, ``lam`` across nodes."""
    return np.where(domain.same_node, 1.0, float(lam))


# Per-domain tables that depend only on the topology and the options, built once per
# (domain, lam, eps, w_inter) instead of on every call; weak keys, so a dropped Domain
# drops its tables.
_TABLES: "weakref.WeakKeyDictionary[Domain, dict]" = weakref.WeakKeyDictionary()


def _tables(domain: Domain, lam: float, eps: float, w_inter: float) -> tuple[np.ndarray, ...]:
    """``(kernel, Brr, bid)``: the Sinkhorn kernel ``exp(-cost / eps)``, the topology
    preference ``B`` (1 intra, ``w_inter`` inter) and the auction's bonus ``B[r, q] -
    1e-9 * ((r - q) % world)`` of source ``r`` for a slot on rank ``q`` (the tie-break of
    :func:`lagrangian_auction`'s ``slot_rank``), all float64 ``[world, world]``."""
    per = _TABLES.get(domain)
    if per is None:
        per = _TABLES[domain] = {}
    key = (float(lam), float(eps), float(w_inter))
    t = per.get(key)
    if t is None:
        R = domain.world
        kernel = np.exp(-topology_cost(domain, lam) / eps)
        Brr = np.where(domain.same_node, 1.0, float(w_inter))
        bid = Brr - 1e-9 * ((np.arange(R)[:, None] - np.arange(R)[None, :]) % R)
        for a in (kernel, Brr, bid):
            a.setflags(write=False)
        if len(per) >= 8:  # a few option sets per domain at most
            per.pop(next(iter(per)))
        t = per[key] = (kernel, Brr, bid)
    return t


def sinkhorn(
    excess: np.ndarray,
    spare: np.ndarray,
    cost: np.ndarray,
    eps: float,
    iters: int = 100,
    tol: float = 1e-6,
    eps0: float = 1e-9,
    kernel: np.ndarray | None = None,
) -> np.ndarray:
    """Phase 1: balanced entropic OT ``T = diag(u) M diag(v)``, ``M = exp(-cost/eps)``.

    Args:
        excess: ``[R]`` supply (0 on non-hot ranks).
        spare: ``[R]`` demand (0 on non-cold ranks).
        cost: ``[R, R]`` transport cost.
        eps: entropic regularisation.
        iters: maximum Sinkhorn-Knopp iterations (``u = s~ / M v``, ``v = d / M^T u``).
        tol: stop early once every row sum is within ``tol * sum(s~)`` of ``s~``.
        kernel: optional precomputed ``exp(-cost / eps)`` ``[R, R]`` (``cost`` is then
            not read); the planner caches it per domain.

    The supply is scaled by ``gamma = min(1, sum(d) / sum(s))`` (feasibility guard),
    and after the iterations each column is capped at its demand.  Refinement: the
    demand is likewise scaled by ``min(1, sum(s) / sum(d))`` so the problem stays
    balanced when the spare capacity exceeds the excess (it does under the planner's
    balance tolerance; without it the row marginals never converge and every call runs
    all ``iters`` iterations).  Returns the float64 ``[R, R]`` flow.
    """
    s = np.asarray(excess, np.float64)
    d = np.asarray(spare, np.float64)
    R = s.size
    T = np.zeros((R, R))
    hi = (s > 0).nonzero()[0]
    ci = (d > 0).nonzero()[0]
    if hi.size == 0 or ci.size == 0:
        return T
    s_sum, d_sum = s.sum(), d.sum()
    gamma = min(1.0, d_sum / max(s_sum, eps0))
    st = gamma * s[hi]
    dc = d[ci] * min(1.0, s_sum / max(d_sum, eps0))
    if kernel is None:
        M = np.exp(-np.asarray(cost, np.float64)[np.ix_(hi, ci)] / eps)
    else:  # elementwise the same values as above
        M = kernel.take(hi, 0).take(ci, 1)  # = kernel[np.ix_(hi, ci)], faster
    v = np.ones(ci.size)
    thr = tol * st.sum()
    Mv = M @ v
    for _ in range(max(int(iters), 1)):
        u = st / np.maximum(Mv, eps0)
        v = dc / np.maximum(M.T @ u, eps0)
        Mv = M @ v  # row sums of this iterate, reused by the next u update
        if np.abs(u * Mv - st).max() <= thr:
            break
    sub = u[:, None] * M * v[None, :]
    sub *= np.minimum(1.0, dc / (sub.sum(0) + eps0))[None, :]
    T[hi[:, None], ci] = sub
    return T


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
            sp_e, grp, exc, sp_r, np.ascontiguousarray(static), allowed, int(K), int(n_inner),
            mg, bool(mutual), bool(two_pass),
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
    gs, rs = _match(sp_e, grp, exc, sp_r, static, allowed, K, n_inner, min_gain, mutual,
                    two_pass, backend)
    g[np.ix_(ei, ri)] = gs
    rnd[np.ix_(ei, ri)] = rs
    return g, rnd


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
            raise ValueError("auction demand exceeds the tokens of its expert")
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
        caps = [min(int(room[rank[q]]), int(left[expert[q]]) + (a if expert[q] == e else 0))
                for q in others]
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


def plan(
    load: Any,
    domain: Domain,
    slots_per_rank: int,
    *,
    lam: float = 3.0,
    eps: float | None = None,
    w_inter: float = 0.5,
    sinkhorn_iters: int = 100,
    price_step: float = 0.05,
    auction_iters: int | None = None,
    backend: str | None = None,
    tol: float = 0.01,
    min_gain_frac: float = 0.25,
    spill: str = "dynamic",
    mutual: bool = True,
    intra_first: bool = True,
    consolidate: bool = True,
) -> PlannerResult:
    """TAOT planner (phases 1-3 with the refinements listed in the module docstring).

    Args:
        load: int64 ``[world, E]``.
        domain: ranks and nodes.
        slots_per_rank: ``K`` guest slots per rank.
        lam: inter-node cost (intra = 1).
        eps: Sinkhorn regularisation (default ``lam``).
        w_inter: topology preference of an inter-node pair (``< 1``; intra = 1).
        sinkhorn_iters: Sinkhorn iteration cap.
        price_step: auction price step.
        auction_iters: auction round cap (default: until done).
        backend: phases 2-3 in ``"cpp"`` or ``"numpy"`` (default: C++ when built);
            the results are identical.
        tol: balance tolerance: the target is ``T = ceil(mean) + floor(tol * mean)``
            tokens per rank (0: the paper's mean target).
        min_gain_frac: no match moves fewer than ``m = max(1, floor(min_gain_frac * tol
            * mean))`` tokens; hot ranks shed down to ``T - m + 1`` so that what is left
            (``< m``) still ends within ``T``.
        spill: ``"dynamic"`` (a hot rank's excess may be shed by any of its experts) or
            ``"paper"`` (fixed per-expert spill by cumulative-excess differencing).
        mutual: accept a proposal only if it is also the expert's best rank.
        intra_first: match intra-node pairs first, then all pairs.
        consolidate: run the consolidation step between phases 2 and 3.

    ``tol=0, min_gain_frac=0, spill="paper", mutual=False, intra_first=False,
    consolidate=False`` is the paper's algorithm (plus the Sinkhorn demand scaling).

    ``info``: ``target`` (T), ``min_gain`` (m), ``flow`` (phase-1 ``[R, R]``),
    ``consolidated`` (replicas dropped), ``auction_rounds``, and ``intra_first``:
    ``"met"`` (the intra-node-first matching met T), ``"fallback"`` (it missed T, so the
    global matching ran and its plan, better balanced, is returned; ``intra_first_max``
    is the missed plan's most loaded rank), ``"kept"`` (both missed T and the
    intra-first plan was at least as balanced) or ``"off"`` (one node, or
    ``intra_first=False``).
    """
    if spill not in ("dynamic", "paper"):
        raise ValueError(f"spill must be 'dynamic' or 'paper', got {spill!r}")
    load = as_load(load, domain)
    K = check_slots(slots_per_rank)
    opts = dict(lam=lam, eps=eps, w_inter=w_inter, sinkhorn_iters=sinkhorn_iters,
                price_step=price_step, auction_iters=auction_iters, backend=backend, tol=tol,
                min_gain_frac=min_gain_frac, spill=spill, mutual=mutual, consolidate=consolidate)
    two_pass = intra_first and domain.num_nodes > 1
    res, worst = _plan(load, domain, K, two_pass=two_pass, **opts)
    if not two_pass:
        res.info["intra_first"] = "off"
        return res
    if worst <= res.info["target"]:
        res.info["intra_first"] = "met"
        return res
    # locality cost more than the tolerance of balance: the global matching instead
    alt, alt_worst = _plan(load, domain, K, two_pass=False, **opts)
    if alt_worst < worst:
        alt.info.update(intra_first="fallback", intra_first_max=worst)
        return alt
    res.info["intra_first"] = "kept"
    return res


def _plan(load: np.ndarray, domain: Domain, K: int, *, lam: float, eps: float | None,
          w_inter: float, sinkhorn_iters: int, price_step: float, auction_iters: int | None,
          backend: str | None, tol: float, min_gain_frac: float, spill: str, mutual: bool,
          two_pass: bool, consolidate: bool) -> tuple[PlannerResult, int]:
    """One TAOT run (see :func:`plan`); ``two_pass``: intra-node pairs first.  Returns the
    result and its most loaded rank's tokens (``result.rank_load.max()``, from the plan's
    integers without building ``rank_load``)."""
    W, epr = domain.world, domain.experts_per_rank
    el, L = home_rank_load(load, domain)
    total = int(L.sum())
    slack = int(math.floor(max(float(tol), 0.0) * total / W))
    tgt = -(-total // W) + slack
    mg = max(1, int(math.floor(max(float(min_gain_frac), 0.0) * slack)))
    excess = np.maximum(L - (tgt - mg + 1), 0)  # shed down to T - m + 1
    spare = np.maximum(tgt - L, 0)  # fill up to T
    slot_src = np.full((W, K), -1, np.int32)
    info: dict[str, Any] = {"target": tgt, "min_gain": mg, "auction_rounds": 0}
    if K == 0 or not (excess >= mg).any():
        info["flow"] = np.zeros((W, W))
        return _none(load, domain, slot_src, info, L)
    eps_ = lam if eps is None else eps
    kernel, Brr, bid = _tables(domain, lam, eps_, w_inter)
    flow = sinkhorn(excess, spare, None, eps_, sinkhorn_iters, kernel=kernel)
    info["flow"] = flow
    home = domain.home_of
    same = domain.same_node
    alpha = total / el.size  # mean * R / E
    if _use_cpp(backend):  # everything below, and build_result, in one C++ call: same results
        n, slot_src, quota, rep, ncons, rounds, worst = _core_mod.taot_run(
            load, el, L, home, excess, spare, flow, Brr, bid, same.view(np.uint8), epr, K, tgt,
            mg, alpha, spill == "dynamic", bool(mutual), bool(two_pass), bool(consolidate),
            float(price_step), auction_iters)
        if n == 0:
            return _none(load, domain, slot_src, info, L)
        if ncons >= 0:
            info["consolidated"] = ncons
        info["auction_rounds"] = rounds
        return PlannerResult(slot_src, quota, rep, load, domain, info), worst
    # phase 2 on the compacted problem: candidate experts (of hot ranks) x cold ranks with
    # room for a match; the same as column_first_matching on the full [E, R] inputs
    if spill == "dynamic":
        ei = np.flatnonzero((excess[home] >= mg) & (el >= mg))
        cap = el[ei]
    else:
        cap = spill_of(el, epr, tgt - mg + 1)
        ei = np.flatnonzero(cap > 0)
        cap = cap[ei]
    ri = np.flatnonzero(spare >= mg)
    if ei.size == 0 or ri.size == 0:
        return _none(load, domain, slot_src, info, L)
    hb = home[ei]  # nondecreasing: experts are numbered by home
    if spill == "dynamic":
        newh = np.empty(hb.size, bool)  # first candidate of each home
        newh[0] = True
        np.not_equal(hb[1:], hb[:-1], out=newh[1:])
        grp = np.cumsum(newh) - 1
        exc = excess[hb[newh]]
    else:
        grp = np.arange(ei.size)
        exc = cap.copy()
    # score terms: alpha * B (1 intra, w_inter inter; home pairs are never allowed) and
    # 0.1 * alpha * OT hint normalised by the home's excess
    # [experts, ranks] gathers: row take, then column take (= m[np.ix_(hb, ri)], faster)
    hint = flow.take(hb, 0).take(ri, 1) / np.maximum(excess[hb], 1e-9)[:, None]
    static = alpha * Brr.take(hb, 0).take(ri, 1) + 0.1 * alpha * hint
    allowed = (hb[:, None] != ri[None, :]).astype(np.uint8)
    if two_pass:
        allowed += allowed & same.take(hb, 0).take(ri, 1)
    # fresh arrays (fancy-indexed): _match may consume them
    gs, rs = _match(cap, grp.astype(np.int64, copy=False), exc, spare[ri], static, allowed, K,
                    ri.size, mg, mutual, two_pass, backend)
    e_c, r_c = np.nonzero(gs)
    if e_c.size == 0:
        return _none(load, domain, slot_src, info, L)
    e_m, r_m = ei[e_c], ri[r_c]
    rnd_m = rs[e_c, r_c]
    demand = gs[e_c, r_c]
    if consolidate and e_m.size > 1:
        hm = home[e_m]
        shed = np.bincount(hm, weights=demand, minlength=W).astype(np.int64)
        got = np.bincount(r_m, weights=demand, minlength=W).astype(np.int64)
        room = np.maximum(tgt - (L - shed + got), 0)
        # np.unique(e_m, return_inverse=True): e_m is nondecreasing (row-major nonzero of
        # gs over ascending candidate experts)
        newe = np.ones(e_m.size, bool)
        newe[1:] = e_m[1:] != e_m[:-1]
        ue = e_m[newe]
        e_u = np.cumsum(newe) - 1
        left = el[ue] - np.bincount(e_u, weights=demand, minlength=ue.size).astype(np.int64)
        keep, demand = consolidate_replicas(hm, r_m, e_u, ~same[hm, r_m], demand, left, room, backend)
        info["consolidated"] = int(keep.size - keep.sum())
        e_m, r_m, rnd_m, demand = e_m[keep], r_m[keep], rnd_m[keep], demand[keep]
    # slots: per rank, in round order
    o = np.lexsort((rnd_m, r_m))
    e_m, r_m, demand = e_m[o], r_m[o], demand[o]
    first = np.ones(r_m.size, bool)
    first[1:] = r_m[1:] != r_m[:-1]
    start = np.maximum.accumulate(np.where(first, np.arange(r_m.size), 0))
    k_m = np.arange(r_m.size) - start
    slot_src[r_m, k_m] = e_m
    slot_quota = np.zeros((W, K), np.int64)
    slot_quota[r_m, k_m] = demand
    X, rounds = lagrangian_auction(
        load, e_m, demand, Brr[:, r_m], price_step, auction_iters, slot_rank=r_m, backend=backend,
    )
    info["auction_rounds"] = rounds
    rep = np.zeros((W, W, K), np.int64)
    rep[:, r_m, k_m] = X
    # most loaded rank: homes less what their replicas take, plus what slots take
    fin = L - np.bincount(home[e_m], demand, W).astype(np.int64) + np.bincount(
        r_m, demand, W).astype(np.int64)
    res = build_result(load, domain, slot_src, slot_quota, info, replica_moves=rep, expert_load=el)
    return res, int(fin.max(initial=0))


def _none(load: np.ndarray, domain: Domain, slot_src: np.ndarray, info: dict[str, Any],
          L: np.ndarray) -> tuple[PlannerResult, int]:
    """:func:`_plan`'s result without replicas (each rank keeps its load ``L``)."""
    W, K = slot_src.shape
    res = build_result(load, domain, slot_src, np.zeros((W, K), np.int64), info)
    return res, int(L.max(initial=0))
