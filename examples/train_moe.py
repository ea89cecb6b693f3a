"""Train a tiny MoE on synthetic tokens three ways and compare them.

    torchrun --nproc-per-node 4 examples/train_moe.py --check

Every rank holds ``experts // world`` experts (SwiGLU: fc1 [2I, H], fc2 [H, I]); a router
skewed towards a few hot experts sends each token to ``top_k`` of them; tokens travel to the
rank that computes them with ``all_to_all_single`` (gloo on CPU, NCCL on GPUs).  Each step
runs ``--microbatches`` micro-batches in a 1F1B order (two forwards in flight, then one
forward per backward; ``--schedule`` gives another order, e.g. ``"F0 F1 B1 B0"``), then an
SGD update.  The modes:

* ``none``: no replication: every token goes to its expert's home rank.
* ``ultracomm``: ``ultracomm.moe.ReplicaManager`` plans replicas of the hot experts per
  layer and micro-batch, multicasts their weights into spare slots, reroutes tokens by the
  planner's quotas and reduces the replicas' gradients home inside the backward pass.
* ``echo``: the same plans, but replica weights fetched the way Megatron's MoE ECHO
  all-to-all dispatcher does (``index_select`` of the home experts + ``all_to_all_single``;
  gradients return through the all-to-all).

Per step it prints the loss, the per-rank token imbalance (max:mean) before and after
balancing, and the step time.  ``--check`` asserts that at step 0 the master expert
gradients of ``ultracomm`` and ``echo`` equal the ``none`` run's within float
reassociation (``--tol``, relative to each tensor's largest gradient; see ``TOL_WHY``) and
that two ``ultracomm`` runs are bit-identical at every step.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F

import ultracomm
from ultracomm.moe import ReplicaManager, RerouteTable, linear, reroute
from ultracomm.planners import Domain, get_planner

TOL_WHY = (
    "each master-gradient element is a sum over the tokens routed to its expert; replication "
    "splits that sum into the home rank's part and the replicas' parts (reduced in fp32 in a "
    "fixed order), so only the association of the fp32 additions changes: a few ulps of the "
    "largest partial sum, far below 1e-5 of the tensor's largest gradient"
)


class AllToAll(torch.autograd.Function):
    """``all_to_all_single`` of ``[n, ...]`` rows; the backward sends the gradients back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
        ctx.splits = (out_splits, in_splits)
        out = x.new_empty((sum(out_splits), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        out_splits, in_splits = ctx.splits
        back = g.new_empty((sum(in_splits), *g.shape[1:]))
        dist.all_to_all_single(back, g.contiguous(), in_splits, out_splits)
        return back, None, None


def exchange_counts(counts: list[int]) -> list[int]:
    send = torch.tensor(counts, dtype=torch.int64)
    recv = torch.empty_like(send)
    dist.all_to_all_single(recv, send)
    return recv.tolist()


def exchange(x: torch.Tensor, out_splits: list[int], in_splits: list[int]) -> torch.Tensor:
    out = x.new_empty((sum(out_splits), *x.shape[1:]))
    dist.all_to_all_single(out, x.contiguous(), out_splits, in_splits)
    return out


class Model:
    """Router and home experts of this rank, for ``layers`` MoE layers (residual)."""

    def __init__(self, a, rank: int, world: int):
        self.a, self.rank, self.world = a, rank, world
        self.epr = a.experts // world
        g = torch.Generator().manual_seed(a.seed)  # the same router everywhere
        self.router = [
            torch.nn.Parameter(torch.randn(a.experts, a.hidden, generator=g) / a.hidden**0.5) for _ in range(a.layers)
        ]
        self.bias = torch.zeros(a.experts)
        self.bias[: a.hot] = a.skew  # the skew: a few hot experts
        self.fc1, self.fc2 = [], []
        for layer in range(a.layers):
            w1, w2 = [], []
            for e in range(rank * self.epr, (rank + 1) * self.epr):
                ge = torch.Generator().manual_seed(a.seed + 1000 * (layer + 1) + e)
                w1.append(torch.randn(2 * a.inner, a.hidden, generator=ge) / a.hidden**0.5)
                w2.append(torch.randn(a.hidden, a.inner, generator=ge) / a.inner**0.5)
            self.fc1.append(torch.nn.Parameter(torch.stack(w1)))
            self.fc2.append(torch.nn.Parameter(torch.stack(w2)))

    def experts(self):
        return [*self.fc1, *self.fc2]

    def parameters(self):
        return [*self.router, *self.experts()]


def expert(x: torch.Tensor, w1: torch.Tensor, w2: torch.Tensor) -> torch.Tensor:
    gate, up = linear(x, w1).chunk(2, dim=-1)
    return linear(F.silu(gate) * up, w2)


def moe_layer(model: Model, layer: int, h: torch.Tensor, mode: str, mgr, planner, stats: list):
    a, W, rank, epr = model.a, model.world, model.rank, model.epr
    h_in = h
    logits = h @ model.router[layer].t() + model.bias
    top = logits.topk(a.top_k, dim=1).indices
    rmap = torch.zeros_like(logits, dtype=torch.bool).scatter_(1, top, True)
    probs = torch.softmax(logits.masked_fill(~rmap, float("-inf")), dim=1)
    K = 0 if mode == "none" else a.slots
    rep1 = rep2 = None
    step = None
    if mode == "ultracomm":
        step = mgr.step(layer, rmap, probs)
        cmap, cprobs = step.rerouted("physical")
        rep1, rep2 = step.replica_weights()
        stats.append(step.imbalance)
    elif mode == "echo":
        rows = [torch.empty(a.experts, dtype=torch.int64) for _ in range(W)]
        dist.all_gather(rows, rmap.sum(0))
        load = torch.stack(rows)
        result = planner(load.numpy(), Domain.flat(W, epr), K)
        before = load.sum(0).reshape(W, epr).sum(1).double()
        stats.append(((before.max() / before.mean()).item(), float(result.rank_load.max() / result.rank_load.mean())))
        # the same token split as ultracomm: the planner's quotas
        cmap, cprobs = reroute(rmap, probs, RerouteTable.from_result(result, rank, "physical"))
        h, rep1, rep2 = echo_fetch(model, layer, h, result.slot_src, K)
    else:
        cmap, cprobs = rmap, probs
    # dispatch: every routed (token, physical expert) pair goes to the rank hosting it
    per_rank = epr + K
    tok, col = cmap.nonzero(as_tuple=True)  # sorted by token, then column
    order = torch.argsort(col, stable=True)
    tok, col = tok[order], col[order]
    in_splits = torch.bincount(col // per_rank, minlength=W).tolist()
    out_splits = exchange_counts(in_splits)
    x_recv = AllToAll.apply(h[tok], out_splits, in_splits)
    local = exchange(col % per_rank, out_splits, in_splits)  # which local expert each row is for
    y = x_recv * 0  # tied to x_recv: the dispatch's backward all-to-all runs on every rank
    for j in range(per_rank):
        idx = (local == j).nonzero().squeeze(1)
        if idx.numel() == 0:
            continue
        w1, w2 = (model.fc1[layer][j], model.fc2[layer][j]) if j < epr else (rep1[j - epr], rep2[j - epr])
        y = y.index_copy(0, idx, expert(x_recv[idx], w1, w2))
    if mode == "ultracomm":
        y = step.guard(y)  # backward: restore this layer's replicas before the expert Dgrad
    y_back = AllToAll.apply(y, in_splits, out_splits)
    weight = cprobs[tok, col].unsqueeze(1)
    return h_in + torch.zeros_like(h).index_add(0, tok, y_back * weight)


class EchoWeights(torch.autograd.Function):
    """Megatron ECHO's all-to-all weight dispatcher: each home rank ``index_select``s the rows
    its peers' spare slots need and sends them with ``all_to_all_single``; the backward sends
    the spare slots' gradients back the same way and ``index_add``s them into the home grads.

    The layer input ``h`` passes through unchanged: it is used on every rank, so the backward
    (two collectives) runs on every rank at the same point, also where no token reached a
    spare slot (Megatron gets the same from its grouped GEMM, which touches every weight)."""

    @staticmethod
    def forward(ctx, h, w1, w2, rows, recv_slots, in_splits, out_splits, K):
        ctx.save = (rows, recv_slots, in_splits, out_splits, w1.shape, w2.shape)
        out = []
        for w in (w1, w2):
            recv = exchange(w.index_select(0, rows), out_splits, in_splits)
            slots = [torch.zeros(w.shape[1:], dtype=w.dtype) for _ in range(K)]
            for i, k in enumerate(recv_slots):
                slots[k] = recv[i]
            out += slots
        return (h.view_as(h), *out)

    @staticmethod
    def backward(ctx, gh, *grads):
        rows, recv_slots, in_splits, out_splits, *shapes = ctx.save
        K = len(grads) // 2
        home = []
        for m, shape in enumerate(shapes):
            g = [grads[m * K + k] for k in recv_slots]
            send = torch.stack(g) if g else torch.zeros((0, *shape[1:]))
            back = exchange(send, in_splits, out_splits)
            home.append(torch.zeros(shape, dtype=back.dtype).index_add_(0, rows, back))
        return (gh, *home, None, None, None, None, None)


def echo_fetch(model: Model, layer: int, h: torch.Tensor, slot_src, K: int):
    W, rank, epr = model.world, model.rank, model.epr
    send_rows, in_splits = [], []
    for d in range(W):
        rows = [int(e) % epr for e in slot_src[d] if e >= 0 and int(e) // epr == rank]
        send_rows += rows
        in_splits.append(len(rows))
    recv_slots, out_splits = [], []
    for s in range(W):
        slots = [k for k in range(K) if slot_src[rank, k] >= 0 and int(slot_src[rank, k]) // epr == s]
        recv_slots += slots
        out_splits.append(len(slots))
    h, *reps = EchoWeights.apply(
        h,
        model.fc1[layer],
        model.fc2[layer],
        torch.tensor(send_rows, dtype=torch.long),
        recv_slots,
        in_splits,
        out_splits,
        K,
    )
    return h, reps[:K], reps[K:]


def one_f_one_b(n: int, warmup: int = 2) -> list[tuple[str, int]]:
    """F0 F1 B0 F2 B1 F3 ... : ``warmup`` forwards in flight, then one forward per backward."""
    order, f, b = [], 0, 0
    while b < n:
        if f < n and f - b < warmup:
            order.append(("F", f))
            f += 1
        else:
            order.append(("B", b))
            b += 1
    return order


def schedule_of(text: str, n: int) -> list[tuple[str, int]]:
    """``--schedule``: ``1f1b`` or an explicit order such as ``"F0 F1 B1 B0"`` (pipeline
    stages run backwards in any order; each micro-batch once forward, then once backward)."""
    if text == "1f1b":
        return one_f_one_b(n)
    order = [(w[0], int(w[1:])) for w in text.split() if w[:1] in ("F", "B") and w[1:].isdigit()]
    if (
        len(order) != len(text.split())
        or sorted(order) != sorted([("F", i) for i in range(n)] + [("B", i) for i in range(n)])
        or any(order.index(("B", i)) < order.index(("F", i)) for i in range(n))
    ):
        raise SystemExit(
            f"--schedule {text!r}: give 1f1b or each of F0..F{n - 1} and B0..B{n - 1} once, every B after "
            "its F (--microbatches is the count)"
        )
    return order


def in_flight(order: list[tuple[str, int]]) -> int:
    live = peak = 0
    for kind, _ in order:
        live += 1 if kind == "F" else -1
        peak = max(peak, live)
    return peak


def train(a, mode: str, rank: int, world: int):
    """Returns per step ``(loss, [master grads])``."""
    model = Model(a, rank, world)
    mgr = None
    planner = get_planner(a.planner)
    if mode == "ultracomm":
        layout = ultracomm.ExpertLayout.swiglu(a.hidden, a.inner, dtype=torch.float32)
        order = schedule_of(a.schedule, a.microbatches)
        mgr = ReplicaManager(
            None, layout, model.epr, a.slots, a.layers, max_microbatches=in_flight(order), planner=a.planner
        )
        for layer in range(a.layers):
            mgr.register_layer(layer, [model.fc1[layer], model.fc2[layer]])
    history = []
    for step in range(a.steps):
        t0 = time.perf_counter()
        for p in model.parameters():
            p.grad = None
        losses, stats, pending = [], [], {}
        for kind, mb in schedule_of(a.schedule, a.microbatches):
            if kind == "F":
                g = torch.Generator().manual_seed(a.seed + 7919 * step + 104729 * mb + rank)
                h = torch.randn(a.tokens, a.hidden, generator=g)
                target = torch.sin(h)
                for layer in range(a.layers):
                    h = moe_layer(model, layer, h, mode, mgr, planner, stats)
                pending[mb] = ((h - target) ** 2).mean()
            else:
                loss = pending.pop(mb)
                loss.backward()
                losses.append(loss.detach())
        for p in model.router:  # data parallel over the EP group
            dist.all_reduce(p.grad)
        grads = [p.grad.clone() for p in model.experts()]
        with torch.no_grad():
            for p in model.parameters():
                p -= a.lr * p.grad
        loss = torch.stack(losses).mean()
        dist.all_reduce(loss)
        ms = (time.perf_counter() - t0) * 1000
        if rank == 0:
            imb = ""
            if stats:
                imb = " imbalance {:.2f} -> {:.2f}".format(
                    sum(s[0] for s in stats) / len(stats), sum(s[1] for s in stats) / len(stats)
                )
            print(f"step {step} {mode:9s} loss {loss.item() / world:.6f}{imb} time {ms:.1f} ms", flush=True)
        history.append((loss, grads))
    if mgr is not None:
        mgr.close()
    return history


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--modes", default="none,ultracomm,echo")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--experts", type=int, default=32)
    p.add_argument("--slots", type=int, default=2, help="replica slots per rank")
    p.add_argument("--top-k", type=int, default=2)
    p.add_argument("--hidden", type=int, default=16)
    p.add_argument("--inner", type=int, default=24)
    p.add_argument("--tokens", type=int, default=64, help="tokens per rank and micro-batch")
    p.add_argument("--microbatches", type=int, default=4)
    p.add_argument("--schedule", default="1f1b", help='1f1b, or an order such as "F0 F1 B1 B0"')
    p.add_argument("--hot", type=int, default=3, help="hot experts (their logits get --skew added)")
    p.add_argument("--skew", type=float, default=2.5)
    p.add_argument("--planner", default="quota")
    p.add_argument("--lr", type=float, default=0.05)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--check", action="store_true", help="assert the comparisons (exit 1 if one fails)")
    p.add_argument("--tol", type=float, default=1e-5)
    a = p.parse_args(argv)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    if a.check:  # which process is which rank (the test checks /dev/shm for this run's leftovers only)
        sys.stdout.write(f"rank {rank} pid {os.getpid()}\n")  # one write: torchrun interleaves ranks' output
        sys.stdout.flush()
    if a.experts % world:
        raise SystemExit(f"--experts {a.experts} must divide by the world size {world}")
    modes = a.modes.split(",")
    runs = {m: train(a, m, rank, world) for m in modes}
    failures = []
    if a.check:
        if "ultracomm" in runs:
            again = train(a, "ultracomm", rank, world)
            same = all(
                torch.equal(l1, l2) and all(torch.equal(x, y) for x, y in zip(g1, g2))
                for (l1, g1), (l2, g2) in zip(runs["ultracomm"], again)
            )
            if not same:
                failures.append("two ultracomm runs differ")
        ref = runs["none"][0][1]
        for m in ("ultracomm", "echo"):
            if m not in runs:
                continue
            worst = max(
                (g - r).abs().max().item() / max(r.abs().max().item(), 1e-30) for g, r in zip(runs[m][0][1], ref)
            )
            ok = worst <= a.tol
            if rank == 0:
                print(
                    f"check {m}: master grads vs none at step 0: max relative difference {worst:.2e} "
                    f"({'<=' if ok else '>'} {a.tol:g})",
                    flush=True,
                )
            if not ok:
                failures.append(f"{m} master grads differ from none by {worst:.2e}")
        flags = torch.tensor([len(failures)])
        dist.all_reduce(flags)
        if rank == 0:
            print(
                f"check: bit-identical ultracomm reruns: {'yes' if 'two ultracomm runs differ' not in failures else 'NO'}"
            )
            print(f"check: tolerance {a.tol:g} because {TOL_WHY}")
            print("check " + ("OK" if int(flags) == 0 else "FAILED"), flush=True)
        failures = failures or (["a peer rank failed a check"] if int(flags) else [])
    for f in failures:
        print(f"rank {rank}: {f}", file=sys.stderr)
    dist.destroy_process_group()
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
