"""``ReplicaManager``: what a MoE layer calls once per (layer, micro-batch).

::

    mgr = ReplicaManager(group, layout, experts_per_rank=8, slots_per_rank=2, num_layers=2)
    mgr.register_layer(layer, [fc1, fc2])        # stacked [epr, *shape] params or per-expert lists

    step = mgr.step(layer, routing_map, probs)   # loads -> planner -> begin -> async weight_sync
    rmap, rprobs = step.rerouted("echo")         # hot experts' tokens sent to their replicas
    fc1_rep, fc2_rep = step.replica_weights()    # per member, per slot [*shape] tensors
    y = experts(tokens, home weights, replicas)  # ultracomm.moe.linear for fp32 wgrads
    y = step.guard(y)                            # backward: restore, then the reduce fires

Backward needs nothing else: the guard restores the slots before the expert Dgrad, the
replica weights' node folds their gradients into fp32 staging, runs ``grad_reduce`` and
returns each master's reduced replica contribution *through autograd* (added into the
``main_grad`` the master has at that moment where it has one, as Megatron's fused path does).
See :mod:`ultracomm.moe.autograd` for why every rank reaches every collective, also with no
token on its replicas; :mod:`ultracomm.moe.step` for a step, :mod:`ultracomm.moe.grad_staging`
for where the gradients are staged.
"""

from __future__ import annotations

import contextlib
import logging
import weakref
from collections.abc import Iterable
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..context import Context
from ..errors import ConfigError, InputError, RegistrationError, UltracommError
from ..layout import ExpertLayout
from ..planners import Domain, get_planner
from ..planners import device as device_planner
from ..resident_plan import ResidentPlan
from .board_layout import ExchangeTag
from .grad_staging import GradStaging, RegisteredLayer, describe, masters_of, tensors_of
from .recompute import recompute_target
from .loads import board_for_context, gather_loads
from .reroute import LAYOUTS
from .step import ON_STREAM, Step

__all__ = ["ReplicaManager", "Step"]

_log = logging.getLogger("ultracomm")

#: the planner options ``planners.device.plan_on_gpu`` takes (the device control plane's planner)
_GPU_PLANNER_OPTIONS = ("eps", "min_tokens", "intra_node_only")


def _orphaned(manager_ref: weakref.ref, vid: int) -> None:
    """A live step was garbage-collected before its backward: abandon it at the next call
    (not here: a finalizer runs wherever the last reference happened to drop)."""
    manager = manager_ref()
    if manager is not None:
        manager._orphans.append(vid)


def _member_entries(layout: ExpertLayout, params: Any) -> list:
    """``register_layer``'s ``params`` as a list (one entry per member: a tensor, or a list of
    per-expert tensors), refused with a RegistrationError before anything is registered."""
    names = [m.name for m in layout.members]
    if isinstance(params, torch.Tensor) or not isinstance(params, Iterable):
        raise RegistrationError(
            f"ultracomm: register_layer takes params as a list with one entry per layout member {names}, "
            f"got {type(params).__name__}"
        )
    out = []
    for m, p in enumerate(params):
        entry = p if isinstance(p, torch.Tensor) else list(p) if isinstance(p, Iterable) else None
        if entry is None or (isinstance(entry, list) and not all(isinstance(t, torch.Tensor) for t in entry)):
            what = names[m] if m < len(names) else f"entry {m}"
            raise RegistrationError(
                f"ultracomm: register_layer: params[{m}] ({what}) must be a tensor or a list of per-expert "
                f"tensors, got {type(p).__name__}"
            )
        out.append(entry)
    return out


