"""``Step``: one (layer, micro-batch) of a :class:`~ultracomm.moe.manager.ReplicaManager`.

What a MoE layer's forward holds between ``manager.step(...)`` and its backward: the plan (or,
on the GPU, the device copies of it), the rerouted routing, the replica weights (outputs of the
``_ReplicaWeights`` autograd node) and the guard; its backward restores the slots, folds the
replicas' gradients into the manager's staging, reduces them and returns each master's share
(:mod:`ultracomm.moe.autograd`).
"""

from __future__ import annotations

import weakref
from typing import TYPE_CHECKING, Any, Sequence

import numpy as np
import torch

from ..errors import InputError, UltracommError
from ..planners import PlannerResult, max_mean
from ..planners import device as device_planner
from ..planners.base import build_result
from .autograd import _Guard, _ReplicaWeights
from .reroute import LAYOUTS, RerouteTable, reroute

if TYPE_CHECKING:  # pragma: no cover
    from .manager import ReplicaManager

__all__ = ["Step", "ON_STREAM"]


class _OnStream:
    """The Work of an operation enqueued on the caller's stream without one (during CUDA graph
    capture): later work on that stream is ordered after it already."""

    def wait_stream(self) -> None:
        pass

    def wait(self, timeout: float | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


ON_STREAM = _OnStream()


def _alias(t: torch.Tensor) -> torch.Tensor:
    """``t``'s memory as a tensor with its own version counter: autograd saves replica weights
    for the Dgrad, and writes into other views of the window (the grad slots) must not count
    as modifying them."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(
        t.untyped_storage(), t.storage_offset(), t.shape, t.stride()
    )


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

    def __init__(
        self,
        manager: "ReplicaManager",
        layer: int,
        result: PlannerResult | None,
        routing_map: torch.Tensor,
        probs: torch.Tensor | None,
        vid: int | None,
        sync: Any,
        grad: bool,
        target: "Step | None" = None,
        resident: dict | None = None,
    ):
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
        self._guard_ref: weakref.ref | None = None  # the guard's node (recompute: a pass that runs no reduce)
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
            self._result = build_result(
                snap["loads"].cpu().numpy().astype(np.int64),
                mgr.domain,
                snap["slot_src"].cpu().numpy(),
                snap["slot_quota"].cpu().numpy(),
                info,
            )
        return self._result

    @property
    def imbalance(self) -> tuple[float, float]:
        res = self.result
        load = np.asarray(res.load)
        epr = res.domain.experts_per_rank
        return max_mean(load.sum(0).reshape(-1, epr).sum(1)), max_mean(res.rank_load)

    # -------------------------------------------------------------- forward
    def rerouted(
        self,
        layout: str | None = None,
        routing_map: torch.Tensor | None = None,
        probs: torch.Tensor | None = None,
        source: int | None = None,
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
            raise InputError(f"ultracomm: layout must be one of {LAYOUTS}, got {layout!r}")
        src = self.manager.rank if source is None else source
        if isinstance(src, bool) or not isinstance(src, int) or not 0 <= src < self.manager.world:
            raise InputError(
                f"ultracomm: rerouted(source={source!r}): source must be a rank in "
                f"0..{self.manager.world - 1} (default: this rank)"
            )
        key = f"{layout}:{src}"
        table = self._tables.get(key)
        if table is None and self._resident is not None:  # on the GPU, from the plan there (no host sync)
            snap = self._resident
            table = self._tables[key] = RerouteTable.from_plan(
                snap["loads"], snap["slot_src"], snap["slot_quota"], src, self.manager.experts_per_rank, layout
            )
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
                    "returned were dropped; call replica_weights() once per step and keep its tensors until guard()"
                )
        M, S = len(self.manager.layout.members), self.manager.slots_per_rank
        return [list(views[m * S : (m + 1) * S]) for m in range(M)]

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
            raise UltracommError(
                f"ultracomm: layer {self.layer} step (vid {self.vid}): guard() was already called; "
                "call it once per step, on the expert output"
            )
        if self._frozen and not x.requires_grad:  # no backward will come through here: done now
            self._finish()
            return x
        out = _Guard.apply(x, token, self)
        self._guard_ref = None if out.grad_fn is None else weakref.ref(out.grad_fn)
        return out

    def wait_grads(self) -> None:
        """Wait for every pending gradient reduction of the manager (see
        :meth:`ReplicaManager.wait_grads`)."""
        self.manager.wait_grads()

    def _build(self) -> list[torch.Tensor] | None:
        """Create the forward's outputs once; returns the views when it created them."""
        if self._released:
            raise UltracommError(
                f"ultracomm: layer {self.layer} step (vid {self.vid}): its backward is done, it was "
                "abandoned, or its manager closed; replica_weights() and guard() belong to its forward"
            )
        if self._built:
            return None
        self._built = True
        if not self.grad:
            self._plain = self._forward_views()
            return self._plain
        layer = self.manager.layers[self.layer]
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

    def _guard_node(self) -> Any:
        """This step's ``_Guard`` autograd node (None before guard(), or once its graph is freed)."""
        return None if self._guard_ref is None else self._guard_ref()

    def _forward_views(self) -> list[torch.Tensor]:
        mgr = self.manager
        self._sync.wait_stream()  # stream-ordered: the caller's stream waits, not the host
        owner = self._target or self
        if mgr.slots_owner is not owner:
            raise UltracommError(
                f"ultracomm: layer {self.layer}: the replica slots were overwritten by layer "
                f"{getattr(mgr.slots_owner, 'layer', '?')} after this step's weight_sync; run each layer's "
                "expert compute (replica_weights()) before the next layer's step()"
            )
        return [_alias(t[s]) for t in mgr.ctx.replica_weights for s in range(mgr.slots_per_rank)]

    # -------------------------------------------------------------- backward
    def _backward_restore(self) -> None:
        if self._target is not None:  # a recomputed forward's node: act for the original step
            return self._target._backward_restore()
        mgr = self.manager
        self._check_backward()
        # The staging is bound only by the pass that runs the reduce: a pass that does not (an
        # input-gradient pass, autograd.grad(loss, [x]) with retain_graph, before the weight pass
        # of a zero-bubble schedule) needs the weights back for the Dgrad and no wgrad; binding a
        # staging set there would hold it across the other steps' passes until the weight pass
        # (there are two sets: a third step would zero and share it).
        node = self._node()
        reduces = not self._frozen and node is not None and torch._C._will_engine_execute_node(node)
        if self._staging is None and reduces:
            self._staging = mgr.grads.acquire()
        S = mgr.slots_per_rank
        staging = mgr.grads.replica[self._staging] if reduces else None
        for i, t in enumerate(self._views()):  # the fused fp32 wgrad path writes straight into staging
            if t is None or staging is None or staging[i // S] is None:  # dropped, frozen, or no gradient
                continue
            # no grad_added_to_main_grad: a fused wgrad then returns None for the view, an unfused
            # one its gradient, and _backward_reduce adds whichever comes into the same staging
            t.main_grad = staging[i // S][i % S]
        if mgr.slots_owner is not self:
            mgr.ctx.restore(self.vid)
            mgr.slots_owner = self
        self._restored = True
        self._state = "restored"
        if self._frozen:  # the Dgrad needed the weights back; there is nothing to reduce
            self._finish()

    def _finish(self) -> None:
        """A step without a reduction (frozen masters) is over: its micro-batch slot is free."""
        mgr = self.manager
        self._release_graph()
        self._state = "reduced"
        if mgr.retire(self.vid) and not mgr.ctx.closed:
            mgr.ctx.end(self.vid)

    def _check_backward(self) -> None:
        if self._state == "reduced":
            # A second pass that reaches the layer's masters: the reduce ran in the first, so this one
            # would get no replica gradient (or, re-run, count them twice).  torch.distributed.pipelining's
            # weight pass (stage_backward_weight, one autograd.grad per parameter group) does this where
            # its get_param_groups left a master in two groups (a parameter whose graph nodes are partly
            # shared with another's -- every master shares the layer's replica node -- stays in the group
            # it was first put in when that group is merged into another; plain torch fails there too).
            raise UltracommError(
                f"ultracomm: layer {self.layer} step (vid {self.vid}) was already reduced; a step supports one "
                "backward pass that reaches its masters (no retain_graph re-runs; a weight pass split into "
                "several backward calls must ask for all masters of a MoE layer in one of them).  Under "
                "torch.distributed.pipelining's split backward (stage_backward_input / stage_backward_weight) "
                "this is torch's get_param_groups leaving a parameter in two groups, which would also count "
                "its own gradient twice: merge the groups that share a parameter or an intermediate before "
                "stage_backward_weight, or use a schedule whose backward is one call (GPipe, 1F1B, Interleaved1F1B)"
            )
        if self._state == "abandoned":
            raise UltracommError(
                f"ultracomm: layer {self.layer} step (vid {self.vid}) was abandoned "
                "(ReplicaManager.abandon() or close()) before its backward; its replica gradients "
                "cannot be reduced any more"
            )

    def _release_graph(self) -> None:
        """The forward is over for good: replica_weights()/guard() raise from now on."""
        self._token, self._view_refs, self._plain = None, [], None
        self._released = True
        if self._finalizer is not None:
            self._finalizer.detach()

    def _backward_reduce(
        self, grads: Sequence[torch.Tensor | None], needs: Sequence[bool]
    ) -> list[torch.Tensor | None]:
        """The replicas' gradients of this step -> ``grad_reduce`` -> per master anchor its
        reduced replica contribution (what ``_ReplicaWeights.backward`` returns)."""
        if self._target is not None:
            self._release_graph()
            return self._target._backward_reduce(grads, needs)
        mgr = self.manager
        self._check_backward()
        if not self._restored and mgr.slots_owner is not self:
            raise UltracommError(
                f"ultracomm: layer {self.layer} (vid {self.vid}): the replica slots were overwritten by layer "
                f"{getattr(mgr.slots_owner, 'layer', '?')} after this step's weight_sync and nothing restored them "
                "before the expert backward, so its gradients used stale weights; wrap the expert output in "
                "step.guard(...)"
            )
        if self._staging is None:
            self._staging = mgr.grads.acquire()
        staging = mgr.grads.replica[self._staging]
        S = mgr.slots_per_rank
        members = mgr.layout.members
        for i, g in enumerate(grads):  # unfused wgrads; fused ones are in the staging already
            if g is None:
                continue
            if members[i // S].fp8:
                raise UltracommError(
                    f"ultracomm: layer {self.layer}: the replica of FP8 member {members[i // S].name!r} got its gradient "
                    f"through autograd, which rounds it to {g.dtype}; accumulate an FP8 weight's gradient in fp32 "
                    "into weight.main_grad instead (ultracomm.moe.linear(x, weight, weight_scale) does)"
                )
            staging[i // S][i % S].add_(g)
        rows = self._reduced_rows()
        mgr.grads.zero_master(rows)
        work = mgr.ctx.grad_reduce(self.vid, async_op=mgr.async_ok(), grads=staging) or ON_STREAM
        mgr.grads.work[self._staging] = work
        self._release_graph()
        self._state = "reduced"
        mgr.retire(self.vid)
        # the host waits here; a stream-ordered reduce makes the current stream wait instead,
        # so what is returned below is computed after it (no host synchronisation)
        work.wait_stream()
        return mgr.grads.contributions(mgr.layers[self.layer], rows, self._inputs, needs)

    def _reduced_rows(self) -> list[int] | None:
        """This rank's expert rows (local index) that have a replica anywhere under this step's
        plan; None on the device-resident path (the plan is on the GPU: every row, no sync)."""
        if self._result is None:
            return None
        mgr = self.manager
        lo = mgr.rank * mgr.experts_per_rank
        experts = {
            int(e) for e in np.asarray(self._result.plan.slot_src).ravel() if lo <= e < lo + mgr.experts_per_rank
        }
        return sorted(e - lo for e in experts)
