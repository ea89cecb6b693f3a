"""The recorder: :class:`Profiler` (buffering, steps, the writer thread) and the Context's hook
(see :mod:`ultracomm.profile`)."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import threading
import time
import warnings
import weakref
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator, Mapping, Optional, Sequence, Union

import numpy as np

from ..private_dir import PrivateDirError, create_exclusive, make_private_dir, open_private
from .fields import DETAILS, FORMAT, INDEX, OPS, VERSION, int_array
from .record import Record, plan_shape, records_to_arrays
from ..errors import InputError, InputTypeError, UltracommError, reason

PathLike = Union[str, os.PathLike]


class Profiler:
    """Records loads, plans, schedule stats and op times per (step, layer, micro-batch).

    Args:
        path: directory to write (created with mode 0700; must not hold a trace already unless
            ``overwrite=True``).  An existing directory must belong to this user and not be
            group- or world-writable (:mod:`ultracomm.private_dir`); files are created in it
            exclusively, mode 0600, never through a symbolic link, under unpredictable
            temporary names, then renamed into place.
        detail: ``"full"`` keeps the load matrix ``[world, E]``; ``"experts"`` only its
            per-expert totals ``[E]``.
        steps: ``"auto"`` (a step ends when a layer comes back while nothing is in flight) or
            ``"manual"`` (only :meth:`step` ends one).  See the module docstring.
        max_buffer_bytes: memory for records not yet on disk, twice: the current step (a
            larger one is written in parts) and the steps waiting for the writer (beyond it,
            recording waits for the disk).
        op_wait_s: how long the writer waits for a step's operations still running.
        write_interval_s: steps handed over within this time go into one file (fewer, larger
            files: the writer's cost per file stays off short steps); ``close`` writes at once.
        meta: JSON-serialisable facts stored in the index (model name, fabric, ...).
        overwrite: replace an existing trace in ``path``.

    Loads are copied; plans and schedules are kept by reference until written (do not modify
    them in place).  Thread-safe: :meth:`record` and :meth:`step` may run on any thread; the
    Context times operations on its operation thread.  Use as a context manager or call
    :meth:`close`.
    """

    def __init__(
        self,
        path: PathLike,
        *,
        detail: str = "full",
        steps: str = "auto",
        max_buffer_bytes: int = 64 << 20,
        op_wait_s: float = 60.0,
        write_interval_s: float = 1.0,
        meta: Optional[Mapping[str, Any]] = None,
        overwrite: bool = False,
    ):
        if detail not in DETAILS:
            raise InputError(f"ultracomm.profile: detail must be one of {DETAILS}, got {detail!r}")
        if steps not in ("auto", "manual"):
            raise InputError(f"ultracomm.profile: steps must be 'auto' or 'manual', got {steps!r}")
        if not isinstance(max_buffer_bytes, int) or max_buffer_bytes < 1:
            raise InputError(f"ultracomm.profile: max_buffer_bytes must be an int >= 1, got {max_buffer_bytes!r}")
        self.path = Path(path)
        if self.path.is_file():
            raise InputError(f"ultracomm.profile: {self.path} is a file; give a directory")
        self.meta = dict(meta or {})
        json.dumps(self.meta)  # fail now, not in the writer thread
        self._dir_fd = _claim_dir(self.path, overwrite)  # every file is created relative to it
        self.detail, self.auto_steps = detail, steps == "auto"
        self.max_buffer_bytes, self.op_wait_s = max_buffer_bytes, float(op_wait_s)
        self.write_interval_s = float(write_interval_s)
        self.world: Optional[int] = None
        self.num_experts: Optional[int] = None
        self.slots_per_rank: Optional[int] = None
        self.experts_per_rank: Optional[int] = None
        self.node_of: Optional[list[int]] = None
        self.rank: Optional[int] = None
        self.owned_by_context = False  # a Context that made it closes it
        self._cond = threading.Condition()  # guards everything below
        self._step = 0
        self._records: list[Record] = []  # the current step's, not yet flushed
        self._by_layer: dict[int, list[Record]] = {}
        self._bytes = 0
        self._layer_mbs: dict[int, set] = {}  # micro-batches each layer has in the step
        self._vids: dict[Any, Record] = {}  # micro-batches in flight -> their record
        self._outbox: list[list[Record]] = []  # flushed, waiting for the writer
        self._outbox_bytes = 0
        self._files: list[dict] = []
        self._file_no = 0
        self._late = 0
        self._error: Optional[BaseException] = None
        self._closed = False
        self._last_write = time.monotonic()
        self._write_index()
        self._writer = threading.Thread(target=self._write_loop, name="ultracomm-profile-writer", daemon=True)
        self._writer.start()

    # -- shapes -------------------------------------------------------------------------
    def set_domain(
        self,
        world: int,
        experts_per_rank: int,
        slots_per_rank: Optional[int] = None,
        node_of: Optional[Sequence[int]] = None,
        rank: Optional[int] = None,
    ) -> None:
        """Fix the trace's shapes up front (a Context does; otherwise the first record does)."""
        with self._cond:
            self._check_shape("world", int(world))
            self._check_shape("num_experts", int(world) * int(experts_per_rank))
            self._check_shape("experts_per_rank", int(experts_per_rank))
            if slots_per_rank is not None:
                self._check_shape("slots_per_rank", int(slots_per_rank))
            if node_of is not None:
                self.node_of = [int(n) for n in node_of]
            if rank is not None:
                self.rank = int(rank)

    def _check_shape(self, name: str, value: int) -> None:
        have = getattr(self, name)
        if have is None:
            setattr(self, name, value)
        elif have != value:
            raise InputError(
                f"ultracomm.profile: {name} is {value} here but {have} earlier in this trace; "
                "one trace holds one EP group's shapes (use another Profiler)"
            )

    def _check_plan(self, plan: Any) -> None:
        w, s, e = plan_shape(plan)
        self._check_shape("world", w)
        self._check_shape("slots_per_rank", s)
        self._check_shape("num_experts", e)

    # -- the two sides of a record ---------------------------------------------------------
    def _raise_writer_error(self) -> None:
        if self._error is not None:
            err, self._error = self._error, None
            raise UltracommError(f"ultracomm.profile: writing the trace to {self.path} failed: {err}") from err
        if self._closed:
            raise UltracommError("ultracomm.profile: this Profiler is closed")

    def _take(self, layer: int, side: str, microbatch: Optional[int], vid: Any) -> Record:
        """The record of ``layer`` this side fills next (lock held)."""
        for r in self._by_layer.get(layer, ()):
            if not getattr(r, side) and microbatch in (None, r.microbatch):
                return r
        seen = self._layer_mbs.setdefault(layer, set())
        repeat = bool(seen) if microbatch is None else microbatch in seen
        if repeat and (self.auto_steps or microbatch is not None):
            if any(v != vid for v in self._vids):
                if microbatch is not None:
                    raise InputError(
                        f"ultracomm.profile: layer {layer} micro-batch {microbatch} is already "
                        f"recorded in step {self._step} while micro-batches are in flight"
                    )
            else:  # the forward came back to a layer it has seen: a new step
                self._end_step()
                seen = self._layer_mbs.setdefault(layer, set())
        mb = (max(seen) + 1 if seen else 0) if microbatch is None else int(microbatch)
        seen.add(mb)
        rec = Record(self._step, layer, mb)
        self._records.append(rec)
        self._by_layer.setdefault(layer, []).append(rec)
        self._bytes += rec.nbytes
        return rec

    def _grow(self, rec: Record, nbytes: int) -> None:
        rec.nbytes += nbytes
        self._bytes += nbytes
        if self._bytes > self.max_buffer_bytes:
            self._flush(part=True)

    def record(
        self,
        layer: int,
        *,
        load: Any = None,
        plan: Any = None,
        schedule: Any = None,
        rank_load_after: Any = None,
        times: Optional[Mapping[str, float]] = None,
        microbatch: Optional[int] = None,
    ) -> tuple[int, int, int]:
        """Record what the balancer saw and did for one micro-batch of ``layer``.

        Args:
            load: int ``[world, E]`` tokens rank ``s`` sends to expert ``e`` (numpy or torch),
                or int ``[E]`` per-expert totals.
            plan: a :class:`~ultracomm.plan.ReplicaPlan` or a
                :class:`~ultracomm.planners.PlannerResult` (then the exact per-rank tokens
                after balancing are kept too).
            schedule: the plan's :class:`~ultracomm.schedule.Schedule` (stats and trees).
            rank_load_after: ``[world]`` tokens each rank computes after balancing, when the
                caller knows them better than ``plan`` does.
            times: op name (``weight_sync``, ``restore``, ``grad_reduce``) -> seconds.
            microbatch: the micro-batch index (default: the next one of this layer).

        Returns ``(step, layer, microbatch)`` of the record.
        """
        if not isinstance(layer, (int, np.integer)) or layer < 0:
            raise InputError(f"ultracomm.profile: layer must be an int >= 0, got {layer!r}")
        layer = int(layer)
        if times is not None:
            bad = sorted(set(times) - set(OPS))
            if bad:
                raise InputError(f"ultracomm.profile: unknown op names {bad} in times; use {OPS}")
        full, totals = None, None
        if load is not None:
            a = int_array(load, "load")
            if a.ndim == 2:
                full, totals = a, a.sum(axis=0)
            elif a.ndim == 1:
                totals = a
            else:
                raise InputError(f"ultracomm.profile: load must be [world, E] or [E], got shape {a.shape}")
        after = None if rank_load_after is None else np.array(rank_load_after, dtype=np.float64).reshape(-1)
        with self._cond:
            self._raise_writer_error()
            if full is not None:
                self._check_shape("world", full.shape[0])
            if totals is not None:
                self._check_shape("num_experts", totals.size)
            if plan is not None:
                self._check_plan(plan)
            if after is not None:
                self._check_shape("world", after.size)
            rec = self._take(layer, "has_data", microbatch, None)
            rec.has_data = True
            grow = 0
            if totals is not None:
                rec.expert_load = totals
                grow += totals.nbytes
                if full is not None and self.detail == "full":
                    rec.load = full if full.max(initial=0) >= 2**31 else full.astype(np.int32)
                    grow += rec.load.nbytes
            if plan is not None:
                rec.plan = plan
                grow += 8 * (self.world or 0) * ((self.slots_per_rank or 0) + 2)
            if after is not None:
                rec.rank_after = after
            if schedule is not None:
                rec.schedule = schedule
                grow += 40 * (self.world or 0) * ((self.slots_per_rank or 0) + 1)
            for k, v in (times or {}).items():
                rec.times.setdefault(k, []).append(float(v))
            key = (rec.step, rec.layer, rec.microbatch)
            self._grow(rec, grow)
            self._wait_for_room()
        return key

    # -- the Context's hook ------------------------------------------------------------------
    def op_begin(self, name: str, vid: Any, layer: int, plan: Any, schedule: Any) -> Record:
        """Called when operation ``name`` of micro-batch ``vid`` is submitted (``vid``: any
        hashable key unique while the micro-batch is in flight; a Context passes its vid).  ``weight_sync`` binds ``vid`` to a record, ``restore`` and
        ``grad_reduce`` use that record, ``grad_reduce`` releases it.  Returns the token
        :meth:`op_end` takes."""
        with self._cond:
            self._raise_writer_error()
            rec = self._vids.get(vid)
            if name == "weight_sync" or rec is None:
                if plan is not None:
                    self._check_plan(plan)
                rec = self._take(layer, "has_ops", None, vid)
                rec.has_ops, rec.vid = True, vid
                self._vids[vid] = rec
                if rec.plan is None:
                    rec.plan = plan
                if rec.schedule is None and schedule is not None:
                    rec.schedule = schedule
                    self._grow(rec, 48 * (self.world or 0) * ((self.slots_per_rank or 0) + 1))
            if name == "grad_reduce":
                self._vids.pop(vid, None)
            rec.pending += 1
            self._wait_for_room()
        return rec

    def op_end(self, rec: Record, name: str, seconds: Any) -> None:
        """Called when ``name`` finished (host transports, on the Context's operation thread) or
        was enqueued (stream-ordered transports): ``seconds`` is a float, a ``(start, end)``
        pair of CUDA timing events recorded on the operation's stream (resolved when the step is
        written, never synchronised here), or None (the operation failed: no time)."""
        with self._cond:
            if seconds is not None:
                if rec.sealed:  # already taken by the writer (it waited op_wait_s for this)
                    self._late += 1
                else:
                    rec.times.setdefault(name, []).append(seconds)
            rec.pending -= 1
            self._cond.notify_all()

    def wrap(self, fn: Any, name: str, vid: Any, layer: int, plan: Any, schedule: Any) -> Any:
        """:meth:`op_begin` now, and ``fn`` wrapped to time itself (host timer) and hand the
        time to :meth:`op_end` (no time when ``fn`` raises).  What a Context calls."""
        rec = self.op_begin(name, vid, layer, plan, schedule)

        def timed() -> None:
            t0 = time.perf_counter()
            ok = False
            try:
                fn()
                ok = True
            finally:
                self.op_end(rec, name, time.perf_counter() - t0 if ok else None)

        return timed

    def release(self, vid: Any) -> None:
        """The Context released ``vid`` without ``grad_reduce`` (``end``)."""
        with self._cond:
            self._vids.pop(vid, None)

    # -- steps and writing ----------------------------------------------------------------
    @property
    def current_step(self) -> int:
        return self._step

    def step(self) -> None:
        """End the current step and hand its records to the writer (returns at once unless
        more than ``max_buffer_bytes`` already wait for the disk)."""
        with self._cond:
            self._raise_writer_error()
            self._end_step()
            self._wait_for_room()

    def _end_step(self) -> None:
        self._flush(part=False)
        self._step += 1
        self._layer_mbs = {}

    def _flush(self, part: bool) -> None:
        """Hand the current step's records to the writer (lock held).  A part keeps the records
        of micro-batches in flight: their restore and grad_reduce are still to come."""
        keep = [r for r in self._records if self._vids.get(r.vid) is r] if part else []
        recs = [r for r in self._records if r not in keep] if keep else self._records
        self._records, self._bytes = keep, sum(r.nbytes for r in keep)
        self._by_layer = {}
        for r in keep:
            self._by_layer.setdefault(r.layer, []).append(r)
        if recs:
            self._outbox.append(recs)
            self._outbox_bytes += sum(r.nbytes for r in recs)
            self._cond.notify_all()

    def _wait_for_room(self) -> None:
        """Backpressure (lock held; the writer frees room): recording waits for the disk."""
        self._cond.wait_for(
            lambda: (
                self._outbox_bytes <= self.max_buffer_bytes or self._error is not None or not self._writer.is_alive()
            )
        )

    def _write_loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._outbox or self._closed)
                if not self._outbox:
                    return
                # one file per write interval (or per quarter of the buffer), not per step
                self._cond.wait_for(
                    lambda: self._closed or self._outbox_bytes >= self.max_buffer_bytes // 4,
                    timeout=max(0.0, self._last_write + self.write_interval_s - time.monotonic()),
                )
                batch, self._outbox = self._outbox, []
                recs = [r for rs in batch for r in rs]
                # the Context's last operations of these records may still be running
                self._cond.wait_for(lambda: all(r.pending == 0 for r in recs), timeout=self.op_wait_s)
                late = sum(r.pending for r in recs)
                for r in recs:
                    r.sealed = True
                shapes = (self.world or 0, self.num_experts or 0, self.slots_per_rank or 0, self.detail)
            try:
                arrays = records_to_arrays(recs, *shapes, wait_s=self.op_wait_s)
                first, last = recs[0].step, recs[-1].step
                name = f"{self._file_no:06d}_step{first}" + (f"-{last}" if last != first else "") + ".npz"
                _write_npz(self._dir_fd, name, arrays)
                with self._cond:
                    self._file_no += 1
                    self._files.append({"file": name, "steps": [first, last], "records": len(recs)})
                    self._late += late
                self._write_index()
                if late:
                    warnings.warn(
                        f"ultracomm.profile: {late} operation(s) of steps {first}..{last} were still "
                        f"running after {self.op_wait_s} s; their times are not in the trace"
                    )
            except BaseException as e:  # noqa: BLE001 - raised by the next caller
                with self._cond:
                    self._error = e
            finally:
                with self._cond:
                    self._outbox_bytes -= sum(r.nbytes for r in recs)
                    self._last_write = time.monotonic()
                    self._cond.notify_all()

    def _write_index(self) -> None:
        with self._cond:
            idx = {
                "format": FORMAT,
                "version": VERSION,
                "detail": self.detail,
                "world": self.world,
                "num_experts": self.num_experts,
                "experts_per_rank": self.experts_per_rank,
                "slots_per_rank": self.slots_per_rank,
                "node_of": self.node_of,
                "rank": self.rank,
                "meta": self.meta,
                "late_ops": self._late,
                "files": list(self._files),
            }
        with _replacing(self._dir_fd, INDEX) as f:
            f.write(json.dumps(idx, indent=1).encode())

    def close(self) -> None:
        """Write what is buffered, wait for the writer, and close.  Idempotent."""
        with self._cond:
            if self._closed:
                return
            self._flush(part=False)
            self._closed = True
            self._cond.notify_all()
        self._writer.join()
        if self.experts_per_rank is None and self.world and self.num_experts:
            self.experts_per_rank = self.num_experts // self.world
        try:
            self._write_index()
        except OSError as e:
            self._error = self._error or e
        finally:
            os.close(self._dir_fd)
        if self._error is not None:
            err, self._error = self._error, None
            raise UltracommError(f"ultracomm.profile: writing the trace to {self.path} failed: {err}") from err

    def context_closed(self) -> None:
        """The Context recording into this Profiler closed: close it if that Context made it."""
        if self.owned_by_context:
            self.close()

    def __enter__(self) -> "Profiler":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"Profiler({str(self.path)!r}, detail={self.detail!r}, step={self._step})"


