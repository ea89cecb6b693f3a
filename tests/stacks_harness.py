"""The loopback MoE of ``moe_harness`` trained for several optimizer steps the ways training
stacks take their gradients, with ultracomm (a ReplicaManager) and without it (the same
per-expert loop with no manager at all): what the differential tests of issue 32 compare.

Stacks (``stack``):

* ``backward``: ``loss.backward()``, the optimizer reads ``.grad``;
* ``autograd_grad``: ``torch.autograd.grad(loss, params, allow_unused=True)`` gives the grads
  (functional style); they are put in ``.grad`` for the optimizer;
* ``hook_step``: an optimizer step per parameter inside the backward, from
  ``register_post_accumulate_grad_hook`` (torchtitan's optimizer-in-backward); the grad the
  hook saw is recorded, ``.grad`` cleared there;
* ``late_main_grad``: an fp32 ``main_grad`` allocated after ``register_layer`` (Megatron's
  order: DDP wraps the model after the layers are built), filled by ``moe.linear``'s fused
  wgrad; the optimizer reads only ``main_grad`` (zeroed in place after each step);
* ``rebound_main_grad``: as ``late_main_grad``, but ``main_grad`` is a new tensor each step;
* ``megatron_ddp``: ``late_main_grad`` plus Megatron's DDP grad-accumulator hook (adds
  ``.grad`` into ``main_grad`` unless ``grad_added_to_main_grad``), the flag reset per step.

``fp8`` (``"row"`` or ``"mxfp8"``): the masters are high-precision; each step quantizes them
into FP8 runtime copies and scales (:mod:`ultracomm.fp8`), which the manager multicasts; home
experts compute with ``quantized_weight`` (straight through to the master, its wgrad fused into
the master's ``main_grad`` where it has one), replicas with ``moe.linear(x, q, weight_scale=s)``
(fp32 wgrad into the staging).  The run without ultracomm computes every expert the home way.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import torch

import moe_harness as mh

STACKS = ("backward", "autograd_grad", "hook_step", "late_main_grad", "rebound_main_grad", "megatron_ddp")
MAIN_GRAD_STACKS = ("late_main_grad", "rebound_main_grad", "megatron_ddp")


class NoReplica:
    """Stands in for a :class:`~ultracomm.moe.Step` in ``mh.rank_loss`` without ultracomm:
    every token stays on its home expert (the echo layout's spare columns are empty)."""

    def __init__(self, world: int, epr: int, slots: int):
        self.manager = SimpleNamespace(num_experts=world * epr, experts_per_rank=epr, slots_per_rank=slots)
        self.spare = world * slots

    def rerouted(self, layout: str, rmap: torch.Tensor, probs: torch.Tensor, source: int):
        pad = torch.zeros(rmap.shape[0], self.spare, dtype=rmap.dtype)
        return torch.cat([rmap, pad], 1), torch.cat([probs, torch.zeros(pad.shape, dtype=probs.dtype)], 1)


def flat(params: list[list[Any]]) -> list[torch.Tensor]:
    return [t for layer in params for m in layer for t in ([m] if isinstance(m, torch.Tensor) else list(m))]


def megatron_ddp_hook(p: torch.Tensor) -> None:
    """megatron-core 0.16.1 ``DistributedDataParallel._make_backward_post_hook``, restated (as
    tests/integrations/test_integration_megatron_echo.py does): on the grad accumulator, add ``.grad`` into
    ``main_grad`` unless a fused wgrad set ``grad_added_to_main_grad``; then clear ``.grad``."""

    def hook(*unused):
        if p.grad is not None and not p.grad_added_to_main_grad:
            p.main_grad.add_(p.grad.data)
        p.grad = None

    acc = p.expand_as(p).grad_fn.next_functions[0][0]
    acc.register_hook(hook)
    p._ddp_grad_acc = acc


def train_rank(
    group: Any,
    world: int,
    epr: int,
    slots: int,
    layers: int,
    *,
    ultracomm: bool,
    stack: str = "backward",
    form: str = "stacked",
    steps: int = 3,
    optimizer: str = "adamw",
    cold: tuple = (),
    frozen: bool = False,
    planner: Any = "device",
    tokens: int = 24,
    twice: bool = False,
    checkpoint: bool = False,
    evaluate: str | None = None,
    fp8: str | None = None,
    master_dtype: torch.dtype = torch.float32,
) -> dict:
    """``steps`` optimizer steps of the loopback MoE on rank ``group.rank``.  Returns
    ``{"loss": [...], "grads": [per step, per tensor: grad or None], "params": [per tensor]}``;
    with ``frozen`` every expert is frozen and a per-layer input scale ``x_scale`` is what trains
    (its gradient comes through the experts' Dgrad, so through the replicas' restore; one value
    on every rank, its gradient summed over the ranks).  ``twice``: each MoE layer applied twice
    per block (other tokens each time); ``checkpoint``: each block under non-reentrant
    activation checkpointing; ``evaluate``: between the forward and the backward, an evaluation
    forward with grad enabled whose output is dropped -- ``"plain"`` (its steps drop themselves
    when their graph dies) or ``"scope"`` (inside ``mgr.evaluating()``)."""
    import contextlib

    import torch.utils.checkpoint as cp
    from ultracomm.moe import ReplicaManager, linear

    r, E = group.rank, world * epr
    params = mh.make_params(r, epr, layers, master_dtype, form, False, False)
    tensors = flat(params)
    copies = [fp8_copies(p, fp8) for p in params] if fp8 else None
    scales = [torch.nn.Parameter(torch.ones(())) for _ in range(layers)]
    if frozen:
        for t in tensors:
            t.requires_grad_(False)
    mgr = None
    if ultracomm:
        mgr = ReplicaManager(
            group,
            fp8_layout(fp8, master_dtype) if fp8 else mh.layout(),
            epr,
            slots,
            layers,
            planner=planner,
            timeout_s=20,
            max_microbatches=2 if twice or evaluate == "plain" else 1,
        )
        for layer in range(layers):
            if fp8:  # the runtime copies are multicast; the replicas' gradients reduce into the masters
                mgr.register_layer(layer, copies[layer], masters=[params[layer][0], None, params[layer][1], None])
            else:
                mgr.register_layer(layer, params[layer])
    trained = scales if frozen else tensors
    main_grad = stack in MAIN_GRAD_STACKS
    if main_grad:  # after registration, as Megatron's DDP does
        for t in trained:
            t.main_grad = torch.zeros(t.shape)
            if stack == "megatron_ddp":
                t.grad_added_to_main_grad = False
                megatron_ddp_hook(t)
    make = {
        "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-2, weight_decay=0.1),
        "sgd": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9),
    }[optimizer]
    seen: dict[int, torch.Tensor | None] = {}
    if stack == "hook_step":
        opts = {id(t): make([t]) for t in trained}

        def step_in_backward(p: torch.Tensor) -> None:
            if p.grad is None:  # called for a None gradient too; optimizers skip those (torchtitan's step does)
                return
            seen[id(p)] = p.grad.clone()
            opts[id(p)].step()
            p.grad = None

        for t in trained:
            t.register_post_accumulate_grad_hook(step_in_backward)
    else:
        opt = make(trained)

    def block(layer: int, it: int, scale: torch.Tensor) -> torch.Tensor:
        total = torch.zeros(())
        for mb in [it, 50 + it] if twice else [it]:
            _, rmap, probs, _ = mh.batch(r, layer, mb, E, tokens, cold=cold)
            step = mgr.step(layer, rmap, probs) if mgr else NoReplica(world, epr, slots)
            reps = step.replica_weights() if mgr else None
            if mgr and torch.is_grad_enabled() and not mgr._evaluating:
                out["replicated"] += int((step.result.plan.slot_src >= 0).sum())
            home, lin = params[layer], linear
            if fp8:
                home = [
                    [home_weight(params[layer][i], *copies[layer][2 * i : 2 * i + 2], j) for j in range(epr)]
                    for i in range(2)
                ]
                reps = reps and [list(zip(reps[0], reps[1])), list(zip(reps[2], reps[3]))]
                lin = fp8_linear
            part = mh.rank_loss(
                step,
                r,
                world,
                layer,
                mb,
                home,
                reps,
                lin,
                tokens=tokens,
                skip_replicas=mgr is None,
                cold=cold,
                x_scale=scale,
            )
            total = total + (step.guard(part) if mgr else part)
        return total

    def forward(it: int) -> torch.Tensor:
        loss = 0 * sum(scales)  # a graph also on a rank that computes no token
        for layer in range(layers):
            if checkpoint:
                loss = loss + cp.checkpoint(block, layer, it, scales[layer], use_reentrant=False)
            else:
                loss = loss + block(layer, it, scales[layer])
        return loss

    out = {"loss": [], "grads": [], "params": None, "replicated": 0}
    for it in range(steps):
        if fp8:  # the caller refreshes its runtime copies in place before the step multicasts them
            for p, c in zip(params, copies):
                fp8_copies(p, fp8, out=c)
        loss = forward(it)
        if evaluate:  # its output dropped at once; the training step in flight must not notice
            with mgr.evaluating() if mgr and evaluate == "scope" else contextlib.nullcontext():
                forward(100 + it)
        out["loss"].append(loss.item())
        if stack == "autograd_grad":
            got = torch.autograd.grad(loss, trained, allow_unused=True)
            for t, g in zip(trained, got):
                t.grad = g
            grads = [None if g is None else g.clone() for g in got]
        else:
            seen.clear()
            loss.backward()
            if stack == "hook_step":
                grads = [seen.get(id(t)) for t in trained]
            elif main_grad:
                grads = [t.main_grad.clone() for t in trained]
            else:
                grads = [None if t.grad is None else t.grad.clone() for t in trained]
        if frozen:  # the scales are one parameter replicated on every rank (data parallel): sum their grads
            every = group.all_gather_object([t.grad for t in trained], op="test", what="scale grads")
            for i, t in enumerate(trained):
                t.grad = sum(g[i] for g in every)
            grads = [t.grad.clone() for t in trained]
        out["grads"].append(grads)
        if main_grad:  # an optimizer that reads only main_grad
            with torch.no_grad():
                for t in trained:
                    t.sub_(1e-2 * t.main_grad)
                    if stack == "rebound_main_grad":
                        t.main_grad = torch.zeros(t.shape)
                    else:
                        t.main_grad.zero_()
                    if stack == "megatron_ddp":
                        t.grad_added_to_main_grad = False
                    t.grad = None
        elif stack != "hook_step":
            opt.step()
            opt.zero_grad(set_to_none=True)
    out["params"] = [t.detach().clone() for t in trained]
    if mgr:
        mgr.close()
    return out


