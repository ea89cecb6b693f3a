"""UltraEP quota-driven planner.

The planner solves for the *quota* (tokens each expert instance computes) directly,
coupling replica placement with token rerouting.  It searches for the smallest global
per-rank load threshold ``T`` it can meet.

Feasibility at ``T`` (:func:`feasible`; C++, csrc/planners/quota_search.cpp):

* Once the replicas are chosen, meeting ``T`` is a max-flow problem: source -> hot rank
  ``h`` (capacity ``L_h - T``) -> each of ``h``'s experts (its tokens) -> every rank
  holding a replica of it -> sink (capacity ``T - L_j``).  The max-flow moves tokens
  along the replicas already placed, so a later replica can take over part of an earlier
  one's tokens to make room (what a one-pass greedy cannot do).
* Choosing the replicas is the hard part: each rank holds at most ``slots_per_rank``
  replicas, which makes it a packing problem (bin covering reduces to it with one slot
  per rank, so no polynomial test is exact in general unless P = NP).
* Greedy: replicas are added one at a time: the (expert, rank with a free slot) pair that
  promises the most tokens, ties to the tightest fit (the smallest spare left on the looser
  side), then the lower rank; promises are direct (the hot rank's remaining excess, the
  expert's tokens left at home, the rank's spare) while any pair has one, then over the
  widest residual paths (rerouting included).  After each addition the max-flow is
  recomputed.  A replica may not promise fewer than ``min_tokens`` tokens (a rank may end
  up to ``min_tokens - 1`` above ``T``); replicas left below it are dropped at the end.
* Cheap necessary conditions refuse hopeless thresholds first (per node with
  ``intra_node_only``): the receivers' spare must cover the excess, and the replicas the
  hot ranks need at least -- each as many as the fewest of its experts, and as many as
  the fewest receivers, that hold its excess -- must fit in the receivers' slots.
* Cover search (csrc/planners/quota_cover.cpp), within ``cover_budget`` per call: a
  depth-first search over which receivers and experts cover each hot rank's excess (hot
  ranks largest first, tightest receiver first), cutting every branch that wastes more
  spare than the total slack; then, with one slot per rank, a tabu local search over which
  expert each receiver holds.  With one slot per rank it replaces the greedy (which seldom
  meets tight thresholds there and, run after it, met no planted load it had missed); with
  more, it runs after the greedy failed.
* With more than one slot per rank, when both fail, a limited-discrepancy search retries
  the greedy with runner-up choices (the three best per step, a receiver's second-best
  expert among them; up to three deviations) within ``search_budget`` replica additions
  per :func:`plan` call.  (With one slot it met no planted load the cover search had
  missed, so it does not run there.)
* Bounded work: both budgets count work, never time, so plans are deterministic.  The
  probes of one call share them, and a probe may spend at most three quarters of what is
  left, so that after a hard tight probe the looser ones still search.  The defaults
  (``COVER_BUDGET`` 80000 units of about 10 ns, ``SEARCH_BUDGET`` 128 additions of a few
  microseconds at EP64) keep a call's search under 1 ms on the evaluation machine; the
  greedy itself is not budgeted (at most ``slots_per_rank`` additions per receiver per
  probe).
* Model: hot ranks (above ``T``) never take replicas (UltraEP's model), so a plan that
  needs a hot rank to take another's tokens while shedding its own is out of reach.

Threshold search: gallop up from ``lb - 1`` (``lb = ceil(mean)``, so the first probe is
``ceil(mean) - 1 + tol``) in steps of ``tol = max(1, floor(eps * mean))`` tokens, doubling,
then bisect until the bracket is within ``tol``; the smallest feasible ``T`` found gives
the plan.  With ``tol = 1`` (means below ``1 / eps``) the search ends on the smallest ``T``
the feasibility test meets, ``ceil(mean)`` included.

What is guaranteed:

* With ``slots_per_rank=1`` and ``min_tokens=1`` the depth-first cover search is
  complete: if it runs to the end (at most 1000 placements per probe, and a quarter of
  the probe's share of ``cover_budget``), its answer is exact -- a plan when one exists,
  else a proof that none does (``info['refuted']``; checked against brute force on small
  loads, tests/planners/test_planners.py).  When it stops early the local search, which cannot
  refute, takes over, and a threshold is then missed only if that runs out of budget too.
* With more slots per rank the cover search splits a receiver's spare only in the way its
  order suggests (a partial piece at a hot rank's last receiver), so nothing is exact: a
  failed probe is not a proof.
* The threshold search assumes feasibility is monotone in ``T`` and stops within ``tol``
  tokens of the smallest threshold it could meet, ``ceil(mean)`` included.

What it finds (measured on a loaded 2-core machine; perf/planners.md, generated with
:func:`ultracomm.tools.planted.planted_family`): the Zipf, hot-rank and rank-blocked
loads of the evaluation meet the 1 % target at the first probe.  On loads built around a
known plan at 1.01 x mean with every receiver filled exactly
(:func:`ultracomm.tools.planted.planted_load`), world 8-64, 400 loads per slots-per-rank
value: 1 slot 395/400, 2 slots 399/400, 3 slots 400/400 met; every miss ends at the next
probe, 1.02 x mean.  Four of the one-slot misses are the budget's price: their local
search needs 70000-172000 units at the first probe (``cover_budget=240_000`` meets them,
at up to 2-3 ms per call); the fifth (world 64) needs 381000, and the two-slot miss (world
64) about 2000 limited-discrepancy additions (``search_budget=5000``: ~13 ms).  Once the
replicas are placed, meeting ``T`` is decided exactly (the max-flow); what these misses
lack is the placement, the NP-hard part.

Token split: a source rank's own tokens go to its own instance first, the rest
north-west-corner (:func:`~ultracomm.planners.base.split_tokens`).

UltraEP keeps replication inside one scale-up domain; with ``intra_node_only=True``
replicas only go to ranks on the expert's home node.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import Domain, PlannerResult, as_load, build_result, check_slots, home_rank_load
from ..errors import InputError, UltracommError

try:  # the search runs in C++ (csrc/planners/quota_search.cpp)
    from .. import _core as _core_mod

    _HAVE_CPP = hasattr(_core_mod, "quota_search")
except ImportError:  # pragma: no cover - core not built
    _core_mod = None
    _HAVE_CPP = False

__all__ = ["plan", "feasible", "SEARCH_BUDGET", "COVER_BUDGET"]

#: Default replica additions the bounded search may spend in one :func:`plan` call, shared
#: by the threshold probes the greedy fails (each at most three quarters of what is left;
#: a few microseconds each at EP64 on the evaluation machine).
SEARCH_BUDGET = 128

#: Default work the cover search may spend in one :func:`plan` call (depth-first piece
#: placements, and (expert, receiver) pairs scanned by the local search), shared by the
#: threshold probes the greedy fails, each at most three quarters of what is left (about
#: 10 ns per unit on the evaluation machine: the whole budget is under 1 ms).
COVER_BUDGET = 80_000


def _core():
    if not _HAVE_CPP:
        raise UltracommError(
            "ultracomm._core has no quota_search; rebuild the core (pip install --no-build-isolation -e .)"
        )
    return _core_mod


def _inputs(load: Any, domain: Domain, intra_node_only: bool):
    load = as_load(load, domain)
    W, epr = domain.world, domain.experts_per_rank
    el, L = home_rank_load(load, domain)
    elr = el.reshape(W, epr)
    order = np.argsort(-elr, axis=1, kind="stable")  # hottest first, ties lower id
    order = np.ascontiguousarray(order + (np.arange(W) * epr)[:, None]).reshape(-1)
    node = domain.node_of if intra_node_only else None
    return load, el, L, order, node


def _check_budget(budget: int, name: str = "search_budget") -> int:
    if not isinstance(budget, (int, np.integer)) or isinstance(budget, bool) or budget < 0:
        raise InputError(f"{name} must be an int >= 0, got {budget!r}")
    return int(budget)


def feasible(
    load: Any,
    domain: Domain,
    slots_per_rank: int,
    T: int,
    *,
    min_tokens: int = 1,
    intra_node_only: bool = False,
    search_budget: int = SEARCH_BUDGET,
    cover_budget: int = COVER_BUDGET,
) -> np.ndarray | None:
    """One feasibility test of the quota planner at threshold ``T``.

    Args:
        load: int64 ``[world, E]``.
        domain: ranks and nodes.
        slots_per_rank: replica slots per rank.
        T: per-rank token threshold.
        min_tokens, intra_node_only: as in :func:`plan`.
        search_budget: replica additions the bounded search may spend after the greedy.
        cover_budget: piece placements the cover search may spend (after the greedy; with one slot
            per rank, instead of it).

    Returns:
        int64 ``[n, 3]`` replicas ``(expert, rank, tokens)`` that bring every rank to at
        most ``T + min_tokens - 1``, or ``None`` if none was found.  With one slot per rank
        and ``min_tokens=1``, ``None`` after the cover search ran to the end (not out of
        budget) is a proof that no placement meets ``T`` (module docstring).
    """
    load, el, L, order, node = _inputs(load, domain, intra_node_only)
    K = check_slots(slots_per_rank)
    reps, _ = _core().quota_feasible(
        L,
        el,
        order,
        node,
        K,
        max(int(min_tokens), 1),
        _check_budget(search_budget),
        _check_budget(cover_budget, "cover_budget"),
        int(T),
    )
    return reps


def plan(
    load: Any,
    domain: Domain,
    slots_per_rank: int,
    *,
    eps: float = 0.01,
    min_tokens: int = 1,
    intra_node_only: bool = False,
    search_budget: int = SEARCH_BUDGET,
    cover_budget: int = COVER_BUDGET,
) -> PlannerResult:
    """UltraEP quota planner.

    Args:
        load: int64 ``[world, E]``.
        domain: ranks and nodes.
        slots_per_rank: replica slots per rank.
        eps: relative tolerance of the threshold search (``eps * mean`` tokens).
        min_tokens: smallest quota a replica may take.
        intra_node_only: keep replicas on the expert's home node.
        search_budget: replica additions the bounded search may spend in this call on
            thresholds the greedy and the cover search failed.
        cover_budget: piece placements the cover search may spend in this call on
            thresholds the greedy failed, or with one slot per rank on every threshold, in
            place of the greedy (both 0: greedy only).

    ``info``: ``threshold`` (the T met), ``probes`` (feasibility tests run), ``steps``
    (replica additions over all probes), ``pruned`` (probes refused by the necessary
    conditions), ``searched`` / ``rescued`` (probes the greedy failed and the bounded
    search ran on, and those it then met), ``budget_left``; ``covered`` / ``cover_met`` /
    ``refuted`` (probes the greedy failed and the cover search ran on, those it met, those
    it proved infeasible), ``cover_budget_left``.
    """
    load, el, L, order, node = _inputs(load, domain, intra_node_only)
    K = check_slots(slots_per_rank)
    W = domain.world
    tol = max(1, int(math.floor(eps * L.sum() / W)))
    thr, reps, stats = _core().quota_search(
        L,
        el,
        order,
        node,
        K,
        max(int(min_tokens), 1),
        tol,
        _check_budget(search_budget),
        _check_budget(cover_budget, "cover_budget"),
    )
    slot_src = np.full((W, K), -1, np.int32)
    slot_quota = np.zeros((W, K), np.int64)
    if reps.shape[0]:
        # per rank, its replicas in the order the search listed them
        o = np.argsort(reps[:, 1], kind="stable")
        r = reps[o]
        first = np.ones(r.shape[0], bool)
        first[1:] = r[1:, 1] != r[:-1, 1]
        start = np.maximum.accumulate(np.where(first, np.arange(r.shape[0]), 0))
        k = np.arange(r.shape[0]) - start
        slot_src[r[:, 1], k] = r[:, 0]
        slot_quota[r[:, 1], k] = r[:, 2]
    return build_result(load, domain, slot_src, slot_quota, {"threshold": int(thr), **stats})
