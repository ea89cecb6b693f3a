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
replica weights' node folds their gradients into fp32 staging and launches ``grad_reduce``,
and at the end of the backward pass the reduced gradients are in ``main_grad`` (parameters
that have one, as in Megatron) or added into ``.grad``.  See :mod:`ultracomm.moe.autograd`
for why every rank reaches every collective, also with no token on its replicas.
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..context import Context
from ..errors import RegistrationError, UltracommError
from ..layout import ExpertLayout
from ..planners import Domain, PlannerResult, get_planner, max_mean
from .autograd import _Guard, _ReplicaWeights
from .loads import gather_loads
from .reroute import LAYOUTS, RerouteTable, reroute

__all__ = ["ReplicaManager", "Step"]


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor with its own version counter: autograd saves replica weights
    for the Dgrad, and writes into other views of the window (the grad slots) must not count
    as modifying them."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


def _tensors(member: Any) -> list[torch.Tensor]:
    return [member] if isinstance(member, torch.Tensor) else list(member)


class _Layer:
    """A registered layer: its master parameters and where their reduced grads go."""

    def __init__(self, params: list[Any], grads: list[Any], fold: bool):
        self.params, self.grads, self.fold = params, grads, fold
        self.anchors = [t for p in params for t in _tensors(p)]

    def fold_into_grad(self) -> None:
        """``.grad`` mode: add the reduced replica contributions into ``.grad``, then clear."""
        for p, acc in zip(self.params, self.grads):
            for t, a in zip(_tensors(p), _tensors(acc)):
                if t.requires_grad:
                    g = a.to(t.dtype)
                    t.grad = g if t.grad is None else t.grad.add_(g)
                a.zero_()


