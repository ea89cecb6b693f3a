"""What the backward's wait for the replicas' reduce costs a training step (issue 32), host executor.

    OMP_NUM_THREADS=1 ULTRACOMM_NUM_WORKERS=1 python -m torch.distributed.run --standalone --nproc-per-node 4 \\
        perf/bench_backward_wait.py [--steps 20] [--layers 4] [--hidden 256] [--inner 128] [--tokens 256] [--json PATH]

Since issue 32 ``_ReplicaWeights.backward`` returns the reduced replica gradients, so on the host
executor ``Step._backward_reduce`` waits for ``grad_reduce`` (``work.wait_stream()``, i.e.
``Work.wait()``) before the backward goes on; before, the reduce was waited for at the end of the
backward and could overlap the compute between that MoE layer and the next one.

The model (gloo, ``ReplicaManager`` with its default settings, 4 experts and 2 replica slots per
rank): ``--layers`` layers, each a dense block ``tanh(x @ W)`` (``x`` ``[T, H]``, ``W`` ``[H, H]``)
followed by a residual MoE layer through the manager (``ExpertLayout`` fc1 ``[I, H]``, fc2
``[H, I]`` fp32, ``ultracomm.moe.linear``, ``step.rerouted("physical")`` / ``replica_weights`` /
``guard``; a router skewed towards experts 0 and 1, so replicas are placed).  There is no token
all-to-all: each rank runs its own tokens through the expert instances it hosts (home experts and
replica slots) and tokens routed elsewhere pass by the residual; the manager's traffic (loads,
weight_sync, restore, grad_reduce) is the real one.  SGD updates every parameter after each step.

Per step, on every rank, side by side:
* ``step``: forward + backward wall time (after a barrier);
* ``wait``: time the backward spends in ``Work.wait_stream`` called from ``_backward_reduce``
  (wrapped; calls from anywhere else, or outside ``loss.backward()``, are not counted);
* ``dense``: the dense blocks' backward (timed inside their autograd function's backward) -- the
  compute an asynchronous reduce could hide behind;
* ``bound``: ``min(wait, dense)``: an upper bound of what the wait costs over the asynchronous
  reduce (it could at most have overlapped the dense backward; the next MoE layer's ``restore``
  queues behind the reduce on the host executor's runner thread anyway).
Each is the max over ranks of that step; the table shows the median over steps (after 3 warm-up
steps).  ``expert bytes``: one expert's weights, fc1 + fc2 in fp32 = ``8 * H * I`` (the reduce
carries the same bytes of fp32 gradient per replica).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import torch
import torch.distributed as dist

from ultracomm import ExpertLayout, Member
from ultracomm.moe import ReplicaManager, linear
from ultracomm.work import Work

EPR, SLOTS, TOP_K, WARMUP = 4, 2, 2, 3
COLUMNS = (
    "world",
    "expert bytes",
    "step ms",
    "reduce wait in bwd ms",
    "wait/step %",
    "dense bwd ms",
    "min(wait,dense)/step %",
)
TIMES = {"wait": 0.0, "dense": 0.0, "waits": 0}
IN_BACKWARD = [False]


def wrap_wait() -> None:
    """Count the time of ``Work.wait_stream`` calls made by ``_backward_reduce`` during the backward."""
    orig = Work.wait_stream

    def timed(self):
        if not (IN_BACKWARD[0] and sys._getframe(1).f_code.co_name == "_backward_reduce"):
            return orig(self)
        t0 = time.perf_counter()
        try:
            return orig(self)
        finally:
            TIMES["wait"] += time.perf_counter() - t0
            TIMES["waits"] += 1

    Work.wait_stream = timed


class Dense(torch.autograd.Function):
    """``tanh(x @ w)`` whose backward times itself into ``TIMES["dense"]``."""

    @staticmethod
    def forward(ctx, x, w):
        y = torch.tanh(x @ w)
        ctx.save_for_backward(x, w, y)
        return y

    @staticmethod
    def backward(ctx, gy):
        t0 = time.perf_counter()
        x, w, y = ctx.saved_tensors
        gz = gy * (1 - y * y)
        gx, gw = gz @ w.t(), x.t() @ gz
        TIMES["dense"] += time.perf_counter() - t0
        return gx, gw


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--inner", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--json", default=None)
    a = ap.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    H, I, T, L, E, P = a.hidden, a.inner, a.tokens, a.layers, EPR * world, EPR + SLOTS
    wrap_wait()
    layout = ExpertLayout((Member("fc1", (I, H), torch.float32), Member("fc2", (H, I), torch.float32)))
    mgr = ReplicaManager(None, layout, EPR, SLOTS, L)  # the default settings
    g = torch.Generator().manual_seed(rank)
    dense = [torch.nn.Parameter(torch.randn(H, H, generator=g) / H**0.5) for _ in range(L)]
    experts = [
        [
            torch.nn.Parameter(torch.randn(EPR, I, H, generator=g) / H**0.5),
            torch.nn.Parameter(torch.randn(EPR, H, I, generator=g) / I**0.5),
        ]
        for _ in range(L)
    ]
    for layer in range(L):
        mgr.register_layer(layer, experts[layer])
    params = dense + [p for ps in experts for p in ps]

    def moe(layer: int, h: torch.Tensor, it: int) -> torch.Tensor:
        gr = torch.Generator().manual_seed(1_000_000 * it + 1000 * layer + rank)
        logits = torch.randn(T, E, generator=gr)
        logits[:, :2] += 3.0  # hot experts 0 and 1 (on rank 0)
        rmap = torch.zeros(T, E, dtype=torch.bool).scatter_(1, logits.topk(TOP_K, dim=1).indices, True)
        probs = torch.softmax(logits, dim=1).masked_fill(~rmap, 0)
        step = mgr.step(layer, rmap, probs)
        replicas.add(int((step.result.slot_src >= 0).sum()))
        cmap, cprobs = step.rerouted("physical")
        fc1_rep, fc2_rep = step.replica_weights()
        fc1, fc2 = experts[layer]
        weights = [(fc1[j], fc2[j]) for j in range(EPR)] + list(zip(fc1_rep, fc2_rep))
        y = torch.zeros_like(h)
        for i, (w1, w2) in enumerate(weights):  # this rank's instances: its masters, then its slots
            col = rank * P + i
            t = cmap[:, col].nonzero().squeeze(1)
            if t.numel():
                out = linear(torch.nn.functional.silu(linear(h[t], w1)), w2) * cprobs[t, col, None]
                y = y.index_add(0, t, out)
        return h + step.guard(y)

    rows, waits, replicas = [], set(), set()  # replicas: slots filled (all ranks) per layer step
    for it in range(WARMUP + a.steps):
        x = torch.randn(T, H, generator=torch.Generator().manual_seed(it * 100 + rank))
        TIMES.update(wait=0.0, dense=0.0, waits=0)
        dist.barrier()
        t0 = time.perf_counter()
        for layer in range(L):
            x = moe(layer, Dense.apply(x, dense[layer]), it)
        loss = x.square().mean()
        IN_BACKWARD[0] = True
        loss.backward()
        IN_BACKWARD[0] = False
        dt = time.perf_counter() - t0
        with torch.no_grad():
            for p in params:
                p.sub_(1e-3 * p.grad)
                p.grad = None
        m = torch.tensor([dt, TIMES["wait"], TIMES["dense"], min(TIMES["wait"], TIMES["dense"])], dtype=torch.float64)
        dist.all_reduce(m, op=dist.ReduceOp.MAX)
        if it >= WARMUP:
            rows.append(m.tolist())
            waits.add(TIMES["waits"])
    mgr.close()
    med = [statistics.median(r[k] for r in rows) * 1e3 for k in range(4)]
    rec = {
        "world": world,
        "hidden": H,
        "inner": I,
        "tokens": T,
        "layers": L,
        "steps": a.steps,
        "experts_per_rank": EPR,
        "slots_per_rank": SLOTS,
        "expert_bytes": 8 * H * I,
        "step_ms": med[0],
        "wait_ms": med[1],
        "dense_bwd_ms": med[2],
        "bound_ms": med[3],
        "wait_pct": 100 * med[1] / med[0],
        "bound_pct": 100 * med[3] / med[0],
        "reduce_waits_per_step": sorted(waits),
        "replicas_placed": sorted(replicas),
        "per_step_ms": [[v * 1e3 for v in r] for r in rows],
    }
    if rank == 0:
        print(
            f"# bench_backward_wait: host executor, gloo, {L} layers, H {H}, I {I}, {T} tokens/rank, "
            f"{EPR} experts + {SLOTS} slots per rank; expert bytes = fc1 + fc2 fp32 = 8*H*I; "
            f"median over {a.steps} steps of the slowest rank",
            flush=True,
        )
        w = [len(c) + 2 for c in COLUMNS]
        print("#" + "".join(f"{c:>{n}}" for c, n in zip(COLUMNS, w)))
        vals = (world, rec["expert_bytes"], med[0], med[1], rec["wait_pct"], med[2], rec["bound_pct"])
        print(" " + "".join(f"{v:>{n}}" if isinstance(v, int) else f"{v:>{n}.2f}" for v, n in zip(vals, w)), flush=True)
        if a.json:
            with open(a.json, "w") as f:
                json.dump(rec, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