class ReplicaManager:
    """Replica manager over one :class:`~ultracomm.Context` (one EP group).

    Args:
        group: process group (``None``: default) or ``LoopbackGroup``; ignored when
            ``context`` is given.
        layout: the members of one expert (e.g. ``ExpertLayout.swiglu(H, I)``).
        experts_per_rank: master experts per rank (expert ``e`` lives on ``e // epr``).
        slots_per_rank: replica slots per rank.
        num_layers: MoE layers.
        max_microbatches: micro-batches in flight per layer (pipeline parallelism).
        planner: ``device`` (default: the device control plane's quota planner, the same
            C++ a GPU runs; beyond its capacities -- world 1024, 65536 experts, 8 slots --
            the manager falls back to ``quota`` and logs one line) | ``quota`` | ``taot`` |
            ``greedy`` | ``lpt`` (host planners) or a callable with the planners'
            signature; ``planner_options`` go to it.
        reroute_layout: default layout of :meth:`Step.rerouted` (``echo`` or ``physical``).
        node_of: node of each rank (planners' topology and the schedule's tiers).
        context: an existing Context to use instead of building one.
        context_options: further ``Context`` keywords (``timeout_s``, ``relay_mode``, ...).
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
        planner: Any = "device",
        planner_options: dict | None = None,
        reroute_layout: str = "echo",
        node_of: Sequence[int] | None = None,
        context: Context | None = None,
        **context_options: Any,
    ):
        if reroute_layout not in LAYOUTS:
            raise InputError(f"ultracomm: reroute_layout must be one of {LAYOUTS}, got {reroute_layout!r}")
        self.ctx = (
            context
            if context is not None
            else Context(
                # one micro-batch slot per layer beyond the caller's: the steps that expect no backward
                # (evaluation, no_grad) take it and free it at once, whatever is in flight
                group,
                layout,
                experts_per_rank,
                slots_per_rank,
                num_layers,
                max_microbatches + 1,
                node_of=node_of,
                **context_options,
            )
        )
        c = self.ctx
        if c.stream_ordered and getattr(c.window, "loopback", False) and c.world > 1:
            if context is None:  # ours: nothing else will close it
                c.close()
            raise ConfigError(
                "ultracomm: ReplicaManager cannot run on a one-GPU loopback domain (cuda_local windows) of more "
                "than one rank: there one launch runs every rank's share of an operation, enqueued by the last "
                "rank to call it, so a rank's forward compute and its backward (every rank's autograd nodes run on "
                "one device thread) would be enqueued before the operation they read.  Use one process per GPU "
                "(cuda_ipc or torch_symm windows), the host executor, or Context operations driven from one "
                "thread (as tests/cuda/test_gpu_context.py does)"
            )
        self.layout, self.rank, self.world = c.layout, c.rank, c.world
        #: steps whose backward has not run, per layer, at most (the Context has one slot more
        #: when the manager built it)
        self.max_microbatches = max_microbatches if context is None else c.max_microbatches
        self._evaluating = 0
        self.experts_per_rank, self.slots_per_rank, self.num_layers = c.experts_per_rank, c.slots_per_rank, c.num_layers
        self.num_experts = c.num_experts
        self.domain = Domain(self.world, np.asarray(c.node_of, np.int64), self.experts_per_rank)
        if planner == "device" and not device_planner.fits(self.world, self.num_experts, self.slots_per_rank):
            _log.warning(
                "ultracomm: world %d, %d experts, %d slots exceed the device planner's capacities; "
                "planning with the host planner 'quota'",
                self.world,
                self.num_experts,
                self.slots_per_rank,
            )
            planner = "quota"
        self.planner = get_planner(planner) if isinstance(planner, str) else planner
        self.planner_options = dict(planner_options or {})
        self.reroute_layout = reroute_layout
        self.layers: list[RegisteredLayer | None] = [None] * self.num_layers
        #: the replicas' gradient staging and the masters' reduced sums (made at the first register_layer)
        self.grads: GradStaging | None = None
        self._owner_ref: weakref.ref | None = None
        # steps whose backward has not reduced yet, held weakly: a step lives as long as its
        # autograd graph (or the caller) holds it; one that dies unreduced is abandoned
        self._live: dict[int, weakref.ref] = {}
        self._orphans: list[int] = []
        #: loads exchanged through a load board (host memory or GPU windows) where every rank maps
        #: every board (no store call per step); else None: the store exchange
        self._board = board_for_context(self.ctx)
        #: the device control plane runs the step: "device" (loads, plan, schedule build and
        #: reroute on the GPU, nothing on the host), "host" (the same C++ built for the host:
        #: board, device planner, portable schedule builder), or None (a host planner)
        self.control_plane = self._control_plane(planner)
        self._plan_bufs: dict[int, dict] = {}  # vid slot -> the device planner's output buffers

    def _control_plane(self, planner: Any) -> str | None:
        if planner != "device":
            return None
        from .loads_gpu import GpuLoadBoard

        if isinstance(self._board, GpuLoadBoard) and self.ctx.transport.build_on_device:
            other = sorted(set(self.planner_options) - set(_GPU_PLANNER_OPTIONS))
            if other:  # plan_on_gpu takes these only: a TypeError at the first step on the GPU otherwise
                raise InputError(
                    f"ultracomm: planner_options {other}: the device control plane plans on the GPU "
                    f"(plan_on_gpu), which takes {list(_GPU_PLANNER_OPTIONS)}; lanes and groups are the "
                    "host build's (the GPU runs a warp per probe)"
                )
            return "device"
        return "host"

    def async_ok(self) -> bool:
        """Whether operations may return a Work: not while the current stream captures a CUDA
        graph (a captured operation has no completion; stream order is what holds it, and
        :data:`ON_STREAM` stands in for its Work)."""
        return not (self.ctx.stream_ordered and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())

    # -------------------------------------------------------------- setup
    def register_layer(self, layer: int, params: Sequence[Any], masters: Sequence[Any] | None = None) -> None:
        """Register layer ``layer``'s master experts on this rank.

        Args:
            params: one entry per layout member: a stacked ``[experts_per_rank, *shape]``
                tensor (e.g. an ``nn.Parameter``) or a list of ``experts_per_rank``
                per-expert ``[*shape]`` tensors (Megatron's ``weight0..N``).  With FP8 members:
                the FP8 runtime copies and their scales, which the caller refreshes in place
                each step (``ultracomm.fp8.quantize(master, out=...)``) before ``step``.
            masters: only for layouts with FP8 members (``Member.master_dtype``): per member,
                the high-precision master (``master_dtype``, shaped like ``params[m]``) the FP8
                member is quantized from and its replicas' gradients reduce into; None for the
                other members (a member with a gradient then uses ``params[m]``, one without
                -- the scales -- has none).
        The replicas' reduced gradients reach the masters through autograd, at backward
        time: returned as their gradient, or added into the ``main_grad`` a tensor has at that
        moment (Megatron's ``DistributedDataParallel`` may allocate it after this call, and
        rebind it between steps).  Tensors with ``requires_grad=False`` get replicas and no
        reduction.
        """
        self._check_layer(layer)
        params = _member_entries(self.layout, params)
        anchors = masters_of(self.layout, params, masters)
        flat = [t for p in params for t in tensors_of(p)]
        dev = flat[0].device if flat else torch.device("cpu")
        if self.grads is None:  # see moe.grad_staging: no user pointer in a schedule or captured graph
            self.grads = GradStaging(self.layout, self.experts_per_rank, self.slots_per_rank, dev)
        grads = [
            g if g is None or isinstance(p, torch.Tensor) else list(g.unbind(0))
            for p, g in zip(params, self.grads.master)
        ]
        self.ctx.register_masters(
            layer, [p.detach() if isinstance(p, torch.Tensor) else [t.detach() for t in p] for p in params], grads
        )
        self.layers[layer] = RegisteredLayer(anchors)

    # -------------------------------------------------------------- per layer and micro-batch
    def step(self, layer: int, routing_map: torch.Tensor, probs: torch.Tensor | None = None) -> Step:
        """Plan and start the replication of layer ``layer`` for this micro-batch.

        Args:
            routing_map: bool ``[T, E]``, this rank's tokens; ``probs``: ``[T, E]`` or None.
        Collective: every rank calls ``step`` for the same layers in the same order.
        Under ``torch.no_grad()`` the step needs no backward (inference, or the first pass
        of reentrant checkpointing); called again inside a backward pass (activation
        recompute) it re-syncs the original step's replicas instead of planning anew.
        """
        self._check_layer(layer)
        if self.layers[layer] is None:
            raise RegistrationError(f"ultracomm: layer {layer!r} is not registered; call register_layer first")
        self._check_routing(routing_map, probs)
        self._collect_orphans()
        grad = torch.is_grad_enabled() and not self._evaluating
        if grad and torch._C._current_autograd_node() is not None:
            target = recompute_target(self._live_steps(), layer, routing_map)
            if target is not None:
                return self._recompute(target, routing_map, probs)
        if grad and sum(s.layer == layer for s in self._live_steps()) >= self.max_microbatches:
            raise self._in_flight_error(layer)
        if self.control_plane == "device":
            vid, step = self._step_on_device(layer, routing_map, probs, grad)
        else:
            vid, step = self._step_on_host(layer, routing_map, probs, grad)
        self.slots_owner = step
        if grad:
            self._live[vid] = weakref.ref(step)
            step._finalizer = weakref.finalize(step, _orphaned, weakref.ref(self), vid)
            step._finalizer.atexit = False
        else:
            self.ctx.end(vid)  # no backward will restore or reduce it
        return step

    def _begin(self, layer: int) -> int:
        try:
            return self.ctx.begin(layer)
        except UltracommError as e:
            if "in flight" not in str(e):
                raise
            raise self._in_flight_error(layer) from None

    def _in_flight_error(self, layer: int) -> UltracommError:
        return UltracommError(
            f"ultracomm: layer {layer} already has {self.max_microbatches} steps whose backward has not run; "
            "run their backward, call ReplicaManager.abandon() to drop them (a skipped step), take evaluation "
            "forwards inside `with manager.evaluating():`, or create the manager with a larger max_microbatches"
        )

    @contextlib.contextmanager
    def evaluating(self) -> Iterator[None]:
        """Forwards inside take steps that expect no backward (an evaluation pass with grad
        enabled): they plan and multicast as any step, hand out replica weights without a graph
        to the masters (``guard`` is the identity), and free their micro-batch slot at once;
        every step in flight is left as it was (its backward restores its replicas).  Collective
        like ``step``: every rank evaluates alike."""
        self._evaluating += 1
        try:
            yield
        finally:
            self._evaluating -= 1

    def _step_on_host(
        self, layer: int, routing_map: torch.Tensor, probs: torch.Tensor | None, grad: bool
    ) -> tuple[int, Step]:
        """Loads to the host, a planner there, the plan handed over: a host planner, or the device
        control plane's host build (then the schedule is the portable builder's, as on a GPU).
        The loads' exchange names what it is for (layer, micro-batch slot, grad): ranks out of
        step raise PlanMismatchError there, on every rank, before anything moves."""
        vid = self._begin(layer)
        try:
            tag = ExchangeTag(layer, vid % self.ctx.max_microbatches, grad)
            if self._board is not None:
                load = self._board.gather(routing_map.sum(0), op=str(tag), tag=tag.value)
            else:  # the store exchange compares the ops' names
                load = gather_loads(self.ctx.comm, routing_map.sum(0), op=str(tag))
            result = self.planner(load, self.domain, self.slots_per_rank, **self.planner_options)
            if self.ctx.profiler is not None:  # the loads the balancer saw, beside the ops' plan/stats/times
                self.ctx.profiler.record(layer, load=load, plan=result)
            plan = result.plan
            if self.control_plane == "host":
                plan = ResidentPlan(torch.from_numpy(np.ascontiguousarray(result.plan.slot_src, dtype=np.int32)))
            sync = self.ctx.weight_sync(vid, plan, async_op=self.async_ok()) or ON_STREAM
            return vid, Step(self, layer, result, routing_map, probs, vid, sync, grad)
        except BaseException:
            self.ctx.end(vid)  # nothing of this step survives: its slot is free again
            raise

    def _step_on_device(
        self, layer: int, routing_map: torch.Tensor, probs: torch.Tensor | None, grad: bool
    ) -> tuple[int, Step]:
        """The device-resident step: the loads' all-gather through the GPU windows, the quota
        planner, the schedule build into the vid's plan slot and the multicast, all enqueued on
        the current stream -- no host synchronisation, no store or torch.distributed call,
        capturable in a CUDA graph (buffers are allocated at a vid slot's first step).  The
        exchange's tag (layer, micro-batch slot, grad) is checked by the kernel: ranks out of
        step get a failed exchange status, which the build refuses."""
        vid = self._begin(layer)
        try:
            tag = ExchangeTag(layer, vid % self.ctx.max_microbatches, grad)
            loads = self._board.exchange(routing_map.sum(0), op=str(tag), tag=tag.value)
            step_loads = loads.clone()  # this step's own copy: the board's buffer is the next exchange's
            out = self._plan_buffers(vid % (self.num_layers * self.ctx.max_microbatches), loads)
            device_planner.plan_on_gpu(step_loads, self.domain, self.slots_per_rank, out=out, **self.planner_options)
            # the build rejects (instead of using them) loads that never all arrived or a refused plan
            plan = ResidentPlan(out["slot_src"], exchange_status=self._board.status, planner_result=out["result"])
            sync = self.ctx.weight_sync(vid, plan, async_op=self.async_ok()) or ON_STREAM
            # the step's own copies (stream-ordered, small): the vid slot's buffers serve its next step
            snap = dict(
                loads=step_loads,
                slot_src=out["slot_src"].clone(),
                slot_quota=out["slot_quota"].clone(),
                result=out["result"].clone(),
            )
            return vid, Step(self, layer, None, routing_map, probs, vid, sync, grad, resident=snap)
        except BaseException:
            self.ctx.end(vid)
            raise

    def _plan_buffers(self, slot: int, loads: torch.Tensor) -> dict:
        """The device planner's output buffers of vid slot ``slot`` (allocated at its first step;
        reused after, so a captured graph writes the same memory at every replay)."""
        out = self._plan_bufs.get(slot)
        if out is None:
            out = self._plan_bufs[slot] = device_planner.plan_on_gpu(
                loads, self.domain, self.slots_per_rank, **self.planner_options
            )
        return out

    def _check_layer(self, layer: Any) -> None:
        if isinstance(layer, bool) or not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise RegistrationError(
                f"ultracomm: layer {layer!r} is out of range 0..{self.num_layers - 1} (num_layers={self.num_layers})"
            )

    def _check_routing(self, routing_map: Any, probs: Any) -> None:
        """Everything ``step`` needs of its inputs, checked before it takes a slot."""
        E = self.num_experts
        if (
            not isinstance(routing_map, torch.Tensor)
            or routing_map.dtype != torch.bool
            or routing_map.dim() != 2
            or routing_map.shape[1] != E
        ):
            raise InputError(f"ultracomm: routing_map must be a bool [tokens, {E}] tensor, got {describe(routing_map)}")
        if routing_map.device.type not in ("cpu", "cuda"):  # e.g. meta: no counts to exchange
            raise InputError(f"ultracomm: routing_map is on {routing_map.device}; pass it on the CPU or a CUDA device")
        if probs is None:
            return
        if (
            not isinstance(probs, torch.Tensor)
            or not probs.is_floating_point()
            or tuple(probs.shape) != tuple(routing_map.shape)
        ):
            raise InputError(
                f"ultracomm: probs must be a floating-point [tokens, {E}] tensor shaped like "
                f"routing_map {list(routing_map.shape)} (or None), got {describe(probs)}"
            )
        if probs.device != routing_map.device:
            raise InputError(
                f"ultracomm: probs is on {probs.device} but routing_map on {routing_map.device}; "
                "pass both on the same device"
            )

    # -------------------------------------------------------------- abandoned steps
    @property
    def slots_owner(self) -> "Step | None":
        """The step whose replicas the slots hold now (held weakly: see Step._build)."""
        return None if self._owner_ref is None else self._owner_ref()

    @slots_owner.setter
    def slots_owner(self, step: "Step | None") -> None:
        self._owner_ref = None if step is None else weakref.ref(step)

    def _live_steps(self) -> list[Step]:
        return [s for s in (r() for r in self._live.values()) if s is not None]

    def _collect_orphans(self) -> None:
        """Abandon the steps that died unreduced (their autograd graph was freed)."""
        orphans, self._orphans = self._orphans, []
        for vid in orphans:
            if self._live.pop(vid, None) is not None and not self.ctx.closed:
                self.ctx.end(vid)

    def abandon(self) -> list[int]:
        """Drop every step whose backward has not run (an evaluation forward with grad
        enabled, a step skipped after a NaN loss), freeing their micro-batch slots; their
        backward then raises.  Steps whose autograd graph is freed are dropped by themselves
        at the next ``step``.  Call it on every rank alike (the steps' collectives are paired).

        Returns:
            The layers of the dropped steps, in the order they were taken.
        """
        self._collect_orphans()
        dropped = []
        for vid, ref in list(self._live.items()):
            step = ref()
            del self._live[vid]
            if step is not None:
                step._release_graph()
                step._state = "abandoned"
                dropped.append(step.layer)
            self.ctx.end(vid)
        return dropped

    def _recompute(self, target: Step, routing_map: torch.Tensor, probs: torch.Tensor | None) -> Step:
        # the slots may still hold the target (every rank decides alike: same calls, same owner)
        sync = (
            target._sync
            if self.slots_owner is target
            else self.ctx.restore(target.vid, async_op=self.async_ok()) or ON_STREAM
        )
        self.slots_owner = target
        return Step(
            self,
            target.layer,
            target._result,
            routing_map,
            probs,
            target.vid,
            sync,
            True,
            target=target,
            resident=target._resident,
        )

    def retire(self, vid: int) -> bool:
        """A step's backward is done (or it was dropped): it no longer counts as in flight.
        Returns whether it did."""
        return self._live.pop(vid, None) is not None

    def wait_grads(self) -> None:
        """Kept for compatibility: nothing to wait for.  The replicas' gradients are returned
        through autograd by the backward node that reduces them (on the host executor it waits
        for the reduction; stream-ordered transports make the stream wait instead)."""

    def close(self) -> None:
        """Drop the steps whose backward never ran and close the Context."""
        for step in self._live_steps():  # forwards whose backward never ran
            step._release_graph()
            step._state = "abandoned"
        self._live.clear()
        board, self._board = self._board, None
        if board is not None:
            board.close()
        self.ctx.close()