class Step:
    """One (layer, micro-batch) of a :class:`ReplicaManager`; see the module docstring.

    Attributes:
        layer: the layer index.
        vid: the Context's micro-batch slot id.
        result: the planner's :class:`~ultracomm.planners.PlannerResult` (plan, quotas,
            token moves).
        imbalance: ``(before, after)`` max:mean of the per-rank token loads.
    """

    def __init__(self, manager: "ReplicaManager", layer: int, result: PlannerResult, routing_map: torch.Tensor,
                 probs: torch.Tensor | None, vid: int | None, sync: Any, grad: bool, target: "Step | None" = None):
        self.manager, self.layer, self.result = manager, layer, result
        self.routing_map, self.probs = routing_map, probs
        self.vid, self._sync, self.grad, self._target = vid, sync, grad, target
        self.device = routing_map.device
        load = np.asarray(result.load)
        epr = result.domain.experts_per_rank
        self.imbalance = (max_mean(load.sum(0).reshape(-1, epr).sum(1)), max_mean(result.rank_load))
        self._tables: dict[str, RerouteTable] = {}
        self._outputs: tuple[torch.Tensor, ...] | None = None
        self._views: list[torch.Tensor] = []
        self._staging: int | None = None
        self._restored = False
        self._released = False  # _release_graph ran: the forward's outputs are gone
        self._state = "forward" if grad else "done"

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
        key = f"{layout}:{src}"
        table = self._tables.get(key)
        if table is None:
            table = self._tables[key] = RerouteTable.from_result(self.result, src, layout).to(self.device)
        rm = self.routing_map if routing_map is None else routing_map
        pr = self.probs if routing_map is None and probs is None else probs
        return reroute(rm, pr, table)

    def replica_weights(self) -> list[list[torch.Tensor]]:
        """Per layout member, per replica slot of this rank, a ``[*member.shape]`` tensor.

        The forward waits for this step's ``weight_sync``; the tensors alias the slots
        (no copy), so run the expert compute before another layer's ``step`` and wrap its
        output in :meth:`guard`.  Slot ``s`` holds expert ``self.replicas()[s]`` (-1: empty).
        """
        self._build()
        M, S = len(self.manager.layout.members), self.manager.slots_per_rank
        return [list(self._outputs[1 + m * S:1 + (m + 1) * S]) for m in range(M)]

    def replicas(self) -> list[int]:
        """Expert held by each of this rank's replica slots (-1 = empty)."""
        return self.result.slot_src[self.manager.rank].tolist()

    def guard(self, x: torch.Tensor) -> torch.Tensor:
        """Identity on the expert output; its backward restores this step's replica
        weights before the expert Dgrad and lets the gradient reduction fire."""
        if not self.grad:
            return x
        self._build()
        return _Guard.apply(x, self._outputs[0], self)

    def wait_grads(self) -> None:
        """Wait for every pending gradient reduction of the manager (see
        :meth:`ReplicaManager.wait_grads`)."""
        self.manager.wait_grads()

    def _build(self) -> None:
        if self._outputs is not None:
            return
        if self._released:
            raise UltracommError(f"ultracomm: layer {self.layer} step (vid {self.vid}): its backward is done (or its "
                                 "manager closed); replica_weights() and guard() belong to its forward")
        if not self.grad:
            self._outputs = (torch.zeros(()), *self._forward_views())
            return
        layer = self.manager._layers[self.layer]
        self._outputs = _ReplicaWeights.apply(self, *layer.anchors)
        self._views = list(self._outputs[1:])

    def _forward_views(self) -> list[torch.Tensor]:
        mgr = self.manager
        self._sync.wait()
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
        if self._state == "reduced":
            raise UltracommError(f"ultracomm: layer {self.layer} step (vid {self.vid}) was already reduced; "
                                 "a step supports one backward pass (no retain_graph re-runs)")
        if self._staging is None:
            self._staging = mgr._acquire_staging()
        staging = mgr._staging[self._staging]
        S = mgr.slots_per_rank
        for i, t in enumerate(self._views):  # the fused fp32 wgrad path writes straight into staging
            t.main_grad = staging[i // S][i % S]
            t.grad_added_to_main_grad = False
        if mgr._slots_owner is not self:
            mgr.ctx.restore(self.vid)
            mgr._slots_owner = self
        self._restored = True
        self._state = "restored"

    def _release_graph(self) -> None:
        """Drop the forward's outputs: their grad_fn holds this Step (``ctx.step``), a cycle
        through the C++ autograd graph that Python's gc cannot collect -- it kept every Step,
        its manager and Context (and so the process group) alive."""
        self._outputs, self._views = None, []
        self._released = True

    def _backward_reduce(self, grads: Sequence[torch.Tensor]) -> None:
        if self._target is not None:
            self._release_graph()
            return self._target._backward_reduce(grads)
        mgr = self.manager
        if self._state == "reduced":
            raise UltracommError(f"ultracomm: layer {self.layer} step (vid {self.vid}) was already reduced; "
                                 "a step supports one backward pass (no retain_graph re-runs)")
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
        for i, (t, g) in enumerate(zip(self._views, grads)):
            if getattr(t, "grad_added_to_main_grad", False) or g is None:
                continue
            staging[i // S][i % S].add_(g)
        work = mgr.ctx.grad_reduce(self.vid, async_op=True, grads=staging)
        mgr._staging_work[self._staging] = work
        self._release_graph()
        self._state = "reduced"
        mgr._pending.append((self, work))
        if not mgr._callback_queued:
            mgr._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(mgr._end_of_backward)


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
        planner: ``quota`` | ``taot`` | ``greedy`` | ``lpt`` or a callable with the
            planners' signature; ``planner_options`` go to it.
        reroute_layout: default layout of :meth:`Step.rerouted` (``echo`` or ``physical``).
        node_of: node of each rank (planners' topology and the schedule's tiers).
        context: an existing Context to use instead of building one.
        context_options: further ``Context`` keywords (``timeout_s``, ``relay_mode``, ...).
    """

    def __init__(self, group: Any, layout: ExpertLayout, experts_per_rank: int, slots_per_rank: int,
                 num_layers: int, max_microbatches: int = 1, *, planner: Any = "quota",
                 planner_options: dict | None = None, reroute_layout: str = "echo",
                 node_of: Sequence[int] | None = None, context: Context | None = None, **context_options: Any):
        if reroute_layout not in LAYOUTS:
            raise ValueError(f"ultracomm: reroute_layout must be one of {LAYOUTS}, got {reroute_layout!r}")
        self.ctx = context if context is not None else Context(
            group, layout, experts_per_rank, slots_per_rank, num_layers, max_microbatches, node_of=node_of,
            **context_options)
        c = self.ctx
        self.layout, self.rank, self.world = c.layout, c.rank, c.world
        self.experts_per_rank, self.slots_per_rank, self.num_layers = c.experts_per_rank, c.slots_per_rank, c.num_layers
        self.num_experts = c.num_experts
        self.domain = Domain(self.world, np.asarray(c.node_of, np.int64), self.experts_per_rank)
        self.planner = get_planner(planner) if isinstance(planner, str) else planner
        self.planner_options = dict(planner_options or {})
        self.reroute_layout = reroute_layout
        self._layers: list[_Layer | None] = [None] * self.num_layers
        self._staging: list[list[torch.Tensor]] = []
        self._staging_work: list[Any] = []
        self._next_staging = 0
        self._slots_owner: Step | None = None
        self._live: list[Step] = []
        self._pending: list[tuple[Step, Any]] = []
        self._callback_queued = False

    # -------------------------------------------------------------- setup
    def register_layer(self, layer: int, params: Sequence[Any]) -> None:
        """Register layer ``layer``'s master experts on this rank.

        Args:
            params: one entry per layout member: a stacked ``[experts_per_rank, *shape]``
                tensor (e.g. an ``nn.Parameter``) or a list of ``experts_per_rank``
                per-expert ``[*shape]`` tensors (Megatron's ``weight0..N``).
        If every tensor has a ``main_grad`` (Megatron), reduced replica gradients are
        added there; otherwise the manager keeps an fp32 buffer per member and adds it into
        ``.grad`` at the end of each backward pass.
        """
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise RegistrationError(f"ultracomm: layer {layer!r} is out of range 0..{self.num_layers - 1}")
        params = [p if isinstance(p, torch.Tensor) else list(p) for p in params]
        flat = [t for p in params for t in _tensors(p)]
        if flat and all(getattr(t, "main_grad", None) is not None for t in flat):
            grads = [p.main_grad if isinstance(p, torch.Tensor) else [t.main_grad for t in p] for p in params]
            fold = False
        else:
            gd = self.layout.grad_dtype
            grads = [torch.zeros(p.shape, dtype=gd, device=p.device) if isinstance(p, torch.Tensor)
                     else [torch.zeros(t.shape, dtype=gd, device=t.device) for t in p] for p in params]
            fold = True
        self.ctx.register_masters(layer, [p.detach() if isinstance(p, torch.Tensor) else [t.detach() for t in p]
                                          for p in params], grads)
        self._layers[layer] = _Layer(params, grads, fold)
        if not self._staging:  # two fp32 staging sets: a reduce in flight never blocks the next layer's wgrads
            dev = flat[0].device if flat else torch.device("cpu")
            gd = self.layout.grad_dtype
            S = self.slots_per_rank
            self._staging = [[torch.zeros((S, *m.shape), dtype=gd, device=dev) for m in self.layout.members]
                             for _ in range(2)]
            self._staging_work = [None, None]

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
        if routing_map.dtype != torch.bool or tuple(routing_map.shape[1:]) != (self.num_experts,):
            raise ValueError(f"ultracomm: routing_map must be bool [tokens, {self.num_experts}], got "
                             f"{routing_map.dtype} {list(routing_map.shape)}")
        grad = torch.is_grad_enabled()
        if grad and torch._C._current_autograd_node() is not None:
            target = self._recompute_target(layer, routing_map)
            if target is not None:
                return self._recompute(target, routing_map, probs)
        load = gather_loads(self.ctx.comm, routing_map.sum(0), op=f"step(layer {layer})")
        result = self.planner(load, self.domain, self.slots_per_rank, **self.planner_options)
        if self.ctx._profiler is not None:  # the loads the balancer saw, beside the ops' plan/stats/times
            self.ctx._profiler.record(layer, load=load, plan=result)
        vid = self.ctx.begin(layer)
        sync = self.ctx.weight_sync(vid, result.plan, async_op=True)
        step = Step(self, layer, result, routing_map, probs, vid, sync, grad)
        self._slots_owner = step
        if grad:
            self._live.append(step)
        else:
            self.ctx.end(vid)  # no backward will restore or reduce it
        return step

    def _recompute_target(self, layer: int, routing_map: torch.Tensor) -> Step | None:
        # non-reentrant checkpointing: the forward's step is alive and not reduced; pipeline
        # schedules run backward in forward order per layer, so the oldest one is recomputed
        for s in self._live:
            if s.layer == layer and s._state != "reduced":
                if not torch.equal(s.routing_map, routing_map):
                    raise UltracommError(
                        f"ultracomm: layer {layer}: the recomputed routing differs from the forward's; activation "
                        "recompute needs a deterministic router (same inputs, same routing)")
                return s
        return None

    def _recompute(self, target: Step, routing_map: torch.Tensor, probs: torch.Tensor | None) -> Step:
        # the slots may still hold the target (every rank decides alike: same calls, same owner)
        sync = target._sync if self._slots_owner is target else self.ctx.restore(target.vid, async_op=True)
        self._slots_owner = target
        return Step(self, target.layer, target.result, routing_map, probs, target.vid, sync, True, target=target)

    # -------------------------------------------------------------- gradients
    def _acquire_staging(self) -> int:
        i = self._next_staging
        self._next_staging ^= 1
        work = self._staging_work[i]
        if work is not None:  # its reduce copies out of it inside the ordered runner
            work.wait()
            self._staging_work[i] = None
        for t in self._staging[i]:
            t.zero_()
        return i

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.wait_grads()

    def wait_grads(self) -> None:
        """Wait for every launched gradient reduction and put the results in place
        (``main_grad`` is written by the reduction itself; ``.grad`` gets the fp32 sum
        added).  Runs by itself at the end of each backward pass."""
        pending, self._pending = self._pending, []
        for step, work in pending:  # all of them first: a layer's fp32 buffer may take several
            work.wait()
            if self._staging_work[step._staging] is work:
                self._staging_work[step._staging] = None
            if step in self._live:
                self._live.remove(step)
        for layer in sorted({step.layer for step, _ in pending}):
            if self._layers[layer].fold:
                self._layers[layer].fold_into_grad()

    def close(self) -> None:
        """Wait for pending work and close the Context."""
        self.wait_grads()
        for step in self._live:  # forwards whose backward never ran
            step._release_graph()
        self._live.clear()
        self.ctx.close()
