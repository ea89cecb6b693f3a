"""Megatron MoE ECHO over ultracomm: the planner and the expert-weight dispatcher.

ECHO clones hot experts into spare slots each step.  Its two seams, with upstream's names,
arguments and shapes (checked against Victarry/Megatron-LM's BalancedMoELayer branch --
``balanced_moe_layer.py`` at ae807d3f and the ``expert_weight_dispatcher.py`` it imports --
and NVIDIA/Megatron-LM PR #2368 at a2b16b87):

* :func:`gen_offloading_plan` (``offloading_planner.gen_offloading_plan``), from
  :mod:`ultracomm.integrations.echo_planner`: upstream's algorithms, arguments and column
  order (per rank its home experts, then its spares), or an ultracomm planner by name.
* :class:`EchoExpertDispatcher`, upstream's ``AllToAllExpertWeightDispatcher``:
  ``preprocess(expert_offloading_map) -> metadata``; ``dispatch(metadata, *expert_weights,
  runtime_weight_dtype=None) -> list[Tensor]`` (one tensor per local spare slot, zeros for an
  empty one; ``expert_dispatch`` is the older name), called once for fc1's and once for fc2's
  per-expert weights; ``fold_spare_gradients(metadata, *local_spare_grads,
  reference_weight_dtype=None) -> list[Tensor]`` (the local home experts' sums of their
  spares' gradients, for layers that accumulate the spares' wgrads in ``main_grad``).

Upstream stacks the senders' weights and calls ``all_to_all_single``; this multicasts through
ultracomm's relay trees.  The backward of ``dispatch`` sums every spare's gradient into its
home expert, deterministically: the reduction's schedule order, then the spares on the home
rank itself in slot order, in the grad-combine dtype of
``config.moe_balance_expert_weight_grad_combine_dtype`` (fp32 for 16-bit weights by default).
A home weight without ``main_grad`` gets that sum as its autograd gradient, as upstream.  One
with ``main_grad`` (Megatron) gets it added into ``main_grad`` and a zero autograd gradient,
so the sum lands whichever path the expert's own wgrad takes -- TE's fused accumulation, which
sets ``grad_added_to_main_grad`` and makes DDP's hook skip ``.grad`` (upstream's autograd-only
sum would be skipped with it), or ``.grad`` added by DDP's hook -- and the zero makes that hook
wait for the add.  The dispatcher never sets ``grad_added_to_main_grad``: DDP resets it once
per iteration, so setting it would drop the home experts' own ``.grad`` of later micro-batches.
A spare on the expert's own home rank is a local copy.

Before/after in Megatron's MoE layer::

    dispatcher = AllToAllExpertWeightDispatcher(config, ep_group, num_home_experts, num_spare_experts)
    dispatcher = EchoExpertDispatcher(config, ep_group, num_home_experts, num_spare_experts)   # after

Build every layer's dispatcher before the first dispatch (their Contexts are shared by all
layers, one per weight shape and call); ``close_dispatchers(ep_group)`` at the end.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from typing import Any, Sequence

import torch

from ..context import Context
from ..layout import ExpertLayout, Member
from ..plan import ReplicaPlan
from .echo_planner import gen_offloading_plan
from ..errors import InputError, UltracommError

__all__ = ["gen_offloading_plan", "EchoExpertDispatcher", "EchoDispatchMetadata", "close_dispatchers"]

_COMBINE_POLICIES = ("fp32", "param_dtype", "bf16", "fp16")


def expert_count_problem(ep_size: int, counts: Sequence[tuple[str, Any]]) -> str | None:
    """What is wrong with the first of ``counts`` ((name, value) pairs of global expert counts) that
    is not a positive multiple of ``ep_size`` (every EP rank holds the same share), or None."""
    for name, v in counts:
        if isinstance(v, bool) or not isinstance(v, int) or v <= 0 or v % ep_size:
            return f"{name} must be a positive multiple of the EP size {ep_size}, got {v!r}"
    return None


def _err(msg: str) -> InputError:
    return InputError(f"ultracomm: EchoExpertDispatcher: {msg}")


def _combine_dtype(weight_dtype: torch.dtype, policy: str) -> torch.dtype:
    """Upstream's ``_expert_weight_grad_combine_dtype``."""
    if policy == "fp32":
        return torch.float32 if weight_dtype in (torch.float16, torch.bfloat16) else weight_dtype
    return {"param_dtype": weight_dtype, "bf16": torch.bfloat16, "fp16": torch.float16}[policy]


