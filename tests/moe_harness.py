"""A small MoE on loopback ranks for the manager's tests: every rank can regenerate every
rank's tokens, so a rank computes the tokens routed to the expert instances it hosts without
a token all-to-all, and a float64 no-replication reference is one loop in one thread."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.utils.checkpoint as cp
from torch.distributed.pipelining._backward import _get_grad_fn_or_grad_acc as _grad_node
from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

from ultracomm import ExpertLayout, LoopbackDomain, Member

H, I = 6, 5  # hidden, expert inner size


def layout(dtype=torch.float32, bias: bool = False) -> ExpertLayout:
    members = [Member("fc1", (I, H), dtype), Member("fc2", (H, I), dtype)]
    if bias:
        members += [Member("b1", (I,), dtype), Member("b2", (H,), dtype)]
    return ExpertLayout(tuple(members))


def master_weights(expert: int, dtype=torch.float32, bias: bool = False) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(500 + expert)
    ws = [(torch.randn(I, H, generator=g) / 2).to(dtype), (torch.randn(H, I, generator=g) / 2).to(dtype)]
    if bias:
        ws += [(torch.randn(I, generator=g) / 2).to(dtype), (torch.randn(H, generator=g) / 2).to(dtype)]
    return ws


def batch(
    rank: int,
    layer: int,
    mb: int,
    num_experts: int,
    tokens: int = 24,
    top_k: int = 2,
    hot: float = 3.0,
    dtype=torch.float32,
    cold: tuple = (),
):
    """``(x [T, H], routing_map [T, E] bool, probs [T, E], upstream grad [T, H])`` of one rank:
    a router skewed towards experts 0 and 1 (their logits get ``hot`` added); experts in
    ``cold`` get no token."""
    g = torch.Generator().manual_seed(10_000 * layer + 100 * mb + rank)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, :2] += hot
    logits[:, list(cold)] = float("-inf")
    top = logits.topk(top_k, dim=1).indices
    rmap = torch.zeros(tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(logits, dim=1).masked_fill(~rmap, 0).to(dtype)
    return x, rmap, probs, torch.randn(tokens, H, generator=g).to(dtype)


def expert_fn(
    x: torch.Tensor,
    w1: torch.Tensor,
    w2: torch.Tensor,
    linear,
    b1: torch.Tensor | None = None,
    b2: torch.Tensor | None = None,
) -> torch.Tensor:
    h = linear(x, w1)
    h = torch.nn.functional.silu(h if b1 is None else h + b1)
    y = linear(h, w2)
    return y if b2 is None else y + b2


def reference_grads(world: int, epr: int, layers: int, mbs: int, tokens: int = 24, hot: float = 3.0):
    """float64 master grads without replication: ``grads[layer][expert] = [d fc1, d fc2]``."""
    E = world * epr
    out = []
    for layer in range(layers):
        ws = [[w.double().requires_grad_() for w in master_weights(e)] for e in range(E)]
        loss = 0
        for mb in range(mbs):
            for s in range(world):
                x, rmap, probs, up = batch(s, layer, mb, E, tokens, hot=hot)
                x, probs, up = x.double(), probs.double(), up.double()
                for e in range(E):
                    t = rmap[:, e].nonzero().squeeze(1)
                    y = expert_fn(x[t], *ws[e], lambda a, w: a @ w.t()) * probs[t, e, None]
                    loss = loss + (y * up[t]).float().sum()
        loss.backward()
        out.append([[w.grad for w in ws[e]] for e in range(E)])
    return out


# fp32 master grads vs the float64 reference: each element is a sum of ~50 token terms whose
# association differs (home + fp32-reduced replicas vs one sum); fp32 rounding of the terms and of
# the sums bounds the difference by a few ulps of the largest partial sum, well inside 1e-5 relative
TOL = 1e-5


def check_grads(per_rank_grads, world: int, epr: int, layers: int, mbs: int = 1, tol: float = TOL) -> None:
    """Assert ``per_rank_grads[r][layer][member]`` (``[epr, *shape]``) match the float64
    no-replication reference within ``tol`` of each tensor's largest gradient."""
    ref = reference_grads(world, epr, layers, mbs)
    for r, grads in enumerate(per_rank_grads):
        check_rank_grads(grads, r, ref, epr, layers, tol)


