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

Modules: :mod:`.tables` (the topology cost and the per-domain tables), :mod:`.sinkhorn` (phase
1), :mod:`.matching` (phase 2 and the paper's fixed spill), :mod:`.consolidation` (the refinement
between phases 2 and 3), :mod:`.auction` (phase 3), :mod:`.backend` (compiled loops or the numpy
reference); :func:`plan` (here) runs them.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ..base import Domain, PlannerResult, as_load, build_result, check_slots, home_rank_load
from .auction import lagrangian_auction
from .backend import _HAVE_CPP as _HAVE_CPP  # whether the compiled loops are built (the tests read it)
from .backend import _core_mod, _use_cpp
from .consolidation import consolidate_replicas
from .matching import _match, column_first_matching, spill_of
from .sinkhorn import sinkhorn
from .tables import _tables, topology_cost
from ...errors import InputError

__all__ = [
    "plan",
    "topology_cost",
    "sinkhorn",
    "spill_of",
    "column_first_matching",
    "consolidate_replicas",
    "lagrangian_auction",
]


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
        raise InputError(f"spill must be 'dynamic' or 'paper', got {spill!r}")
    load = as_load(load, domain)
    K = check_slots(slots_per_rank)
    opts = dict(
        lam=lam,
        eps=eps,
        w_inter=w_inter,
        sinkhorn_iters=sinkhorn_iters,
        price_step=price_step,
        auction_iters=auction_iters,
        backend=backend,
        tol=tol,
        min_gain_frac=min_gain_frac,
        spill=spill,
        mutual=mutual,
        consolidate=consolidate,
    )
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


def _plan(
    load: np.ndarray,
    domain: Domain,
    K: int,
    *,
    lam: float,
    eps: float | None,
    w_inter: float,
    sinkhorn_iters: int,
    price_step: float,
    auction_iters: int | None,
    backend: str | None,
    tol: float,
    min_gain_frac: float,
    spill: str,
    mutual: bool,
    two_pass: bool,
    consolidate: bool,
) -> tuple[PlannerResult, int]:
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
            load,
            el,
            L,
            home,
            excess,
            spare,
            flow,
            Brr,
            bid,
            same.view(np.uint8),
            epr,
            K,
            tgt,
            mg,
            alpha,
            spill == "dynamic",
            bool(mutual),
            bool(two_pass),
            bool(consolidate),
            float(price_step),
            auction_iters,
        )
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
    gs, rs = _match(
        cap,
        grp.astype(np.int64, copy=False),
        exc,
        spare[ri],
        static,
        allowed,
        K,
        ri.size,
        mg,
        mutual,
        two_pass,
        backend,
    )
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
        load, e_m, demand, Brr[:, r_m], price_step, auction_iters, slot_rank=r_m, backend=backend
    )
    info["auction_rounds"] = rounds
    rep = np.zeros((W, W, K), np.int64)
    rep[:, r_m, k_m] = X
    # most loaded rank: homes less what their replicas take, plus what slots take
    fin = L - np.bincount(home[e_m], demand, W).astype(np.int64) + np.bincount(r_m, demand, W).astype(np.int64)
    res = build_result(load, domain, slot_src, slot_quota, info, replica_moves=rep, expert_load=el)
    return res, int(fin.max(initial=0))


def _none(
    load: np.ndarray, domain: Domain, slot_src: np.ndarray, info: dict[str, Any], L: np.ndarray
) -> tuple[PlannerResult, int]:
    """:func:`_plan`'s result without replicas (each rank keeps its load ``L``)."""
    W, K = slot_src.shape
    res = build_result(load, domain, slot_src, np.zeros((W, K), np.int64), info)
    return res, int(L.max(initial=0))
