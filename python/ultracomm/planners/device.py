"""The device control plane's quota planner, host build (``get_planner("device")``).

The same C++ source (``include/ultracomm/impl/quota_plan.h``) is compiled by g++ into
``_core.quota_device`` and by nvcc into the GPU kernel (``csrc/cuda/k_quota.cu``), so what
the CPU tests check is the code a GPU runs.  UltraEP's quota formulation with integer
arithmetic only, no allocation and fixed capacities:

* Threshold search: the smallest global per-rank token threshold ``T`` it can meet, searched
  in rounds of 8 thresholds (concurrent on the GPU, one warp each; in turn on the host):
  round 0 gallops up from ``ceil(mean) - 1`` in steps of ``tol * 2**i`` -- its first probe is
  the lower bound times ``1 + eps``, so when that is feasible the search is one round (and
  one probe on the host, which stops a round at its first feasible threshold: the later ones
  cannot lower the bound) --, later rounds split the bracket evenly; it stops when the
  bracket is within ``tol = max(1, floor(mean) * eps_bp // 10000)`` tokens (``eps`` in steps
  of 0.0001, integers only so every build derives the same ``tol``).  The plan is kept from
  the probe that found the final threshold (no re-probe).  The rounds depend only on the
  probes' answers, so every build, lane count, probe-group count and rank computes the same
  plan from the same loads (no broadcast, no leader).
* A probe at ``T``: hot ranks (home load above ``T``), largest first, shed their experts'
  tokens, hottest expert first, to replicas on cold ranks.  Each replica takes one piece, on
  the cold rank that fits it best: the smallest spare that takes the whole piece, else the
  largest spare (a min-reduction over ranks -- a warp reduction on the GPU).  Hot ranks take
  no replica (UltraEP's fixed-home model); a piece is at least ``min_tokens``.
* Capacities: world <= 1024, experts <= 65536, slots <= 8, total tokens <= 2**48; beyond
  them :func:`plan` raises ``ValueError`` (use a host planner: ``quota``, ``taot``).
* On the GPU (:func:`plan_on_gpu`): one CTA of 8 warps with its whole state in shared
  memory where it fits the device's per-block limit (``_core.quota_device_smem_bytes``: 40 KB
  at EP64 with 2 slots), else the same code on global scratch.

Compared with the host ``quota`` planner (max-flow repair, cover search, bounded
backtracking): no search beyond the greedy, so on tight loads it may stop one ``tol`` step
higher or place more replicas; perf/planners.md measures both on the evaluation loads.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:  # pragma: no cover - annotations only; the GPU path imports torch where it runs
    import torch

from .base import Domain, PlannerResult, as_load, build_result, check_slots
from ..errors import InputError, UltracommError

try:
    from .. import _core as _core_mod

    _HAVE_CPP = hasattr(_core_mod, "quota_device")
except ImportError:  # pragma: no cover - core not built
    _core_mod = None
    _HAVE_CPP = False

__all__ = ["plan", "plan_on_gpu", "decode_result", "fits", "MAX_WORLD", "MAX_EXPERTS", "MAX_SLOTS"]

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
    groups: int = 1,
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
        groups: probe groups splitting each round's 8 thresholds, ``lanes`` threads each (8:
            the GPU kernel's shape, one warp per threshold; tests -- the plan is the same).

    Returns:
        :class:`PlannerResult`; ``info``: ``threshold``, ``probes`` (thresholds the search
        scheduled -- what the GPU runs; the host may skip those above a round's first feasible
        one), ``rounds``, ``replicas``.

    Raises:
        ValueError: shapes or sizes beyond the planner's capacities, bad options.
    """
    if not _HAVE_CPP:
        raise UltracommError(
            "ultracomm._core has no quota_device; rebuild the core (pip install --no-build-isolation -e .)"
        )
    load = as_load(load, domain)
    K = check_slots(slots_per_rank)
    _check(domain, K, min_tokens)
    W, epr = domain.world, domain.experts_per_rank
    eps_bp = _eps_bp(eps)
    el = np.ascontiguousarray(load.sum(0), dtype=np.int64)
    node = np.ascontiguousarray(domain.node_of, dtype=np.int32) if intra_node_only else None
    slot_src, slot_quota, info = _core_mod.quota_device(
        el, node, W, epr, K, int(min_tokens), 0, eps_bp, int(lanes), int(groups)
    )
    return build_result(load, domain, slot_src, slot_quota, dict(info))


def _eps_bp(eps: float) -> int:
    if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 <= eps <= 1:
        raise InputError(f"eps must be a float in [0, 1], got {eps!r}")
    return int(round(eps * 10000))


def fits(world: int, num_experts: int, slots_per_rank: int) -> bool:
    """Whether a problem of this size is within the planner's capacities."""
    return world <= MAX_WORLD and num_experts <= MAX_EXPERTS and slots_per_rank <= MAX_SLOTS