def check_rank_grads(grads, rank: int, ref, epr: int, layers: int, tol: float = TOL) -> None:
    """Rank ``rank``'s part of :func:`check_grads` against ``ref = reference_grads(...)``."""
    for layer in range(layers):
        for m in range(2):
            want = torch.stack([ref[layer][rank * epr + j][m] for j in range(epr)])
            got = grads[layer][m].double()
            assert (got - want).abs().max() <= tol * want.abs().max(), f"rank {rank} layer {layer} member {m}"


def rank_loss(
    step,
    rank: int,
    world: int,
    layer: int,
    mb: int,
    masters,
    replicas,
    linear,
    tokens: int | Callable[[int], int] = 24,
    hot: float = 3.0,
    skip_replicas: bool = False,
    dtype=torch.float32,
    cold: tuple = (),
    x_scale: torch.Tensor | None = None,
) -> torch.Tensor:
    """The part of the loss computed on ``rank``: every source rank's tokens that the rerouted
    (echo layout) map sends to an instance hosted here, times a fixed upstream gradient.
    ``masters[m][j]``: member ``m`` of home expert ``j``; ``replicas[m][k]``: of slot ``k``;
    ``tokens``: per rank, or a function of the rank; ``cold``: experts the router never picks;
    ``x_scale``: multiplies every token (a parameter that takes a gradient through the experts'
    Dgrad)."""
    E = step.manager.num_experts
    epr, K = step.manager.experts_per_rank, step.manager.slots_per_rank
    ntok = tokens if callable(tokens) else (lambda s: tokens)
    loss = torch.zeros((), dtype=torch.float32)
    for s in range(world):
        x, rmap, probs, up = batch(s, layer, mb, E, ntok(s), hot=hot, dtype=dtype, cold=cold)
        if x_scale is not None:
            x = x * x_scale
        cmap, cprobs = step.rerouted("echo", rmap, probs, source=s)
        for j in range(epr):  # home experts
            e = rank * epr + j
            t = cmap[:, e].nonzero().squeeze(1)
            if t.numel() == 0:  # as dispatchers do: an expert without tokens is not run (its .grad may stay None)
                continue
            y = expert_fn(x[t], *[m[j] for m in masters[:2]], linear, *[m[j] for m in masters[2:]])
            loss = loss + (y * cprobs[t, e, None] * up[t]).float().sum()
        if skip_replicas:
            continue
        for k in range(K):
            c = E + rank * K + k
            t = cmap[:, c].nonzero().squeeze(1)
            if t.numel() == 0:
                continue
            y = expert_fn(x[t], *[m[k] for m in replicas[:2]], linear, *[m[k] for m in replicas[2:]])
            loss = loss + (y * cprobs[t, c, None] * up[t]).float().sum()
    return loss


# ------------------------------------------------------------------ whole training runs
FORMS = ("stacked", "list", "parameter_list")


def parse_schedule(text: str) -> list[tuple[str, int]]:
    """``"F0 F1 B1 B0"`` -> ``[("F", 0), ("F", 1), ("B", 1), ("B", 0)]``; ``I<mb>``: an
    input-gradient pass (``autograd.grad`` of the micro-batch's anchor input, graph retained)
    before its ``B``, as zero-bubble schedules run ahead of the weight pass."""
    out = [(w[0], int(w[1:])) for w in text.split()]
    assert all(k in "FIB" for k, _ in out), text
    return out


def in_flight(schedule: list[tuple[str, int]]) -> int:
    """Most micro-batches forwarded and not yet backwarded at once."""
    live = peak = 0
    for kind, _ in schedule:
        live += {"F": 1, "B": -1}.get(kind, 0)
        peak = max(peak, live)
    return peak


