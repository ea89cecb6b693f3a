"""Megatron MoE ECHO over ultracomm: the planner and the expert-weight dispatcher.

ECHO (NVIDIA/Megatron-LM PR #2368, ``megatron/core/transformer/moe/``) clones hot experts
into spare slots each step.  Its two seams, with the same names and shapes:

* :func:`gen_offloading_plan` (``offloading_planner.gen_offloading_plan``), from
  :mod:`ultracomm.integrations.echo_planner`: upstream's algorithms, arguments and column
  order (per rank its home experts, then its spares), or an ultracomm planner by name.
* :class:`EchoExpertDispatcher`, the dispatcher duck type: ``preprocess(expert_offloading_map)
  -> metadata`` and ``expert_dispatch(metadata, *expert_weights) -> list[Tensor]`` (one
  tensor per local spare slot), called once for fc1's and once for fc2's per-expert
  weights.  ECHO's all-to-all version stacks the local experts, ``index_select``s one row
  per spare and calls ``all_to_all_single``; this one multicasts through ultracomm's relay
  trees and, in the backward pass, reduces the spare slots' gradients deterministically
  into the home experts' ``main_grad`` (setting ``grad_added_to_main_grad`` where the
  parameter has it, as Megatron's fused wgrad path does) or, for parameters without
  ``main_grad``, into ``.grad`` at the end of the backward pass.

Before/after in Megatron's MoE layer::

    dispatcher = AllToAllExpertWeightDispatcher(config, ep_group, num_experts, num_spare)
    dispatcher = EchoExpertDispatcher(config, ep_group, num_experts, num_spare)   # after

Like ECHO's, the returned spare weights are fresh tensors (copies of the slots), so no
restore is needed before the Dgrad; build every layer's dispatcher before the first forward
(their Contexts are shared by all layers, one per weight shape).
"""
from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..context import Context
from ..layout import ExpertLayout, Member
from ..plan import ReplicaPlan
from .echo_planner import gen_offloading_plan

__all__ = ["gen_offloading_plan", "EchoExpertDispatcher", "EchoDispatchMetadata", "close_dispatchers"]


@dataclass
class EchoDispatchMetadata:
    """What ``preprocess`` derives from ``expert_offloading_map``: the ultracomm plan and, per
    weight shape dispatched, the micro-batch slot that holds it until the backward."""

    expert_offloading_map: torch.Tensor
    plan: ReplicaPlan
    local_spare_home_indices: list[int]
    vids: dict[Any, int]


class _Pool:
    """One Context per (EP group, weight shape, dtype), shared by every layer's dispatcher."""

    def __init__(self) -> None:
        self.dispatchers: list["EchoExpertDispatcher"] = []
        self.members: dict[Any, "_Member"] = {}


_POOLS: "weakref.WeakKeyDictionary[Any, _Pool]" = weakref.WeakKeyDictionary()
_DEFAULT_GROUP_POOL: dict[str, _Pool] = {}  # ep_group=None: the default process group


def close_dispatchers(ep_group: Any) -> None:
    """Close the Contexts shared by ``ep_group``'s dispatchers and forget them (end of training;
    dispatchers built afterwards start a new pool)."""
    pool = _DEFAULT_GROUP_POOL.pop("default", None) if ep_group is None else _POOLS.pop(ep_group, None)
    for member in (pool.members.values() if pool else ()):
        member.ctx.close()


def _pool_of(ep_group: Any) -> _Pool:
    if ep_group is None:
        return _DEFAULT_GROUP_POOL.setdefault("default", _Pool())
    pool = _POOLS.get(ep_group)
    if pool is None:
        pool = _POOLS[ep_group] = _Pool()
    return pool


