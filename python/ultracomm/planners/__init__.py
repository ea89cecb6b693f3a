"""Balancing planners: which experts get replicas where, and how many tokens each
expert instance computes.

Every planner has the signature::

    plan(load, domain, slots_per_rank, **opts) -> PlannerResult

with ``load`` int64 ``[world, E]`` (tokens rank ``s`` sends to expert ``e``),
``domain`` a :class:`Domain` and ``slots_per_rank`` the replica slots per rank.  See
:mod:`ultracomm.planners.base` for the result's conventions (instance order, exact
integer token conservation).

=========  ==================================================================
``quota``  UltraEP: threshold search; replicas added by a max-flow-backed greedy
``taot``   TAOT: Sinkhorn flow hint, column-first matching, Lagrangian auction
``greedy`` FEPLB: move the busiest whole expert of the most loaded rank (mild skew)
``lpt``    DeepSeek EPLB: replica counts, balanced packing; min-max quotas (fixed homes)
``device`` the device control plane's quota planner (same C++ as the GPU kernel), host build
=========  ==================================================================
"""

from __future__ import annotations

from typing import Callable

from .base import Domain, PlannerResult, copy_counts, excess_imbalance, max_mean
from ..errors import InputError

__all__ = ["Domain", "PlannerResult", "PLANNERS", "get_planner", "excess_imbalance", "max_mean", "copy_counts"]

from . import device, greedy, lpt, quota, taot

PLANNERS: dict[str, Callable[..., PlannerResult]] = {
    "quota": quota.plan,
    "taot": taot.plan,
    "greedy": greedy.plan,
    "lpt": lpt.plan,
    "device": device.plan,
}


def get_planner(name: str) -> Callable[..., PlannerResult]:
    """The ``plan`` function registered as ``name`` (``quota``, ``taot``, ``greedy``,
    ``lpt``, ``device``)."""
    try:
        return PLANNERS[name]
    except KeyError:
        raise InputError(f"ultracomm: unknown planner {name!r}; choose one of {sorted(PLANNERS)}") from None