def make_params(rank: int, epr: int, layers: int, dtype, form: str, main_grad: bool, bias: bool) -> list[list[Any]]:
    """Per layer, per member: this rank's masters in ``form`` (``stacked``: one ``[epr, ...]``
    Parameter; ``list``: a list of per-expert Parameters (Megatron's weight0..N);
    ``parameter_list``: an ``nn.ParameterList`` of them), with an fp32 ``main_grad`` if asked."""
    out = []
    for _ in range(layers):
        ws = [master_weights(rank * epr + j, dtype, bias) for j in range(epr)]
        members = []
        for m in range(len(ws[0])):
            if form == "stacked":
                members.append(torch.nn.Parameter(torch.stack([w[m] for w in ws])))
            else:
                ps = [torch.nn.Parameter(w[m].clone()) for w in ws]
                members.append(ps if form == "list" else torch.nn.ParameterList(ps))
        for t in (t for m in members for t in (m if not isinstance(m, torch.Tensor) else [m])):
            if main_grad:
                t.main_grad = torch.zeros(t.shape, dtype=torch.float32)
        out.append(members)
    return out


def master_grads(params: list[list[Any]], main_grad: bool) -> list[list[torch.Tensor]]:
    """Per layer, per member ``[epr, ...]``: with ``main_grad``, ``main_grad + .grad`` (what
    Megatron's DDP hook adds up: fused wgrads land in main_grad, the rest in .grad), else
    ``.grad``; a tensor that got no gradient counts as zeros."""

    def g(t):
        grad = torch.zeros_like(t) if t.grad is None else t.grad
        return t.main_grad + grad.float() if main_grad else grad.clone()

    return [[g(m) if isinstance(m, torch.Tensor) else torch.stack([g(t) for t in m]) for m in ps] for ps in params]


def merge_param_groups(groups: list[dict]) -> list[dict]:
    """torch.distributed.pipelining's parameter groups with those that share a parameter or an
    intermediate merged into the first of them (order kept).  torch's ``get_param_groups`` merges
    a parameter's group into an existing one but leaves the group it first put it in: a parameter
    whose graph nodes are partly shared (each master of an ultracomm layer: its home GEMMs, and the
    layer's replica node) can end up in two groups, and the weight pass would run it twice."""
    out: list[dict] = []
    for g in groups:
        hits = [o for o in out if o["params"] & g["params"] or set(o["intermediates"]) & set(g["intermediates"])]
        if not hits:
            out.append(g)
            continue
        for o in hits[1:] + [g]:
            for node, grads in zip(o["intermediates"], o["grads"]):
                if node not in hits[0]["intermediates"]:
                    hits[0]["intermediates"].append(node)
                    hits[0]["grads"].append(grads)
            hits[0]["params"] |= o["params"]
            if o is not g:
                out.remove(o)
    return out


def stage_input_pass(loss: torch.Tensor, anchor: torch.Tensor, weights: list, mode: str) -> list[dict]:
    """torch.distributed.pipelining's input pass (``stage_backward_input``: autograd.grad of the
    stage input, the grads at the weights' intermediates saved) and its parameter groups, whose
    weight pass (``stage_backward_weight``) is one ``autograd.grad`` per group.  ``mode``:
    ``"merged"``: :func:`merge_param_groups` (what the weight pass needs); ``"duplicated"``: merged,
    plus a group holding layer 0's first master again, as torch's grouping leaves on some ranks
    (which ranks depends on set order: this makes it every rank's, deterministically)."""
    groups = merge_param_groups(stage_backward_input([loss], None, [anchor], iter(weights))[1])
    assert len(groups) > 1, "one parameter group: the weight pass would be one call"
    if mode == "duplicated":
        first = _grad_node(weights[0])
        g = next(g for g in groups if first in g["params"])
        groups.append({"params": {first}, "intermediates": list(g["intermediates"]), "grads": list(g["grads"])})
    return groups


def train(
    world: int,
    epr: int,
    slots: int,
    layers: int,
    schedule: str | list = "F0 B0",
    *,
    planner: Any = "quota",
    timeout: float = 240,
    **kw,
):
    """Train ``layers`` MoE layers of the loopback model on ``world`` loopback ranks with a
    ``ReplicaManager`` (:func:`train_rank` on each).  Returns per rank
    ``(master_grads(...), [step.imbalance, ...])``."""
    return LoopbackDomain(world).run(
        lambda group: train_rank(group, group.rank, world, epr, slots, layers, schedule, planner=planner, **kw),
        timeout=timeout,
    )