class TraceExistsError(UltracommError, ValueError):
    """The directory already holds a trace (``index.json``) and ``overwrite`` was not given."""


def _claim_dir(path: Path, overwrite: bool) -> int:
    """Create ``path`` private (mode 0700; an existing one must be this user's and not group- or
    world-writable: :mod:`ultracomm.private_dir`) and claim it: without ``overwrite`` the first
    ``index.json`` is created exclusively, so two writers never share a directory.  Returns the
    directory's descriptor."""
    try:
        make_private_dir(str(path))
        fd = open_private(str(path))
    except PrivateDirError as e:
        raise PrivateDirError(f"ultracomm.profile: {reason(e)}") from None
    try:
        if overwrite:
            for name in os.listdir(fd):
                if name.endswith(".npz"):
                    os.unlink(name, dir_fd=fd)
        else:
            try:
                os.close(create_exclusive(fd, INDEX))  # the claim; filled by the first _write_index
            except FileExistsError:
                raise TraceExistsError(
                    f"ultracomm.profile: {path} already holds a trace; pick another directory, "
                    "remove it, or pass overwrite=True"
                ) from None
    except BaseException:
        os.close(fd)
        raise
    return fd


@contextlib.contextmanager
def _replacing(dir_fd: int, name: str) -> Iterator[BinaryIO]:
    """A file that replaces ``name`` in ``dir_fd`` atomically once written: written first under an
    unpredictable temporary name, created exclusively (mode 0600, never through a link)."""
    tmp = f".{name}.{secrets.token_hex(8)}.tmp"
    f = os.fdopen(create_exclusive(dir_fd, tmp), "wb")
    try:
        with f:
            yield f
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise


