"""The device control plane's quota planner, host build (``get_planner("device")``).

The same C++ source (``include/ultracomm/quota_plan.h``) is compiled by g++ into
``_core.quota_device`` and by nvcc into the GPU kernel (``csrc/cuda/k_quota.cu``), so what
the CPU tests check is the code a GPU runs.  UltraEP's quota formulation with integer
arithmetic only, no allocation and fixed capacities:

* Threshold search: the smallest global per-rank token threshold ``T`` it can meet, searched
  in rounds of 8 thresholds (concurrent on the GPU, one warp each; in turn on the host):
  round 0 gallops up from ``ceil(mean) - 1`` in steps of ``tol * 2**i``, later rounds split
  the bracket evenly; it stops when the bracket is within ``tol = max(1, floor(eps *
  mean))`` tokens.  The rounds depend only on the probes' answers, so every build, lane
  count and rank computes the same plan from the same loads (no broadcast, no leader).
* A probe at ``T``: hot ranks (home load above ``T``), largest first, shed their experts'
  tokens, hottest expert first, to replicas on cold ranks.  Each replica takes one piece, on
  the cold rank that fits it best: the smallest spare that takes the whole piece, else the
  largest spare (a min-reduction over ranks -- a warp reduction on the GPU).  Hot ranks take
  no replica (UltraEP's fixed-home model); a piece is at least ``min_tokens``.
* Capacities: world <= 1024, experts <= 65536, slots <= 8, total tokens <= 2**48; beyond
  them :func:`plan` raises ``ValueError`` (use a host planner: ``quota``, ``taot``).

Compared with the host ``quota`` planner (max-flow repair, cover search, bounded
backtracking): no search beyond the greedy, so on tight loads it may stop one ``tol`` step
higher or place more replicas; perf/planners.md measures both on the evaluation loads.
"""
from __future__ import annotations

import math
from typing import Any

import numpy as np

from .base import Domain, PlannerResult, as_load, build_result, check_slots

try:
    from .. import _core as _core_mod

    _HAVE_CPP = hasattr(_core_mod, "quota_device")
except ImportError:  # pragma: no cover - core not built
    _core_mod = None
    _HAVE_CPP = False

__all__ = ["plan", "MAX_WORLD", "MAX_EXPERTS", "MAX_SLOTS"]

MAX_WORLD = 1024
MAX_EXPERTS = 1 << 16
MAX_SLOTS = 8


def plan(
    load: Any,
    domain: Domain,
    slots_per_rank: int,
    *,
    eps: float = 0.01,
    min_tokens: int = 1,
    intra_node_only: bool = False,
    lanes: int = 1,
) -> PlannerResult:
    """Plan with the device quota planner's host build.

    Args:
        load: int64 ``[world, E]`` tokens each source rank sends to each expert.
        domain: ranks and nodes (``experts_per_rank`` fixes each expert's home).
        slots_per_rank: replica slots per rank (1..8).
        eps: relative tolerance of the threshold search (``eps * mean`` tokens).
        min_tokens: smallest quota a replica may take (>= 1).
        intra_node_only: keep replicas on the expert's home node (``domain.node_of``).
        lanes: host threads standing in for a warp's lanes (tests; the plan is the same for
            every value).

    Returns:
        :class:`PlannerResult`; ``info``: ``threshold``, ``probes``, ``rounds``,
        ``replicas``.

    Raises:
        ValueError: shapes or sizes beyond the planner's capacities, bad options.
    """
    if not _HAVE_CPP:
        raise RuntimeError("ultracomm._core has no quota_device; rebuild the core "
                           "(pip install --no-build-isolation -e .)")
    load = as_load(load, domain)
    K = check_slots(slots_per_rank)
    W, epr = domain.world, domain.experts_per_rank
    if W > MAX_WORLD or W * epr > MAX_EXPERTS or K > MAX_SLOTS:
        raise ValueError(f"the device planner holds world <= {MAX_WORLD}, experts <= {MAX_EXPERTS}, "
                         f"slots <= {MAX_SLOTS}; got world {W}, experts {W * epr}, slots {K} "
                         "(use a host planner: planner='quota')")
    if not isinstance(min_tokens, (int, np.integer)) or isinstance(min_tokens, bool) or min_tokens < 1:
        raise ValueError(f"min_tokens must be an int >= 1, got {min_tokens!r}")
    if not (isinstance(eps, (int, float)) and 0 <= eps < 1):
        raise ValueError(f"eps must be a float in [0, 1), got {eps!r}")
    el = np.ascontiguousarray(load.sum(0), dtype=np.int64)
    tol = max(1, int(math.floor(eps * int(el.sum()) / W)))
    node = np.ascontiguousarray(domain.node_of, dtype=np.int32) if intra_node_only else None
    slot_src, slot_quota, info = _core_mod.quota_device(el, node, W, epr, K, int(min_tokens), tol, int(lanes))
    return build_result(load, domain, slot_src, slot_quota, dict(info))
