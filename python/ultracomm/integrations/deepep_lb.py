"""DeepEP's redundant-expert calls (``EPBuffer.lb_prefetch_weights`` / ``lb_reduce_grads``) over ultracomm.

DeepEP V2.5 gives a MoE stack two collective calls for dynamic redundant experts inside one NVLink
domain: push each requested expert's tensors (weights *and* quantization scales, as bytes) from its
home rank into redundant slots, and add the slots' fp32 gradients back into the home expert's.
DeepEP pushes straight from the home rank, one copy per slot.  Here the same calls run as ultracomm
operations: an expert that many ranks request leaves its home once and is forwarded through a relay
tree, and the gradients are summed in a fixed order (bit-identical run to run).

Read at deepseek-ai/DeepEP (not imported, not copied), V2.5, file by file at the commit the
reading had: ``deep_ep/buffers/ep.py`` at 13b3abaa (``EPBuffer.lb_prefetch_weights``,
``lb_reduce_grads``, ``lb_get_theoretical_num_sms``, ``capture``); ``csrc/buffers/ep.hpp`` (the C++
checks and stream handling of both calls; 2578e50a and an earlier stored version agree on them);
at def865146e95: ``deep_ep/include/deep_ep/impls/ep/prefetch_weights.cuh`` and ``reduce_grads.cuh``
(the kernels), ``csrc/kernels/ep/prefetch_weights.hpp`` (launch), ``deep_ep/utils/event.py``
(``EventOverlap``), ``tests/ep/test_reduce_grads.py``; at 855fa9de: ``deep_ep/include/deep_ep/
layout/ep/eplb.cuh`` (task table, chunk iterator), ``csrc/kernels/ep/reduce_grads.hpp``; at
1a1ffbac: ``deep_ep/buffers/allocator.py`` (``BufferAllocator``), ``tests/ep/test_prefetch_weights.py``;
and the README's "Expert load balancing" section.
No ``lb_get_redundancy_mapping`` exists in any of that code, so none is offered here.

What those files fix, and what this module does with it:

* ``redundancy_mapping``: int32 ``[num_nvlink_ranks, num_redundant_experts]``, identical on every
  rank; entry ``[r, c]`` is the expert in slot ``c`` of domain rank ``r``, an id local to the domain
  (``owner_rank * num_local_experts + local_expert_idx``), or ``-1`` for an empty slot, which is not
  written.  The kernel builds its task list from every entry whose owner is this rank, so one
  expert in two slots of one rank fills both (DeepEP's tests draw slots with replacement): served
  here too, the second slot copied locally from the first after the multicast, and its gradient
  summed into the first slot's before the reduction.  Raised instead (DeepEP leaves them
  undefined): an id outside ``[-1, num_nvlink_ranks * num_local_experts)`` (the kernel would skip it
  silently, leaving the slot's old contents) and a rank's own expert in its own row (the README
  forbids it).  A mapping that differs across ranks raises ``PlanMismatchError`` on every rank.
* ``lb_prefetch_weights``: one tensor or matching nonempty lists; each pair has the same bytes per
  expert (trailing shapes and dtypes may differ: bytes move, nothing is converted); sources
  ``[num_local_experts, ...]``, destinations ``[num_redundant_experts, ...]`` in the LB region.
  Slots a call does not name, and pools it does not pass, keep their contents.
* ``lb_reduce_grads``: 2-D fp32 ``redundant_expert_grads [num_redundant_experts, hidden]`` (in the
  LB region) and ``expert_grads [num_local_experts, hidden]``; ``expert_grads`` is added into in
  place, never overwritten, so repeated calls accumulate; the redundant grads are left as they were
  ("does not clear": zero or overwrite them before the next backward).  DeepEP adds with atomics
  in no fixed order; here each element is ``expert_grads + sum of its replicas`` in the order the
  schedule writes down (duplicate slots of one rank pre-summed in slot order), fp32.
* Both return an :class:`EventOverlap`; ``.wait()`` (or ``current_stream_wait()``, or leaving a
  ``with`` block) before reading the results.  ``previous_event`` (an event from :meth:`LBBuffer.
  capture`, a CUDA event, or anything with ``current_stream_wait()``) is waited for first.
  ``num_sms``: 0 or a positive int, as DeepEP checks it; ultracomm's SM counts are the Context's
  (``multicast_sms=`` / ``reduce_sms=`` at construction, ``ULTRACOMM_MULTICAST_SMS`` /
  ``ULTRACOMM_REDUCE_SMS``), so a value here is checked and not otherwise used.

The LB region: DeepEP's ``BufferAllocator`` plans meta tensors that ``EPBuffer`` turns into views
of its LB storage; :class:`BufferAllocator` and :class:`LBBuffer` do the same, each planned tensor
(a *pool*) becoming the window of a Context of its own (its replica slots), so a destination is
written by ultracomm's executors directly.  Unlike ``EPBuffer``, :class:`LBBuffer` needs
``num_local_experts`` up front (a Context is sized when it is made) and takes only a plan, not a
byte count.  A pool's slots are 256-byte aligned: a pool whose bytes per slot are not a multiple of
256 is a strided view (each slot contiguous).  Memory: a fp32 2-D pool (a gradient pool, or fp32
weights) holds twice its size (the handed-out slots, and the scratch its reduction pre-sums in);
another pool 1.25x when its bytes per slot divide by 8 (else up to 3x).

Host executor (CPU tensors, the tests): each call returns when the data has moved, with an event
that is already complete.  On a GPU the operations are enqueued on the current stream and the
event is recorded after them; this module has not been run on a GPU yet.  A call reads the
mapping on the host (on a GPU: one device-to-host copy of it per call).
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Sequence

import numpy as np
import torch

from ..context import Context
from ..errors import ConfigError, InputError, InputTypeError, PlanError
from ..layout import ExpertLayout, Member
from ..plan import ReplicaPlan

__all__ = ["BufferAllocator", "LBBuffer", "EventOverlap", "lb_prefetch_weights", "lb_reduce_grads"]

_LIVE: "weakref.WeakSet[LBBuffer]" = weakref.WeakSet()  # buffers the module-level calls look in


class EventOverlap:
    """What DeepEP's ``lb_`` calls return: ``wait()`` / ``current_stream_wait()`` before reading the
    results (the current stream waits for the operation's event on a GPU; on the host executor the
    operation has finished already).  Usable as a context manager, as DeepEP's."""

    def __init__(self, event: Any = None):
        self.event = event
        self._release = False

    def current_stream_wait(self, release_handle: bool = False) -> None:
        if self.event is not None:
            _wait_for(self.event)
        if release_handle:
            self.event = None

    def wait(self) -> None:
        self.current_stream_wait()

    def __call__(self, release_handle: bool = False) -> "EventOverlap":
        self._release = release_handle
        return self

    def __enter__(self) -> "EventOverlap":
        return self

    def __exit__(self, *exc: Any) -> None:
        if self.event is not None:
            self.current_stream_wait(release_handle=self._release)
        self._release = False