def _write_npz(dir_fd: int, name: str, arrays: Mapping[str, np.ndarray]) -> None:
    """``np.savez_compressed`` at deflate level 1 (fast), written to a temporary name first."""
    with (
        _replacing(dir_fd, name) as out,
        zipfile.ZipFile(out, "w", compression=zipfile.ZIP_DEFLATED, compresslevel=1) as zf,
    ):
        for k, v in arrays.items():
            with zf.open(k + ".npy", "w", force_zip64=True) as f:
                np.lib.format.write_array(f, np.ascontiguousarray(v), allow_pickle=False)


MAX_RUNS = 10000  # run<n> subdirectories searched for a free one


def run_dir(base: PathLike, rank: int, world: int) -> Profiler:
    """A Profiler in the first free run directory of ``base`` for this rank: ``base`` itself
    (``base/rank<r>`` when world > 1), else ``base/run1``, ``base/run2``, ... (each with its
    ``rank<r>``).  A directory is taken when it holds no trace (``index.json``); the claim is
    exclusive.  Each rank searches on its own, so the ranks of a run land in the same ``run<n>``
    whenever every earlier run wrote all its ranks."""
    base = Path(base)
    try:
        make_private_dir(str(base))
    except PrivateDirError as e:
        raise PrivateDirError(f"ultracomm.profile: {reason(e)}") from None
    for n in range(MAX_RUNS):
        d = base if n == 0 else base / f"run{n}"
        try:
            return Profiler(d / f"rank{rank}" if world > 1 else d)
        except TraceExistsError:
            continue
    raise InputError(f"ultracomm.profile: {base} already holds {MAX_RUNS} runs; give another directory")


