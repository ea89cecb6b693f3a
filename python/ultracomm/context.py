"""``Context``: owns the replica buffers, the window and the in-flight micro-batch slots.

One Context per EP group.  Per MoE layer and micro-batch::

    vid = ctx.begin(layer)               # a micro-batch slot id (PP keeps several in flight)
    ctx.weight_sync(vid, plan)           # forward: home experts -> replica slots
    ...  forward compute reads ctx.replica_weights ...
    ctx.restore(vid)                     # backward, before Dgrad: re-multicast the same plan
    ...  backward writes replica weight grads into ctx.replica_grads ...
    ctx.grad_reduce(vid)                 # master grads += replicas' grads, deterministic

Every collective operation must be called by all ranks of the group in the same order.
Every wait is bounded by ``ULTRACOMM_TIMEOUT_S``: a stalled or dead peer makes the others
raise :class:`~ultracomm.errors.UltracommTimeout` naming the rank, the operation and what
was awaited.  Setup agrees on success: if any rank fails a setup step, every rank raises.

With a GPU transport (``tma``: ``device="cuda"``, a GPU window, or ``transport="tma"``; and
``copy_engine``) the operations are stream-ordered: they are enqueued on the caller's current
CUDA stream and return at once (see :mod:`ultracomm.cuda.stream_ordered`); device errors surface at
``work.wait()`` or ``synchronize()``.
"""

from __future__ import annotations

import functools
import logging
from typing import Any, Sequence

import torch

from . import context_setup
from .control import plans
from .control.microbatches import MicroBatch
from .dataplane import check_like, check_master_devices, copy_into, zero_slots
from .env import Config
from .errors import ClosedError, ConfigError, InputError, PlanError, RegistrationError, UltracommTimeout
from .layout import ExpertLayout
from .plan import ReplicaPlan
from .resident_plan import ResidentPlan
from .records import Op
from .schedule_base import ScheduleBase
from .transports.base import Masters
from .work import OrderedRunner, Work

log = logging.getLogger("ultracomm")