def _check(domain: Domain, K: int, min_tokens: int) -> None:
    W, epr = domain.world, domain.experts_per_rank
    if W > MAX_WORLD or W * epr > MAX_EXPERTS or K > MAX_SLOTS:
        raise InputError(
            f"the device planner holds world <= {MAX_WORLD}, experts <= {MAX_EXPERTS}, "
            f"slots <= {MAX_SLOTS}; got world {W}, experts {W * epr}, slots {K} "
            "(use a host planner: planner='quota')"
        )
    if not isinstance(min_tokens, (int, np.integer)) or isinstance(min_tokens, bool) or min_tokens < 1:
        raise InputError(f"min_tokens must be an int >= 1, got {min_tokens!r}")


STATUS = {
    1: "world, experts_per_rank or slots beyond the planner's capacity",
    2: "an expert load is negative, or the total is above 2**48 tokens",
    3: "min_tokens, tol or eps out of range",
    4: "node_of has a negative node",
}


def plan_on_gpu(
    loads: "torch.Tensor",
    domain: Domain,
    slots_per_rank: int,
    *,
    eps: float = 0.01,
    min_tokens: int = 1,
    intra_node_only: bool = False,
    stream: "torch.cuda.Stream | None" = None,
    out: "dict | None" = None,
) -> "dict":
    """Run the same planner as :func:`plan` on the GPU, stream-ordered, with no host sync.

    The first call on a device sets the kernel's shared-memory attribute (host calls, no stream
    work): make it before capturing a CUDA graph.

    Args:
        loads: int32 ``[world, E]`` CUDA tensor, the gathered token counts.
        domain, slots_per_rank, eps, min_tokens, intra_node_only: as in :func:`plan`.
        stream: the CUDA stream to enqueue on (default: the current stream).
        out: buffers of an earlier call with the same shapes, reused (no allocation; what a
            captured CUDA graph needs).

    Returns:
        dict of CUDA tensors: ``slot_src`` int32 ``[world, slots]``, ``slot_quota`` int64
        ``[world, slots]``, ``expert_load`` int64 ``[E]``, ``result`` int64 ``[3]`` (status |
        probes << 32, rounds | replicas << 32, threshold), ``scratch``; read them after the
        stream's work (``decode_result`` turns ``result`` into a dict, raising on a bad status).
    """
    import torch

    from ..cuda import support as cuda_support

    K = check_slots(slots_per_rank)
    _check(domain, K, min_tokens)
    W, epr = domain.world, domain.experts_per_rank
    E = W * epr
    if not (
        isinstance(loads, torch.Tensor)
        and loads.is_cuda
        and loads.dtype == torch.int32
        and tuple(loads.shape) == (W, E)
        and loads.is_contiguous()
    ):
        raise InputError(f"loads must be a contiguous int32 CUDA tensor of shape [{W}, {E}]")
    dev = loads.device
    cuda = cuda_support.cuda_runtime(dev.index, "the device planner")
    if out is None:
        out = dict(
            slot_src=torch.empty((W, K), dtype=torch.int32, device=dev),
            slot_quota=torch.empty((W, K), dtype=torch.int64, device=dev),
            expert_load=torch.empty(E, dtype=torch.int64, device=dev),
            result=torch.zeros(3, dtype=torch.int64, device=dev),
            scratch=torch.empty(cuda.quota_scratch_bytes(W, E, K) // 8, dtype=torch.int64, device=dev),
        )
        out["node_of"] = torch.as_tensor(np.asarray(domain.node_of, np.int32), device=dev) if intra_node_only else None
    s = stream if stream is not None else torch.cuda.current_stream(dev)
    node = out.get("node_of")
    cuda.quota_plan(
        loads.data_ptr(),
        out["expert_load"].data_ptr(),
        node.data_ptr() if node is not None else 0,
        out["scratch"].data_ptr(),
        out["slot_src"].data_ptr(),
        out["slot_quota"].data_ptr(),
        out["result"].data_ptr(),
        W,
        epr,
        K,
        int(min_tokens),
        0,
        _eps_bp(eps),
        s.cuda_stream,
    )
    return out


def decode_result(result: Any) -> dict:
    """``plan_on_gpu``'s ``result`` words (host copy) as a dict; raises ValueError on a bad status."""
    w = [int(x) for x in (result.tolist() if hasattr(result, "tolist") else result)]
    status, probes = w[0] & 0xFFFFFFFF, w[0] >> 32
    if status:
        raise InputError(f"device planner: {STATUS.get(status, f'status {status}')}")
    return dict(threshold=w[2], probes=probes, rounds=w[1] & 0xFFFFFFFF, replicas=w[1] >> 32)
