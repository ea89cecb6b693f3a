"""ReplicaPlan: which logical expert each replica slot holds, and converters from the
plan formats of the systems ultracomm plugs into.

A plan is two small CPU tensors:

* ``slot_src``  int32 ``[world, slots_per_rank]`` -- the logical expert copied into
  replica slot ``(rank, slot)``; ``-1`` marks an empty slot.
* ``home_of``   int32 ``[E]`` -- the rank that holds the master copy of each expert
  (default ``e // experts_per_rank``).

Invariants (checked by :meth:`ReplicaPlan.validate`, raised as :class:`PlanError`):
expert ids in ``0..E-1`` or ``-1``; no replica on the expert's own home rank; no expert
twice on one rank; homes in ``0..world-1``.

Converters:

=============================================  ===========================================
Megatron MoE ECHO ``map_home_expert_to_spare``  :meth:`ReplicaPlan.from_echo_map` /
bool ``[E, S_global]``                         :meth:`ReplicaPlan.to_echo_map`
Megatron transport seam ``experts_to_copy``     :meth:`ReplicaPlan.from_experts_to_copy` /
int32 ``[EP, slots]``, -1 unused                :meth:`ReplicaPlan.to_experts_to_copy`
vLLM / DeepSeek EPLB ``phy2log`` ``[(L,) P]``   :func:`moves_from_phy2log` (weight moves),
                                               :func:`plan_from_phy2log` (home-fixed maps)
=============================================  ===========================================
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, NamedTuple, Sequence, Union

import numpy as np
import torch

from .errors import PlanError

__all__ = [
    "ReplicaPlan",
    "Move",
    "moves_from_phy2log",
    "plan_from_phy2log",
]

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[Any]]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


# ----------------------------------------------------------------------------- helpers


def _to_numpy(x: ArrayLike, name: str, *, allow_bool: bool = False) -> np.ndarray:
    """Convert a tensor / ndarray / nested list to an int64 numpy array.

    Floats, complex and (unless ``allow_bool``) bools are rejected with a PlanError
    naming ``name``.  Empty lists are accepted as integer.
    """
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.dtype == torch.bool:
            if not allow_bool:
                raise PlanError(
                    f"{name} must hold integer expert ids, got a torch.bool tensor; "
                    "convert it with .to(torch.int32)"
                )
            return t.cpu().numpy().astype(np.int64)
        if t.is_floating_point() or t.is_complex():
            raise PlanError(
                f"{name} must hold integers, got dtype {t.dtype}; expert ids are integers "
                "(-1 marks an empty slot): convert with .to(torch.int32) if the values are whole"
            )
        return _as_int64(t.cpu().numpy(), name)
    arr = np.asarray(x)
    if arr.size == 0 and not isinstance(x, np.ndarray):
        arr = arr.astype(np.int64)
    if arr.dtype == np.bool_:
        if not allow_bool:
            raise PlanError(
                f"{name} must hold integer expert ids, got booleans; convert to int32"
            )
        return arr.astype(np.int64)
    if arr.dtype.kind in "fO" and not isinstance(x, np.ndarray) and _all_python_ints(x):
        raise PlanError(f"{name} has values outside the int32 range")  # numpy fell back to float/object
    if arr.dtype.kind not in "iu":
        raise PlanError(
            f"{name} must hold integers, got dtype {arr.dtype}; expert ids are integers "
            "(-1 marks an empty slot)"
        )
    return _as_int64(arr, name)


def _all_python_ints(x: Any) -> bool:
    """``x`` is a (nested) sequence of Python ints (bools excluded)."""
    items = np.asarray(x, dtype=object).ravel()
    return bool(items.size) and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items)


def _as_int64(arr: np.ndarray, name: str) -> np.ndarray:
    """``arr`` as int64; unsigned values that int64 cannot hold (e.g. uint64 2^64-1, which a
    plain cast turns into -1, an empty slot) are rejected instead of wrapped."""
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT32_MAX:
        raise PlanError(f"{name} has values outside the int32 range (largest {int(arr.max())})")
    return arr.astype(np.int64)


def _check_int32_range(a: np.ndarray, name: str) -> None:
    if a.size and (a.min() < _INT32_MIN or a.max() > _INT32_MAX):
        raise PlanError(f"{name} has values outside the int32 range")


def _default_home_of(num_experts: int, world: int, experts_per_rank: int | None) -> np.ndarray:
    """home_of[e] = e // experts_per_rank, with checks that every rank hosts exactly
    experts_per_rank experts."""
    if experts_per_rank is None:
        if num_experts % world != 0:
            raise PlanError(
                f"num_experts = {num_experts} does not divide evenly over world = {world} "
                "ranks; pass home_of= to place experts explicitly"
            )
        experts_per_rank = num_experts // world
    if experts_per_rank <= 0 or experts_per_rank * world != num_experts:
        raise PlanError(
            f"experts_per_rank = {experts_per_rank} with world = {world} ranks gives "
            f"{experts_per_rank * world} experts, but num_experts = {num_experts}; each rank "
            "must host exactly experts_per_rank experts (pass home_of= for uneven placement)"
        )
    return np.arange(num_experts, dtype=np.int64) // experts_per_rank


# ----------------------------------------------------------------------------- plan


class SlotShape:
    """``world`` and ``slots_per_rank`` of a plan held as ``slot_src [world, slots_per_rank]``
    (:class:`ReplicaPlan`, :class:`~ultracomm.resident_plan.ResidentPlan`)."""

    slot_src: torch.Tensor

    @property
    def world(self) -> int:
        """Number of ranks (rows of ``slot_src``)."""
        return int(self.slot_src.shape[0])

    @property
    def slots_per_rank(self) -> int:
        """Replica slots per rank (columns of ``slot_src``)."""
        return int(self.slot_src.shape[1])


@dataclass(frozen=True, eq=False)
class ReplicaPlan(SlotShape):
    """Which logical expert each replica slot holds.

    Attributes:
        slot_src: int32 ``[world, slots_per_rank]`` CPU contiguous tensor; the logical
            expert held by replica slot ``(rank, slot)``, ``-1`` = empty.
        home_of: int32 ``[E]`` CPU contiguous tensor; home rank of each expert.

    Build plans with :meth:`make` (or a ``from_*`` converter), which copies its inputs
    and validates them.  The tensors are read-only by convention: do not modify them in
    place (the digest and every schedule built from the plan assume they do not change).
    Equality compares content; plans are hashable.
    """

    slot_src: torch.Tensor
    home_of: torch.Tensor

    def __post_init__(self) -> None:
        self.validate()

    # -- construction -------------------------------------------------------------

    @classmethod
    def make(
        cls,
        slot_src: ArrayLike,
        num_experts: int | None = None,
        home_of: ArrayLike | None = None,
        experts_per_rank: int | None = None,
    ) -> "ReplicaPlan":
        """Build and validate a plan.

        Args:
            slot_src: integer ``[world, slots_per_rank]`` (tensor, ndarray or nested
                list); ``-1`` marks an empty slot.  Copied.
            num_experts: E.  May be omitted when ``home_of`` or ``experts_per_rank`` is
                given (then E = ``len(home_of)`` or ``world * experts_per_rank``).
            home_of: integer ``[E]`` home rank per expert.  Default
                ``e // experts_per_rank``.
            experts_per_rank: experts hosted per rank; default ``E // world`` (E must
                divide by world).  When given together with ``home_of`` every rank must
                host exactly this many experts.

        Raises:
            PlanError: with the offending entry and how to fix it.
        """
        src = _to_numpy(slot_src, "slot_src")
        if src.ndim != 2:
            raise PlanError(
                f"slot_src must be 2-D [world, slots_per_rank], got shape {tuple(src.shape)}; "
                "use shape [world, 0] for a plan without replica slots"
            )
        world = src.shape[0]
        if world < 1:
            raise PlanError("slot_src has 0 rows: a plan needs world >= 1 ranks")
        if experts_per_rank is not None and (
            not isinstance(experts_per_rank, (int, np.integer)) or experts_per_rank < 1
        ):
            raise PlanError(f"experts_per_rank must be a positive int, got {experts_per_rank!r}")

        home: np.ndarray | None = None
        if home_of is not None:
            home = _to_numpy(home_of, "home_of")
            if home.ndim != 1:
                raise PlanError(f"home_of must be 1-D [E], got shape {tuple(home.shape)}")
            if num_experts is not None and home.shape[0] != num_experts:
                raise PlanError(
                    f"home_of has {home.shape[0]} entries but num_experts = {num_experts}; "
                    "give one home rank per expert"
                )
            num_experts = home.shape[0]
        if num_experts is None:
            if experts_per_rank is None:
                raise PlanError(
                    "cannot infer the number of experts: pass num_experts=, home_of= or "
                    "experts_per_rank="
                )
            num_experts = world * int(experts_per_rank)
        if not isinstance(num_experts, (int, np.integer)) or num_experts < 1:
            raise PlanError(f"num_experts must be a positive int, got {num_experts!r}")
        num_experts = int(num_experts)
        if home is None:
            home = _default_home_of(num_experts, world, experts_per_rank)
        _check_int32_range(src, "slot_src")
        _check_int32_range(home, "home_of")
        plan = cls(
            torch.from_numpy(np.ascontiguousarray(src, dtype=np.int32)),
            torch.from_numpy(np.ascontiguousarray(home, dtype=np.int32)),
        )
        if experts_per_rank is not None:
            plan.validate(experts_per_rank=int(experts_per_rank))
        return plan

    @classmethod
    def empty(
        cls, world: int, slots_per_rank: int, num_experts: int, home_of: ArrayLike | None = None
    ) -> "ReplicaPlan":
        """A plan with every slot empty (``slot_src`` all -1)."""
        return cls.make(
            np.full((world, slots_per_rank), -1, dtype=np.int32), num_experts, home_of
        )

    # -- validation ---------------------------------------------------------------

    def validate(self, experts_per_rank: int | None = None) -> None:
        """Check every invariant; raise :class:`PlanError` naming the first offending
        entry.  With ``experts_per_rank`` also check that each rank hosts exactly that
        many experts."""
        s, h = self.slot_src, self.home_of
        for name, t, nd, shape_txt in (
            ("slot_src", s, 2, "[world, slots_per_rank]"),
            ("home_of", h, 1, "[E]"),
        ):
            if not isinstance(t, torch.Tensor):
                raise PlanError(
                    f"{name} must be a torch.Tensor, got {type(t).__name__}; build plans with "
                    "ReplicaPlan.make(), which converts lists and arrays"
                )
            if t.dtype != torch.int32:
                raise PlanError(
                    f"{name} must have dtype torch.int32, got {t.dtype}; build plans with "
                    "ReplicaPlan.make(), which converts integer inputs"
                )
            if t.ndim != nd:
                raise PlanError(f"{name} must be {nd}-D {shape_txt}, got shape {tuple(t.shape)}")
            if t.device.type != "cpu":
                raise PlanError(f"{name} must be a CPU tensor, got device {t.device}; call .cpu()")
            if not t.is_contiguous():
                raise PlanError(f"{name} must be contiguous; call .contiguous()")
        world, spr = s.shape
        E = h.shape[0]
        if world < 1:
            raise PlanError("slot_src has 0 rows: a plan needs world >= 1 ranks")
        if E < 1:
            raise PlanError("home_of is empty: a plan needs at least one expert")
        hn = h.numpy()
        bad = np.flatnonzero((hn < 0) | (hn >= world))
        if bad.size:
            e = int(bad[0])
            raise PlanError(
                f"home_of[{e}] = {int(hn[e])} is out of range: ranks are 0..{world - 1}"
            )
        if experts_per_rank is not None:
            counts = np.bincount(hn, minlength=world)
            wrong = np.flatnonzero(counts != experts_per_rank)
            if wrong.size:
                r = int(wrong[0])
                raise PlanError(
                    f"rank {r} is home to {int(counts[r])} experts, but experts_per_rank = "
                    f"{experts_per_rank}: each rank must host exactly experts_per_rank experts "
                    "(omit experts_per_rank for uneven placement)"
                )
        sn = s.numpy()
        bad_idx = np.argwhere((sn < -1) | (sn >= E))
        if bad_idx.size:
            r, j = (int(v) for v in bad_idx[0])
            raise PlanError(
                f"slot_src[{r}, {j}] = {int(sn[r, j])} is out of range: experts are "
                f"0..{E - 1} (-1 marks an empty slot)"
            )
        filled = sn >= 0
        homes = np.where(filled, hn[np.where(filled, sn, 0)], -1)
        own = np.argwhere(filled & (homes == np.arange(world)[:, None]))
        if own.size:
            r, j = (int(v) for v in own[0])
            raise PlanError(
                f"expert {int(sn[r, j])} is replicated onto its own home rank {r} "
                f"(slot_src[{r}, {j}]); replicas must live on other ranks: set the slot to -1"
            )
        # duplicates within a row: sort each row once, compare neighbours (empties are -1)
        if spr > 1:
            srt = np.sort(sn, axis=1)
            dup = (srt[:, 1:] == srt[:, :-1]) & (srt[:, 1:] >= 0)
            rows = np.flatnonzero(dup.any(axis=1))
            if rows.size:
                r = int(rows[0])
                e = int(srt[r, 1:][dup[r]][0])
                j0, j1 = (int(j) for j in np.flatnonzero(sn[r] == e)[:2])
                raise PlanError(
                    f"expert {e} appears twice on rank {r} (slots {j0} and {j1}); "
                    "a rank needs at most one replica of an expert: set one slot to -1"
                )

    # -- shape properties ---------------------------------------------------------

    @property
    def num_experts(self) -> int:
        """E, the number of logical experts."""
        return int(self.home_of.shape[0])

    @property
    def experts_per_rank(self) -> int | None:
        """Experts hosted per rank if every rank hosts the same number, else ``None``."""
        counts = np.bincount(self.home_of.numpy(), minlength=self.world)
        return int(counts[0]) if (counts == counts[0]).all() else None

    # -- derived views ------------------------------------------------------------

    def replicas_of(self, expert: int) -> list[tuple[int, int]]:
        """``[(rank, slot), ...]`` of the replica slots holding ``expert``, sorted by
        rank then slot (the home copy is not included)."""
        if not 0 <= expert < self.num_experts:
            raise PlanError(f"expert {expert} is out of range: experts are 0..{self.num_experts - 1}")
        idx = np.argwhere(self.slot_src.numpy() == expert)
        return [(int(r), int(j)) for r, j in idx]

    @property
    def num_replicas(self) -> torch.Tensor:
        """int32 ``[E]``: number of replica slots holding each expert (home excluded)."""
        sn = self.slot_src.numpy()
        counts = np.bincount(sn[sn >= 0], minlength=self.num_experts)
        return torch.from_numpy(counts.astype(np.int32))

    @property
    def is_empty(self) -> bool:
        """True when no slot holds an expert (including ``slots_per_rank == 0``)."""
        return bool((self.slot_src.numpy() < 0).all())

    @property
    def local_index_of(self) -> torch.Tensor:
        """int32 ``[E]``: position of each expert among the experts with the same home
        rank, in expert order (its row in the home rank's stacked weight tensors)."""
        hn = self.home_of.numpy()
        out = np.empty_like(hn)
        seen = np.zeros(self.world, dtype=np.int64)
        for e, r in enumerate(hn):
            out[e] = seen[r]
            seen[r] += 1
        return torch.from_numpy(out.astype(np.int32))

    def experts_homed_on(self, rank: int) -> list[int]:
        """Experts whose home is ``rank``, in expert order."""
        return [int(e) for e in np.flatnonzero(self.home_of.numpy() == rank)]

    # -- identity -----------------------------------------------------------------

    def digest(self) -> bytes:
        """sha256 over the shapes and bytes of ``slot_src`` and ``home_of`` (32 bytes).

        Equal plans have equal digests on every rank and machine; compare digests across
        ranks (e.g. by all-gather) to check that every rank got the same plan.
        """
        h = hashlib.sha256(b"ultracomm.ReplicaPlan.v1")
        for t in (self.slot_src, self.home_of):
            h.update(np.asarray(t.shape, dtype="<i8").tobytes())
            h.update(t.numpy().astype("<i4", copy=False).tobytes())
        return h.digest()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ReplicaPlan):
            return NotImplemented
        return (
            self.slot_src.shape == other.slot_src.shape
            and self.home_of.shape == other.home_of.shape
            and bool(torch.equal(self.slot_src, other.slot_src))
            and bool(torch.equal(self.home_of, other.home_of))
        )

    def __hash__(self) -> int:
        return hash(self.digest())

    def __repr__(self) -> str:
        return (
            f"ReplicaPlan(world={self.world}, slots_per_rank={self.slots_per_rank}, "
            f"num_experts={self.num_experts}, filled="
            f"{int((self.slot_src >= 0).sum())}/{self.slot_src.numel()})"
        )

    # -- Megatron MoE ECHO --------------------------------------------------------

    @classmethod
    def from_echo_map(
        cls,
        map_home_expert_to_spare: ArrayLike,
        world: int,
        home_of: ArrayLike | None = None,
        experts_per_rank: int | None = None,
    ) -> "ReplicaPlan":
        """From Megatron MoE ECHO's bool ``map_home_expert_to_spare [E, S_global]``.

        Global spare slot ``j`` lives on rank ``j // (S_global // world)`` at slot index
        ``j % (S_global // world)``; ``map[e, j]`` True means slot ``j`` holds expert
        ``e``.  Integer 0/1 maps are accepted; floats are rejected.
        """
        m = _to_numpy(map_home_expert_to_spare, "map_home_expert_to_spare", allow_bool=True)
        if m.ndim != 2:
            raise PlanError(
                f"map_home_expert_to_spare must be 2-D [E, S_global], got shape {tuple(m.shape)}"
            )
        if m.size and not np.isin(m, (0, 1)).all():
            raise PlanError("map_home_expert_to_spare must hold booleans (or 0/1)")
        if world < 1:
            raise PlanError(f"world must be >= 1, got {world}")
        E, S = m.shape
        if S % world != 0:
            raise PlanError(
                f"map_home_expert_to_spare has S_global = {S} columns, which does not divide "
                f"by world = {world}; every rank must have the same number of spare slots"
            )
        spr = S // world
        m = m.astype(bool)
        per_col = m.sum(axis=0)
        multi = np.flatnonzero(per_col > 1)
        if multi.size:
            j = int(multi[0])
            es = [int(e) for e in np.flatnonzero(m[:, j])]
            raise PlanError(
                f"column {j} of map_home_expert_to_spare (rank {j // spr}, slot {j % spr}) is "
                f"True for experts {es}; a replica slot holds one expert"
            )
        flat = np.full(S, -1, dtype=np.int64)
        e_idx, j_idx = np.nonzero(m)
        flat[j_idx] = e_idx
        return cls.make(flat.reshape(world, spr), E, home_of, experts_per_rank)

    def to_echo_map(self) -> torch.Tensor:
        """bool ``[E, world * slots_per_rank]``: Megatron ECHO's
        ``map_home_expert_to_spare`` for this plan."""
        flat = self.slot_src.reshape(-1).numpy()
        out = np.zeros((self.num_experts, flat.shape[0]), dtype=bool)
        j = np.flatnonzero(flat >= 0)
        out[flat[j], j] = True
        return torch.from_numpy(out)

    # -- Megatron transport seam --------------------------------------------------

    @classmethod
    def from_experts_to_copy(
        cls,
        experts_to_copy: ArrayLike,
        num_experts: int,
        home_of: ArrayLike | None = None,
        experts_per_rank: int | None = None,
    ) -> "ReplicaPlan":
        """From the Megatron-style seam's ``experts_to_copy`` int32 ``[EP, slots]``
        (-1 = unused slot).  Same layout as ``slot_src``."""
        return cls.make(experts_to_copy, num_experts, home_of, experts_per_rank)

    def to_experts_to_copy(self) -> torch.Tensor:
        """int32 ``[world, slots_per_rank]`` (a copy of ``slot_src``)."""
        return self.slot_src.clone()