@dataclass
class EchoDispatchMetadata:
    """What ``preprocess`` derives from ``expert_offloading_map``.

    Attributes:
        expert_offloading_map: the bool ``[E, S]`` map given.
        plan: the ultracomm plan of the spares on other ranks than their home (the multicast).
        local_spare_home_indices: long ``[K]``: global home expert of each local spare (-1 empty),
            as upstream's metadata field.
        local_copies: ``(local spare, local home)`` of this rank's spares that hold one of its
            own experts (copied, not multicast).
        dispatched: per (weight shape, dtype), how many ``dispatch`` calls used this metadata.
    """

    expert_offloading_map: torch.Tensor
    plan: ReplicaPlan
    local_spare_home_indices: torch.Tensor
    local_copies: list[tuple[int, int]]
    dispatched: dict[Any, int] = field(default_factory=dict)


class _Pool:
    """One Context per (EP group, weight shape, dtype, call), shared by every layer's dispatcher."""

    def __init__(self) -> None:
        self.dispatchers: list["EchoExpertDispatcher"] = []
        self.members: dict[Any, "_Member"] = {}


_POOLS: "weakref.WeakKeyDictionary[Any, _Pool]" = weakref.WeakKeyDictionary()
_DEFAULT_GROUP_POOL: dict[str, _Pool] = {}  # ep_group=None before init_process_group


def _pool_key(ep_group: Any) -> Any:
    """The group a pool belongs to: ``ep_group``, or for None the default process group *object*
    -- one destroyed and initialised again is another object, so its dispatchers start a new pool
    rather than finding the old group's (its Contexts on a destroyed group, its dispatchers full)."""
    if ep_group is not None:
        return ep_group
    import torch.distributed as dist

    return dist.distributed_c10d._get_default_group() if dist.is_available() and dist.is_initialized() else None


def close_dispatchers(ep_group: Any) -> None:
    """Close the Contexts shared by ``ep_group``'s dispatchers and forget them (end of training;
    dispatchers built afterwards start a new pool)."""
    key = _pool_key(ep_group)
    pool = _DEFAULT_GROUP_POOL.pop("default", None) if key is None else _POOLS.pop(key, None)
    for member in pool.members.values() if pool else ():
        member.ctx.close()


def _pool_of(ep_group: Any) -> _Pool:
    key = _pool_key(ep_group)
    if key is None:
        return _DEFAULT_GROUP_POOL.setdefault("default", _Pool())
    pool = _POOLS.get(key)
    if pool is None:
        pool = _POOLS[key] = _Pool()
    return pool


class _Member:
    """One Context and, per layer, the registered home weights and the grad buffers the
    reduction adds into (zeroed before each use; the backward waits, so one per layer)."""

    def __init__(self, ctx: Context):
        self.ctx = ctx
        self.registered: dict[int, tuple[tuple, list[torch.Tensor]]] = {}
        self.sums: dict[int, torch.Tensor] = {}

    def register(self, layer: int, weights: Sequence[torch.Tensor]) -> None:
        key = tuple((w.data_ptr(), tuple(w.shape)) for w in weights)
        have = self.registered.get(layer)
        if have is not None and have[0] == key:
            return
        m = self.ctx.layout.members[0]
        sums = torch.zeros((len(weights), *m.shape), dtype=self.ctx.layout.grad_dtype, device=weights[0].device)
        self.ctx.register_masters(layer, [[w.detach() for w in weights]], [list(sums.unbind(0))])
        # the storage is pinned (the key's addresses stay theirs), not the tensors: an adapter may
        # track them by weak reference (megatron_echo_elastic)
        self.registered[layer], self.sums[layer] = (key, [w.detach() for w in weights]), sums

    def reduce(
        self,
        disp: "EchoExpertDispatcher",
        vid: int,
        layer: int,
        spare_grads: torch.Tensor,
        local_copies: list[tuple[int, int]],
    ) -> torch.Tensor:
        """``[M, *shape]`` home sums of ``spare_grads [K, *shape]`` (collective)."""
        sums = self.sums[layer]
        sums.zero_()
        self.ctx.grad_reduce(vid, grads=[spare_grads])  # waits: the sums are returned now
        out = sums.clone()
        for k, h in local_copies:  # after the reduction: a fixed order
            out[h] += spare_grads[k]
        return out


