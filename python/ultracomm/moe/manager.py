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
token on its replicas.
"""
from __future__ import annotations

import contextlib
import logging
import weakref
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..context import Context
from ..errors import ConfigError, RegistrationError, UltracommError
from ..layout import ExpertLayout
from ..planners import Domain, PlannerResult, get_planner, max_mean
from ..planners import device as device_planner
from ..planners.base import build_result
from ..resident_plan import ResidentPlan
from .autograd import _Guard, _ReplicaWeights, fused_wgrad_return
from .board_layout import ExchangeTag
from .loads import board_for_context, gather_loads
from .reroute import LAYOUTS, RerouteTable, reroute

__all__ = ["ReplicaManager", "Step"]

_log = logging.getLogger("ultracomm")


class _OnStream:
    """The Work of an operation enqueued on the caller's stream without one (during CUDA graph
    capture): later work on that stream is ordered after it already."""

    def wait_stream(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


_ON_STREAM = _OnStream()


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor with its own version counter: autograd saves replica weights
    for the Dgrad, and writes into other views of the window (the grad slots) must not count
    as modifying them."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


def _tensors(member: Any) -> list[torch.Tensor]:
    return [member] if isinstance(member, torch.Tensor) else list(member)


def _describe(x: Any) -> str:
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)} on {x.device}"
    return type(x).__name__


def _orphaned(manager_ref: weakref.ref, vid: int) -> None:
    """A live step was garbage-collected before its backward: abandon it at the next call
    (not here: a finalizer runs wherever the last reference happened to drop)."""
    manager = manager_ref()
    if manager is not None:
        manager._orphans.append(vid)


def _will_execute(node: Any) -> bool:
    """Whether the running backward pass will execute ``node``."""
    return node is not None and torch._C._will_engine_execute_node(node)


def _nearest_in_graph(start: Any, steps: list["Step"]) -> list["Step"]:
    """The step whose node a breadth-first walk from ``start`` (the node whose backward is
    running) meets first: the recompute belongs to the checkpointed region ``start`` is in."""
    want = {s._node(): s for s in steps}
    seen, frontier = set(), [start]
    while frontier:
        nxt = []
        for node in frontier:
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in want:
                return [want[node]]
            nxt.extend(fn for fn, _ in node.next_functions)
        frontier = nxt
    return []


class _Layer:
    """A registered layer: its master parameters, flat (the ``_ReplicaWeights`` node's inputs),
    with each one's member and first expert row.  ``masters[m]``: what member ``m``'s gradient
    reduces into (the registered weights themselves, an FP8 member's high-precision master,
    None for a member without a gradient)."""

    def __init__(self, masters: list[Any]):
        self.params = masters
        self.anchors: list[torch.Tensor] = []
        self.rows: list[tuple[int, int, int]] = []  # (member, first expert, experts) per anchor
        for m, p in enumerate(masters):
            if p is None:
                continue
            ts = _tensors(p)
            for j, t in enumerate(ts):
                self.anchors.append(t)
                self.rows.append((m, 0, t.shape[0]) if len(ts) == 1 and isinstance(p, torch.Tensor) else (m, j, 1))

    def inputs(self) -> list[int]:
        """The anchors that take a gradient (the replica node's inputs)."""
        return [i for i, t in enumerate(self.anchors) if t.requires_grad]

    def frozen(self) -> bool:
        """No master takes a gradient (LoRA, router-only fine-tuning): multicast only."""
        return not self.inputs()


class Step:
    """One (layer, micro-batch) of a :class:`ReplicaManager`; see the module docstring.

    Attributes:
        layer: the layer index.
        vid: the Context's micro-batch slot id.
        result: the planner's :class:`~ultracomm.planners.PlannerResult` (plan, quotas,
            token moves).  On the device-resident path (GPU) the plan lives on the GPU and
            ``result`` is made on first access from host copies: a host synchronisation.
        imbalance: ``(before, after)`` max:mean of the per-rank token loads (from ``result``).
    """

    def __init__(self, manager: "ReplicaManager", layer: int, result: PlannerResult | None,
                 routing_map: torch.Tensor, probs: torch.Tensor | None, vid: int | None, sync: Any, grad: bool,
                 target: "Step | None" = None, resident: dict | None = None):
        self.manager, self.layer, self._result = manager, layer, result
        self.routing_map, self.probs = routing_map, probs
        self.vid, self._sync, self.grad, self._target = vid, sync, grad, target
        self.device = routing_map.device
        # the device-resident path: this step's copies of its loads and plan (device tensors)
        self._resident = resident
        self._tables: dict[str, RerouteTable] = {}
        # The forward's outputs are held weakly (the token strongly only until guard()): their
        # autograd node holds this Step, so strong references back would make a cycle through
        # C++ that Python's gc cannot collect -- a forward without a backward would keep the
        # Step, its manager and Context alive.  Weak, the graph's death is observable.
        self._built = False
        self._plain: list[torch.Tensor] | None = None  # no-grad steps: views without a graph
        self._token: torch.Tensor | None = None
        self._view_refs: list[weakref.ref] = []
        self._node_ref: weakref.ref | None = None
        self._finalizer: weakref.finalize | None = None  # abandons the step if it dies unreduced
        self._staging: int | None = None
        self._restored = False
        self._frozen = False  # every master frozen: no graph to them, nothing to reduce
        self._recomputed = False  # matched to an activation recompute already
        self._inputs: list[int] = []  # the masters (anchor indices) that are the replica node's inputs
        self._released = False  # backward done, abandoned, or manager closed
        self._state = "forward" if grad else "done"

    @property
    def result(self) -> PlannerResult:
        if self._result is None:  # device-resident: host copies of the loads and the plan (a sync)
            snap, mgr = self._resident, self.manager
            info = device_planner.decode_result(snap["result"].cpu())
            self._result = build_result(snap["loads"].cpu().numpy().astype(np.int64), mgr.domain,
                                        snap["slot_src"].cpu().numpy(), snap["slot_quota"].cpu().numpy(), info)
        return self._result

    @property
    def imbalance(self) -> tuple[float, float]:
        res = self.result
        load = np.asarray(res.load)
        epr = res.domain.experts_per_rank
        return max_mean(load.sum(0).reshape(-1, epr).sum(1)), max_mean(res.rank_load)

    # -------------------------------------------------------------- forward
    def rerouted(self, layout: str | None = None, routing_map: torch.Tensor | None = None,
                 probs: torch.Tensor | None = None, source: int | None = None
                 ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """This rank's routing with hot experts' tokens sent to their replicas.

        Args:
            layout: ``"echo"`` (``[T, E + world*K]``: home experts, then global spare
                slots) or ``"physical"`` (``[T, world*(epr+K)]``: per rank its masters,
                then its replica slots); default the manager's.
            routing_map, probs: default the ones passed to ``step``; ``source``: the
                rank whose quotas apply (default this rank).
        Returns:
            bool ``[T, P]`` map and ``[T, P]`` probs (differentiable; ``None`` without probs).
        """
        layout = layout or self.manager.reroute_layout
        if layout not in LAYOUTS:
            raise ValueError(f"ultracomm: layout must be one of {LAYOUTS}, got {layout!r}")
        src = self.manager.rank if source is None else source
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.manager.world:
            raise ValueError(f"ultracomm: rerouted(source={source!r}): source must be a rank in "
                             f"0..{self.manager.world - 1} (default: this rank)")
        key = f"{layout}:{src}"
        table = self._tables.get(key)
        if table is None and self._resident is not None:  # on the GPU, from the plan there (no host sync)
            snap = self._resident
            table = self._tables[key] = RerouteTable.from_plan(
                snap["loads"], snap["slot_src"], snap["slot_quota"], src, self.manager.experts_per_rank, layout)
        elif table is None:
            table = self._tables[key] = RerouteTable.from_result(self.result, src, layout).to(self.device)
        rm = self.routing_map if routing_map is None else routing_map
        pr = self.probs if routing_map is None and probs is None else probs
        return reroute(rm, pr, table)

    def replica_weights(self) -> list[list[torch.Tensor]]:
        """Per layout member, per replica slot of this rank, a ``[*member.shape]`` tensor of the
        member's dtype (FP8 weights and their scales included; a member without a gradient --
        the scales -- is not differentiable, an FP8 member gives its gradient through
        ``main_grad``: see :func:`ultracomm.moe.linear`).

        The forward waits for this step's ``weight_sync``; the tensors alias the slots
        (no copy), so run the expert compute before another layer's ``step`` and wrap its
        output in :meth:`guard`.  Slot ``s`` holds expert ``self.replicas()[s]`` (-1: empty).
        """
        views = self._build()
        if views is None:
            views = self._plain if self._plain is not None else [r() for r in self._view_refs]
            if any(v is None for v in views):
                raise UltracommError(
                    f"ultracomm: layer {self.layer} step (vid {self.vid}): the tensors an earlier replica_weights() "
                    "returned were dropped; call replica_weights() once per step and keep its tensors until guard()")
        M, S = len(self.manager.layout.members), self.manager.slots_per_rank
        return [list(views[m * S:(m + 1) * S]) for m in range(M)]

    def replicas(self) -> list[int]:
        """Expert held by each of this rank's replica slots (-1 = empty); on the device-resident
        path a host copy (a sync)."""
        if self._resident is not None and self._result is None:
            return self._resident["slot_src"][self.manager.rank].tolist()
        return self.result.slot_src[self.manager.rank].tolist()

    def guard(self, x: torch.Tensor) -> torch.Tensor:
        """Identity on the expert output; its backward restores this step's replica
        weights before the expert Dgrad and lets the gradient reduction fire."""
        if not self.grad:
            return x
        self._build()
        token, self._token = self._token, None
        if token is None:
            raise UltracommError(f"ultracomm: layer {self.layer} step (vid {self.vid}): guard() was already called; "
                                 "call it once per step, on the expert output")
        if self._frozen and not x.requires_grad:  # no backward will come through here: done now
            self._finish()
            return x
        return _Guard.apply(x, token, self)

    def wait_grads(self) -> None:
        """Wait for every pending gradient reduction of the manager (see
        :meth:`ReplicaManager.wait_grads`)."""
        self.manager.wait_grads()

    def _build(self) -> list[torch.Tensor] | None:
        """Create the forward's outputs once; returns the views when it created them."""
        if self._released:
            raise UltracommError(f"ultracomm: layer {self.layer} step (vid {self.vid}): its backward is done, it was "
                                 "abandoned, or its manager closed; replica_weights() and guard() belong to its forward")
        if self._built:
            return None
        self._built = True
        if not self.grad:
            self._plain = self._forward_views()
            return self._plain
        layer = self.manager._layers[self.layer]
        if layer.frozen():  # no master takes a gradient: the backward restores (Dgrad) and reduces nothing
            self._frozen = True
            self._plain = self._forward_views()
            self._token = torch.zeros((), dtype=torch.float32, device=self.device)
            return self._plain
        self._inputs = layer.inputs()
        token, *views = _ReplicaWeights.apply(self, *[layer.anchors[i] for i in self._inputs])
        self._token = token
        self._view_refs = [weakref.ref(v) for v in views]
        self._node_ref = weakref.ref(token.grad_fn)
        return views

    def _views(self) -> list[torch.Tensor | None]:
        return [r() for r in self._view_refs]

    def _node(self) -> Any:
        """This step's ``_ReplicaWeights`` autograd node (None before replica_weights/guard,
        or once its graph is freed)."""
        return None if self._node_ref is None else self._node_ref()

    def _forward_views(self) -> list[torch.Tensor]:
        mgr = self.manager
        self._sync.wait_stream()  # stream-ordered: the caller's stream waits, not the host
        owner = self._target or self
        if mgr._slots_owner is not owner:
            raise UltracommError(
                f"ultracomm: layer {self.layer}: the replica slots were overwritten by layer "
                f"{getattr(mgr._slots_owner, 'layer', '?')} after this step's weight_sync; run each layer's "
                "expert compute (replica_weights()) before the next layer's step()")
        return [_alias(t[s]) for t in mgr.ctx.replica_weights for s in range(mgr.slots_per_rank)]

    # -------------------------------------------------------------- backward
    def _backward_restore(self) -> None:
        if self._target is not None:  # a recomputed forward's node: act for the original step
            return self._target._backward_restore()
        mgr = self.manager
        self._check_backward()
        if self._staging is None and not self._frozen:
            self._staging = mgr._acquire_staging()
        S = mgr.slots_per_rank
        staging = mgr._staging[self._staging] if self._staging is not None else None
        for i, t in enumerate(self._views()):  # the fused fp32 wgrad path writes straight into staging
            if t is None or staging is None or staging[i // S] is None:  # dropped, frozen, or no gradient
                continue
            # no grad_added_to_main_grad: a fused wgrad then returns None for the view, an unfused
            # one its gradient, and _backward_reduce adds whichever comes into the same staging
            t.main_grad = staging[i // S][i % S]
        if mgr._slots_owner is not self:
            mgr.ctx.restore(self.vid)
            mgr._slots_owner = self
        self._restored = True
        self._state = "restored"
        if self._frozen:  # the Dgrad needed the weights back; there is nothing to reduce
            self._finish()

    def _finish(self) -> None:
        """A step without a reduction (frozen masters) is over: its micro-batch slot is free."""
        mgr = self.manager
        self._release_graph()
        self._state = "reduced"
        if mgr._live.pop(self.vid, None) is not None and not mgr.ctx.closed:
            mgr.ctx.end(self.vid)

    def _check_backward(self) -> None:
        if self._state == "reduced":
            raise UltracommError(f"ultracomm: layer {self.layer} step (vid {self.vid}) was already reduced; "
                                 "a step supports one backward pass (no retain_graph re-runs)")
        if self._state == "abandoned":
            raise UltracommError(f"ultracomm: layer {self.layer} step (vid {self.vid}) was abandoned "
                                 "(ReplicaManager.abandon() or close()) before its backward; its replica gradients "
                                 "cannot be reduced any more")

    def _release_graph(self) -> None:
        """The forward is over for good: replica_weights()/guard() raise from now on."""
        self._token, self._view_refs, self._plain = None, [], None
        self._released = True
        if self._finalizer is not None:
            self._finalizer.detach()

    def _backward_reduce(self, grads: Sequence[torch.Tensor | None],
                         needs: Sequence[bool]) -> list[torch.Tensor | None]:
        """The replicas' gradients of this step -> ``grad_reduce`` -> per master anchor its
        reduced replica contribution (what ``_ReplicaWeights.backward`` returns)."""
        if self._target is not None:
            self._release_graph()
            return self._target._backward_reduce(grads, needs)
        mgr = self.manager
        self._check_backward()
        if not self._restored and mgr._slots_owner is not self:
            raise UltracommError(
                f"ultracomm: layer {self.layer} (vid {self.vid}): the replica slots were overwritten by layer "
                f"{getattr(mgr._slots_owner, 'layer', '?')} after this step's weight_sync and nothing restored them "
                "before the expert backward, so its gradients used stale weights; wrap the expert output in "
                "step.guard(...)")
        if self._staging is None:
            self._staging = mgr._acquire_staging()
        staging = mgr._staging[self._staging]
        S = mgr.slots_per_rank
        members = mgr.layout.members
        for i, g in enumerate(grads):  # unfused wgrads; fused ones are in the staging already
            if g is None:
                continue
            if members[i // S].fp8:
                raise UltracommError(
                    f"ultracomm: layer {self.layer}: the replica of FP8 member {members[i // S].name!r} got its gradient "
                    f"through autograd, which rounds it to {g.dtype}; accumulate an FP8 weight's gradient in fp32 "
                    "into weight.main_grad instead (ultracomm.moe.linear(x, weight, weight_scale) does)")
            staging[i // S][i % S].add_(g)
        rows = self._reduced_rows()
        mgr._zero_master_staging(rows)
        work = mgr.ctx.grad_reduce(self.vid, async_op=mgr._async_ok(), grads=staging) or _ON_STREAM
        mgr._staging_work[self._staging] = work
        self._release_graph()
        self._state = "reduced"
        mgr._live.pop(self.vid, None)
        # the host waits here; a stream-ordered reduce makes the current stream wait instead,
        # so what is returned below is computed after it (no host synchronisation)
        work.wait_stream()
        return mgr._master_contributions(self.layer, rows, self._inputs, needs)

    def _reduced_rows(self) -> list[int] | None:
        """This rank's expert rows (local index) that have a replica anywhere under this step's
        plan; None on the device-resident path (the plan is on the GPU: every row, no sync)."""
        if self._result is None:
            return None
        mgr = self.manager
        lo = mgr.rank * mgr.experts_per_rank
        experts = {int(e) for e in np.asarray(self._result.plan.slot_src).ravel() if lo <= e < lo + mgr.experts_per_rank}
        return sorted(e - lo for e in experts)


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

    def __init__(self, group: Any, layout: ExpertLayout, experts_per_rank: int, slots_per_rank: int,
                 num_layers: int, max_microbatches: int = 1, *, planner: Any = "device",
                 planner_options: dict | None = None, reroute_layout: str = "echo",
                 node_of: Sequence[int] | None = None, context: Context | None = None, **context_options: Any):
        if reroute_layout not in LAYOUTS:
            raise ValueError(f"ultracomm: reroute_layout must be one of {LAYOUTS}, got {reroute_layout!r}")
        self.ctx = context if context is not None else Context(
            # one micro-batch slot per layer beyond the caller's: the steps that expect no backward
            # (evaluation, no_grad) take it and free it at once, whatever is in flight
            group, layout, experts_per_rank, slots_per_rank, num_layers, max_microbatches + 1, node_of=node_of,
            **context_options)
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
                "thread (as tests/test_gpu_context.py does)")
        self.layout, self.rank, self.world = c.layout, c.rank, c.world
        #: steps whose backward has not run, per layer, at most (the Context has one slot more
        #: when the manager built it)
        self.max_microbatches = max_microbatches if context is None else c.max_microbatches
        self._evaluating = 0
        self.experts_per_rank, self.slots_per_rank, self.num_layers = c.experts_per_rank, c.slots_per_rank, c.num_layers
        self.num_experts = c.num_experts
        self.domain = Domain(self.world, np.asarray(c.node_of, np.int64), self.experts_per_rank)
        if planner == "device" and not device_planner.fits(self.world, self.num_experts, self.slots_per_rank):
            _log.warning("ultracomm: world %d, %d experts, %d slots exceed the device planner's capacities; "
                         "planning with the host planner 'quota'", self.world, self.num_experts, self.slots_per_rank)
            planner = "quota"
        self.planner = get_planner(planner) if isinstance(planner, str) else planner
        self.planner_options = dict(planner_options or {})
        self.reroute_layout = reroute_layout
        self._layers: list[_Layer | None] = [None] * self.num_layers
        self._staging: list[list[torch.Tensor]] = []
        self._master_grads: list[torch.Tensor] = []
        self._staging_work: list[Any] = []
        self._next_staging = 0
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
            if "lanes" in self.planner_options:
                raise ValueError("ultracomm: planner_options lanes is the host build's; the GPU runs a warp per probe")
            return "device"
        return "host"

    def _async_ok(self) -> bool:
        """Whether operations may return a Work: not while the current stream captures a CUDA
        graph (a captured operation has no completion; stream order is what holds it, and
        :data:`_ON_STREAM` stands in for its Work)."""
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
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise RegistrationError(f"ultracomm: layer {layer!r} is out of range 0..{self.num_layers - 1}")
        params = [p if isinstance(p, torch.Tensor) else list(p) for p in params]
        anchors = self._masters_of(params, masters)
        flat = [t for p in params for t in _tensors(p)]
        dev = flat[0].device if flat else torch.device("cpu")
        gd, S = self.layout.grad_dtype, self.slots_per_rank
        if not self._staging:
            # the reduction lands in the manager's fp32 staging, shared by every layer (one reduce
            # at a time returns from it), never in a user tensor: no user pointer is baked into a
            # schedule or a captured graph.  Replica grads: two sets, so a reduce in flight never
            # blocks the next layer's wgrads.  None for a member without a gradient.
            self._master_grads = [torch.zeros((self.experts_per_rank, *m.shape), dtype=gd, device=dev)
                                  if m.grad else None for m in self.layout.members]
            self._staging = [[torch.zeros((S, *m.shape), dtype=gd, device=dev) if m.grad else None
                              for m in self.layout.members] for _ in range(2)]
            self._staging_work = [None, None]
        grads = [g if g is None or isinstance(p, torch.Tensor) else list(g.unbind(0))
                 for p, g in zip(params, self._master_grads)]
        self.ctx.register_masters(layer, [p.detach() if isinstance(p, torch.Tensor) else [t.detach() for t in p]
                                          for p in params], grads)
        self._layers[layer] = _Layer(anchors)

    def _masters_of(self, params: list[Any], masters: Sequence[Any] | None) -> list[Any]:
        """Per member, what its gradient reduces into (see ``register_layer``), checked."""
        members = self.layout.members
        if masters is None:
            fp8 = [m.name for m in members if m.fp8 and m.grad]
            if fp8:
                raise RegistrationError(
                    f"ultracomm: members {fp8} are FP8 runtime copies: pass masters=[...] (per member the "
                    "high-precision master its replicas' gradients reduce into, None for the others)")
            return [p if m.grad else None for m, p in zip(members, params)]
        if isinstance(masters, torch.Tensor) or len(masters) != len(members):
            raise RegistrationError(f"ultracomm: masters must be a list with one entry per member "
                                    f"{list(self.layout.names)} (None where the member needs none)")
        out = []
        for m, p, hp in zip(members, params, masters):
            if hp is None:
                if m.fp8 and m.grad:
                    raise RegistrationError(f"ultracomm: masters[{m.name!r}] is None, but {m.name!r} is an FP8 runtime "
                                            f"copy with a gradient: pass its {m.master_dtype} master")
                out.append(p if m.grad else None)
                continue
            if not m.grad:
                raise RegistrationError(f"ultracomm: masters[{m.name!r}]: member {m.name!r} carries no gradient "
                                        "(grad=False); pass None in its place")
            hp = hp if isinstance(hp, torch.Tensor) else list(hp)
            for i, (t, w) in enumerate(zip(_tensors(hp), _tensors(p))):
                if not isinstance(t, torch.Tensor) or t.shape != w.shape or t.dtype != m.grad_master_dtype \
                        or t.device != w.device or isinstance(hp, torch.Tensor) != isinstance(p, torch.Tensor) \
                        or len(_tensors(hp)) != len(_tensors(p)):
                    raise RegistrationError(
                        f"ultracomm: masters[{m.name!r}]: expected what params[{m.name!r}] is (a stacked tensor or a "
                        f"list of per-expert tensors, shaped {list(w.shape)}, on {w.device}) in "
                        f"{m.grad_master_dtype}; got {_describe(t)}")
            out.append(hp)
        return out

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
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers or self._layers[layer] is None:
            raise RegistrationError(f"ultracomm: layer {layer!r} is not registered; call register_layer first")
        self._check_routing(routing_map, probs)
        self._collect_orphans()
        grad = torch.is_grad_enabled() and not self._evaluating
        if grad and torch._C._current_autograd_node() is not None:
            target = self._recompute_target(layer, routing_map)
            if target is not None:
                return self._recompute(target, routing_map, probs)
        if grad and sum(s.layer == layer for s in self._live_steps()) >= self.max_microbatches:
            raise self._in_flight_error(layer)
        if self.control_plane == "device":
            vid, step = self._step_on_device(layer, routing_map, probs, grad)
        else:
            vid, step = self._step_on_host(layer, routing_map, probs, grad)
        self._slots_owner = step
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
            "forwards inside `with manager.evaluating():`, or create the manager with a larger max_microbatches")

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

    def _step_on_host(self, layer: int, routing_map: torch.Tensor, probs: torch.Tensor | None,
                      grad: bool) -> tuple[int, Step]:
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
            sync = self.ctx.weight_sync(vid, plan, async_op=self._async_ok()) or _ON_STREAM
            return vid, Step(self, layer, result, routing_map, probs, vid, sync, grad)
        except BaseException:
            self.ctx.end(vid)  # nothing of this step survives: its slot is free again
            raise

    def _step_on_device(self, layer: int, routing_map: torch.Tensor, probs: torch.Tensor | None,
                        grad: bool) -> tuple[int, Step]:
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
            sync = self.ctx.weight_sync(vid, plan, async_op=self._async_ok()) or _ON_STREAM
            # the step's own copies (stream-ordered, small): the vid slot's buffers serve its next step
            snap = dict(loads=step_loads, slot_src=out["slot_src"].clone(), slot_quota=out["slot_quota"].clone(),
                        result=out["result"].clone())
            return vid, Step(self, layer, None, routing_map, probs, vid, sync, grad, resident=snap)
        except BaseException:
            self.ctx.end(vid)
            raise

    def _plan_buffers(self, slot: int, loads: torch.Tensor) -> dict:
        """The device planner's output buffers of vid slot ``slot`` (allocated at its first step;
        reused after, so a captured graph writes the same memory at every replay)."""
        out = self._plan_bufs.get(slot)
        if out is None:
            out = self._plan_bufs[slot] = device_planner.plan_on_gpu(loads, self.domain, self.slots_per_rank,
                                                                         **self.planner_options)
        return out

    def _check_routing(self, routing_map: Any, probs: Any) -> None:
        """Everything ``step`` needs of its inputs, checked before it takes a slot."""
        E = self.num_experts
        if not isinstance(routing_map, torch.Tensor) or routing_map.dtype != torch.bool or routing_map.dim() != 2 \
                or routing_map.shape[1] != E:
            raise ValueError(f"ultracomm: routing_map must be a bool [tokens, {E}] tensor, got "
                             f"{_describe(routing_map)}")
        if probs is None:
            return
        if not isinstance(probs, torch.Tensor) or not probs.is_floating_point() \
                or tuple(probs.shape) != tuple(routing_map.shape):
            raise ValueError(f"ultracomm: probs must be a floating-point [tokens, {E}] tensor shaped like "
                             f"routing_map {list(routing_map.shape)} (or None), got {_describe(probs)}")
        if probs.device != routing_map.device:
            raise ValueError(f"ultracomm: probs is on {probs.device} but routing_map on {routing_map.device}; "
                             "pass both on the same device")

    # -------------------------------------------------------------- abandoned steps
    @property
    def _slots_owner(self) -> "Step | None":
        """The step whose replicas the slots hold now (held weakly: see Step._build)."""
        return None if self._owner_ref is None else self._owner_ref()

    @_slots_owner.setter
    def _slots_owner(self, step: "Step | None") -> None:
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

    def _recompute_target(self, layer: int, routing_map: torch.Tensor) -> Step | None:
        """The live step whose forward this call recomputes (non-reentrant checkpointing), or
        None (a reentrant recompute: its first forward ran under no_grad and left no step).

        With several micro-batches of ``layer`` in flight the one being recomputed is the one
        whose graph the running backward pass executes -- not the oldest: pipeline schedules
        run backwards in any order (F0 F1 B1 B0)."""
        live = [s for s in self._live_steps() if s.layer == layer]
        if not live:
            return None
        hits = [s for s in live if _will_execute(s._node())]
        # the routing first: a layer applied twice in one checkpointed block has two steps the
        # backward executes, and the recompute replays both calls in their order -- every rank
        # picks the same one this way (a restore it triggers is collective)
        same = [s for s in hits if torch.equal(s.routing_map, routing_map)]
        if not same:  # a step without replica weights/guard (no node): match by routing
            same = [s for s in live if s._node() is None and torch.equal(s.routing_map, routing_map)]
        if not same:
            if hits:
                raise UltracommError(
                    f"ultracomm: layer {layer}: the recomputed routing differs from the forward's; activation "
                    "recompute needs a deterministic router (same inputs, same routing)")
            return None
        if len(same) > 1:  # the same routing twice: the first not yet recomputed, nearest in the graph
            fresh = [s for s in same if not s._recomputed] or same
            same = _nearest_in_graph(torch._C._current_autograd_node(), fresh) or fresh
        target = same[0]
        target._recomputed = True
        return target

    def _recompute(self, target: Step, routing_map: torch.Tensor, probs: torch.Tensor | None) -> Step:
        # the slots may still hold the target (every rank decides alike: same calls, same owner)
        sync = target._sync if self._slots_owner is target else \
            self.ctx.restore(target.vid, async_op=self._async_ok()) or _ON_STREAM
        self._slots_owner = target
        return Step(self, target.layer, target._result, routing_map, probs, target.vid, sync, True, target=target,
                    resident=target._resident)

    # -------------------------------------------------------------- gradients
    def _acquire_staging(self) -> int:
        i = self._next_staging
        self._next_staging ^= 1
        work = self._staging_work[i]
        if work is not None:  # its reduce copies out of it: the zero_() below must come after
            work.wait_stream()
            self._staging_work[i] = None
        for t in self._staging[i]:
            if t is not None:
                t.zero_()
        return i

    def _zero_master_staging(self, rows: list[int] | None) -> None:
        """Zero the rows the next reduction adds into (every row where the plan is on the GPU)."""
        for g in self._master_grads:
            if g is None:
                continue
            if rows is None:
                g.zero_()
            else:
                for j in rows:
                    g[j].zero_()

    def _master_contributions(self, layer: int, rows: list[int] | None, inputs: Sequence[int],
                              needs: Sequence[bool]) -> list[torch.Tensor | None]:
        """Per master anchor of ``layer``, from the staging a reduction just filled: its reduced
        replica contribution as an autograd gradient in the master's dtype (None where no expert
        of it has a replica, or it takes no gradient); or, where the master has a ``main_grad``
        now, the contribution added into it and what Megatron's fused path returns instead."""
        out: list[torch.Tensor | None] = []
        L = self._layers[layer]
        for i, need in zip(inputs, needs):
            t, (m, j0, n) = L.anchors[i], L.rows[i]
            mine = list(range(n)) if rows is None else [j - j0 for j in rows if j0 <= j < j0 + n]
            if not need or not mine:
                out.append(None)
                continue
            src = self._master_grads[m][j0:j0 + n].view(t.shape)  # a per-expert anchor: n == 1
            main_grad = getattr(t, "main_grad", None)
            if main_grad is not None:
                if len(mine) == n:
                    main_grad.add_(src)
                else:
                    for k in mine:
                        main_grad[k].add_(src[k])
                # the flag is left alone: DDP resets it once per iteration, so setting it here would
                # drop an unfused home .grad of the next micro-batch
                out.append(fused_wgrad_return(t, mark=False))
            elif len(mine) == n:
                out.append(src.to(t.dtype, copy=True))
            else:  # rows without a replica: zeros (the staging there holds another layer's sums)
                g = torch.zeros(t.shape, dtype=t.dtype, device=t.device)
                for k in mine:
                    g[k].copy_(src[k])
                out.append(g)
        return out

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
