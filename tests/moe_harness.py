"""A small MoE on loopback ranks for the manager's tests: every rank can regenerate every
rank's tokens, so a rank computes the tokens routed to the expert instances it hosts without
a token all-to-all, and a float64 no-replication reference is one loop in one thread."""
from __future__ import annotations

import torch

from ultracomm import ExpertLayout, Member

H, I = 6, 5  # hidden, expert inner size


def layout(dtype=torch.float32) -> ExpertLayout:
    return ExpertLayout((Member("fc1", (I, H), dtype), Member("fc2", (H, I), dtype)))


def master_weights(expert: int, dtype=torch.float32) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(500 + expert)
    return [(torch.randn(I, H, generator=g) / 2).to(dtype), (torch.randn(H, I, generator=g) / 2).to(dtype)]


def batch(rank: int, layer: int, mb: int, num_experts: int, tokens: int = 24, top_k: int = 2,
          hot: float = 3.0, dtype=torch.float32):
    """``(x [T, H], routing_map [T, E] bool, probs [T, E], upstream grad [T, H])`` of one rank:
    a router skewed towards experts 0 and 1 (their logits get ``hot`` added)."""
    g = torch.Generator().manual_seed(10_000 * layer + 100 * mb + rank)
    x = torch.randn(tokens, H, generator=g).to(dtype)
    logits = torch.randn(tokens, num_experts, generator=g)
    logits[:, :2] += hot
    top = logits.topk(top_k, dim=1).indices
    rmap = torch.zeros(tokens, num_experts, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(logits, dim=1).masked_fill(~rmap, 0).to(dtype)
    return x, rmap, probs, torch.randn(tokens, H, generator=g).to(dtype)


def expert_fn(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor, linear) -> torch.Tensor:
    return linear(torch.nn.functional.silu(linear(x, w1)), w2)


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
        for layer in range(layers):
            for m in range(2):
                want = torch.stack([ref[layer][r * epr + j][m] for j in range(epr)])
                got = grads[layer][m].double()
                assert (got - want).abs().max() <= tol * want.abs().max(), f"rank {r} layer {layer} member {m}"


def rank_loss(step, rank: int, world: int, layer: int, mb: int, masters, replicas, linear,
              tokens: int = 24, hot: float = 3.0, skip_replicas: bool = False, dtype=torch.float32) -> torch.Tensor:
    """The part of the loss computed on ``rank``: every source rank's tokens that the rerouted
    (echo layout) map sends to an instance hosted here, times a fixed upstream gradient."""
    E = step.manager.num_experts
    epr, K = step.manager.experts_per_rank, step.manager.slots_per_rank
    loss = torch.zeros((), dtype=torch.float32)
    for s in range(world):
        x, rmap, probs, up = batch(s, layer, mb, E, tokens, hot=hot, dtype=dtype)
        cmap, cprobs = step.rerouted("echo", rmap, probs, source=s)
        for j in range(epr):  # home experts
            e = rank * epr + j
            t = cmap[:, e].nonzero().squeeze(1)
            y = expert_fn(x[t], masters[0][j], masters[1][j], linear) * cprobs[t, e, None]
            loss = loss + (y * up[t]).float().sum()
        if skip_replicas:
            continue
        for k in range(K):
            c = E + rank * K + k
            t = cmap[:, c].nonzero().squeeze(1)
            if t.numel() == 0:
                continue
            y = expert_fn(x[t], replicas[0][k], replicas[1][k], linear) * cprobs[t, c, None]
            loss = loss + (y * up[t]).float().sum()
    return loss
