"""Quickstart: a small MoE trained with ultracomm's ReplicaManager, token dispatch included.

    torchrun --nproc-per-node 4 examples/quickstart.py                    # CPU: gloo + host executor
    torchrun --nproc-per-node 4 examples/quickstart.py --no-replication   # the same model without it

Each rank holds EPR SwiGLU experts per layer (fc1 [2I, H], fc2 [H, I]) and SLOTS spare replica
slots.  A router skewed towards a few hot experts sends each token to TOP_K experts.  Per layer:

1. ``mgr.step(...)`` exchanges the expert loads, plans which hot experts get replicas where, and
   multicasts their weights into the replica slots (asynchronously);
2. ``step.rerouted("physical")`` sends part of the hot experts' tokens to those replicas: columns
   ``[T, world * (EPR + SLOTS)]``, per rank its EPR home experts, then its SLOTS replica slots;
3. the tokens travel to the rank of their column (``all_to_all_single``), the rank runs its home
   experts and its replicas (``step.replica_weights()``), wraps the output in ``step.guard(...)``
   and the results travel back;
4. ``loss.backward()`` reduces the replicas' gradients into their masters' ``.grad``, so the
   optimizer step sees ordinary gradients.

Rank 0 prints per step the loss and the token imbalance (max:mean over ranks) before and after
balancing; ``--no-replication`` prints the same losses (tests/moe/test_example_quickstart.py checks).
CPU only, as written (gloo); on GPUs use NCCL and put the tensors on each rank's device.
"""

import argparse

import torch
import torch.distributed as dist
import torch.nn.functional as F

from ultracomm import ExpertLayout, ReplicaManager
from ultracomm.moe import linear  # x @ w.T; wgrads accumulate in fp32

H, I, EPR, SLOTS, LAYERS, TOKENS, TOP_K, HOT = 32, 48, 4, 2, 2, 128, 2, 2


class AllToAll(torch.autograd.Function):
    """Rows to the ranks (``send[r]`` rows to rank r, ``recv[r]`` from it); the backward sends the
    gradients back the same way."""

    @staticmethod
    def forward(ctx, x, send, recv):
        ctx.counts = send, recv
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send)
        return out

    @staticmethod
    def backward(ctx, g):
        send, recv = ctx.counts
        return AllToAll.apply(g, recv, send), None, None


def expert(x, fc1, fc2):
    gate, up = linear(x, fc1).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, fc2)


def moe_layer(layer, h, router, fc1, fc2, mgr):
    logits = h @ router[layer].t()
    logits = logits + 2.0 * (torch.arange(logits.shape[1]) < HOT)  # skew: experts 0..HOT-1 are hot
    routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, logits.topk(TOP_K).indices, True)
    probs = torch.softmax(logits.masked_fill(~routing_map, float("-inf")), dim=1)  # [T, E]

    slots, step = 0, None
    if mgr is not None:
        step = mgr.step(layer, routing_map, probs)  # loads, plan, async weight multicast
        routing_map, probs = step.rerouted("physical")  # [T, world*(EPR+SLOTS)]
        fc1_rep, fc2_rep = step.replica_weights()  # per slot [2I, H] / [H, I]
        slots = SLOTS

    # dispatch: every (token, column) pair goes to the rank that holds the column
    world, per_rank = dist.get_world_size(), EPR + slots
    tok, col = routing_map.nonzero(as_tuple=True)
    order = torch.argsort(col, stable=True)  # grouped by destination rank
    tok, col = tok[order], col[order]
    send = torch.bincount(col // per_rank, minlength=world)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    send, recv = send.tolist(), recv.tolist()
    x = AllToAll.apply(h[tok], send, recv)  # rows this rank computes
    local = AllToAll.apply(col % per_rank, send, recv)  # their local column

    # experts: local column j < EPR is home expert j, else replica slot j - EPR.  y starts as
    # x * 0 (not zeros): it depends on x, so the backward all-to-all runs on every rank, also
    # on one that received no rows (its peers would otherwise wait for it forever).
    y = x * 0
    for j in range(per_rank):
        rows = (local == j).nonzero().squeeze(1)
        if rows.numel():
            w1, w2 = (fc1[layer][j], fc2[layer][j]) if j < EPR else (fc1_rep[j - EPR], fc2_rep[j - EPR])
            y = y.index_copy(0, rows, expert(x[rows], w1, w2))
    if step is not None:
        y = step.guard(y)  # backward: restores the replicas, then reduces their grads home
    y = AllToAll.apply(y, recv, send)  # results back to the tokens' rank
    return h + torch.zeros_like(h).index_add(0, tok, y * probs[tok, col].unsqueeze(1)), step


def main():
    p = argparse.ArgumentParser(description="ultracomm quickstart (torchrun, CPU)")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--no-replication", action="store_true", help="the same model without ultracomm")
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    g = torch.Generator().manual_seed(0)  # every rank draws the whole model, keeps its experts
    router = [torch.randn(EPR * world, H, generator=g) / H**0.5 for _ in range(LAYERS)]
    w1 = [torch.randn(EPR * world, 2 * I, H, generator=g) / H**0.5 for _ in range(LAYERS)]
    w2 = [torch.randn(EPR * world, H, I, generator=g) / I**0.5 for _ in range(LAYERS)]
    # this rank's masters: experts rank*EPR .. rank*EPR+EPR-1, stacked [EPR, *shape]
    fc1 = [torch.nn.Parameter(w[rank * EPR : (rank + 1) * EPR].clone()) for w in w1]
    fc2 = [torch.nn.Parameter(w[rank * EPR : (rank + 1) * EPR].clone()) for w in w2]

    mgr = None
    if not args.no_replication:
        # one manager per expert layout (all these layers share one); fp32 here, bf16 by default
        layout = ExpertLayout.swiglu(hidden=H, moe_inter=I, dtype=torch.float32)
        mgr = ReplicaManager(None, layout, experts_per_rank=EPR, slots_per_rank=SLOTS, num_layers=LAYERS)
        for layer in range(LAYERS):
            mgr.register_layer(layer, [fc1[layer], fc2[layer]])

    for it in range(args.steps):
        h = torch.randn(TOKENS, H, generator=torch.Generator().manual_seed(1 + rank))  # one batch, fitted
        target = torch.sin(h)
        imbalance = []
        for layer in range(LAYERS):
            h, step = moe_layer(layer, h, router, fc1, fc2, mgr)
            if step is not None:
                imbalance.append(step.imbalance)  # (before, after) max:mean of the ranks' token loads
        loss = ((h - target) ** 2).mean()
        loss.backward()  # replica grads reach fc1/fc2 .grad through autograd
        with torch.no_grad():
            for w in fc1 + fc2:
                if w.grad is not None:  # None: no token reached these experts, nor their replicas
                    w -= 0.05 * w.grad
                    w.grad = None
        loss = loss.detach()
        dist.all_reduce(loss)
        if rank == 0:
            imb = ", ".join(f"{before:.2f} -> {after:.2f}" for before, after in imbalance)
            imb = f"  imbalance per layer {imb}" if imb else ""
            print(f"step {it} loss {loss.item() / world:.6f}{imb}", flush=True)
    if mgr is not None:
        mgr.close()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
