"""The autograd pieces of a :class:`~ultracomm.moe.manager.Step`.

Autograd is the contract: a replica's gradient reaches its master only as the return value
of a backward, so autograd accumulates it like any other gradient -- DDP's and Megatron's
hooks fire after it, ``torch.autograd.grad`` returns it, ``None`` stays ``None``.  Three nodes
per (layer, micro-batch):

* ``_ReplicaWeights`` (inputs: the layer's masters; outputs: a 0-d *token* and the replica
  slots as tensors).  Forward: wait for ``weight_sync``.  Backward: fold the replicas'
  gradients into fp32 staging, run ``grad_reduce`` into the manager's fp32 master staging
  (collective, deterministic; on the host executor the node waits for it, on a GPU the
  return is stream-ordered) and *return* each master's reduced replica contribution --
  or, for a master that has a ``main_grad`` at that moment (Megatron's gradient-accumulation
  fusion), add it there and return what Megatron's fused path returns.
* ``_Guard`` on the expert output (backward: ``restore`` the slots before the expert Dgrad).
  Because it consumes the token, the engine runs ``_ReplicaWeights.backward`` only after
  the guard's backward *and* after every consumer of the replica weights: on a rank whose
  replicas got no token the reduce still fires (right after the guard), so every rank
  reaches every collective.
* ``_Linear``: ``x @ w.T`` whose weight gradient is accumulated in fp32 straight into
  ``w.main_grad`` when the weight has one (Megatron's gradient-accumulation fusion; replica
  weights get theirs from the guard), so bf16 weights never round their wgrads to bf16.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import InputError, UltracommError
from ..fp8 import dequantize
from ..layout import FP8_DTYPES

if TYPE_CHECKING:  # pragma: no cover
    from .step import Step

__all__ = ["linear"]


class _ReplicaWeights(torch.autograd.Function):
    """Inputs: the step and every master of the layer that takes a gradient.  All of them,
    whatever the plan: the reduce is collective, so the engine must run this node on every
    rank whenever any master of the layer is asked for (``autograd.grad(loss, masters)`` runs
    only nodes that lead to what it is asked for), also on a rank none of whose masters has a
    replica.  A master without a replica gets None from here (its ``.grad`` stays None; a
    post-accumulate hook is called with ``p.grad is None``, as for any None gradient)."""

    @staticmethod
    def forward(ctx: Any, step: "Step", *masters: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.step = step
        # a view nothing took a gradient of stays None (not zeros): a fused wgrad is in the staging
        # already, and an FP8 view's None must not become an FP8 zero tensor
        ctx.set_materialize_grads(False)
        views = step._forward_views()
        token = torch.zeros((), dtype=torch.float32, device=step.device)
        S = step.manager.slots_per_rank
        # members without a gradient (an FP8 weight's scales): no edge back to a master
        ctx.mark_non_differentiable(*[v for i, v in enumerate(views) if not step.manager.layout.members[i // S].grad])
        return (token, *views)

    @staticmethod
    def backward(ctx: Any, _token_grad: torch.Tensor, *grads: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        # per pass, not the forward's needs_input_grad: a master's main_grad gets its sum only from a
        # pass that asks for that master (backward(inputs=[...]) may name some of them)
        needs = [need and _asked(ctx, k) for k, need in enumerate(ctx.needs_input_grad[1:])]
        return (None, *ctx.step._backward_reduce(grads, needs))


class _Guard(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, token: torch.Tensor, step: "Step") -> torch.Tensor:
        ctx.step = step
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        ctx.step._backward_restore()
        return grad, None, None


def _effective(weight: torch.Tensor, scale: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor:
    """The weight the GEMM uses: an FP8 weight dequantized with its scales, in ``dtype``."""
    if scale is None:
        return weight
    return dequantize(weight, scale).to(dtype)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x)
        # the weight object itself (not a saved copy): under activation checkpointing its
        # main_grad attribute must be the one the guard set on the forward's tensor
        ctx.weight, ctx.scale = weight, scale
        return x @ _effective(weight, scale, x.dtype).t()

    @staticmethod
    def backward(ctx: Any, dy: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None, None]:
        (x,) = ctx.saved_tensors
        w = ctx.weight
        dx = dy @ _effective(w, ctx.scale, dy.dtype) if ctx.needs_input_grad[0] else None
        if not ctx.needs_input_grad[1] or not _asked(ctx, 1):
            return dx, None, None
        dy2, x2 = dy.reshape(-1, dy.shape[-1]), x.reshape(-1, x.shape[-1])
        main_grad = getattr(w, "main_grad", None)
        if main_grad is None:
            if ctx.scale is not None:
                raise UltracommError(
                    f"ultracomm: linear(): the {w.dtype} weight has no main_grad; autograd would round its "
                    "gradient to that dtype.  Replica weights of a ReplicaManager get one in the backward; "
                    "for another FP8 weight set weight.main_grad (an fp32 tensor of its shape)"
                )
            return dx, dy2.t() @ x2, None
        main_grad.add_(dy2.t().float() @ x2.float())  # fp32 wgrad, accumulated in place
        return dx, fused_wgrad_return(w), None


def _asked(ctx: Any, i: int) -> bool:
    """Whether the running backward pass asks for the gradient of tensor input ``i`` of the node
    ``ctx``.  ``needs_input_grad`` is fixed at forward time, but ``autograd.grad(loss, [x])`` /
    ``backward(inputs=[...])`` (an input-gradient pass, as zero-bubble pipeline schedules run
    before the weight pass; an adversarial or gradient-penalty input grad before
    ``loss.backward()``) does not execute the node that gradient goes to (a replica view's
    ``_ReplicaWeights``, a master's accumulator): a wgrad added into ``main_grad`` there would be
    counted again by the pass that asks for it.  ``autograd.grad`` with that tensor itself among
    its inputs cannot be asked about (torch refuses for a captured leaf): it asks for it."""
    node = ctx.next_functions[i][0]
    try:
        return node is None or torch._C._will_engine_execute_node(node)
    except RuntimeError:  # "A leaf node was passed ... running autograd.grad()": that leaf is asked for
        return True


def fused_wgrad_return(w: torch.Tensor, mark: bool = True) -> torch.Tensor | None:
    """What Megatron's fused wgrad path returns once it has added into ``w.main_grad``: under
    Megatron's DDP (``w`` has ``grad_added_to_main_grad``) a dummy gradient, so that the
    grad-accumulator hook fires, with the flag set (``mark``: the hook then skips ``.grad``);
    else None.  Megatron's dummy is ``torch.empty`` (``torch.zeros`` under ``zero_out_wgrad``);
    ours is always zeros, so a hook that adds ``.grad`` anyway adds nothing."""
    if not hasattr(w, "grad_added_to_main_grad"):
        return None
    if mark:
        w.grad_added_to_main_grad = True
    return torch.zeros(w.shape, dtype=w.dtype, device=w.device)


def linear(x: torch.Tensor, weight: torch.Tensor, weight_scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T`` with the weight gradient accumulated in fp32 into ``weight.main_grad``.

    Args:
        x: ``[..., in]``.
        weight: ``[out, in]`` (a replica weight from ``Step.replica_weights()``, a Megatron
            parameter with ``main_grad``, or any tensor); an FP8 weight with ``weight_scale``.
        weight_scale: an FP8 weight's scales (``[out, in / 32]`` MXFP8 e8m0, ``[out, 1]`` fp32
            per row; :mod:`ultracomm.fp8`): the GEMM uses ``dequantize(weight, weight_scale)``
            in ``x``'s dtype (a reference GEMM: a production stack calls its FP8 GEMM), and the
            weight's gradient must go to ``main_grad`` (replica weights have one).
    Returns:
        ``[..., out]`` in ``x``'s dtype.

    When ``weight`` has a ``main_grad`` attribute at backward time (in a backward pass that asks
    for the weight's gradient: not ``autograd.grad(loss, [x])``), ``dW = dy.T @ x`` is
    computed in fp32 and added into it and the weight's autograd gradient is what Megatron's
    fused path returns (:func:`fused_wgrad_return`: under Megatron's DDP, the flag
    ``grad_added_to_main_grad`` set and a zero dummy; else None); otherwise this is an
    ordinary linear.
    """
    if weight_scale is not None and weight.dtype not in FP8_DTYPES:
        raise InputError(f"ultracomm: linear(weight_scale=...) is for FP8 weights; the weight is {weight.dtype}")
    return _Linear.apply(x, weight, weight_scale)