class Context:
    """Replica buffers, window and operations of one expert-parallel group.

    Args:
        group: ``torch.distributed`` process group (``None``: the default group) or a
            ``LoopbackGroup`` (ranks as threads of one process).
        layout: the members of one expert (:class:`ExpertLayout`).
        experts_per_rank: master experts on each rank; expert ``e``'s home is
            ``e // experts_per_rank`` unless a plan says otherwise.
        slots_per_rank: replica slots on each rank (weights and grads).
        num_layers: MoE layers that will register masters.
        max_microbatches: micro-batches in flight per layer (pipeline parallelism): each layer
            has this many ``begin`` slots, released by ``grad_reduce`` or ``end``.
        transport: ``auto`` or a transport name (default from ``ULTRACOMM_TRANSPORT``):
            ``host``, ``tma``, ``p2p``, ``copy_engine``, ``split``.  ``auto`` is ``host`` (CPU) or
            ``tma`` (CUDA) when every rank shares one memory domain, ``p2p`` when no two do, and
            where domains hold several ranks ``split`` (host -- CUDA: tma -- inside a domain,
            p2p across); see :mod:`ultracomm.dataplane.domains`, ``transport_choice`` and ``domain_of``.
            Domains are detected (host, NVLink fabric) or declared with ``ULTRACOMM_DOMAIN`` /
            ``domain=``.
        window: window provider (default from ``ULTRACOMM_WINDOW``).
        device: where the window (and the registered masters) live: ``None`` (the CPU unless
            the window or transport named is a GPU one), ``"cpu"``, ``"cuda"`` (the current
            device), ``"cuda:N"`` or an index.  See :mod:`ultracomm.dataplane`.
        node_of: node index of each rank (``[world]``); ``None``: one node.
        config: an :class:`ultracomm.env.Config`; keyword ``overrides`` replace its fields.
        profile: record plans, schedule stats and op times (:mod:`ultracomm.profile`): a
            directory (the Context closes that recorder), a ``Profiler`` (the caller's),
            ``False`` or ``""`` (off, as an empty ``ULTRACOMM_PROFILE``), or ``None``: ``ULTRACOMM_PROFILE``.
    """

    def __init__(
        self,
        group: Any,
        layout: ExpertLayout,
        experts_per_rank: int,
        slots_per_rank: int,
        num_layers: int,
        max_microbatches: int = 1,
        *,
        transport: str | None = None,
        window: str | None = None,
        device: Any = None,
        node_of: Sequence[int] | None = None,
        config: Config | None = None,
        profile: Any = None,
        **overrides: Any,
    ):
        self._runner: OrderedRunner | None = None  # set last: a half-built Context has nothing to close
        context_setup.construct(
            self,
            group,
            layout,
            experts_per_rank,
            slots_per_rank,
            num_layers,
            max_microbatches,
            transport,
            window,
            device,
            node_of,
            config,
            profile,
            overrides,
        )

    def register_masters(self, layer: int, weights: Sequence, grads: Sequence | None = None) -> None:
        """Register layer ``layer``'s master experts on this rank.

        Args:
            weights: one entry per layout member, in ``member.dtype``: a stacked
                ``[experts_per_rank, *member.shape]`` tensor, or a list of
                ``experts_per_rank`` per-expert ``[*member.shape]`` tensors (any addresses,
                each contiguous; Megatron's one parameter per expert).
            grads: the same in ``layout.grad_dtype`` (e.g. Megatron's ``main_grad``, views
                into its grad buckets), ``None`` in the place of each member without a gradient
                (``Member.grad``: FP8 scales); ``grad_reduce`` adds the replicas' gradients into
                them.  ``None``: weights only (inference); ``grad_reduce`` then raises.
        The tensors must stay alive, at the same address and size, while the Context uses
        them: every operation re-checks them and raises naming the layer and member if one
        was swapped (``param.data = ...``, ``set_``, a resized storage).  They live where the
        window does: CPU tensors for the host transport; for ``tma``, tensors on the window's
        GPU with every expert's row 16-byte aligned.
        """
        self._check_open()
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise RegistrationError(f"ultracomm: layer {layer!r} is out of range 0..{self.num_layers - 1}")
        self.layout.check_tensors(weights, grads, self.experts_per_rank)
        check_master_devices(
            self.window.device, self.transport.name, self.layout.names, weights, grads or (), self.experts_per_rank
        )
        self._masters[layer] = Masters.of(
            tuple(weights), None if grads is None else tuple(grads), self.experts_per_rank, self.layout.names
        )

    # ------------------------------------------------------------------ micro-batch slots
    def begin(self, layer: int) -> int:
        """Take a micro-batch slot for ``layer``; returns its id (``vid``, an opaque int).

        Released by ``grad_reduce`` or ``end``; a released vid is never valid again (the next
        ``begin`` returns a new one), so a stale vid raises instead of reaching a newer micro-batch.
        """
        self._check_open()
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise InputError(f"ultracomm: layer {layer!r} is out of range 0..{self.num_layers - 1}")
        if self._masters[layer] is None:
            raise RegistrationError(
                f"ultracomm: layer {layer} has no masters; call register_masters({layer}, ...) first"
            )
        return self._vids.begin(layer)

    def end(self, vid: int) -> None:
        """Release ``vid`` without reducing (inference, or a micro-batch that is dropped)."""
        self._check_open()
        self._get(vid)
        self._vids.release(vid)
        if self.profiler is not None:
            self.profiler.release(vid)

    def _get(self, vid: int, need_plan: bool = False) -> MicroBatch:
        return self._vids.get(vid, need_plan)

    def _check_open(self) -> None:
        if self._runner is None:
            raise ClosedError(
                "ultracomm: this Context is closed (close() was called or setup failed); create a new Context"
            )

    def _check_masters(self, layer: int) -> Masters:
        """Layer ``layer``'s masters, unchanged since register_masters (else RegistrationError)."""
        return self._masters[layer].check(layer)

    # ------------------------------------------------------------------ operations
    def schedule_for(self, plan: ReplicaPlan, key: bytes | None = None, builder: str | None = None) -> ScheduleBase:
        """The (cached) schedule of ``plan`` with this Context's configuration (this rank's lists).
        ``key``: ``plan.digest()`` if the caller has it already.  ``builder``: ``portable`` builds
        with the device control plane's builder whatever ``schedule_builder`` says (a resident
        plan on the host path); default the configuration's."""
        self._check_open()
        plan = plans.check_plan(plan, self.world, self.slots_per_rank, self.num_experts, self.experts_per_rank)
        return self._schedules.get(plan, key, builder)

    def _prepare_plan(
        self, plan: ReplicaPlan | BaseException, layer: int | None = None, builder: str | None = None
    ) -> ScheduleBase:
        """Check ``plan`` (and ``layer``'s masters) here, build its schedule, agree with every rank
        (:func:`ultracomm.control.plans.prepare`; the window check publishes a rejection instead)."""

        def check(p: Any) -> ReplicaPlan:
            p = plans.check_plan(p, self.world, self.slots_per_rank, self.num_experts, self.experts_per_rank)
            if layer is not None:
                self._check_masters(layer)
            return p

        return plans.prepare(
            plan,
            check=check,
            schedule=lambda p, key: self._schedules.get(p, key, builder),
            window_check=self.window_plan_check,
            reject=self._queue.reject,
            collective=lambda obj: self._collective(obj, op="weight_sync", what="plan agreement"),
        )

    def _collective(self, obj: Any, *, op: str, what: str) -> list[Any]:
        """A bounded exchange with every rank; a timeout breaks the Context (ranks are out of step)."""
        try:
            return self.comm.all_gather_object(obj, op=op, what=what)
        except UltracommTimeout as e:
            self._queue.fail(e)
            raise

    def plan_arena_bytes(self) -> int:
        """Device memory this rank's transport set aside at setup for its plans (the plan arena:
        one slot per ``num_layers x max_microbatches`` vid and op kind, sized for the largest plan
        this Context's experts, slots, world and window chunks allow, plus a few scratch slots), in
        bytes; as much again is pinned host memory (the staging its async uploads copy from).  0
        for transports without one (host, p2p, split's host side).  A loopback domain's ranks
        (``cuda_local``) share one arena that holds every rank's plan, so each reports the whole.
        Like DeepEP's buffer-size hints, it tells what memory to leave for ultracomm; nothing is
        allocated for plans after setup."""
        return int(self.transport.plan_arena_bytes)

    def _check_usable(self) -> None:
        self._check_open()
        self._queue.check()

    def weight_sync(self, vid: int, plan: ReplicaPlan | ResidentPlan, async_op: bool = False) -> Work | None:
        """Multicast the home experts of ``vid``'s layer into the replica slots ``plan`` names.

        On return (or ``work.wait()``), ``replica_weights[m][s]`` on rank ``r`` holds member
        ``m`` of expert ``plan.slot_src[r, s]``.  Collective: every rank passes the same plan.

        ``plan`` may be a :class:`~ultracomm.resident_plan.ResidentPlan` (the plan as an int32
        ``[world, slots]`` tensor, e.g. the device planner's output): on the ``tma`` transport
        with the tensor on the window's GPU the schedule is built on the GPU into the vid's plan
        slot and nothing goes to the host (no validation there either: an invalid plan is
        rejected by the device build, raised by the next ``synchronize()``, and peers raise
        ``PlanError``); elsewhere it is copied to the host and built by the same portable builder.
        """
        self._check_usable()
        mb = self._get(vid)
        builder = None
        if isinstance(plan, ResidentPlan):  # None: set up to be built on the device
            plan, builder = self._resident(mb, plan), "portable"
        if plan is not None:
            mb.keep(self.rank, plan, self._prepare_plan(plan, mb.layer, builder))
        work = self._queue.submit("weight_sync", Op.MULTICAST, mb, self._masters[mb.layer], async_op)
        self._vids.wrote_slots(mb)
        return work

    def set_plan(self, vid: int, plan: ReplicaPlan) -> None:
        """Give ``vid`` its plan without a multicast, for a ``grad_reduce`` whose replica grads the
        caller wrote into ``replica_grads`` itself (the replicas' weights came another way, e.g.
        DeepEP's ``lb_reduce_grads``).  Checked, built and agreed across ranks as ``weight_sync``
        does it, before anything moves; collective like it."""
        self._check_usable()
        mb = self._get(vid)
        if not isinstance(plan, ReplicaPlan):
            raise PlanError(f"ultracomm: set_plan takes a ReplicaPlan, got {type(plan).__name__}")
        mb.keep(self.rank, plan, self._prepare_plan(plan, mb.layer))
        mb.restored = True  # nothing in the slots to go stale: the grads are the caller's

    def _resident(self, mb: MicroBatch, plan: ResidentPlan) -> ReplicaPlan | BaseException | None:
        """:func:`ultracomm.control.plans.resident_route`; ``mb`` set up for the device build."""
        route = plans.resident_route(
            plan,
            self.world,
            self.slots_per_rank,
            self.experts_per_rank,
            self.transport.build_on_device,
            self.window.local.device,
            self.window_plan_check,
        )
        if route is not None:
            return route
        self._check_masters(mb.layer)
        mb.keep(self.rank, plan, self._schedules.device(plan), self._home_local_index)
        return None

    def restore(self, vid: int, async_op: bool = False) -> Work | None:
        """Re-multicast ``vid``'s plan (the slots were reused by other layers since its forward)."""
        self._check_usable()
        mb = self._get(vid, need_plan=True)
        work = self._queue.submit("restore", Op.MULTICAST, mb, self._check_masters(mb.layer), async_op)
        mb.restored, mb.overwritten_by = True, None
        self._vids.wrote_slots(mb)
        return work

    def weights_copied(self, vid: int) -> None:
        """Declare that ``vid``'s replica weights were copied out of the slots (as an ECHO-style
        dispatcher does), so later multicasts into the slots do not leave its backward stale and
        ``grad_reduce`` needs no ``restore`` first."""
        self._check_open()
        mb = self._get(vid, need_plan=True)
        mb.restored, mb.overwritten_by = True, None

    def grad_reduce(
        self,
        vid: int,
        async_op: bool = False,
        grads: Sequence[torch.Tensor] | None = None,
        *,
        release: bool = True,
        zero_replica_grads: bool = False,
    ) -> Work | None:
        """Add every replica's gradient (``replica_grads``) into its home expert's master grad.

        Deterministic: for each element, fp32 ``acc = master``, then the sources in the order
        the schedule lists them (relays pre-reduce their subtree first), cast back to the
        grad dtype.  Releases ``vid`` unless ``release=False``.

        A relay's ``replica_grads`` slot is overwritten with its partial sum (its own grad
        plus its children's), so replica grads are consumed by this call; with
        ``async_op=True`` write ``replica_grads`` again only after ``work.wait()``.

        ``grads``: optional per-member ``[slots_per_rank, *member.shape]`` tensors in the grad
        dtype, copied into ``replica_grads`` right before the reduction, in the operation
        queue (so a caller can stage the next micro-batch's grads while an earlier reduction
        still reads the slots).

        ``zero_replica_grads``: once every reader has consumed them, zero this rank's filled
        replica grad slots (every member), as part of the operation -- what UltraEP's reduce
        leaves behind, so hosts that accumulate replica grads with ``+=`` start from zero.
        Not available on a one-GPU loopback domain (its ranks' shares launch together later).

        ``release=False`` keeps ``vid`` and its plan in flight (``restore`` and ``grad_reduce``
        may run on it again; ``end(vid)`` releases it).  Its slots count as not restored again:
        a later multicast of another layer makes the next ``grad_reduce`` raise until ``restore``.

        Raises :class:`UltracommError` if another layer's multicast overwrote the slots after
        ``vid``'s ``weight_sync`` and ``restore(vid)`` was never called: its backward then
        ran on another layer's weights.
        """
        self._check_usable()
        mb = self._get(vid, need_plan=True)
        mb.check_not_overwritten()
        before = after = None
        if grads is not None:
            check_like(grads, self.replica_grads, f"[slots_per_rank, *member.shape] {self.layout.grad_dtype}")
            before = functools.partial(copy_into, self.replica_grads, grads)
        if zero_replica_grads:
            if self._streams is not None and getattr(self.window, "loopback", False):
                raise ConfigError(
                    "ultracomm: grad_reduce(zero_replica_grads=True) is not supported on a one-GPU "
                    "loopback domain (cuda_local windows): a rank's share runs in a later launch, so "
                    "the zeroing could not follow it; zero the slots after work.wait() instead"
                )
            # a resident plan's row is on the device: every slot (an empty one's grads are unused)
            filled = (
                list(range(self.slots_per_rank))
                if mb.my_slots is None
                else [s for s, e in enumerate(mb.my_slots) if e >= 0]
            )
            after = functools.partial(zero_slots, self.replica_grads, filled)
        masters = self._check_masters(mb.layer)
        if masters.grads is None:
            raise RegistrationError(
                f"ultracomm: layer {mb.layer} was registered without grads "
                f"(register_masters({mb.layer}, weights, None)); grad_reduce needs them: register "
                "the master grads too"
            )
        work = self._queue.submit("grad_reduce", Op.REDUCE, mb, masters, async_op, before, after)
        if release:
            self._vids.release(vid)
        else:  # the slots hold other layers' data as soon as one multicasts
            mb.restored = False
        return work

    def replicas(self, vid: int) -> list[int]:
        """Expert held by each of this rank's replica slots under ``vid``'s plan (-1 = empty)."""
        self._check_open()
        return self._get(vid, need_plan=True).plan.slot_src[self.rank].tolist()

    def synchronize(self) -> None:
        """Wait for every operation submitted so far on this rank (stream-ordered transports:
        for all work on the device), then raise the first failure, if any."""
        self._check_open()
        self._queue.synchronize()

    @property
    def stream_ordered(self) -> bool:
        """True when operations are enqueued on the caller's current CUDA stream (GPU transports);
        False when they run on this Context's own thread (host executor, ``p2p``, ...)."""
        return self._streams is not None

    def set_relay_mode(self, mode: str) -> None:
        """Use relay mode ``mode`` (``auto`` | ``off`` | ``force``, as ``ULTRACOMM_RELAY``) for the
        schedules built from now on; cached schedules of the old mode are dropped.  Every rank must
        call it between the same operations (ranks must build the same schedules)."""
        self._check_open()
        self.config = self._schedules.config = self.config.replace(relay_mode=mode)
        self._schedules.clear()

    @property
    def closed(self) -> bool:
        """True after ``close()`` (or a failed setup)."""
        return self._runner is None

    def close(self) -> None:
        """Finish queued operations (each bounded by the timeout) and release the thread and
        window.  Not collective; idempotent.  A Context dropped without ``close()`` is released
        the same way when it is garbage-collected."""
        runner, self._runner = self._runner, None
        if runner is not None:
            self._finalizer()
            if self.profiler is not None:
                self.profiler.context_closed()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
