"""Common planner interface: :class:`Domain`, :class:`PlannerResult` and the helpers
every planner shares (input checks, instance numbering, exact integer token splits).

Conventions (all planners):

* ``load``: int64 ``[world, E]``; ``load[s, e]`` tokens source rank ``s`` sends to
  expert ``e`` (numpy array, torch tensor or nested list).
* Expert ``e`` lives on home rank ``e // experts_per_rank``; its *instances* are
  instance 0 = the home copy, then its replicas in the order of
  ``plan.replicas_of(e)`` (sorted by rank, then slot).
* ``quota``: int64 ``[E, max_instances]`` tokens each instance computes; unused
  entries are 0.  ``quota.sum(1) == load.sum(0)`` exactly.
* ``token_moves``: int64 ``[world, E, max_instances]`` tokens source rank ``s`` sends
  to each instance; ``token_moves.sum(2) == load`` and ``token_moves.sum(0) == quota``
  exactly.  Planning computes the compact per-slot form ``slot_moves`` int64
  ``[world(src), world, slots]`` (tokens each source sends to each replica slot; the
  home instance gets the rest); ``token_moves`` is that, expanded on first access
  (the dense array is ``max_instances`` times the size of ``load``: 2.4 MB at EP64
  with one expert on 17 instances, a few hundred microseconds of memory traffic).
* ``max_instances = 1 + max_e (replicas of e)`` (at least 1).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..errors import InputError, PlanError, UltracommError
from ..plan import ReplicaPlan

try:  # compiled split (csrc/planners/split.cpp); numpy reference otherwise
    from .. import _core as _core_mod

    _HAVE_CPP_SPLIT = hasattr(_core_mod, "split_slots")
except ImportError:  # pragma: no cover - core not built
    _core_mod = None
    _HAVE_CPP_SPLIT = False

__all__ = [
    "Domain",
    "PlannerResult",
    "as_load",
    "build_result",
    "split_tokens",
    "split_slots",
    "expand_moves",
    "instance_index",
    "excess_imbalance",
    "max_mean",
    "copy_counts",
]


# ----------------------------------------------------------------------------- domain


@dataclass(frozen=True, eq=False)
class Domain:
    """Ranks and nodes of an EP group.

    Attributes:
        world: number of EP ranks.
        node_of: int64 ``[world]`` node index of each rank.
        experts_per_rank: experts homed on each rank (home of ``e`` is
            ``e // experts_per_rank``).
    """

    world: int
    node_of: np.ndarray
    experts_per_rank: int

    def __post_init__(self) -> None:
        node = np.ascontiguousarray(np.asarray(self.node_of, dtype=np.int64))
        if self.world < 1:
            raise PlanError(f"Domain.world must be >= 1, got {self.world}")
        if node.shape != (self.world,):
            raise PlanError(f"Domain.node_of must have shape [{self.world}], got {tuple(node.shape)}")
        if self.experts_per_rank < 1:
            raise PlanError(f"Domain.experts_per_rank must be >= 1, got {self.experts_per_rank}")
        node.setflags(write=False)
        object.__setattr__(self, "node_of", node)

    @classmethod
    def flat(cls, world: int, experts_per_rank: int) -> "Domain":
        """All ranks on one node (one scale-up domain)."""
        return cls(world, np.zeros(world, np.int64), experts_per_rank)

    @classmethod
    def nodes(cls, num_nodes: int, gpus_per_node: int, experts_per_rank: int) -> "Domain":
        """``num_nodes`` nodes of ``gpus_per_node`` ranks; rank ``r`` on node
        ``r // gpus_per_node``."""
        world = num_nodes * gpus_per_node
        return cls(world, np.arange(world, dtype=np.int64) // gpus_per_node, experts_per_rank)

    @property
    def num_experts(self) -> int:
        return self.world * self.experts_per_rank

    @property
    def num_nodes(self) -> int:
        return int(self.node_of.max()) + 1

    @functools.cached_property
    def home_of(self) -> np.ndarray:
        """int64 ``[E]`` home rank of each expert."""
        return np.arange(self.num_experts, dtype=np.int64) // self.experts_per_rank

    @functools.cached_property
    def same_node(self) -> np.ndarray:
        """bool ``[world, world]``: ranks on the same node."""
        return self.node_of[:, None] == self.node_of[None, :]

    def __repr__(self) -> str:
        return f"Domain(world={self.world}, nodes={self.num_nodes}, experts_per_rank={self.experts_per_rank})"


# ----------------------------------------------------------------------------- result


@dataclass(eq=False)
class PlannerResult:
    """What a planner returns.

    Attributes:
        slot_src: int32 ``[world, slots_per_rank]`` numpy array (-1 = empty): the plan's
            contents.  :attr:`plan` builds (and validates) the :class:`ReplicaPlan` from
            it on first access.
        quota: int64 ``[E, max_instances]`` tokens per expert instance.
        slot_moves: int64 ``[world(src), world, slots_per_rank]`` tokens each source
            rank sends to each replica slot (0 for empty slots); every other token of
            ``load`` goes to its expert's home.
        load: the int64 ``[world, E]`` load planned for.
        domain: the :class:`Domain` planned for.
        info: planner-specific diagnostics (threshold found, iterations, ...).
    """

    slot_src: np.ndarray
    quota: np.ndarray
    slot_moves: np.ndarray
    load: np.ndarray
    domain: Domain
    info: dict[str, Any] = field(default_factory=dict)

    @functools.cached_property
    def token_moves(self) -> np.ndarray:
        """int64 ``[world, E, max_instances]`` tokens each source rank sends to each
        instance (dense form of :attr:`slot_moves`, built on first access)."""
        return expand_moves(self.load, self.slot_src, self.slot_moves, self.domain, self.max_instances)

    @functools.cached_property
    def plan(self) -> ReplicaPlan:
        """The :class:`ReplicaPlan` (built and validated lazily; validation costs a few
        hundred microseconds at EP64, which is why it is not part of planning)."""
        return ReplicaPlan.make(
            self.slot_src, home_of=self.domain.home_of, experts_per_rank=self.domain.experts_per_rank
        )

    @property
    def max_instances(self) -> int:
        return int(self.quota.shape[1])

    @functools.cached_property
    def instance_rank(self) -> np.ndarray:
        """int64 ``[E, max_instances]``: rank of each instance (-1 unused)."""
        return instance_index(self.slot_src, self.domain)[0]

    @functools.cached_property
    def rank_load(self) -> np.ndarray:
        """int64 ``[world]``: tokens each rank computes after balancing (its experts' tokens,
        less what their replicas compute, plus what its own replica slots compute)."""
        W = self.domain.world
        slot_q = self.slot_moves.sum(0)  # [world, K] tokens each replica slot computes
        filled = self.slot_src >= 0
        home = self.domain.home_of[self.slot_src[filled].astype(np.int64)]
        out = self.load.sum(0).reshape(W, -1).sum(1) + slot_q.sum(1)  # experts homed e // epr
        np.subtract.at(out, home, slot_q[filled])
        return out

    @functools.cached_property
    def copies(self) -> tuple[int, int]:
        """``(intra_node, inter_node)`` replica copies (weight transfers from home)."""
        return copy_counts(self.slot_src, self.domain)

    def weighted_cost(self, inter_weight: float = 3.0) -> float:
        """Weighted copy cost: intra-node copies count 1, inter-node ``inter_weight``."""
        a, b = self.copies
        return float(a + inter_weight * b)


# ----------------------------------------------------------------------------- helpers


#: Most tokens one plan may hold (the sum of ``load``): 2**48, far above any batch, and low
#: enough that the planners' int64 arithmetic (sums, products with world and slot counts,
#: thresholds) cannot wrap; above it they reported "busiest 0 -> 0" or did not return.
MAX_LOAD_TOTAL = 1 << 48


def as_load(load: Any, domain: Domain) -> np.ndarray:
    """Check and convert ``load`` to a C-contiguous int64 numpy ``[world, E]`` (non-negative,
    at most :data:`MAX_LOAD_TOTAL` tokens in all)."""
    try:
        import torch

        if isinstance(load, torch.Tensor):
            if load.is_floating_point() or load.is_complex() or load.dtype == torch.bool:
                raise PlanError(f"ultracomm: load must hold integer token counts, got dtype {load.dtype}")
            load = load.detach().cpu().numpy()
    except ImportError:  # pragma: no cover
        pass
    a = np.asarray(load)
    if a.dtype.kind not in "iu":
        raise PlanError(f"ultracomm: load must hold integer token counts, got dtype {a.dtype}")
    if a.size and a.dtype.kind == "u" and int(a.max()) > MAX_LOAD_TOTAL:  # before int64 could wrap it
        raise PlanError(
            f"ultracomm: load holds {int(a.max())} tokens for one expert; a plan holds at most "
            f"{MAX_LOAD_TOTAL} (2**48) tokens in all"
        )
    a = np.ascontiguousarray(a, dtype=np.int64)
    if a.shape != (domain.world, domain.num_experts):
        raise PlanError(
            f"ultracomm: load must have shape [world, E] = [{domain.world}, {domain.num_experts}], got {tuple(a.shape)}"
        )
    if a.size and a.min() < 0:
        r, e = (int(i) for i in np.argwhere(a < 0)[0])
        raise PlanError(f"ultracomm: load must be non-negative: rank {r} routes {int(a[r, e])} tokens to expert {e}")
    total = float(a.sum(dtype=np.float64))  # exact below 2**53; int64 could wrap
    if total > MAX_LOAD_TOTAL:
        raise PlanError(
            f"ultracomm: load holds {int(a.astype(object).sum())} tokens in all; a plan holds at most "
            f"{MAX_LOAD_TOTAL} (2**48)"
        )
    return a


def check_slots(slots_per_rank: int) -> int:
    if not isinstance(slots_per_rank, (int, np.integer)) or slots_per_rank < 0:
        raise PlanError(f"slots_per_rank must be an int >= 0, got {slots_per_rank!r}")
    return int(slots_per_rank)


def instance_index(slot_src: np.ndarray, domain: Domain) -> tuple[np.ndarray, np.ndarray]:
    """Instance numbering of a plan.

    Returns:
        ``(instance_rank [E, I], slot_instance [world, slots])``: the rank of each
        instance (instance 0 = home; -1 = unused) and the instance index each filled
        slot holds (-1 for empty slots), ``I = 1 + max replicas``.
    """
    W, K = slot_src.shape
    E = domain.num_experts
    flat = slot_src.reshape(-1).astype(np.int64)
    filled = (flat >= 0).nonzero()[0]  # row-major = sorted by (rank, slot)
    ex = flat[filled]
    order = np.argsort(ex, kind="stable")
    ex_sorted = ex[order]
    counts = np.bincount(ex, minlength=E)
    starts = np.cumsum(counts) - counts  # exclusive prefix sum
    pos = np.arange(ex_sorted.size) - starts[ex_sorted]  # 0-based among e's replicas
    I = 1 + (int(counts.max()) if counts.size and ex.size else 0)
    inst_rank = np.full((E, I), -1, np.int64)
    inst_rank[:, 0] = domain.home_of
    slot_inst = np.full(W * K, -1, np.int64)
    fs = filled[order]
    inst_rank[ex_sorted, pos + 1] = fs // max(K, 1)
    slot_inst[fs] = pos + 1
    return inst_rank, slot_inst.reshape(W, K)


def split_tokens(load: np.ndarray, inst_rank: np.ndarray, quota: np.ndarray, backend: str | None = None) -> np.ndarray:
    """Exact integer split of each expert's tokens over its instances.

    Locality first: a source rank that holds an instance of ``e`` sends its own tokens
    to that instance up to the instance's quota; the rest is filled north-west-corner
    (sources in rank order, instances in instance order).

    Args:
        load: int64 ``[world, E]``.
        inst_rank: int64 ``[E, I]`` (-1 unused; unused instances must have quota 0).
        quota: int64 ``[E, I]`` with ``quota.sum(1) == load.sum(0)``.

        backend: ignored (this is the numpy reference; the planners use the C++ port
            :func:`split_slots` when built).

    Returns:
        int64 ``[world, E, I]`` with ``.sum(2) == load`` and ``.sum(0) == quota``.
    """
    W, E = load.shape
    I = quota.shape[1]
    moves = np.zeros((W, E, I), np.int64)
    moves[:, :, 0] = load
    if I == 1:
        return moves
    multi = np.flatnonzero((quota[:, 1:] > 0).any(1))  # experts with a loaded replica
    # every other expert's replicas take nothing: all its tokens go home (set above)
    if multi.size == 0:
        return moves
    ld = load[:, multi]  # [W, M]
    ir = inst_rank[multi]  # [M, I]
    q = quota[multi]  # [M, I]
    used = ir >= 0
    mi = np.broadcast_to(np.arange(multi.size)[:, None], ir.shape)
    local = np.zeros_like(q)
    local[used] = np.minimum(ld[ir[used], mi[used]], q[used])
    rem_ld = ld.copy()
    rem_ld[ir[used], mi[used]] -= local[used]
    rem_q = q - local
    # north-west corner on the remainders, sparse: merge each expert's cumulative
    # supply (sources) and demand (instances) breakpoints; every piece between two
    # consecutive breakpoints is one (source, instance) flow.  Experts are laid end
    # to end on one axis with offsets so one sort handles all of them.
    M = multi.size
    big = int(ld.sum()) + 1
    off = np.arange(M, dtype=np.int64) * big
    sc = (np.cumsum(rem_ld, axis=0).T + off[:, None]).ravel()  # [M*W], nondecreasing
    dc = (np.cumsum(rem_q, axis=1) + off[:, None]).ravel()  # [M*I]
    bp = np.sort(np.concatenate((off, sc, dc)))
    bp = bp[np.concatenate(([True], bp[1:] != bp[:-1]))]
    left = bp[:-1]
    length = bp[1:] - left
    si = np.searchsorted(sc, left, side="right")
    ii = np.searchsorted(dc, left, side="right")
    ok = (si < M * W) & (ii < M * I)
    si, ii, left, length = si[ok], ii[ok], left[ok], length[ok]
    m = si // W
    ok = left >= off[m]
    m, si, ii, length = m[ok], si[ok], ii[ok], length[ok]
    moves[:, multi, 0] = 0
    moves[si % W, multi[m], ii % I] = length  # (source, expert, instance) pieces are distinct
    moves[ir[used], multi[mi[used]], np.nonzero(used)[1]] += local[used]  # distinct too
    return moves


def expand_moves(load: np.ndarray, slot_src: np.ndarray, slot_moves: np.ndarray, domain: Domain, I: int) -> np.ndarray:
    """Dense ``[world, E, I]`` token moves from the per-slot form (home = the rest)."""
    W, E = load.shape
    _, slot_inst = instance_index(slot_src, domain)
    filled = slot_src >= 0
    ex = slot_src[filled].astype(np.int64)
    si = slot_inst[filled]
    rr, kk = np.nonzero(filled)
    rep = slot_moves[:, rr, kk]  # [W, filled]
    moves = np.zeros((W, E, I), np.int64)
    moves[:, ex, si] = rep
    home = load.copy()
    if ex.size:
        o = np.argsort(ex, kind="stable")
        exo = ex[o]
        starts = np.flatnonzero(np.concatenate(([True], exo[1:] != exo[:-1])))
        home[:, exo[starts]] -= np.add.reduceat(rep[:, o], starts, axis=1)
    moves[:, :, 0] = home
    return moves


def split_slots(
    load: np.ndarray,
    slot_src: np.ndarray,
    inst_rank: np.ndarray,
    slot_inst: np.ndarray,
    quota: np.ndarray,
    backend: str | None = None,
) -> np.ndarray:
    """:func:`split_tokens` in per-slot form: int64 ``[world(src), world, K]`` tokens
    each source sends to each replica slot (C++ when built; ``backend="numpy"`` goes
    through the numpy reference)."""
    W, K = slot_src.shape
    if backend not in (None, "auto", "cpp", "numpy"):
        raise InputError(f"backend must be 'auto', 'cpp' or 'numpy', got {backend!r}")
    if backend == "cpp" or (backend in (None, "auto") and _HAVE_CPP_SPLIT):
        if not _HAVE_CPP_SPLIT:
            raise UltracommError("ultracomm._core has no split_slots; rebuild the core")
        E, I = inst_rank.shape
        inst_slot = np.full((E, I), -1, np.int64)
        filled = slot_src >= 0
        rr, kk = np.nonzero(filled)
        inst_slot[slot_src[filled].astype(np.int64), slot_inst[filled]] = rr * K + kk
        return _core_mod.split_slots(load, inst_rank, quota, inst_slot, K).reshape(W, W, K)
    moves = split_tokens(load, inst_rank, quota, backend="numpy")
    rep = np.zeros((W, W, K), np.int64)
    filled = slot_src >= 0
    rr, kk = np.nonzero(filled)
    rep[:, rr, kk] = moves[:, slot_src[filled].astype(np.int64), slot_inst[filled]]
    return rep


def build_result(
    load: np.ndarray,
    domain: Domain,
    slot_src: np.ndarray,
    slot_quota: np.ndarray,
    info: dict[str, Any] | None = None,
    replica_moves: np.ndarray | None = None,
    backend: str | None = None,
    expert_load: np.ndarray | None = None,
) -> PlannerResult:
    """Assemble a :class:`PlannerResult` from per-slot replica quotas.

    Args:
        slot_src: int ``[world, K]`` (-1 empty).
        slot_quota: int64 ``[world, K]`` tokens each replica slot computes (0 where
            empty); the home instance takes the rest of each expert's tokens.
        replica_moves: optional int64 ``[world(src), world, K]`` tokens each source rank
            sends to each replica slot (its sum over sources must equal
            ``slot_quota``, and per source and expert it must not exceed ``load``); the
            home instance gets every remaining token.  Without it tokens are split by
            :func:`split_tokens` (locality first, then north-west corner).
        backend: for the split (see :func:`split_slots`).
        expert_load: optional int64 ``[E]`` ``load.sum(0)`` when the caller has it.
    """
    slot_src = np.ascontiguousarray(slot_src, dtype=np.int32)
    inst_rank, slot_inst = instance_index(slot_src, domain)
    E, I = inst_rank.shape
    total = load.sum(0) if expert_load is None else expert_load
    quota = np.zeros((E, I), np.int64)
    filled = slot_src >= 0
    ex = slot_src[filled].astype(np.int64)
    si = slot_inst[filled]
    quota[ex, si] = slot_quota[filled]
    home_q = total - quota[:, 1:].sum(1)
    if home_q.size and home_q.min() < 0:  # pragma: no cover - planner bug
        raise AssertionError("replica quotas exceed an expert's load")
    quota[:, 0] = home_q
    if replica_moves is None:
        rep = split_slots(load, slot_src, inst_rank, slot_inst, quota, backend)
    else:
        rep = np.asarray(replica_moves, np.int64)
    return PlannerResult(slot_src, quota, rep, load, domain, dict(info or {}))


def max_mean(rank_load: np.ndarray) -> float:
    """max : mean of per-rank loads (1.0 for an all-zero load)."""
    m = float(np.mean(rank_load))
    return float(np.max(rank_load)) / m if m > 0 else 1.0


def excess_imbalance(rank_load: np.ndarray) -> float:
    """(max - mean) / mean, the TAOT imbalance ratio."""
    return max_mean(rank_load) - 1.0


def copy_counts(slot_src: np.ndarray, domain: Domain) -> tuple[int, int]:
    """``(intra_node, inter_node)`` replica copies in ``slot_src``."""
    W, K = slot_src.shape
    filled = slot_src >= 0
    dst = np.broadcast_to(np.arange(W)[:, None], (W, K))[filled]
    src = domain.home_of[slot_src[filled].astype(np.int64)]
    same = domain.node_of[dst] == domain.node_of[src]
    return int(same.sum()), int((~same).sum())


def home_rank_load(load: np.ndarray, domain: Domain) -> tuple[np.ndarray, np.ndarray]:
    """``(expert_load [E], rank_load [world])`` before balancing."""
    el = load.sum(0)
    return el, el.reshape(domain.world, domain.experts_per_rank).sum(1)