# ----------------------------------------------------------------------------- EPLB


class Move(NamedTuple):
    """One EPLB weight move: copy ``expert`` from physical slot ``src_phys`` (on
    ``src_rank``) into physical slot ``dst_phys`` (on ``dst_rank``).

    ``src_phys`` and ``dst_phys`` are *global* physical indices into ``phy2log``
    (``rank = phys // physical_per_rank``, local index ``phys % physical_per_rank``).
    """

    expert: int
    src_rank: int
    src_phys: int
    dst_rank: int
    dst_phys: int


def _phy2log_pair(old: ArrayLike, new: ArrayLike, world: int) -> tuple[np.ndarray, np.ndarray, int]:
    o = _to_numpy(old, "old_phy2log")
    n = _to_numpy(new, "new_phy2log")
    if o.shape != n.shape:
        raise PlanError(
            f"old_phy2log has shape {tuple(o.shape)} but new_phy2log has shape "
            f"{tuple(n.shape)}; both must be [P] or [layers, P] with the same P"
        )
    if o.ndim not in (1, 2):
        raise PlanError(f"phy2log must be [P] or [layers, P], got shape {tuple(o.shape)}")
    if world < 1:
        raise PlanError(f"world must be >= 1, got {world}")
    P = o.shape[-1]
    if P % world != 0:
        raise PlanError(
            f"phy2log has P = {P} physical slots, which does not divide by world = {world}; "
            "every rank must have the same number of physical slots"
        )
    for name, a in (("old_phy2log", o), ("new_phy2log", n)):
        if a.size and a.min() < -1:
            idx = tuple(int(v) for v in np.argwhere(a < -1)[0])
            raise PlanError(
                f"{name}[{', '.join(map(str, idx))}] = {int(a[idx])}: logical expert ids "
                "must be >= 0 (-1 marks an unused physical slot)"
            )
    return o, n, P // world