def fp8_layout(scaling: str, master_dtype: torch.dtype):
    """``mh.layout()``'s experts as FP8 runtime copies with their scales."""
    from ultracomm import ExpertLayout, Member
    from ultracomm.fp8 import scale_shape

    members = []
    for name, shape in (("fc1", (mh.I, mh.H)), ("fc2", (mh.H, mh.I))):
        sshape, sdtype = scale_shape(shape, scaling)
        members += [
            Member(name, shape, torch.float8_e4m3fn, master_dtype=master_dtype),
            Member(f"{name}_scale", sshape, sdtype, grad=False),
        ]
    return ExpertLayout(tuple(members))


def fp8_copies(masters: list[Any], scaling: str, out: list | None = None) -> list[torch.Tensor]:
    """``[q1, s1, q2, s2]``: the FP8 runtime copies of one layer's stacked masters."""
    from ultracomm.fp8 import quantize

    res = []
    for i, m in enumerate(masters):
        if not isinstance(m, torch.Tensor):
            raise ValueError("the FP8 harness takes stacked masters (form='stacked')")
        res += quantize(m, torch.float8_e4m3fn, scaling, out=None if out is None else (out[2 * i], out[2 * i + 1]))
    return res


def home_weight(master: torch.Tensor, q: torch.Tensor, s: torch.Tensor, j: int) -> torch.Tensor:
    """Home expert ``j``'s FP8 weight, straight through to the master; a master with a
    ``main_grad`` gets the wgrad there (fused, as an FP8 GEMM with wgrad fusion does)."""
    from ultracomm.fp8 import quantized_weight

    w = quantized_weight(master, q, s)[j].float()  # the tokens are fp32: the GEMM is (as replicas' are)
    if hasattr(master, "main_grad"):
        w.main_grad = master.main_grad[j]
    return w


