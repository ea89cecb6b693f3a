"""Host executor bandwidth: 4 loopback ranks as threads in one process, vs torch baselines.

Cases (expert of SIZE bytes, home = rank 0, replicas on ranks 1, 2, 3):
  mc-direct   multicast, home copies each chunk to the 3 replicas
  mc-chain    multicast, relay chain home -> r1 -> r2 -> r3 (chunk-streamed forwarding)
  red-direct  reduce (fp32 or --dtype), home sums its master + the 3 replica grads
  red-relay   reduce, r1 pre-reduces r2 and r3 into its slot, home sums master + r1's partial

Bytes counted ("algbw" = counted bytes / wall time of the whole operation on all ranks):
  multicast: bytes delivered into replica slots = 3 x SIZE (each replica once; relay hops
             are not counted again)
  reduce:    replica grad bytes summed into the home = 3 x SIZE (each replica once; the relay's
             partial is not counted again)
Baselines, same bytes in the same process:
  multicast: torch copy_ of the master into 3 destination tensors (memcpy)
  reduce:    acc.copy_(master); acc.add_(g_i) for the 3 grads; out.copy_(acc) (acc fp32, out in the
             grad dtype, all preallocated; torch.add in fp32 is exactly the reference sum)
'ratio' = executor algbw / baseline algbw.  '#wrong' = bytes (multicast) or elements (reduce)
that differ from the reference (torch ordered sum / the master's bytes).

  python perf/bench_host.py [--sizes-mib 8 32 64] [--workers 2] [--dtype fp32] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import threading
import time

import torch

from ultracomm import _core
from ultracomm.records import MASTER, Op, TaskKind
from ultracomm.tools.reference import tasks_from_trees

WORLD = 4
DTYPES = {"fp32": (torch.float32, 0), "bf16": (torch.bfloat16, 1), "fp16": (torch.float16, 2)}


def tree_tasks(children, slot_bytes, chunk, kind, expert=0):
    """One expert's tree homed on rank 0 -> per-rank TASK_DTYPE / REF_DTYPE arrays."""
    return tasks_from_trees(WORLD, [(expert, 0, children)], slot_bytes, chunk, kind)