def _wait_for(event: Any) -> None:
    """The current stream waits for ``event`` (CPU: nothing is pending)."""
    if isinstance(event, EventOverlap):
        event.current_stream_wait()
    elif hasattr(event, "current_stream_wait"):
        event.current_stream_wait()
    elif isinstance(event, (getattr(torch, "Event", ()), getattr(torch.cuda, "Event", ()))):
        torch.cuda.current_stream().wait_event(event)
    elif event is not True:
        raise InputTypeError(
            f"ultracomm: previous_event must be an event from capture(), a CUDA event or an EventOverlap; "
            f"got {type(event).__name__}"
        )


class BufferAllocator:
    """DeepEP's allocation plan: ``allocate(shape, dtype)`` returns a meta placeholder that
    :class:`LBBuffer` turns into a view of its LB region (a pool, ``[num_redundant_experts, ...]``).
    Plan the same shapes in the same order on every rank."""

    def __init__(self) -> None:
        self.allocations: list[torch.Tensor] = []
        self.materialized = False

    def allocate(self, shape: Sequence[int], dtype: torch.dtype) -> torch.Tensor:
        if self.materialized:
            raise InputError("ultracomm: this allocation plan was materialized by an LBBuffer; it cannot change")
        shape = tuple(int(d) for d in shape)
        if len(shape) < 1 or any(d < 1 for d in shape):
            raise InputError(
                f"ultracomm: a pool is [num_redundant_experts, ...] with positive sizes, got {list(shape)}"
            )
        tensor = torch.empty(shape, dtype=dtype, device="meta")
        self.allocations.append(tensor)
        return tensor


