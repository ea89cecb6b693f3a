"""Reading traces back: :class:`Trace`, :func:`load_trace`, and traces from plain routing
statistics (see :mod:`ultracomm.profile`)."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from .fields import FORMAT, INDEX, OPS, VERSION, empty_arrays, int_array, spread_expert_load
from .recorder import Profiler
from .trace_checks import (
    MAX_INDEX_BYTES,
    MAX_WORLD,
    TraceError,
    bounded_int,
    check_part,
    load_counts,
    load_npz,
    member_path,
    parse_index,
    read_regular,
)

PathLike = Union[str, os.PathLike]


@dataclass(eq=False)
class Trace:
    """A recorded (or imported) trace: per-record arrays, sorted by (step, layer, microbatch).

    Attributes:
        world, num_experts, experts_per_rank, slots_per_rank: the EP group's shapes
            (``slots_per_rank`` 0 when no plan was recorded).
        detail: ``"full"`` or ``"experts"``.
        node_of: int64 ``[world]``.
        meta: the index's user facts.
        arrays: name -> array with the record axis first: ``step``, ``layer``,
            ``microbatch``, ``has_load``, ``has_full_load``, ``has_plan``, ``has_stats``,
            ``expert_load [n, E]``, ``load [n, world, E]`` (full detail, when read),
            ``slot_src [n, world, S]``, ``home_of [n, E]``, ``rank_load_after [n, world]``,
            ``{multicast,reduce}_{egress,ingress} [n, world]``, ``..._{depth, max_egress,
            max_ingress, lower_bound_bytes, lower_bound_s, predicted_s, tree_lower_bound_s}
            [n]``, ``..._{parent_rank, parent_slot, tree_depth} [n, world, S]``,
            ``time_{weight_sync,restore,grad_reduce} [n]`` (seconds, NaN = not measured).
        late_ops: operations whose times came after their step was written.
        path: where it was read from (None for an imported array).
    """

    world: int
    num_experts: int
    experts_per_rank: int
    slots_per_rank: int
    detail: str
    node_of: np.ndarray
    meta: dict
    arrays: dict
    late_ops: int = 0
    path: Optional[str] = None
    _lazy: list = field(default_factory=list, repr=False)  # (file, rows in file -> trace rows)
    _before: Optional[np.ndarray] = field(default=None, repr=False)

    def __len__(self) -> int:
        return int(self.arrays["step"].size)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    @property
    def steps(self) -> np.ndarray:
        return np.unique(self.arrays["step"])

    @property
    def layers(self) -> np.ndarray:
        return np.unique(self.arrays["layer"])

    @property
    def rank_load_before(self) -> np.ndarray:
        """float64 ``[n, world]``: tokens each home rank receives (no balancing)."""
        if self._before is None:
            el = self.arrays["expert_load"]
            n, E, W = el.shape[0], self.num_experts, self.world
            out = (el.reshape(n, W, E // W).sum(axis=2) if W and E % W == 0 else np.zeros((n, W))).astype(np.float64)
            default = np.arange(E) // max(self.experts_per_rank, 1)
            for i in np.flatnonzero(self.arrays["has_plan"]):  # a plan may home experts elsewhere
                home = self.arrays["home_of"][i]
                if not np.array_equal(home, default):
                    out[i] = np.bincount(home, weights=el[i], minlength=W)
            self._before = out
        return self._before

    @property
    def imbalance_before(self) -> np.ndarray:
        """float64 ``[n]``: max:mean of :attr:`rank_load_before` (NaN without a load)."""
        return np.where(self.arrays["has_load"], _max_mean_rows(self.rank_load_before), np.nan)

    @property
    def imbalance_after(self) -> np.ndarray:
        """float64 ``[n]``: max:mean of ``rank_load_after`` (NaN where unknown)."""
        return _max_mean_rows(self.arrays["rank_load_after"])

    def find(self, step: int, layer: int, microbatch: int = 0) -> int:
        """Row of (step, layer, microbatch); KeyError if absent."""
        a = self.arrays
        hit = np.flatnonzero((a["step"] == step) & (a["layer"] == layer) & (a["microbatch"] == microbatch))
        if not hit.size:
            raise KeyError(f"no record for step {step}, layer {layer}, micro-batch {microbatch}")
        return int(hit[0])

    def load_matrix(self, i: int) -> np.ndarray:
        """int64 ``[world, E]`` load of row ``i``: the recorded matrix, or (per-expert totals
        only) :func:`spread_expert_load` of them."""
        return next(self.loads([i]))

    def loads(self, rows: Sequence[int]) -> Iterator[np.ndarray]:
        """:meth:`load_matrix` of each row, reading each file at most once when the loads
        were not read up front."""
        rows = [int(r) for r in rows]
        a = self.arrays
        cache: dict = {}
        for i in rows:
            if a["has_full_load"][i]:
                if "load" in a:
                    yield a["load"][i].astype(np.int64)
                    continue
                fname, local = self._lazy[i]
                if fname not in cache:
                    cache.clear()
                    root = Path(self.path)
                    cache[fname] = load_npz(member_path(root, fname, "a listed records file"), "a records file")["load"]
                yield cache[fname][local].astype(np.int64)
            else:
                yield spread_expert_load(a["expert_load"][i], self.world)

    def plan(self, i: int):
        """The :class:`~ultracomm.plan.ReplicaPlan` of row ``i`` (None without one)."""
        if not self.arrays["has_plan"][i]:
            return None
        from ..plan import ReplicaPlan

        return ReplicaPlan.make(self.arrays["slot_src"][i], home_of=self.arrays["home_of"][i])

    def summary(self) -> str:
        a = self.arrays
        parts = [
            f"{len(self)} records, {self.steps.size} steps, {self.layers.size} layers",
            f"world {self.world}, {self.num_experts} experts ({self.experts_per_rank}/rank), "
            f"{self.slots_per_rank} slots/rank, detail {self.detail}",
            f"with load {int(a['has_load'].sum())}, plan {int(a['has_plan'].sum())}, stats {int(a['has_stats'].sum())}",
        ]
        for op in OPS:
            t = a[f"time_{op}"]
            if np.isfinite(t).any():
                parts.append(f"{op}: {int(np.isfinite(t).sum())} timed, median {np.nanmedian(t) * 1e3:.3f} ms")
        imb = self.imbalance_before
        if np.isfinite(imb).any():
            parts.append(f"imbalance before: mean {np.nanmean(imb):.3f}, max {np.nanmax(imb):.3f}")
        imb = self.imbalance_after
        if np.isfinite(imb).any():
            parts.append(f"imbalance after: mean {np.nanmean(imb):.3f}, max {np.nanmax(imb):.3f}")
        return "\n".join(parts)


def _max_mean_rows(x: np.ndarray) -> np.ndarray:
    with np.errstate(invalid="ignore", divide="ignore"):
        m = x.mean(axis=1)
        return np.where(m > 0, x.max(axis=1) / np.where(m > 0, m, 1), np.where(np.isnan(m), np.nan, 1.0))


def _read_dir(path: Path, loads: bool) -> Trace:
    idx = parse_index(read_regular(path / INDEX, INDEX, MAX_INDEX_BYTES), str(path / INDEX))
    if idx.get("format") != FORMAT:
        raise TraceError(f"ultracomm.profile: {path / INDEX} is not an ultracomm profile index")
    if idx.get("version") != VERSION:
        raise TraceError(
            f"ultracomm.profile: {path} has format version {idx.get('version')}; this ultracomm reads version {VERSION}"
        )
    parts: list[dict] = []
    lazy: list = []
    world = int(idx["world"] or 0)
    E = int(idx["num_experts"] or 0)
    epr = int(idx.get("experts_per_rank") or (E // world if world else 0))
    S = int(idx.get("slots_per_rank") or 0)
    for f in idx["files"]:
        fp = member_path(path, f["file"], "a listed records file")
        d = load_npz(fp, "a records file", skip=() if loads else ("load",))
        check_part(d, world, E, S, str(fp))
        parts.append(d)
        lazy.extend((f["file"], j) for j in range(d["step"].size))
    if parts:
        keys = set(parts[0])
        for p in parts[1:]:
            keys &= set(p)
        if loads and any("load" in p for p in parts):
            for p in parts:  # a part without full loads: zeros (has_full_load says so)
                if "load" not in p:
                    p["load"] = np.zeros((p["step"].size, world, E), np.int32)
            keys.add("load")
        try:
            arrays = {k: np.concatenate([p[k] for p in parts]) for k in sorted(keys)}
        except ValueError as e:
            raise TraceError(f"{path}: the records files disagree on an array's shape or type ({e})") from None
        if "load" in arrays:
            arrays["load"] = arrays["load"].astype(np.int64)
    else:
        arrays = empty_arrays(world, E, S)
    order = np.lexsort((arrays["microbatch"], arrays["layer"], arrays["step"]))
    arrays = {k: v[order] for k, v in arrays.items()}
    lazy = [lazy[i] for i in order] if lazy else []
    node_of = np.asarray(idx["node_of"] if idx.get("node_of") else np.zeros(world), dtype=np.int64)
    return Trace(
        world,
        E,
        epr,
        S,
        idx["detail"],
        node_of,
        dict(idx.get("meta") or {}),
        arrays,
        int(idx.get("late_ops", 0)),
        str(path),
        lazy,
    )


def load_trace(path: PathLike, *, loads: bool = True, world: Optional[int] = None, rank: Optional[int] = None) -> Trace:
    """Read a trace back.

    Args:
        path: a trace directory (``index.json``); a directory of ``rank<r>`` traces (a Context
            with world > 1 writes one per rank; ``rank`` picks one, default the lowest); or a
            ``.npy``/``.npz`` file of routing statistics ``[steps, layers, E]`` (needs ``world``).
        loads: read the full ``[world, E]`` load matrices now (``False``: only per-expert
            totals; :meth:`Trace.loads` reads matrices on demand, one file at a time).
    """
    p = Path(path)
    if not p.exists():
        raise TraceError(f"ultracomm.profile: {p} does not exist")
    if p.is_dir():
        if (p / INDEX).exists():
            return _read_dir(p, loads)
        ranks = sorted(int(d.name[4:]) for d in p.glob("rank*") if d.name[4:].isdigit() and (d / INDEX).exists())
        if ranks:
            r = ranks[0] if rank is None else int(rank)
            if r not in ranks:
                raise TraceError(f"ultracomm.profile: {p} holds traces of ranks {ranks}, not rank {r}")
            return _read_dir(p / f"rank{r}", loads)
        raise TraceError(f"ultracomm.profile: {p} holds no trace (no {INDEX}, no rank<r>/{INDEX})")
    if p.suffix in (".npy", ".npz"):  # regular files only: read_counts refuses FIFOs without blocking
        if world is None:
            raise TraceError(
                f"ultracomm.profile: {p} holds routing statistics; say how many EP ranks they "
                "come from (world=..., --ep on the command line)"
            )
        bounded_int(world, "world (--ep)", 1, MAX_WORLD, str(p))
        return from_routing_stats(read_counts(p), world, meta={"source": str(p)})
    raise TraceError(f"ultracomm.profile: {p} is neither a trace directory nor a .npy/.npz routing-statistics file")


def read_counts(path: PathLike) -> np.ndarray:
    """The routing-statistics array in a ``.npy`` file (or the first array of a ``.npz``):
    a regular file, bounded in size, integer counts (see :mod:`.trace_checks`)."""
    return load_counts(Path(path))


def from_routing_stats(
    counts: Any, world: int, *, experts_per_rank: Optional[int] = None, meta: Optional[Mapping[str, Any]] = None
) -> Trace:
    """A :class:`Trace` (``detail="experts"``, no plans) from token counts a user logs.

    Args:
        counts: int ``[steps, layers, E]`` tokens each expert received (numpy or torch), or
            ``[steps, layers, microbatches, E]``.
        world: EP ranks; expert ``e`` is homed on ``e // (E // world)``.
    """
    c = int_array(counts, "counts")
    if c.ndim == 3:
        c = c[:, :, None, :]
    if c.ndim != 4:
        raise TraceError(
            f"ultracomm.profile: counts must be [steps, layers, E] or [steps, layers, microbatches, E], "
            f"got shape {c.shape}"
        )
    T, L, M, E = c.shape
    if not isinstance(world, (int, np.integer)) or world < 1 or E % world:
        raise TraceError(f"ultracomm.profile: {E} experts do not divide over world = {world!r} ranks")
    epr = E // int(world) if experts_per_rank is None else int(experts_per_rank)
    if epr * int(world) != E:
        raise TraceError(f"ultracomm.profile: experts_per_rank {epr} x world {world} != {E} experts")
    n = T * L * M
    arrays = empty_arrays(int(world), E, 0, n)
    s, l, m = np.meshgrid(np.arange(T), np.arange(L), np.arange(M), indexing="ij")
    arrays.update(
        step=s.reshape(-1).astype(np.int64),
        layer=l.reshape(-1).astype(np.int32),
        microbatch=m.reshape(-1).astype(np.int32),
        expert_load=c.reshape(n, E),
    )
    arrays["has_load"][:] = True
    return Trace(int(world), E, epr, 0, "experts", np.zeros(int(world), np.int64), dict(meta or {}), arrays)


def import_routing_stats(
    counts: Any, path: PathLike, world: int, *, meta: Optional[Mapping[str, Any]] = None, overwrite: bool = False
) -> Trace:
    """Write routing statistics ``[steps, layers(, microbatches), E]`` as a trace directory
    (``detail="experts"``) and return it read back."""
    tr = from_routing_stats(counts, world, meta=meta)
    with Profiler(path, detail="experts", steps="manual", meta=dict(meta or {}), overwrite=overwrite) as prof:
        prof.set_domain(tr.world, tr.experts_per_rank)
        a = tr.arrays
        step = int(a["step"][0]) if len(tr) else 0
        for i in range(len(tr)):
            if int(a["step"][i]) != step:
                prof.step()
                step = int(a["step"][i])
            prof.record(int(a["layer"][i]), load=a["expert_load"][i], microbatch=int(a["microbatch"][i]))
    return load_trace(path)