def fp8_linear(x: torch.Tensor, w: Any) -> torch.Tensor:
    """``moe.linear`` on a home weight, or on a replica's ``(q, scale)``."""
    from ultracomm.moe import linear

    return linear(x, *w) if isinstance(w, tuple) else linear(x, w)


def train(world: int, epr: int, slots: int, layers: int = 2, **kw) -> list[dict]:
    from ultracomm import LoopbackDomain

    return LoopbackDomain(world).run(lambda g: train_rank(g, world, epr, slots, layers, **kw), timeout=240)


def compare(base: list[dict], got: list[dict], tol: float = 1e-5) -> None:
    """Every step's loss and every gradient (None where the baseline has None), and the
    parameters after the last step, within ``tol`` of each tensor's largest value."""

    def close(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
        scale = max(a.abs().max().item(), 1e-30)
        err = (a.double() - b.double()).abs().max().item() / scale
        assert err <= tol, f"{what}: differs from the run without ultracomm by {err:.3g} of its largest value"

    assert sum(g["replicated"] for g in got) > 0, "no training step placed a replica: the case tests nothing"
    steps = len(base[0]["loss"])
    for it in range(steps):
        close(
            torch.tensor(sum(b["loss"][it] for b in base)),
            torch.tensor(sum(g["loss"][it] for g in got)),
            f"step {it} loss",
        )
    for r, (b, g) in enumerate(zip(base, got)):
        for it in range(steps):
            for i, (x, y) in enumerate(zip(b["grads"][it], g["grads"][it])):
                where = f"rank {r} step {it} tensor {i}"
                assert (x is None) == (y is None), (
                    f"{where}: grad is {'None' if y is None else 'a tensor'} where the run without ultracomm has "
                    f"{'None' if x is None else 'a tensor'}"
                )
                if x is not None:
                    close(x, y, f"{where} grad")
        for i, (x, y) in enumerate(zip(b["params"], g["params"])):
            close(x, y, f"rank {r} tensor {i} after {steps} steps")