class _Dispatch(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        disp: "EchoExpertDispatcher",
        member: _Member,
        vid: int,
        meta: EchoDispatchMetadata,
        runtime_dtype: torch.dtype,
        *weights: torch.Tensor,
    ) -> tuple[torch.Tensor, ...]:
        ctx.disp, ctx.member, ctx.vid, ctx.meta = disp, member, vid, meta
        ctx.weights = weights  # the parameters themselves: their main_grad is read at backward time
        return tuple(disp._outputs(member, meta, weights, runtime_dtype))

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        member: _Member = ctx.member
        m = member.ctx.layout.members[0]
        gdt = member.ctx.layout.grad_dtype
        spare = torch.zeros((len(grads), *m.shape), dtype=gdt, device=member.sums[ctx.disp.layer].device)
        for k, g in enumerate(grads):
            if g is not None:
                spare[k] = g.to(gdt)
        home = member.reduce(ctx.disp, ctx.vid, ctx.disp.layer, spare, ctx.meta.local_copies)
        out = []
        for w, h in zip(ctx.weights, home.unbind(0)):
            main_grad = getattr(w, "main_grad", None)
            if main_grad is None:
                out.append(h)
                continue
            # Megatron: into main_grad whichever path the home wgrad takes (fused, flag set; or
            # .grad and DDP's hook); the zero makes DDP's hook for w wait for this add
            main_grad.add_(h.to(main_grad.dtype))
            out.append(torch.zeros((), dtype=w.dtype, device=w.device).expand(w.shape))
        return (None,) * 5 + tuple(out)