class Bench:
    def __init__(self, size, chunk, workers, dtype, code):
        self.size, self.chunk, self.workers, self.dtype, self.code = size, chunk, workers, dtype, code
        self.L = _core.window_layout(1, size, size, chunk)
        self.win = [torch.zeros(self.L["total_bytes"], dtype=torch.uint8) for _ in range(WORLD)]
        self.epoch = 0
        self.master_w = torch.randint(0, 256, (size,), dtype=torch.uint8)
        self.master_g = torch.randn(size // dtype.itemsize).to(dtype)
        for r in range(1, WORLD):
            self.grad(r).view(dtype).copy_(torch.randn(size // dtype.itemsize).to(dtype))
        self.grad_init = [self.grad(r).clone() for r in range(WORLD)]

    def weight(self, r):
        return self.win[r][self.L["weights_off"] : self.L["weights_off"] + self.size]

    def grad(self, r):
        return self.win[r][self.L["grads_off"] : self.L["grads_off"] + self.size]

    def run(self, op, tasks, refs):
        self.epoch += 1
        mc = op == Op.MULTICAST
        errs = []

        def body(r):
            try:
                _core.run_host(
                    int(op),
                    r,
                    WORLD,
                    self.epoch,
                    1,
                    self.size,
                    self.size,
                    self.chunk,
                    [w.data_ptr() for w in self.win],
                    [0],
                    [self.size],
                    [(self.master_w if mc else self.master_g).data_ptr()] if r == 0 else [],
                    [0 if r == 0 else -1],
                    self.code,
                    [-1] if r == 0 else [0],
                    tasks[r],
                    refs[r],
                    self.workers,
                    60.0,
                )
            except Exception as e:  # noqa: BLE001
                errs.append(e)

        th = [threading.Thread(target=body, args=(r,)) for r in range(WORLD)]
        t0 = time.perf_counter()
        for t in th:
            t.start()
        for t in th:
            t.join()
        dt = time.perf_counter() - t0
        if errs:
            raise errs[0]
        return dt


def best(fn, iters, setup=None):
    ts = []
    for _ in range(iters + 1):  # the first run warms up (page faults, thread start)
        if setup:
            setup()
        ts.append(fn())
    return min(ts[1:])


def timed(fn):
    def f():
        t0 = time.perf_counter()
        fn()
        return time.perf_counter() - t0

    return f


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes-mib", type=int, nargs="+", default=[8, 32, 64])
    ap.add_argument("--chunk-kib", type=int, default=1024)
    ap.add_argument("--workers", type=int, default=2, help="host executor workers per rank")
    ap.add_argument("--dtype", choices=list(DTYPES), default="fp32", help="grad dtype of the reduce")
    ap.add_argument("--iters", type=int, default=4, help="best of N (after one warm-up)")
    ap.add_argument("--json", help="write the rows to this file")
    a = ap.parse_args()
    dtype, code = DTYPES[a.dtype]
    chunk = a.chunk_kib << 10
    rows = []
    print(
        f"host executor, {WORLD} ranks as threads, {a.workers} workers/rank, chunk {a.chunk_kib} KiB, "
        f"torch threads {torch.get_num_threads()}, grad dtype {a.dtype}"
    )
    print("counted bytes = 3 x expert size (bytes delivered to / reduced from the 3 replicas)")
    hdr = (
        f"{'case':<11} {'size':>7} {'counted':>8} {'time ms':>9} {'algbw GB/s':>10} {'base ms':>9} "
        f"{'base GB/s':>9} {'ratio':>6} {'#wrong':>7}"
    )
    print(hdr)
    print("-" * len(hdr))
    for mib in a.sizes_mib:
        size = mib << 20
        b = Bench(size, chunk, a.workers, dtype, code)
        counted = 3 * size
        # ---- multicast
        dsts = [torch.empty(size, dtype=torch.uint8) for _ in range(3)]
        t_base_mc = best(timed(lambda: [d.copy_(b.master_w) for d in dsts]), a.iters)
        for case, children in (
            ("mc-direct", {(0, MASTER): [(1, 0), (2, 0), (3, 0)]}),
            ("mc-chain", {(0, MASTER): [(1, 0)], (1, 0): [(2, 0)], (2, 0): [(3, 0)]}),
        ):
            tasks, refs = tree_tasks(children, size, chunk, TaskKind.COPY)
            t = best(
                lambda: b.run(Op.MULTICAST, tasks, refs),
                a.iters,
                setup=lambda: [b.weight(r).zero_() for r in range(1, WORLD)],
            )
            wrong = sum(int((b.weight(r) != b.master_w).sum()) for r in range(1, WORLD))
            rows.append(
                dict(
                    case=case,
                    size=size,
                    counted_bytes=counted,
                    time_s=t,
                    algbw=counted / t,
                    base_time_s=t_base_mc,
                    base_algbw=counted / t_base_mc,
                    ratio=t_base_mc / t,
                    wrong=wrong,
                )
            )
        # ---- reduce
        g0 = b.master_g.clone()
        srcs = [b.grad_init[r].view(dtype) for r in range(1, WORLD)]

        acc = torch.empty(g0.numel(), dtype=torch.float32)
        out = torch.empty_like(g0)

        def base_red():  # preallocated: no page faults in the timed region
            acc.copy_(g0)
            for s in srcs:
                acc.add_(s)
            out.copy_(acc)
            return out

        t_base_red = best(timed(base_red), a.iters)
        exp_direct = base_red().clone()
        p = ((srcs[0].float() + srcs[1].float()) + srcs[2].float()).to(dtype)
        exp_relay = (g0.float() + p.float()).to(dtype)

        def reset():
            b.master_g.copy_(g0)
            for r in range(1, WORLD):
                b.grad(r).copy_(b.grad_init[r])

        for case, children, exp in (
            ("red-direct", {(0, MASTER): [(1, 0), (2, 0), (3, 0)]}, exp_direct),
            ("red-relay", {(0, MASTER): [(1, 0)], (1, 0): [(2, 0), (3, 0)]}, exp_relay),
        ):
            tasks, refs = tree_tasks(children, size, chunk, TaskKind.REDUCE)
            t = best(lambda: b.run(Op.REDUCE, tasks, refs), a.iters, setup=reset)
            ib = torch.int32 if dtype == torch.float32 else torch.int16
            wrong = int((b.master_g.view(ib) != exp.view(ib)).sum())
            rows.append(
                dict(
                    case=case,
                    size=size,
                    counted_bytes=counted,
                    time_s=t,
                    algbw=counted / t,
                    base_time_s=t_base_red,
                    base_algbw=counted / t_base_red,
                    ratio=t_base_red / t,
                    wrong=wrong,
                )
            )
        for r in rows[-4:]:
            print(
                f"{r['case']:<11} {mib:>4} MiB {3 * mib:>4} MiB {r['time_s'] * 1e3:>9.2f} {r['algbw'] / 1e9:>10.2f} "
                f"{r['base_time_s'] * 1e3:>9.2f} {r['base_algbw'] / 1e9:>9.2f} {r['ratio']:>6.2f} {r['wrong']:>7}"
            )
        b = None  # its buffers go before the next size allocates
    if a.json:
        with open(a.json, "w") as f:
            json.dump(
                dict(
                    world=WORLD,
                    workers=a.workers,
                    chunk_bytes=chunk,
                    dtype=a.dtype,
                    torch_threads=torch.get_num_threads(),
                    rows=rows,
                ),
                f,
                indent=1,
            )


if __name__ == "__main__":
    main()
