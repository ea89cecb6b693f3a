"""ReplicaPlan: which logical expert each replica slot holds (``slot_src``) and where each
expert's master lives (``home_of``); built and checked by :meth:`ReplicaPlan.make`, compared by
content and :meth:`ReplicaPlan.digest`, converted to and from Megatron's ECHO map and
``experts_to_copy`` (see :mod:`ultracomm.plan` for the invariants and the converters)."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

import numpy as np
import torch

from ..errors import PlanError
from .inputs import ArrayLike, _check_int32_range, _to_numpy

__all__ = ["ReplicaPlan", "SlotShape"]


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
                raise PlanError("cannot infer the number of experts: pass num_experts=, home_of= or experts_per_rank=")
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
        for name, v in (("world", world), ("slots_per_rank", slots_per_rank)):
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or v < (1 if name == "world" else 0):
                raise PlanError(
                    f"ultracomm: ReplicaPlan.empty: {name} must be an int >= {int(name == 'world')}, got {v!r}"
                )
        return cls.make(np.full((world, slots_per_rank), -1, dtype=np.int32), num_experts, home_of)

    # -- validation ---------------------------------------------------------------

    def validate(self, experts_per_rank: int | None = None) -> None:
        """Check every invariant; raise :class:`PlanError` naming the first offending
        entry.  With ``experts_per_rank`` also check that each rank hosts exactly that
        many experts."""
        s, h = self.slot_src, self.home_of
        for name, t, nd, shape_txt in (("slot_src", s, 2, "[world, slots_per_rank]"), ("home_of", h, 1, "[E]")):
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
            raise PlanError(f"home_of[{e}] = {int(hn[e])} is out of range: ranks are 0..{world - 1}")
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
                f"slot_src[{r}, {j}] = {int(sn[r, j])} is out of range: experts are 0..{E - 1} (-1 marks an empty slot)"
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
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < self.world:
            raise PlanError(f"ultracomm: rank {rank!r} is out of range 0..{self.world - 1} (world {self.world})")
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
            raise PlanError(f"map_home_expert_to_spare must be 2-D [E, S_global], got shape {tuple(m.shape)}")
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