def profile_for_context(profile: Any, ctx: Any) -> Optional[Profiler]:
    """The Profiler a Context records into: ``profile`` if it is one (the caller owns it),
    a new one in directory ``profile`` (or ``ctx.config.profile``, from ``ULTRACOMM_PROFILE``;
    ``rank<r>`` below it when world > 1; a rerun into a directory that holds a trace already
    writes into a fresh ``run<n>`` subdirectory: :func:`run_dir`; the Context closes it), or
    None (off: ``False``, or an empty directory name, as an empty ``ULTRACOMM_PROFILE`` is -- not
    the current directory)."""
    from_env = profile is None
    if profile is None:
        profile = ctx.config.profile or None
        if profile is None:
            return None
    if profile is False or (isinstance(profile, str) and not profile.strip()):
        return None
    if isinstance(profile, Profiler):
        prof, owned = profile, False
    elif isinstance(profile, (str, os.PathLike)):
        try:
            prof, owned = run_dir(profile, ctx.rank, ctx.world), True
        except PrivateDirError as e:
            if from_env:
                raise PrivateDirError(f"{e} (ULTRACOMM_PROFILE)") from None
            raise
    else:
        raise InputTypeError(
            f"ultracomm: profile must be a directory, a Profiler, False or None; got {type(profile).__name__}"
        )
    prof.set_domain(ctx.world, ctx.experts_per_rank, ctx.slots_per_rank, ctx.node_of, ctx.rank)
    prof.owned_by_context = owned
    if owned:  # a Context dropped without close() still writes what it recorded
        weakref.finalize(ctx, prof.close)
    return prof
