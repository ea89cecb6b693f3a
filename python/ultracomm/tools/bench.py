"""Bandwidth test of weight_sync (multicast) and grad_reduce (reduction), nccl-tests style.

    torchrun --nproc-per-node 4 -m ultracomm.tools.bench all [--model qwen3-30b-a3b --scale 0.25]
        [--workload hot-rank|random|zipf:2|hot:0.5|...[,more]] [--min-bytes 1M --max-bytes 16M --factor 4]
        [--methods a2a_shm,a2a_gloo,p2p_gloo,direct,relay,relay_gloo,relay_split] [--grad-dtype fp32|bf16]
        [--iters 5 --warmup 1] [--interleave] [--json FILE] [--plot FILE.png]

Methods, measured side by side in one run on the same plan (``--interleave``: all set up at once
and timed round-robin, one iteration of each in turn, each round in the next permutation of the
methods, so drifting load on a shared machine hits them alike; the load average before and after is
printed and kept in the JSON).  Each row says which transport moved its bytes; only rows over the same transport
compare algorithms:

* ``a2a_shm`` (shared memory): the all-to-all weight distribution of Megatron's MoE ECHO --
  ``index_select`` staging, direct exchange, barrier (:mod:`ultracomm.tools.echo_shm`) -- over the
  same POSIX shared-memory windows ultracomm uses, with as many torch threads as ultracomm has
  workers.  ``a2a_shm`` / ``relay`` measures the algorithm.
* ``a2a_gloo`` (gloo, TCP loopback): the same ECHO pattern through ``all_to_all_single``:
  each rank stacks its local experts, ``index_select``s one row per replica it must send,
  exchanges with split sizes, and places the received rows into its slots.  Its gradient
  reverse: ``all_to_all_single`` of the replicas' grads back to the homes and an
  ``index_add_`` into the master grads.
* ``p2p_gloo`` (gloo, TCP loopback): ``torch.distributed`` point-to-point
  (``batch_isend_irecv``) from each home straight into each replica slot, and back for
  gradients (the home adds them in rank order).  Its slot and receive buffers are plain
  ``torch.zeros`` / ``torch.empty``, as a user would allocate them; ultracomm's replica pool and
  receive buffers start on a page (:mod:`ultracomm.host_memory`), which makes gloo's receives
  faster (``perf/bench_recv_alignment.py``) -- part of what relay_gloo / p2p_gloo measures.
* ``direct`` (shared memory): ultracomm, relay off (home -> every replica).
* ``relay`` (shared memory): ultracomm, relay auto (relay trees with chunk streaming when they help).
* ``relay_gloo`` (gloo, TCP loopback): the same trees as ``relay`` moved by ultracomm's ``p2p``
  transport (``torch.distributed`` point-to-point; NCCL on GPUs).  ``p2p_gloo`` / ``relay_gloo``
  compares the algorithms over one transport, ``relay_gloo`` / ``relay`` the transports.
* ``relay_split`` (shared memory + gloo): ultracomm's ``split`` transport with the ranks declared
  as two memory domains (the lower and the upper half of the ranks, ``ULTRACOMM_DOMAIN`` style;
  the schedule is told the same two nodes, so each expert crosses between the halves at most
  once per remote half): edges inside a half run on the host executor over shared memory, edges
  across as gloo messages through the bridge.  Its ``moved``, ``algbw`` and ``cpbw`` count the
  same bytes as every row (all replica bytes, whichever transport moved them); the JSON row's
  ``cross_bytes`` counts the part that went over gloo (chunks of the crossing edges, summed over
  ranks; every byte where the split transport's route is ``messages``), printed after the
  table.  With 2 ranks every edge crosses.  Its ``choice`` says the route
  (:func:`ultracomm.alpha_beta.split_route`): ``split: ...`` (the tree it ran) or ``messages:
  direct ...`` (every edge a gloo message: small experts, where shared memory cannot pay for its
  fixed cost).

The gloo rows compare transports as much as algorithms (TCP loopback vs shared memory); they
are kept as what a torch.distributed user without ultracomm would run on a CPU.  ``a2a`` and
``p2p`` are accepted as the old names of ``a2a_gloo`` and ``p2p_gloo``.

Byte accounting (every column says what it counts):

* ``size``: bytes of one expert: weights (bf16) for weight_sync, grads (``--grad-dtype``, fp32
  by default; every method moves the same dtype) for grad_reduce.
* ``repl``: replica slots the plan fills; ``moved`` = repl x size is what must land.
* ``time``: median (and p90) over ``--iters`` of the slowest rank's time for one operation.
* ``algbw`` = moved / time.  ``busbw`` = algbw x 1: like broadcast and reduce, every
  replica's bytes cross one link once, so the bus factor is 1.
* ``cpbw``: critical path: the busiest rank's link bytes in that method's traffic
  (egress for multicast, ingress for reduce; a2a and p2p move the direct pattern) / time.
* ``lb``: that busiest-rank byte count / the lower bound of DESIGN.md
  (``max(max ingress, max bytes a rank must send once, total / ranks)``); 1.00 = optimal.
* ``#wrong``: elements that differ from the expected result, checked after every method.

Workloads: ``hot-rank`` (rank 0's experts in every slot of every other rank: the home's
link is the bottleneck of direct multicast), ``random``, or any ``ultracomm.scenarios``
spec (``zipf:<max:mean>``, ``hot:<fraction>``, ``rotating``, ``uniform``) turned into a plan
by ``workloads.greedy_replicas``.  ``--model`` sets the expert size (times ``--scale``) and
the top-k of the generated loads; the expert count is world x ``--experts-per-rank``.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import os
import statistics

import numpy as np
import torch
import torch.distributed as dist

from ..errors import reason
from .bench_baselines import TorchBaselines, times as timed_runs

METHODS = ("a2a_shm", "a2a_gloo", "p2p_gloo", "direct", "relay", "relay_gloo", "relay_split")
#: old method names
ALIASES = {"a2a": "a2a_gloo", "p2p": "p2p_gloo"}
#: what moved each method's bytes
TRANSPORT = {
    "a2a_shm": "shared memory",
    "a2a_gloo": "gloo (TCP loopback)",
    "p2p_gloo": "gloo (TCP loopback)",
    "direct": "shared memory",
    "relay": "shared memory",
    "relay_gloo": "gloo (TCP loopback)",
    "relay_split": "shared memory within a domain + gloo across",
}
GRAD_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def parse_size(s: str) -> int:
    """argparse type for byte sizes (``64K``, ``16M``): :func:`ultracomm.env.parse_size`."""
    from ..env import parse_size as env_parse_size

    try:
        return env_parse_size(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(reason(e)) from None


# ------------------------------------------------------------------------------ plans
def make_plan(workload: str, world: int, slots: int, epr: int, top_k: int = 8, seed: int = 0):
    """A ReplicaPlan for ``workload`` (see the module docstring) and the load's max:mean (or None)."""
    from ..plan import ReplicaPlan

    src = np.full((world, slots), -1, dtype=np.int32)
    if workload == "hot-rank":
        for r in range(1, world):
            k = min(slots, epr)
            src[r, :k] = np.arange(k)
        return ReplicaPlan.make(src, experts_per_rank=epr), None
    if workload == "random":
        rng = np.random.default_rng(seed)
        for r in range(world):
            cands = [e for e in range(world * epr) if e // epr != r]
            src[r, :] = rng.choice(cands, size=min(slots, len(cands)), replace=False).tolist() + [-1] * max(
                0, slots - len(cands)
            )
        return ReplicaPlan.make(src, experts_per_rank=epr), None
    from .. import scenarios as wl

    spec = dataclasses.replace(wl.get_model("qwen3-30b-a3b"), num_experts=world * epr, top_k=top_k)
    load = wl.make_workload(workload, world, spec, tokens_per_rank=8192, seed=seed)
    plan = wl.greedy_replicas(load, world, slots, epr)
    return plan, wl.imbalance(load, epr)


def expert_row(expert: int, epr: int, n: int) -> torch.Tensor:
    """Expert ``expert``'s bench weights, bf16 ``[n]``: ``j + local * n + 7 * home`` (distinct per
    expert, so a slot that holds another expert's bytes is counted wrong)."""
    home, local = divmod(expert, epr)
    return (torch.arange(n, dtype=torch.float32) + local * n + home * 7).to(torch.bfloat16)


def master_weights(rank: int, epr: int, n: int) -> torch.Tensor:
    """This rank's master experts, bf16 ``[epr, n]``."""
    return torch.stack([expert_row(rank * epr + i, epr, n) for i in range(epr)])


def expected_slots(plan, rank: int, epr: int, n: int) -> dict[int, torch.Tensor]:
    """``{slot: the bf16 [n] row a weight_sync must leave there}`` for this rank's filled slots."""
    return {s: expert_row(e, epr, n) for s, e in enumerate(plan.slot_src[rank].tolist()) if e >= 0}


def busiest_home_bytes(plan, nbytes: int) -> int:
    """Bytes on the busiest home's link in the direct pattern: its egress when it sends every
    replica (multicast), its ingress when it receives every replica's grad (reduce)."""
    home = plan.home_of.long()
    src = plan.slot_src.long()
    per_home = torch.bincount(home[src[src >= 0]], minlength=plan.world) * nbytes
    return int(per_home.max())


# ------------------------------------------------------------------------------ timing
def round_order(methods: list[str], i: int) -> list[str]:
    """The methods' order in round ``i`` of an interleaved run: every permutation in turn, so each
    method takes each place equally often and runs right after each other method equally often.
    (Rotating one order keeps the cycle: with three methods A always ran after C, B after A --
    whatever the one before leaves behind, threads winding down, caches, lands on one method.)"""
    perms = list(itertools.permutations(methods))
    return list(perms[i % len(perms)]) if perms else []


# ------------------------------------------------------------------------------ one case
def run_case(op: str, size: int, workload: str, args, rank: int, world: int) -> list[dict]:
    """Every method of ``args.methods`` on one (op, size, workload); one row each.  Methods run one
    after another, or -- ``args.interleave`` -- all set up at once and timed round-robin, one
    iteration of each in turn (the round's order rotated each iteration), so load that drifts on a
    shared machine hits every method alike."""
    from ..context import Context
    from ..layout import ExpertLayout, Member

    n = max(1, size // 2)  # bf16 elements per expert
    gdt = GRAD_DTYPES[args.grad_dtype]
    layout = ExpertLayout((Member("w", (n,), torch.bfloat16),), grad_dtype=gdt)
    epr, slots = args.experts_per_rank, args.slots
    plan, imb = make_plan(workload, world, slots, epr, top_k=args.top_k)
    counts = plan.num_replicas.tolist()
    replicas = int((plan.slot_src >= 0).sum())
    my_slot_experts = plan.slot_src[rank].tolist()
    master = master_weights(rank, epr, n)
    expected = expected_slots(plan, rank, epr, n)
    # one master grad for every method: each run zeroes it first and is checked before the next starts
    grad = torch.zeros((epr, n), dtype=gdt)
    nbytes = layout.weight_bytes if op == "weight_sync" else layout.grad_bytes
    want_grad = torch.tensor([float(counts[e]) for e in range(rank * epr, (rank + 1) * epr)]).unsqueeze(1).to(gdt)

    def check_weights(slot_tensor: torch.Tensor) -> int:
        return sum(int((slot_tensor[s] != w).sum()) for s, w in expected.items())

    def prepare(method: str) -> dict:
        """The method's timed callable, its untimed setup and check, the row's facts and its teardown."""
        ctx = echo = None
        threads = torch.get_num_threads()
        cross = choice = None
        if method in ("direct", "relay", "relay_gloo", "relay_split"):
            split = {}
            if method == "relay_split":  # two declared domains: the lower and the upper half of the ranks
                halves = [int(r >= (world + 1) // 2) for r in range(world)]
                split = dict(domain=",".join(f"half{h}" for h in halves), node_of=halves)
            transport = {"relay_gloo": "p2p", "relay_split": "split"}.get(method, args.transport)
            ctx = Context(
                None,
                layout,
                epr,
                slots,
                num_layers=1,
                relay_mode="off" if method == "direct" else "auto",
                chunk_bytes=args.chunk_bytes,
                tile_bytes=min(args.chunk_bytes, 32768),
                transport=transport,
                **split,
            )
            ctx.register_masters(0, [master], [grad])
            sched, opname = ctx.schedule_for(plan), ("multicast" if op == "weight_sync" else "reduce")
            st = sched.stats(opname)
            busiest, lb = (st["max_egress"] if op == "weight_sync" else st["max_ingress"]), st["lower_bound_bytes"]
            depth = st["depth"]
            # what the schedule choice made of this plan (p2p: ultracomm.alpha_beta; else the builder)
            choice = f"{'direct' if depth <= 1 else f'relay depth {depth}'}, {st['chunks']} chunk(s) of {sched.chunk_bytes} B"
            slot_w, slot_g = ctx.replica_weights[0], ctx.replica_grads[0]
            if method == "relay_split":  # its route (ultracomm.alpha_beta.split_route) and its bytes over gloo
                from ..records import Op

                uop = Op.MULTICAST if op == "weight_sync" else Op.REDUCE
                if ctx.transport.route(uop, sched).route == "messages":  # every edge a message
                    ran = ctx.transport.message_schedule(uop, sched)
                    choice = f"messages: direct, {ran.stats(opname)['chunks']} chunk(s) of {ran.chunk_bytes} B"
                else:
                    choice = "split: " + choice
                cross_t = torch.tensor([ctx.transport.message_bytes(uop, sched)], dtype=torch.int64)
                dist.all_reduce(cross_t)
                cross = int(cross_t)
        else:
            slot_w = torch.zeros((slots, n), dtype=torch.bfloat16)
            slot_g = torch.zeros((slots, n), dtype=gdt)
            busiest = busiest_home_bytes(plan, nbytes)
            lb = None
            depth = 1
            if method == "a2a_shm":
                from ..comm import as_comm
                from .echo_shm import EchoShm

                echo = EchoShm(plan, as_comm(None), n, torch.bfloat16, gdt, timeout_s=args.timeout_s)
            else:
                base = TorchBaselines(plan, rank, epr, n)
                scratch = [torch.empty(n, dtype=gdt) for rows_ in base.send_rows for _ in rows_]
        state: dict = {}
        if op == "weight_sync":
            if ctx is not None:
                vid = ctx.begin(0)
                ctx.weight_sync(vid, plan)
                fn = lambda: ctx.restore(vid)  # noqa: E731 - same plan, schedule cached
            elif method == "a2a_shm":
                fn = lambda: echo.weights(master, slot_w)  # noqa: E731
            elif method == "a2a_gloo":
                fn = lambda: base.a2a_weights(master, slot_w)  # noqa: E731
            else:
                fn = lambda: base.p2p_weights(master, slot_w)  # noqa: E731
            setup, check = (lambda: slot_w.zero_()), (lambda: check_weights(slot_w))
            end = (lambda: ctx.end(vid)) if ctx is not None else (lambda: None)
        else:

            def setup():  # untimed: fresh inputs (relays overwrite their slot with the partial)
                grad.zero_()
                slot_g.fill_(1.0)  # small integers: exact in any order, so checkable
                for s, e in enumerate(my_slot_experts):
                    if e < 0:
                        slot_g[s].zero_()
                if ctx is not None:
                    state["vid"] = ctx.begin(0)
                    ctx.weight_sync(state["vid"], plan)

            if ctx is not None:
                fn = lambda: ctx.grad_reduce(state["vid"])  # noqa: E731
            elif method == "a2a_shm":
                fn = lambda: echo.grads(slot_g, grad)  # noqa: E731
            elif method == "a2a_gloo":
                fn = lambda: base.a2a_grads(slot_g, grad)  # noqa: E731
            else:
                fn = lambda: base.p2p_grads(slot_g, grad, scratch)  # noqa: E731
            check = lambda: int((grad != want_grad).sum())  # noqa: E731
            end = lambda: None  # noqa: E731
        if method == "a2a_shm":  # as many torch threads as ultracomm's host executor, while it runs
            run = fn

            def fn() -> None:
                torch.set_num_threads(args.workers)
                try:
                    run()
                finally:
                    torch.set_num_threads(threads)

        if lb is None:  # the lower bound does not depend on the method: take it from a schedule
            from ..schedule import build_schedule

            s = build_schedule(
                plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=args.chunk_bytes, relay_mode="off"
            )
            lb = s.stats("multicast" if op == "weight_sync" else "reduce")["lower_bound_bytes"]

        def close() -> None:
            end()
            if ctx is not None:
                ctx.close()
            if echo is not None:
                echo.close()

        return dict(
            fn=fn,
            setup=setup,
            check=check,
            close=close,
            busiest=busiest,
            lb=lb,
            depth=depth,
            cross=cross,
            choice=choice,
            times=[],
            wrong=0,
        )

    cases: dict[str, dict] = {}
    if args.interleave:
        for method in args.methods:
            cases[method] = prepare(method)
        for i in range(args.warmup + args.iters):
            for method in round_order(args.methods, i):
                c = cases[method]
                t, w = timed_runs(c["fn"], 1, 0, c["setup"], c["check"])
                c["wrong"] += w
                if i >= args.warmup:
                    c["times"] += t
        for c in cases.values():
            c["close"]()
    else:
        for method in args.methods:
            c = cases[method] = prepare(method)
            c["times"], c["wrong"] = timed_runs(c["fn"], args.iters, args.warmup, c["setup"], c["check"])
            c["close"]()
    rows = []
    for method in args.methods:
        c = cases[method]
        times, busiest, lb = c["times"], c["busiest"], c["lb"]
        wrong_t = torch.tensor([c["wrong"]], dtype=torch.int64)
        dist.all_reduce(wrong_t)
        med = statistics.median(times)
        p90 = sorted(times)[min(len(times) - 1, int(round(0.9 * (len(times) - 1))))]
        moved = replicas * nbytes
        rows.append(
            {
                "op": op,
                "method": method,
                "transport": TRANSPORT[method],
                "workload": workload,
                "imbalance": imb,
                "size": nbytes,
                "grad_dtype": args.grad_dtype,
                "replicas": replicas,
                "max_replicas": max(counts) if counts else 0,
                "moved_bytes": moved,
                "time_us": med * 1e6,
                "p90_us": p90 * 1e6,
                # per iteration, in round order (interleaved: round i of every method): paired comparisons
                "times_us": [t * 1e6 for t in times],
                "interleaved": bool(args.interleave),
                "algbw_GBps": moved / med / 1e9,
                "busbw_GBps": moved / med / 1e9,
                "cpbw_GBps": busiest / med / 1e9,
                "busiest_bytes": busiest,
                "lower_bound_bytes": lb,
                "lb_ratio": busiest / max(1, lb),
                "depth": c["depth"],
                "wrong": int(wrong_t),
                "cross_bytes": c["cross"],
                "choice": c["choice"],
            }
        )
    return rows


HEADER = (
    f"# {'op':>11} {'method':>10} {'over':>6} {'workload':>9} {'size(B)':>10} {'repl':>4} {'dep':>3} "
    f"{'time(us)':>10} {'p90(us)':>10} {'algbw':>7} {'busbw':>7} {'cpbw':>7} {'lb':>5} {'#wrong':>6}"
)


def format_row(r: dict) -> str:
    over = "gloo" if r["transport"].startswith("gloo") else "split" if "+" in r["transport"] else "shm"
    return (
        f"  {r['op']:>11} {r['method']:>10} {over:>6} {r['workload']:>9} {r['size']:>10} {r['replicas']:>4} "
        f"{r['depth']:>3} "
        f"{r['time_us']:>10.1f} {r['p90_us']:>10.1f} {r['algbw_GBps']:>7.2f} {r['busbw_GBps']:>7.2f} "
        f"{r['cpbw_GBps']:>7.2f} {r['lb_ratio']:>5.2f} {r['wrong']:>6}"
    )


def plot(rows: list[dict], path: str, title: str = "") -> None:
    """Time vs workload (imbalance where known) per method, one panel per op."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = sorted({r["op"] for r in rows})
    fig, axes = plt.subplots(1, len(ops), figsize=(6 * len(ops), 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        sizes = sorted({r["size"] for r in rows if r["op"] == op})
        size = sizes[-1]
        for method in METHODS:
            pts = [r for r in rows if r["op"] == op and r["method"] == method and r["size"] == size]
            if not pts:
                continue
            xs = [r["imbalance"] if r["imbalance"] is not None else i for i, r in enumerate(pts)]
            ax.plot(
                xs,
                [r["time_us"] / 1e3 for r in pts],
                marker="o",
                label=f"{method} ({TRANSPORT[method]})",
                linestyle=":" if TRANSPORT[method].startswith("gloo") else "-",
            )
        ax.set_title(f"{op}, {size / 2**20:.1f} MiB per expert")
        ax.set_xlabel("max:mean load imbalance (workload order if unknown)")
        ax.set_ylabel("time (ms), median")
        ax.grid(alpha=0.3)
        ax.legend()
    if title:
        fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m ultracomm.tools.bench", description=__doc__.split("\n\n")[0])
    p.add_argument("op", choices=["weight_sync", "grad_reduce", "all"])
    p.add_argument("--transport", default=None, help="ultracomm transport (default: ULTRACOMM_TRANSPORT / auto)")
    p.add_argument("--model", default=None, help="expert size from a preset (ultracomm.scenarios.MODELS)")
    p.add_argument("--scale", type=float, default=1.0, help="multiply the model's expert bytes (CPU runs)")
    p.add_argument("--workload", default="hot-rank", help="comma-separated workloads (see the module docstring)")
    p.add_argument("--min-bytes", default="1M", help="smallest expert size (bytes; K/M/G suffixes)")
    p.add_argument("--max-bytes", default="16M", help="largest size, in --factor steps; --model sets one")
    p.add_argument("--factor", type=int, default=4)
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument(
        "--interleave",
        action="store_true",
        help="set every method up at once and time them round-robin (one iteration each in turn)",
    )
    p.add_argument("--slots", type=int, default=2)
    p.add_argument("--experts-per-rank", type=int, default=2)
    p.add_argument("--top-k", type=int, default=8)
    p.add_argument("--chunk-bytes", type=parse_size, default=parse_size("256K"))
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated subset of {','.join(METHODS)}")
    p.add_argument(
        "--grad-dtype",
        choices=sorted(GRAD_DTYPES),
        default="fp32",
        help="gradient dtype of grad_reduce, the same for every method",
    )
    p.add_argument("--json", default=None, help="write all rows as JSON to this file (rank 0)")
    p.add_argument("--plot", default=None, help="write a PNG of time per method per workload (rank 0)")
    args = p.parse_args(argv)
    args.methods = [ALIASES.get(m, m) for m in args.methods.split(",") if m]
    bad = [m for m in args.methods if m not in METHODS]
    if bad:
        p.error(f"unknown methods {bad}; choose from {','.join(METHODS)}")
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    ops = ["weight_sync", "grad_reduce"] if args.op == "all" else [args.op]
    if args.model:
        from ..scenarios import get_model

        spec = get_model(args.model)
        args.top_k = spec.top_k
        sizes = [max(2, int(spec.expert_weight_bytes() * args.scale) // 2 * 2)]
    else:
        sizes, s = [], parse_size(args.min_bytes)
        while s <= parse_size(args.max_bytes):
            sizes.append(s)
            s *= args.factor
    workloads = [w for w in args.workload.split(",") if w]
    # "zipf:1.5,2,3" is a convenient shorthand for zipf:1.5,zipf:2,zipf:3
    kind = None
    for i, w in enumerate(workloads):
        if ":" in w:
            kind = w.split(":")[0]
        elif kind and w[0].isdigit():
            workloads[i] = f"{kind}:{w}"
    for w in workloads:  # a load these experts and top-k cannot give is a usage error, before any setup
        try:
            make_plan(w, world, args.slots, args.experts_per_rank, top_k=args.top_k)
        except ValueError as e:
            p.error(f"--workload {w}: {reason(e)}; more --experts-per-rank or a lower --top-k gives more skew")
    from ..env import Config
    from ..transports import resolve_transport

    cfg = Config.from_env()
    args.workers, args.timeout_s = cfg.num_workers, cfg.timeout_s
    transport = resolve_transport(args.transport or cfg.transport).name
    window = "host_shm" if cfg.window == "auto" else cfg.window  # what Context picks for a process group
    rows = []
    load_before = os.getloadavg()
    if rank == 0:
        print(
            f"# ultracomm bench (measured): world {world}; ultracomm transport {transport} over {window} windows "
            f"({cfg.num_workers} workers); relay_gloo: transport p2p; relay_split: transport split over 2 declared "
            f"domains (halves); a2a_shm over {window} windows "
            f"({cfg.num_workers} torch threads); *_gloo "
            f"over {dist.get_backend()}; {args.slots} slots/rank, {args.experts_per_rank} experts/rank, chunk "
            f"{args.chunk_bytes} B, iters {args.iters} (+{args.warmup} warm-up)"
            + (", methods interleaved per iteration" if args.interleave else "")
            + (f"; model {args.model} x{args.scale}" if args.model else "")
        )
        print(
            f"# size: bytes of one expert (bf16 weights / {args.grad_dtype} grads); algbw = replicas x size / time; busbw = "
            "algbw x 1; cpbw = busiest rank's link bytes / time; lb = busiest bytes / lower bound; GB/s"
        )
        print(HEADER)
    for op in ops:
        for workload in workloads:
            for size in sizes:
                for row in run_case(op, size, workload, args, rank, world):
                    rows.append(row)
                    if rank == 0:
                        print(format_row(row), flush=True)
    wrong = sum(r["wrong"] for r in rows)
    load_after = os.getloadavg()
    if rank == 0:
        print(f"# #wrong summed over all rows: {wrong}")
        print(f"# load average (1 min) {load_before[0]:.2f} before, {load_after[0]:.2f} after")
        for r in rows:
            if r["choice"] is not None and r["method"] in ("relay_gloo", "relay_split"):
                print(f"# choice {r['method']} {r['op']} {r['workload']} {r['size']} B: {r['choice']}")
            if r["cross_bytes"] is not None:
                print(
                    f"# relay_split {r['op']} {r['workload']} {r['size']} B: {r['cross_bytes']} of "
                    f"{r['moved_bytes']} replica bytes went over gloo"
                )
        for op in ops:
            for workload in workloads:
                sel = [r for r in rows if r["op"] == op and r["workload"] == workload]
                if not sel:
                    continue
                largest = max(r["size"] for r in sel)  # grad rows count grad-dtype bytes, weight rows bf16
                by = {r["method"]: r["time_us"] for r in sel if r["size"] == largest}
                if "relay" in by:
                    print(
                        f"# {op} {workload} at {largest} B: "
                        + ", ".join(
                            f"{m} / relay = {by[m] / by['relay']:.2f}x" for m in METHODS if m in by and m != "relay"
                        )
                    )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    {
                        "world": world,
                        "transport": transport,
                        "window": window,
                        "baseline_backend": dist.get_backend(),
                        "device": "cpu",
                        "args": {k: v for k, v in vars(args).items()},
                        "rows": rows,
                        "loadavg": {"before": list(load_before), "after": list(load_after)},
                    },
                    f,
                    indent=1,
                )
        if args.plot:
            plot(
                rows,
                args.plot,
                f"measured: {world} ranks, {'GPU' if torch.cuda.is_available() else 'CPU only'}; "
                "solid: shared memory, dotted: gloo TCP loopback",
            )
    dist.destroy_process_group()
    return 1 if wrong else 0


if __name__ == "__main__":
    raise SystemExit(main())