def _moves_1d(o: np.ndarray, n: np.ndarray, ppr: int, layer: int | None) -> list[Move]:
    holders: dict[int, dict[int, int]] = {}  # expert -> {rank: lowest phys}
    for p, e in enumerate(o.tolist()):
        if e >= 0:
            holders.setdefault(e, {}).setdefault(p // ppr, p)
    moves: list[Move] = []
    for p in np.flatnonzero(o != n).tolist():
        e = int(n[p])
        if e < 0:
            continue  # slot becomes unused: nothing to copy
        dst_rank = p // ppr
        h = holders.get(e)
        if not h:
            where = f"layer {layer}: " if layer is not None else ""
            raise PlanError(
                f"{where}physical slot {p} (rank {dst_rank}) needs expert {e}, which no "
                "physical slot holds in old_phy2log; load it from a checkpoint first, or "
                "check that old and new maps describe the same layer"
            )
        src_rank = dst_rank if dst_rank in h else min(h)
        moves.append(Move(e, src_rank, h[src_rank], dst_rank, p))
    return moves


def moves_from_phy2log(
    old_phy2log: ArrayLike, new_phy2log: ArrayLike, world: int
) -> list[Move] | list[list[Move]]:
    """Weight moves that turn an EPLB ``old_phy2log`` into ``new_phy2log``.

    Args:
        old_phy2log, new_phy2log: integer ``[P]`` or ``[layers, P]`` physical→logical
            maps (vLLM / DeepSeek EPLB), ``P = world * physical_per_rank``; rank ``r``
            owns physical slots ``r*ppr .. (r+1)*ppr - 1``; ``-1`` = unused slot.
        world: number of EP ranks.

    Returns:
        For ``[P]``: a list of :class:`Move`, one per physical slot whose logical
        expert changed (slots that become ``-1`` need no move), sorted by ``dst_phys``.
        For ``[layers, P]``: one such list per layer.

    The source is a slot that held the expert in the OLD map: on the destination rank
    if it held it (a local copy), else on the lowest-numbered holder rank; on that
    rank, its lowest physical slot.  All moves read OLD contents: apply them from a
    snapshot (or into a separate buffer), not one by one in place.

    Raises:
        PlanError: shapes differ, P not divisible by world, ids < -1, or an expert in
        the new map that no slot held in the old map.
    """
    o, n, ppr = _phy2log_pair(old_phy2log, new_phy2log, world)
    if o.ndim == 1:
        return _moves_1d(o, n, ppr, None)
    return [_moves_1d(o[l], n[l], ppr, l) for l in range(o.shape[0])]


def plan_from_phy2log(
    new_phy2log: ArrayLike,
    world: int,
    num_experts: int,
    experts_per_rank: int | None = None,
    home_of: ArrayLike | None = None,
) -> ReplicaPlan | list[ReplicaPlan]:
    """ReplicaPlan(s) from a *home-fixed* EPLB ``phy2log`` ``[P]`` or ``[layers, P]``.

    Only maps where each rank's first ``experts_per_rank`` physical slots hold that
    rank's home experts (in expert order) convert: the remaining
    ``physical_per_rank - experts_per_rank`` slots per rank become replica slots.  A
    redundant slot holding an expert whose home is elsewhere becomes a replica of it;
    one holding ``-1`` or an expert homed on the same rank (a useless second copy)
    becomes an empty slot.  General rearrangements (experts leaving their home) have
    no home/replica split: use :func:`moves_from_phy2log` for those.

    Raises:
        PlanError: a home slot holds the wrong expert, sizes do not fit, or the
        resulting plan is invalid (e.g. an expert twice on one rank).
    """
    n = _to_numpy(new_phy2log, "new_phy2log")
    if n.ndim == 2:
        return [
            plan_from_phy2log(n[l], world, num_experts, experts_per_rank, home_of)  # type: ignore[misc]
            for l in range(n.shape[0])
        ]
    if n.ndim != 1:
        raise PlanError(f"new_phy2log must be [P] or [layers, P], got shape {tuple(n.shape)}")
    if world < 1:
        raise PlanError(f"world must be >= 1, got {world}")
    P = n.shape[0]
    if P % world != 0:
        raise PlanError(
            f"phy2log has P = {P} physical slots, which does not divide by world = {world}"
        )
    ppr = P // world
    base = ReplicaPlan.make(
        np.zeros((world, 0), np.int32), num_experts, home_of, experts_per_rank
    )
    hn = base.home_of.numpy()
    homes = [base.experts_homed_on(r) for r in range(world)]
    nhome = max(len(h) for h in homes)
    if ppr < nhome:
        raise PlanError(
            f"phy2log has {ppr} physical slots per rank but a rank hosts {nhome} home "
            "experts; P must be at least world * experts_per_rank"
        )
    if any(len(h) != nhome for h in homes):
        raise PlanError(
            "plan_from_phy2log needs the same number of home experts on every rank; "
            "pass a uniform home_of or experts_per_rank"
        )
    spr = ppr - nhome
    src = np.full((world, spr), -1, dtype=np.int64)
    for r in range(world):
        row = n[r * ppr : (r + 1) * ppr]
        for i, e in enumerate(homes[r]):
            if int(row[i]) != e:
                raise PlanError(
                    f"new_phy2log[{r * ppr + i}] (rank {r}, local slot {i}) = {int(row[i])}, "
                    f"but plan_from_phy2log expects the first {nhome} physical slots of each "
                    f"rank to hold its home experts in order (expected expert {e}); for a "
                    "general rearrangement use moves_from_phy2log()"
                )
        for k in range(spr):
            e = int(row[nhome + k])
            if e >= num_experts:
                raise PlanError(
                    f"new_phy2log[{r * ppr + nhome + k}] = {e} is out of range: experts are "
                    f"0..{num_experts - 1}"
                )
            if e >= 0 and hn[e] != r:
                src[r, k] = e
    return ReplicaPlan.make(src, num_experts, base.home_of, experts_per_rank)