class EchoExpertDispatcher:
    """Upstream's expert-weight dispatcher over ultracomm (constructor as
    ``AllToAllExpertWeightDispatcher(config, ep_group, num_home_experts, num_spare_experts)``).

    Extra keywords: ``max_microbatches`` (micro-batches in flight per layer; default
    ``config.pipeline_model_parallel_size`` x ``virtual_pipeline_model_parallel_size``) and
    ``Context`` options.  ``config.moe_balance_expert_weight_grad_combine_dtype`` (``fp32``,
    ``param_dtype``, ``bf16``, ``fp16``; default ``fp32``) is the dtype spare gradients are
    summed in, as upstream.
    """

    def __init__(
        self,
        config: Any,
        ep_group: Any,
        num_home_experts: int,
        num_spare_experts: int,
        *,
        max_microbatches: int | None = None,
        **context_options: Any,
    ):
        from ..comm import as_comm

        self.config, self.ep_group = config, ep_group
        comm = as_comm(ep_group)
        self.ep_rank, self.ep_size = comm.rank, comm.world
        problem = expert_count_problem(
            self.ep_size, (("num_home_experts", num_home_experts), ("num_spare_experts", num_spare_experts))
        )
        if problem:
            raise _err(problem)
        self.policy = getattr(config, "moe_balance_expert_weight_grad_combine_dtype", "fp32")
        if self.policy not in _COMBINE_POLICIES:
            raise _err(
                f"config.moe_balance_expert_weight_grad_combine_dtype must be one of {_COMBINE_POLICIES}, "
                f"got {self.policy!r}"
            )
        self.num_home_experts, self.num_spare_experts = num_home_experts, num_spare_experts
        self.num_local_home_experts = num_home_experts // self.ep_size
        self.num_local_spare_experts = num_spare_experts // self.ep_size
        if max_microbatches is None:
            pp = getattr(config, "pipeline_model_parallel_size", 1) or 1
            vpp = getattr(config, "virtual_pipeline_model_parallel_size", 1) or 1
            max_microbatches = max(1, int(pp) * int(vpp))
        self.max_microbatches = max_microbatches
        self.context_options = context_options
        self._pool = _pool_of(ep_group)
        if self._pool.members:
            raise UltracommError(
                "ultracomm: an EchoExpertDispatcher was built after the first dispatch of its EP "
                "group; build every MoE layer's dispatcher before the first forward"
            )
        self.layer = len(self._pool.dispatchers)
        self._pool.dispatchers.append(self)

    # ------------------------------------------------------------------ upstream's interface
    def preprocess(self, expert_offloading_map: torch.Tensor) -> EchoDispatchMetadata:
        """Check the bool ``[num_home_experts, num_spare_experts]`` map (each spare holds at most
        one expert; one on its expert's own home rank is a local copy) and plan the multicast."""
        m = expert_offloading_map
        if not isinstance(m, torch.Tensor) or m.dtype != torch.bool:
            raise _err(
                f"expert_offloading_map must be a bool tensor, got "
                f"{m.dtype if isinstance(m, torch.Tensor) else type(m).__name__}"
            )
        want = (self.num_home_experts, self.num_spare_experts)
        if tuple(m.shape) != want:
            raise _err(f"expert_offloading_map must have shape {list(want)}, got {list(m.shape)}")
        cpu = m.detach().cpu()
        per_slot = cpu.sum(0)
        if bool((per_slot > 1).any()):
            j = int((per_slot > 1).nonzero()[0])
            held = cpu[:, j].nonzero().squeeze(1).tolist()
            raise _err(
                f"spare slot {j} of expert_offloading_map holds experts {held}; each spare slot holds at most "
                "one home expert"
            )
        M, K, R = self.num_local_home_experts, self.num_local_spare_experts, self.ep_size
        src = torch.where(per_slot > 0, cpu.to(torch.int64).argmax(0), -1)  # home expert of each spare
        remote = src.clone().view(R, K)
        home_rank = torch.where(remote >= 0, remote // M, -1)
        remote[home_rank == torch.arange(R)[:, None]] = -1  # a spare on its home rank: a local copy
        mine = src.view(R, K)[self.ep_rank]
        local = [(k, e - self.ep_rank * M) for k, e in enumerate(mine.tolist()) if e >= 0 and e // M == self.ep_rank]
        plan = ReplicaPlan.make(remote.to(torch.int32), self.num_home_experts, experts_per_rank=M)
        return EchoDispatchMetadata(m, plan, mine.clone().to(m.device), local)

    def dispatch(
        self,
        metadata: EchoDispatchMetadata,
        *expert_weights: torch.Tensor,
        runtime_weight_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """This rank's spare slots' weights (``num_local_spare_experts`` tensors shaped like one
        expert weight, in ``runtime_weight_dtype`` or the weights' dtype; zeros for an empty
        slot), from the local home experts' weights of one projection.  Collective."""
        if not isinstance(metadata, EchoDispatchMetadata):
            raise _err(f"metadata must come from preprocess(), got {type(metadata).__name__}")
        if len(expert_weights) != self.num_local_home_experts:
            raise _err(f"expected {self.num_local_home_experts} local home weights, got {len(expert_weights)}")
        w0 = expert_weights[0]
        shape, dtype = tuple(w0.shape), w0.dtype
        if any(tuple(w.shape) != shape or w.dtype != dtype or w.device != w0.device for w in expert_weights):
            raise _err("all expert weights of one dispatch call must have one shape, dtype and device")
        runtime = dtype if runtime_weight_dtype is None else runtime_weight_dtype
        if not isinstance(runtime, torch.dtype) or not runtime.is_floating_point:
            raise _err(
                f"runtime_weight_dtype must be a floating-point torch dtype or None, got {runtime_weight_dtype!r}"
            )
        combine = _combine_dtype(dtype, self.policy)
        key = (shape, dtype, combine)
        call = self._call_index(metadata, key, expert_weights)
        member = self._member(key + (call,), w0.device)
        member.register(self.layer, expert_weights)
        vid = member.ctx.begin(self.layer)
        try:
            member.ctx.weight_sync(vid, metadata.plan)
        except BaseException:
            member.ctx.end(vid)
            raise
        metadata.dispatched[key] = call + 1
        if not (torch.is_grad_enabled() and any(w.requires_grad for w in expert_weights)):
            out = self._outputs(member, metadata, expert_weights, runtime)
            member.ctx.end(vid)
            return out
        out = list(_Dispatch.apply(self, member, vid, metadata, runtime, *expert_weights))
        member.ctx.weights_copied(vid)  # the outputs are copies: other layers may reuse the slots
        return out

    def expert_dispatch(
        self,
        metadata: EchoDispatchMetadata,
        *expert_weights: torch.Tensor,
        runtime_weight_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """The older name of :meth:`dispatch`."""
        return self.dispatch(metadata, *expert_weights, runtime_weight_dtype=runtime_weight_dtype)

    def fold_spare_gradients(
        self,
        metadata: EchoDispatchMetadata,
        *local_spare_grads: torch.Tensor,
        reference_weight_dtype: torch.dtype | None = None,
    ) -> list[torch.Tensor]:
        """The local home experts' sums of their spares' gradients (``num_local_home_experts``
        tensors in the grad-combine dtype of ``reference_weight_dtype`` or the grads' dtype),
        from this rank's ``num_local_spare_experts`` spare gradients.  Collective; the metadata
        must have been dispatched for weights of this shape (it re-multicasts them to set up the
        reduction, as ultracomm reduces along the plan it multicast)."""
        if not isinstance(metadata, EchoDispatchMetadata):
            raise _err(f"metadata must come from preprocess(), got {type(metadata).__name__}")
        if len(local_spare_grads) != self.num_local_spare_experts:
            raise _err(f"expected {self.num_local_spare_experts} local spare gradients, got {len(local_spare_grads)}")
        g0 = local_spare_grads[0]
        shape = tuple(g0.shape)
        if any(tuple(g.shape) != shape for g in local_spare_grads):
            raise _err("all spare gradients of one fold_spare_gradients call must have one shape")
        wdtype = reference_weight_dtype or g0.dtype
        combine = _combine_dtype(wdtype, self.policy)
        member = next(
            (
                mb
                for k, mb in self._pool.members.items()
                if k[:3] == (shape, wdtype, combine) and self.layer in mb.registered
            ),
            None,
        )
        if member is None:
            raise _err(
                f"fold_spare_gradients: no dispatch of {list(shape)} {wdtype} weights by this layer yet; "
                "call dispatch(metadata, *home_weights) first (or pass reference_weight_dtype)"
            )
        vid = member.ctx.begin(self.layer)
        try:
            member.ctx.weight_sync(vid, metadata.plan)
            member.ctx.weights_copied(vid)
            spare = torch.stack([g.detach().to(combine) for g in local_spare_grads])
            return list(member.reduce(self, vid, self.layer, spare, metadata.local_copies).unbind(0))
        except BaseException:
            if not member.ctx.closed:
                try:
                    member.ctx.end(vid)
                except ValueError:  # grad_reduce released it
                    pass
            raise

    # ------------------------------------------------------------------ internals
    def _call_index(self, metadata: EchoDispatchMetadata, key: tuple, weights: Sequence[torch.Tensor]) -> int:
        """Which of this layer's Contexts for ``key`` a dispatch uses: the n-th dispatch of one
        metadata gets the n-th (fc1 and fc2 of one shape get a Context each)."""
        return metadata.dispatched.get(key, 0)

    def _outputs(
        self, member: _Member, meta: EchoDispatchMetadata, weights: Sequence[torch.Tensor], runtime: torch.dtype
    ) -> list[torch.Tensor]:
        slots = member.ctx.replica_weights[0]
        out = []
        mine = meta.plan.slot_src[self.ep_rank].tolist()
        local = dict(meta.local_copies)
        for k in range(self.num_local_spare_experts):
            if k in local:
                t = weights[local[k]].detach().to(runtime, copy=True)
            elif mine[k] >= 0:
                t = slots[k].to(runtime, copy=True)
            else:
                t = torch.zeros(slots.shape[1:], dtype=runtime, device=weights[0].device)
            out.append(t)
        return out

    def _member(self, key: tuple, device: torch.device) -> _Member:
        pool = self._pool
        member = pool.members.get(key)
        if member is None:
            shape, dtype, combine, _ = key
            layout = ExpertLayout((Member("w", shape, dtype),), grad_dtype=combine)
            ctx = Context(
                self.ep_group,
                layout,
                self.num_local_home_experts,
                self.num_local_spare_experts,
                len(pool.dispatchers),
                self.max_microbatches,
                **self.context_options,
            )
            member = pool.members[key] = _Member(ctx)
        return member