def train_rank(
    group: Any,
    rank: int,
    world: int,
    epr: int,
    slots: int,
    layers: int,
    schedule: str | list = "F0 B0",
    *,
    planner: Any = "quota",
    checkpoint: str | None = None,
    dtype=torch.float32,
    form: str = "stacked",
    main_grad: bool = False,
    bias: bool = False,
    hot: float = 3.0,
    zero_rank: int | None = None,
    tokens: int = 24,
    lin: Any = None,
    guard: bool = True,
    skip_replicas_on: tuple = (),
    max_microbatches: int | None = None,
    counter: Any = None,
    manager_options: dict | None = None,
    backward_members: tuple | None = None,
    pipelining: str | None = None,
):
    """One rank of :func:`train`: micro-batches forwarded and backwarded in ``schedule`` order.

    ``checkpoint``: None, ``"reentrant"`` or ``"non_reentrant"`` (each layer checkpointed);
    ``zero_rank``: a rank whose batches have no token; ``counter``: an object whose ``arm()``
    is called once setup is done (manager built, layers registered) and ``disarm()`` before the
    manager closes (tests counting the calls a training step makes); ``backward_members``: the
    backward is ``loss.backward(inputs=...)`` with these members' masters only; ``pipelining``:
    ``I``/``B`` run torch.distributed.pipelining's ``stage_backward_input``/``stage_backward_weight``
    (see :func:`stage_input_pass`), with ``main_grad`` under Megatron's DDP flag."""
    from ultracomm.moe import ReplicaManager, linear

    lin = lin or linear
    order = parse_schedule(schedule) if isinstance(schedule, str) else list(schedule)
    E = world * epr
    r = rank

    def ntok(s: int) -> int:
        return 0 if s == zero_rank else tokens

    mgr = ReplicaManager(
        group,
        layout(dtype, bias),
        epr,
        slots,
        layers,
        max_microbatches=max_microbatches or in_flight(order),
        planner=planner,
        timeout_s=20,
        **(manager_options or {}),
    )
    params = make_params(r, epr, layers, dtype, form, main_grad, bias)
    for layer in range(layers):
        mgr.register_layer(layer, params[layer])
    imbalance = []
    input_pass = any(kind == "I" for kind, _ in order)
    if counter is not None:
        counter.arm()

    def layer_loss(layer, mb, anchor):
        _, rmap, probs, _ = batch(r, layer, mb, E, ntok(r), hot=hot, dtype=dtype)
        step = mgr.step(layer, rmap, probs)
        imbalance.append(step.imbalance)
        reps = None if r in skip_replicas_on else step.replica_weights()
        loss = rank_loss(
            step,
            r,
            world,
            layer,
            mb,
            params[layer],
            reps,
            lin,
            tokens=ntok,
            hot=hot,
            skip_replicas=r in skip_replicas_on,
            dtype=dtype,
            x_scale=anchor if input_pass else None,  # the input-gradient pass runs through the experts
        )
        return (step.guard(loss) if guard else loss) * anchor

    def forward(mb):
        total = 0
        anchor = torch.ones((), dtype=dtype, requires_grad=True)
        for layer in range(layers):
            if checkpoint is None:
                total = total + layer_loss(layer, mb, anchor)
            else:
                total = total + cp.checkpoint(layer_loss, layer, mb, anchor, use_reentrant=checkpoint == "reentrant")
        return total, anchor

    losses = {}
    if pipelining:
        weights = [t for ps in params for m in ps for t in ([m] if isinstance(m, torch.Tensor) else m)]
        for t in weights if main_grad else ():
            t.grad_added_to_main_grad = False  # Megatron's DDP: fused wgrads return a zero dummy, not None
        groups = {}
    for kind, mb in order:
        if kind == "F":
            losses[mb] = forward(mb)
        elif pipelining and kind == "I":
            groups[mb] = stage_input_pass(*losses[mb], weights, pipelining)
        elif pipelining:
            losses.pop(mb)
            stage_backward_weight(iter(weights), groups.pop(mb))
        elif kind == "I":
            torch.autograd.grad(losses[mb][0], [losses[mb][1]], retain_graph=True)
        else:
            loss = losses.pop(mb)[0]
            if backward_members is None:
                loss.backward()
            else:
                named = [p[m] for p in params for m in backward_members]
                loss.backward(inputs=[t for m in named for t in ([m] if isinstance(m, torch.Tensor) else m)])
    out = master_grads(params, main_grad)
    if counter is not None:
        counter.disarm()
    mgr.close()
    return out, imbalance