def _word(nbytes: int) -> torch.dtype:
    for dt, size in ((torch.int64, 8), (torch.int32, 4), (torch.int16, 2)):
        if nbytes % size == 0:
            return dt
    return torch.uint8


class _Pool:
    """One planned tensor: a Context whose replica slots are the pool's rows."""

    def __init__(self, index: int, shape: tuple, dtype: torch.dtype, group: Any, num_local_experts: int, options: dict):
        self.index, self.slots, self.inner, self.dtype = index, shape[0], shape[1:], dtype
        itemsize = torch.empty((), dtype=dtype).element_size()
        self.nbytes = itemsize * int(np.prod(self.inner, dtype=np.int64))  # bytes per slot
        self.fp32_rows = dtype == torch.float32 and len(self.inner) == 1  # usable by lb_reduce_grads
        if self.fp32_rows:  # weights region: the pool; grads region: the reduction's scratch
            self.word = torch.float32
            layout = ExpertLayout((Member("row", self.inner, torch.float32),), torch.float32)
        else:  # bytes moved as the widest word that divides them; the grad region is unused (fp16, small)
            self.word = _word(self.nbytes)
            words = self.nbytes // torch.empty((), dtype=self.word).element_size()
            layout = ExpertLayout((Member("bytes", (words,), self.word),), torch.float16)
        self.ctx = Context(group, layout, num_local_experts, self.slots, 1, 1, **options)
        rows = self.ctx.replica_weights[0]  # [slots, words]: slots 256-byte aligned
        view = rows.view(torch.uint8).view(dtype)
        self.tensor = view.unflatten(1, self.inner) if self.inner else view[:, 0]
        self.stride_bytes = rows.stride(0) * rows.element_size()

    def holds(self, t: torch.Tensor) -> bool:
        """``t`` covers this pool: its first slot's address, its slot count and bytes per slot, each
        slot contiguous (a view of the pool such as DeepEP's tests' ``unflatten``)."""
        if t.dim() < 1 or t.device != self.tensor.device or t.data_ptr() != self.tensor.data_ptr():
            return False
        if int(t.shape[0]) != self.slots or t.numel() * t.element_size() != self.slots * self.nbytes:
            return False
        return (self.slots == 1 or t.stride(0) * t.element_size() == self.stride_bytes) and t[0].is_contiguous()


