"""The gradient staging of a :class:`~ultracomm.moe.manager.ReplicaManager` and the masters it
returns gradients to.

The reduction lands in the manager's own staging (``grad_dtype``), shared by every layer (one
reduce at a time returns from it), never in a user tensor: no user pointer is baked into a
schedule or a captured graph.  Replica grads: two sets, so a reduce in flight never blocks the
next layer's wgrads.  ``None`` for a member without a gradient (an FP8 weight's scales).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from ..errors import RegistrationError
from ..layout import MASTER_DTYPES, ExpertLayout
from .autograd import fused_wgrad_return

__all__ = ["RegisteredLayer", "GradStaging", "tensors_of", "masters_of", "describe"]


def tensors_of(member: Any) -> list[torch.Tensor]:
    return [member] if isinstance(member, torch.Tensor) else list(member)


class RegisteredLayer:
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
            ts = tensors_of(p)
            for j, t in enumerate(ts):
                self.anchors.append(t)
                self.rows.append((m, 0, t.shape[0]) if len(ts) == 1 and isinstance(p, torch.Tensor) else (m, j, 1))

    def inputs(self) -> list[int]:
        """The anchors that take a gradient (the replica node's inputs)."""
        return [i for i, t in enumerate(self.anchors) if t.requires_grad]

    def frozen(self) -> bool:
        """No master takes a gradient (LoRA, router-only fine-tuning): multicast only."""
        return not self.inputs()


class GradStaging:
    """``replica[i]``: per member ``[slots, *shape]`` (two sets, ``acquire`` alternates); ``master``:
    per member ``[experts_per_rank, *shape]`` (what ``grad_reduce`` adds into; registered with the
    Context as every layer's master grads); ``work[i]``: the reduce reading set ``i``."""

    def __init__(self, layout: ExpertLayout, experts_per_rank: int, slots_per_rank: int, device: torch.device):
        gd = layout.grad_dtype
        self.master = [
            torch.zeros((experts_per_rank, *m.shape), dtype=gd, device=device) if m.grad else None
            for m in layout.members
        ]
        self.replica = [
            [
                torch.zeros((slots_per_rank, *m.shape), dtype=gd, device=device) if m.grad else None
                for m in layout.members
            ]
            for _ in range(2)
        ]
        self.work: list[Any] = [None, None]
        self._next = 0

    def acquire(self) -> int:
        """The next replica set, zeroed once the reduce that last read it has (stream order)."""
        i = self._next
        self._next ^= 1
        work = self.work[i]
        if work is not None:  # its reduce copies out of it: the zero_() below must come after
            work.wait_stream()
            self.work[i] = None
        for t in self.replica[i]:
            if t is not None:
                t.zero_()
        return i

    def zero_master(self, rows: list[int] | None) -> None:
        """Zero the rows the next reduction adds into (every row where the plan is on the GPU)."""
        for g in self.master:
            if g is None:
                continue
            if rows is None:
                g.zero_()
            else:
                for j in rows:
                    g[j].zero_()

    def contributions(
        self, layer: RegisteredLayer, rows: list[int] | None, inputs: Sequence[int], needs: Sequence[bool]
    ) -> list[torch.Tensor | None]:
        """Per master anchor of ``layer``, from the staging a reduction just filled: its reduced
        replica contribution as an autograd gradient in the master's dtype (None where no expert
        of it has a replica, or it takes no gradient); or, where the master has a ``main_grad``
        now, the contribution added into it and what Megatron's fused path returns instead."""
        out: list[torch.Tensor | None] = []
        for i, need in zip(inputs, needs):
            t, (m, j0, n) = layer.anchors[i], layer.rows[i]
            mine = list(range(n)) if rows is None else [j - j0 for j in rows if j0 <= j < j0 + n]
            if not need or not mine:
                out.append(None)
                continue
            src = self.master[m][j0 : j0 + n].view(t.shape)  # a per-expert anchor: n == 1
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


def masters_of(layout: ExpertLayout, params: list[Any], masters: Sequence[Any] | None) -> list[Any]:
    """Per member, what its gradient reduces into (see ``register_layer``), checked."""
    members = layout.members
    if masters is None:
        fp8 = [m.name for m in members if m.fp8 and m.grad]
        if fp8:
            raise RegistrationError(
                f"ultracomm: members {fp8} are FP8 runtime copies: pass masters=[...] (per member the "
                "high-precision master its replicas' gradients reduce into, None for the others)"
            )
        return [p if m.grad else None for m, p in zip(members, params)]
    if isinstance(masters, torch.Tensor) or len(masters) != len(members):
        raise RegistrationError(
            f"ultracomm: masters must be a list with one entry per member "
            f"{list(layout.names)} (None where the member needs none)"
        )
    out = []
    for m, p, hp in zip(members, params, masters):
        if hp is None:
            if m.fp8 and m.grad:
                raise RegistrationError(
                    f"ultracomm: masters[{m.name!r}] is None, but {m.name!r} is an FP8 runtime "
                    f"copy with a gradient: pass its {m.master_dtype} master"
                )
            out.append(p if m.grad else None)
            continue
        if not m.grad:
            raise RegistrationError(
                f"ultracomm: masters[{m.name!r}]: member {m.name!r} carries no gradient "
                "(grad=False); pass None in its place"
            )
        hp = hp if isinstance(hp, torch.Tensor) else list(hp)
        for i, (t, w) in enumerate(zip(tensors_of(hp), tensors_of(p))):
            want = m.grad_master_dtype
            if (
                not isinstance(t, torch.Tensor)
                or t.shape != w.shape
                or t.dtype not in ((want,) if want is not None else MASTER_DTYPES)
                or t.device != w.device
                or isinstance(hp, torch.Tensor) != isinstance(p, torch.Tensor)
                or len(tensors_of(hp)) != len(tensors_of(p))
            ):
                raise RegistrationError(
                    f"ultracomm: masters[{m.name!r}]: expected what params[{m.name!r}] is (a stacked tensor or a "
                    f"list of per-expert tensors, shaped {list(w.shape)}, on {w.device}) in "
                    f"{want or 'a float dtype'}; got {describe(t)}"
                )
        out.append(hp)
    return out


def describe(x: Any) -> str:
    """``dtype [shape] on device`` of a tensor, else its type's name (for error messages)."""
    if isinstance(x, torch.Tensor):
        return f"{x.dtype} {list(x.shape)} on {x.device}"
    return type(x).__name__
