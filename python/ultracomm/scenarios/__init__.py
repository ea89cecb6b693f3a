"""Workloads for benchmarks, the simulator and tests: MoE model presets, synthetic router loads
and a simple replica planner (formerly ``ultracomm.tools.workloads``, an old path that still
imports this package).  Below the tools and the simulator, which both use it; above the runtime.

:mod:`.models` (presets), :mod:`.loads` (metrics and generators), :mod:`.plans` (planners),
:mod:`.specs` (CLI specs); every name below is importable from the package.

Loads
-----
A *load* is an int64 numpy array ``[world, E]``: ``load[r, e]`` is the number of token
assignments rank ``r`` sends to expert ``e``.  Every generator conserves tokens exactly:
each row sums to ``tokens_per_rank * top_k``.  Expert ``e`` is homed on rank
``e // experts_per_rank`` (the default home placement of :class:`ReplicaPlan`).

=============================  =========================================================
:func:`zipf_load`              two-level Zipf (home ranks, then experts within a rank),
                               exponent bisected to hit a target max:mean rank imbalance
:func:`hot_rank_load`          LLEP-style: a fraction of every rank's assignments go to a
                               few hot experts of one rank, the rest spread evenly
:func:`rotating_hot_load`      a few hot experts that change with the micro-batch ``step``
:func:`rank_blocked_load`      each token's experts all on one home rank (a rank's experts
                               popular together), rank weights Zipf bisected to a target
=============================  =========================================================

All generators are deterministic given ``seed`` (``np.random.default_rng``).

Plans
-----
:func:`greedy_replicas` (greedy slot filling on estimated rank load), :func:`hot_plan`
(one expert replicated onto N other ranks) and :func:`max_mean_after` (the max:mean rank
load once each expert's load is split evenly over its home and replicas).

CLI specs
---------
:func:`make_workload` parses ``"uniform"``, ``"zipf:<target>"``, ``"blocked:<target>"``,
``"hot:<fraction>[:<n>]"`` and ``"rotating[:<step>[:<num_hot>[:<skew>]]]"``; :data:`WORKLOADS`
lists the usual ones.
"""

from __future__ import annotations

from .loads import LoadLike, expert_load, hot_rank_load, imbalance, rank_blocked_load, rotating_hot_load, zipf_load
from .models import MODELS, ModelSpec, get_model
from .plans import greedy_replicas, hot_plan, max_mean_after, zipf_slot_src
from .specs import WORKLOAD_FORMS, WORKLOADS, make_workload

__all__ = [
    "LoadLike",
    "zipf_slot_src",
    "ModelSpec",
    "MODELS",
    "get_model",
    "zipf_load",
    "hot_rank_load",
    "rotating_hot_load",
    "rank_blocked_load",
    "imbalance",
    "expert_load",
    "greedy_replicas",
    "hot_plan",
    "max_mean_after",
    "WORKLOADS",
    "WORKLOAD_FORMS",
    "make_workload",
]