class LBBuffer:
    """The LB region of DeepEP's ``EPBuffer`` and its ``lb_`` calls, over ultracomm Contexts.

    Args:
        group: the NVLink domain's process group (DeepEP's LSA team; any backend, only its Store is
            used) or a ``LoopbackGroup``.  Expert ids and the mapping's rows are local to it.
        lb_allocation_plan_or_num_bytes: a :class:`BufferAllocator` (its tensors become this
            buffer's pools); a byte count is refused (it names no shapes).
        num_local_experts: experts per rank (DeepEP reads it from ``expert_weights`` per call; a
            Context is sized when it is made, so it is fixed here and each call checks it).
        context_options: ``Context`` keywords (``device=``, ``timeout_s``, ``relay_mode``,
            ``multicast_sms`` ...), the same for every pool.

    Collective: every rank constructs it with the same plan.  ``destroy()`` (or garbage
    collection) releases the pools' windows: drop the pool tensors first.
    """

    def __init__(
        self, group: Any, lb_allocation_plan_or_num_bytes: Any, num_local_experts: int, **context_options: Any
    ):
        plan = lb_allocation_plan_or_num_bytes
        if not isinstance(plan, BufferAllocator):
            raise ConfigError(
                "ultracomm: LBBuffer needs a BufferAllocator plan (allocate(shape, dtype) per redundant "
                f"tensor); got {type(plan).__name__}: a byte count says nothing of the tensors' shapes"
            )
        if plan.materialized:
            raise InputError("ultracomm: this allocation plan was materialized by another LBBuffer already")
        if not plan.allocations:
            raise InputError("ultracomm: the allocation plan holds no tensors; allocate the redundant pools first")
        if isinstance(num_local_experts, bool) or not isinstance(num_local_experts, int) or num_local_experts < 1:
            raise InputError(f"ultracomm: num_local_experts must be a positive int, got {num_local_experts!r}")
        self.num_local_experts = num_local_experts
        self.pools: list[_Pool] = []
        try:
            for i, meta in enumerate(plan.allocations):
                self.pools.append(
                    _Pool(i, tuple(meta.shape), meta.dtype, group, num_local_experts, dict(context_options))
                )
        except BaseException:
            self.destroy()
            raise
        ctx = self.pools[0].ctx
        self.rank_idx, self.num_ranks = ctx.rank, ctx.world
        self.num_nvlink_ranks = ctx.world
        for meta, pool in zip(plan.allocations, self.pools):
            torch.utils.swap_tensors(meta, pool.tensor)  # the placeholder is the pool now, as in DeepEP
            pool.tensor = meta
        plan.materialized = True
        _LIVE.add(self)

    # ------------------------------------------------------------------ DeepEP's calls
    @staticmethod
    def capture() -> EventOverlap:
        """An event on the current stream (DeepEP's ``EPBuffer.capture``), for ``previous_event``."""
        if torch.cuda.is_available() and torch.cuda.is_initialized():
            ev = torch.cuda.Event()
            ev.record()
            return EventOverlap(ev)
        return EventOverlap(True)

    def lb_get_theoretical_num_sms(self) -> int:
        """The SMs the pools' Contexts run with (0 on the host executor)."""
        return max((max(p.ctx.sm_counts.values(), default=0) for p in self.pools), default=0)

    def lb_prefetch_weights(
        self,
        redundant_expert_weights: Sequence[torch.Tensor] | torch.Tensor,
        expert_weights: Sequence[torch.Tensor] | torch.Tensor,
        redundancy_mapping: torch.Tensor,
        num_sms: int = 0,
        previous_event: Any = None,
    ) -> EventOverlap:
        """Fill every rank's redundant slots with the experts ``redundancy_mapping`` names (collective)."""
        dst = _tensors(redundant_expert_weights, "redundant_expert_weights")
        src = _tensors(expert_weights, "expert_weights")
        if len(dst) != len(src):
            raise InputError(
                f"ultracomm: lb_prefetch_weights got {len(dst)} redundant_expert_weights and {len(src)} "
                "expert_weights; pass one source per destination"
            )
        _check_sms(num_sms)
        pools = [self._pool_of(t, f"redundant_expert_weights[{i}]") for i, t in enumerate(dst)]
        if len({p.index for p in pools}) != len(pools):
            raise InputError("ultracomm: lb_prefetch_weights names one redundant tensor twice")
        mapping = self._mapping(redundancy_mapping)
        for i, (pool, w) in enumerate(zip(pools, src)):
            if w.dim() < 1 or int(w.shape[0]) != self.num_local_experts:
                raise InputError(
                    f"ultracomm: expert_weights[{i}] is {list(w.shape)}; expected [num_local_experts="
                    f"{self.num_local_experts}, ...]"
                )
            if pool.slots != mapping.shape[1]:
                raise InputError(
                    f"ultracomm: redundant_expert_weights[{i}] has {pool.slots} slots; redundancy_mapping "
                    f"has {mapping.shape[1]} columns"
                )
            got = w.element_size() * (w.numel() // self.num_local_experts)
            if got != pool.nbytes:
                raise InputError(
                    f"ultracomm: expert_weights[{i}] has {got} bytes per expert, its destination "
                    f"{pool.nbytes}; each pair must have the same bytes per expert"
                )
        plan, dups = self._plan(mapping)
        ctx0 = pools[0].ctx
        if dups and ctx0.transport.stream_ordered and getattr(ctx0.window, "loopback", False):
            # a loopback domain on one GPU launches every rank's share at the last rank's call: a
            # duplicate slot's copy_ queued after this rank's call would run before its multicast
            first, dup = dups[0]
            raise InputError(
                f"ultracomm: lb_prefetch_weights: redundancy_mapping puts one expert in slots {first} and {dup} "
                f"of rank {self.rank_idx}; on a one-GPU loopback domain ({ctx0.window.provider}) duplicate slots "
                "are not supported (their copy would run before the launch that fills the first slot): map each "
                "expert at most once per rank, or run one process per GPU"
            )
        if previous_event is not None:
            _wait_for(previous_event)
        for pool, w in zip(pools, src):
            ctx = pool.ctx
            ctx.register_masters(0, [self._words(w, pool)], None)
            vid = ctx.begin(0)
            try:
                ctx.weight_sync(vid, plan)
            finally:
                ctx.end(vid)
            for first, dup in dups:  # one expert twice on this rank: the multicast filled the first slot
                pool.tensor[dup].copy_(pool.tensor[first])
        return self._done()

    def lb_reduce_grads(
        self,
        redundant_expert_grads: torch.Tensor,
        expert_grads: torch.Tensor,
        redundancy_mapping: torch.Tensor,
        num_sms: int = 0,
        previous_event: Any = None,
    ) -> EventOverlap:
        """``expert_grads += `` every redundant slot's gradient of that expert (collective); the
        redundant gradients are left unchanged."""
        for name, t in (("redundant_expert_grads", redundant_expert_grads), ("expert_grads", expert_grads)):
            if not isinstance(t, torch.Tensor) or t.dim() != 2 or t.dtype != torch.float32:
                what = f"{t.dtype} {list(t.shape)}" if isinstance(t, torch.Tensor) else type(t).__name__
                raise InputError(f"ultracomm: lb_reduce_grads: {name} must be a 2-D float32 tensor, got {what}")
        _check_sms(num_sms)
        pool = self._pool_of(redundant_expert_grads, "redundant_expert_grads")
        if not pool.fp32_rows:
            raise InputError(
                "ultracomm: lb_reduce_grads: redundant_expert_grads must be a float32 "
                "[num_redundant_experts, hidden] pool of this buffer"
            )
        mapping = self._mapping(redundancy_mapping)
        if pool.slots != mapping.shape[1]:
            raise InputError(
                f"ultracomm: redundant_expert_grads has {pool.slots} slots; redundancy_mapping has "
                f"{mapping.shape[1]} columns"
            )
        want = (self.num_local_experts, pool.inner[0])
        if tuple(expert_grads.shape) != want or not expert_grads.is_contiguous():
            raise InputError(
                f"ultracomm: lb_reduce_grads: expert_grads must be a contiguous float32 {list(want)} "
                f"(num_local_experts, hidden), got {list(expert_grads.shape)}"
            )
        plan, dups = self._plan(mapping)
        if previous_event is not None:
            _wait_for(previous_event)
        staged = pool.tensor
        if dups:  # a rank's duplicate slots reach the home as one sum (slot order), in the first slot
            staged = staged.clone()
            for first, dup in dups:
                staged[first] += staged[dup]
        ctx = pool.ctx
        rows = expert_grads if expert_grads.data_ptr() % ctx.layout.align == 0 else list(expert_grads.unbind(0))
        ctx.register_masters(0, [rows], [rows])  # weights never move: no multicast runs
        vid = ctx.begin(0)
        try:
            ctx.set_plan(vid, plan)
        except BaseException:
            ctx.end(vid)
            raise
        try:
            ctx.grad_reduce(vid, grads=[staged])  # copied into the scratch slots, reduced from there
        except BaseException:
            with contextlib.suppress(Exception):  # refused before it released the vid
                ctx.end(vid)
            raise
        return self._done()

    def destroy(self) -> None:
        """Close every pool's Context (not collective; idempotent)."""
        for p in getattr(self, "pools", ()):
            p.ctx.close()
        _LIVE.discard(self)

    # ------------------------------------------------------------------ internals
    def _pool_of(self, t: Any, name: str) -> _Pool:
        if not isinstance(t, torch.Tensor):
            raise InputTypeError(f"ultracomm: {name} must be a tensor, got {type(t).__name__}")
        for p in self.pools:
            if p.holds(t):
                return p
        raise InputError(
            f"ultracomm: {name} ({t.dtype} {list(t.shape)}) is not a redundant pool of this LBBuffer; "
            "destinations must be tensors its BufferAllocator planned (or views of one, each slot whole)"
        )

    def _mapping(self, m: Any) -> np.ndarray:
        if (
            not isinstance(m, torch.Tensor)
            or m.dtype != torch.int32
            or m.dim() != 2
            or int(m.shape[0]) != self.num_nvlink_ranks
        ):
            what = f"{m.dtype} {list(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
            raise InputError(
                f"ultracomm: redundancy_mapping must be an int32 [num_nvlink_ranks="
                f"{self.num_nvlink_ranks}, num_redundant_experts] tensor, got {what}"
            )
        a = m.detach().to("cpu").numpy().astype(np.int64)
        num_experts = self.num_nvlink_ranks * self.num_local_experts
        bad = np.argwhere((a < -1) | (a >= num_experts))
        if len(bad):
            r, c = (int(x) for x in bad[0])
            raise PlanError(
                f"ultracomm: redundancy_mapping[{r}, {c}] = {int(a[r, c])}: expert ids are local to the "
                f"NVLink domain, in [0, {num_experts}) (num_nvlink_ranks x num_local_experts), or -1 for "
                "an empty slot"
            )
        own = np.argwhere((a >= 0) & (a // self.num_local_experts == np.arange(a.shape[0])[:, None]))
        if len(own):
            r, c = (int(x) for x in own[0])
            raise PlanError(
                f"ultracomm: redundancy_mapping[{r}, {c}] = {int(a[r, c])} is rank {r}'s own expert; a "
                "redundant slot holds another rank's expert (DeepEP: a rank's own experts must not appear "
                "in its redundant slots)"
            )
        return a

    def _plan(self, mapping: np.ndarray) -> tuple[ReplicaPlan, list[tuple[int, int]]]:
        """The Context plan (each expert in the first of its slots on a rank) and this rank's
        (first, duplicate) slot pairs."""
        slot_src = mapping.copy()
        dups: list[tuple[int, int]] = []
        for r in range(slot_src.shape[0]):
            first: dict[int, int] = {}
            for c, e in enumerate(mapping[r]):
                if e < 0:
                    continue
                if e in first:
                    slot_src[r, c] = -1
                    if r == self.rank_idx:
                        dups.append((first[e], c))
                else:
                    first[int(e)] = c
        return ReplicaPlan.make(slot_src, experts_per_rank=self.num_local_experts), dups

    def _words(self, w: torch.Tensor, pool: _Pool) -> torch.Tensor:
        """``w``'s bytes as ``[num_local_experts, words]`` of the pool's word (no conversion)."""
        w = w.contiguous()
        if w.data_ptr() % pool.ctx.layout.align:
            w = w.clone()
        return w.view(-1).view(torch.uint8).view(pool.word).view(self.num_local_experts, -1)

    def _done(self) -> EventOverlap:
        if self.pools[0].ctx.stream_ordered:
            ev = torch.cuda.Event()
            ev.record()
            return EventOverlap(ev)
        return EventOverlap(None)


def _tensors(x: Any, name: str) -> list[torch.Tensor]:
    ts = [x] if isinstance(x, torch.Tensor) else list(x)
    if not ts or not all(isinstance(t, torch.Tensor) for t in ts):
        raise InputError(f"ultracomm: {name} must be a tensor or a nonempty sequence of tensors (no None entries)")
    return ts


def _check_sms(num_sms: Any) -> None:
    if isinstance(num_sms, bool) or not isinstance(num_sms, int) or num_sms < 0:
        raise InputError(f"ultracomm: num_sms must be 0 (the default count) or a positive int, got {num_sms!r}")


def _buffer_of(t: Any, name: str) -> LBBuffer:
    for buf in list(_LIVE):
        if isinstance(t, torch.Tensor) and any(p.holds(t) for p in buf.pools):
            return buf
    raise InputError(
        f"ultracomm: {name} is not a redundant pool of any live LBBuffer; allocate it with a "
        "BufferAllocator and make an LBBuffer from that plan"
    )


def lb_prefetch_weights(
    redundant_expert_weights: Sequence[torch.Tensor] | torch.Tensor,
    expert_weights: Sequence[torch.Tensor] | torch.Tensor,
    redundancy_mapping: torch.Tensor,
    num_sms: int = 0,
    previous_event: Any = None,
) -> EventOverlap:
    """:meth:`LBBuffer.lb_prefetch_weights` of the buffer that holds the destinations."""
    first = _tensors(redundant_expert_weights, "redundant_expert_weights")[0]
    return _buffer_of(first, "redundant_expert_weights[0]").lb_prefetch_weights(
        redundant_expert_weights, expert_weights, redundancy_mapping, num_sms, previous_event
    )


def lb_reduce_grads(
    redundant_expert_grads: torch.Tensor,
    expert_grads: torch.Tensor,
    redundancy_mapping: torch.Tensor,
    num_sms: int = 0,
    previous_event: Any = None,
) -> EventOverlap:
    """:meth:`LBBuffer.lb_reduce_grads` of the buffer that holds ``redundant_expert_grads``."""
    return _buffer_of(redundant_expert_grads, "redundant_expert_grads").lb_reduce_grads(
        redundant_expert_grads, expert_grads, redundancy_mapping, num_sms, previous_event
    )