class _Member:
    def __init__(self, ctx: Context, device: torch.device):
        self.ctx = ctx
        S = ctx.slots_per_rank
        m = ctx.layout.members[0]
        self.staging = [torch.zeros((S, *m.shape), dtype=ctx.layout.grad_dtype, device=device) for _ in range(2)]
        self.staging_work: list[Any] = [None, None]
        self.next = 0
        self.registered: dict[int, tuple] = {}

    def acquire_staging(self) -> int:
        i, self.next = self.next, self.next ^ 1
        if self.staging_work[i] is not None:
            self.staging_work[i].wait()
            self.staging_work[i] = None
        self.staging[i].zero_()
        return i


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, disp: "EchoExpertDispatcher", member: _Member, layer: int, vid: int,
                *weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.disp, ctx.member, ctx.layer, ctx.vid, ctx.num_weights = disp, member, layer, vid, len(weights)
        return tuple(t.clone() for t in member.ctx.replica_weights[0])

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor) -> tuple[None, ...]:
        ctx.disp._reduce(ctx.member, ctx.layer, ctx.vid, grads)
        return (None,) * (4 + ctx.num_weights)


class EchoExpertDispatcher:
    """ECHO's expert-weight dispatcher over ultracomm (constructor as Megatron's
    ``AllToAllExpertWeightDispatcher(config, ep_group, num_home_experts, num_spare_experts)``).

    Extra keywords: ``max_microbatches`` (micro-batches in flight per layer; default from
    ``config.pipeline_model_parallel_size`` x ``virtual_pipeline_model_parallel_size``),
    ``mark_grad_added`` (set ``param.grad_added_to_main_grad`` after adding into
    ``main_grad``; default True as in ECHO) and ``Context`` options.
    """

    def __init__(self, config: Any, ep_group: Any, num_home_experts: int, num_spare_experts: int, *,
                 max_microbatches: int | None = None, mark_grad_added: bool = True, **context_options: Any):
        from ..comm import as_comm

        self.config, self.ep_group = config, ep_group
        comm = as_comm(ep_group)
        self.ep_rank, self.ep_size = comm.rank, comm.world
        if num_home_experts <= 0 or num_spare_experts <= 0:
            raise ValueError("ultracomm: num_home_experts and num_spare_experts must be positive")
        if num_home_experts % self.ep_size or num_spare_experts % self.ep_size:
            raise ValueError(f"ultracomm: num_home_experts ({num_home_experts}) and num_spare_experts "
                             f"({num_spare_experts}) must divide by the EP size {self.ep_size}")
        self.num_home_experts, self.num_spare_experts = num_home_experts, num_spare_experts
        self.num_local_home_experts = num_home_experts // self.ep_size
        self.num_local_spare_experts = num_spare_experts // self.ep_size
        if max_microbatches is None:
            pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
            vpp = getattr(config, "virtual_pipeline_model_parallel_size", 1) or 1
            max_microbatches = max(1, int(pp) * int(vpp))
        self.max_microbatches = max_microbatches
        self.mark_grad_added = mark_grad_added
        self.context_options = context_options
        self._pool = _pool_of(ep_group)
        if self._pool.members:
            raise RuntimeError("ultracomm: an EchoExpertDispatcher was built after the first expert_dispatch of its "
                               "EP group; build every MoE layer's dispatcher before the first forward")
        self.layer = len(self._pool.dispatchers)
        self._pool.dispatchers.append(self)
        self._pending: list[tuple[_Member, int, Any]] = []
        self._callback_queued = False

    # ------------------------------------------------------------------ Megatron's duck type
    def preprocess(self, expert_offloading_map: torch.Tensor) -> EchoDispatchMetadata:
        """Validate ECHO's bool ``[num_home_experts, num_spare_experts]`` map and turn it into a plan."""
        if expert_offloading_map.dtype != torch.bool:
            raise ValueError("ultracomm: expert_offloading_map must be a bool tensor")
        want = (self.num_home_experts, self.num_spare_experts)
        if tuple(expert_offloading_map.shape) != want:
            raise ValueError(f"ultracomm: expert_offloading_map must have shape {list(want)}, got "
                             f"{list(expert_offloading_map.shape)}")
        plan = ReplicaPlan.from_echo_map(expert_offloading_map, self.ep_size,
                                         experts_per_rank=self.num_local_home_experts)
        return EchoDispatchMetadata(expert_offloading_map, plan, plan.slot_src[self.ep_rank].tolist(), {})

    def expert_dispatch(self, metadata: EchoDispatchMetadata, *expert_weights: torch.Tensor) -> list[torch.Tensor]:
        """This rank's spare slots' weights (``num_local_spare_experts`` tensors shaped like
        one expert weight; empty slots hold stale data and should get no token), from the
        local home experts' weights of one projection (fc1 or fc2).  Collective."""
        if len(expert_weights) != self.num_local_home_experts:
            raise ValueError(f"ultracomm: expected {self.num_local_home_experts} local home weights, got "
                             f"{len(expert_weights)}")
        shape, dtype = tuple(expert_weights[0].shape), expert_weights[0].dtype
        if any(tuple(w.shape) != shape or w.dtype != dtype for w in expert_weights):
            raise ValueError("ultracomm: all expert weights of one dispatch call must have one shape and dtype")
        member = self._member(shape, dtype, expert_weights[0].device)
        self._register(member, expert_weights)
        key = (shape, dtype)
        if key in metadata.vids:
            raise ValueError(f"ultracomm: these metadata were already dispatched for weights of shape {list(shape)}; "
                             "call preprocess() again for a new micro-batch")
        vid = member.ctx.begin(self.layer)
        member.ctx.weight_sync(vid, metadata.plan)
        metadata.vids[key] = vid
        if not torch.is_grad_enabled():
            member.ctx.end(vid)
            return [t.clone() for t in member.ctx.replica_weights[0]]
        out = list(_Dispatch.apply(self, member, self.layer, vid, *expert_weights))
        member.ctx.weights_copied(vid)  # the outputs are copies: other layers may reuse the slots
        return out

    dispatch = expert_dispatch  # the newer ECHO name

    # ------------------------------------------------------------------ internals
    def _member(self, shape: tuple, dtype: torch.dtype, device: torch.device) -> _Member:
        pool = self._pool
        member = pool.members.get((shape, dtype))
        if member is None:
            layout = ExpertLayout((Member("w", shape, dtype),))
            ctx = Context(self.ep_group, layout, self.num_local_home_experts, self.num_local_spare_experts,
                          len(pool.dispatchers), self.max_microbatches, **self.context_options)
            member = pool.members[(shape, dtype)] = _Member(ctx, device)
        return member

    def _register(self, member: _Member, weights: Sequence[torch.Tensor]) -> None:
        """Register this layer's home weights (and their ``main_grad`` or an fp32 stand-in) once."""
        key = tuple(w.data_ptr() for w in weights)
        have = member.registered.get(self.layer)
        if have is not None and have[0] == key:
            return
        if all(getattr(w, "main_grad", None) is not None for w in weights):
            grads, fold = [w.main_grad for w in weights], False
        else:
            grads = [torch.zeros(w.shape, dtype=member.ctx.layout.grad_dtype, device=w.device) for w in weights]
            fold = True
        member.ctx.register_masters(self.layer, [[w.detach() for w in weights]], [grads])
        member.registered[self.layer] = (key, list(weights), grads, fold)

    def _reduce(self, member: _Member, layer: int, vid: int, grads: Sequence[torch.Tensor]) -> None:
        i = member.acquire_staging()
        staging = member.staging[i]
        for s, g in enumerate(grads):
            if g is not None:
                staging[s].add_(g)
        work = member.ctx.grad_reduce(vid, async_op=True, grads=[staging])
        member.staging_work[i] = work
        self._pending.append((member, layer, work))
        if not self._callback_queued:
            self._callback_queued = True
            torch.autograd.Variable._execution_engine.queue_callback(self._end_of_backward)

    def _end_of_backward(self) -> None:
        self._callback_queued = False
        self.wait_grads()

    def wait_grads(self) -> None:
        """Wait for this layer's launched reductions and put their results in place."""
        pending, self._pending = self._pending, []
        for _, _, work in pending:
            work.wait()
        for member in {id(m): m for m, _, _ in pending}.values():
            _, weights, grads, fold = member.registered[self.layer]
            for w, g in zip(weights, grads):
                if fold:
                    if w.requires_grad:
                        w.grad = g.to(w.dtype) if w.grad is None else w.grad.add_(g.to(w.dtype))
                    g.zero_()
                elif self.mark_grad_added and hasattr(w, "grad_added_to_main_grad"):
                    w.grad_added_to_main_grad = True
