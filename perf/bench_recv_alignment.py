"""gloo receives into buffers that start at different offsets within a page (perf/README.md 6b).

    torchrun --standalone --nproc-per-node 4 perf/bench_recv_alignment.py [--size 8M] [--rounds 40]
             [--offsets 0,64,2048] [--json FILE]

The bench's weight_sync plan (zipf:1.5, 8 experts per rank, 2 slots, top-2) moved the way
``p2p_gloo`` moves it (``TorchBaselines.p2p_weights``: one whole-expert message per replica), into
slot buffers that start ``offset`` bytes into a page; everything else (sources, messages, order)
is the same.  ``offset 64`` is where ``torch.empty`` puts a large CPU tensor (glibc's mmap chunk
header, torch's 64-byte alignment); ``0`` is where :mod:`ultracomm.host_memory` puts ultracomm's
own pool.  The offsets are timed in rounds (one operation of each, back to back, every order in
turn); time = the slowest rank's, per round; each offset against the first one round by round:
the median of the per-round ratios and its 95% interval (:mod:`ultracomm.tools.paired`).  Bytes
counted: every replica's weight bytes once (algbw).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
import torch.distributed as dist

from ultracomm.host_memory import page_aligned_zeros
from ultracomm.tools.bench import TorchBaselines, expected_slots, make_plan, master_weights, parse_size, round_order
from ultracomm.tools.paired import compare


def at_offset(nbytes: int, offset: int) -> torch.Tensor:
    """``uint8 [nbytes]``, zeroed, starting ``offset`` (< a page) bytes into a page."""
    return page_aligned_zeros(offset + nbytes)[offset:]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", type=parse_size, default=parse_size("8M"), help="bytes of one expert (bf16)")
    p.add_argument("--rounds", type=int, default=40)
    p.add_argument("--offsets", default="0,64,2048")
    p.add_argument("--workload", default="zipf:1.5")
    p.add_argument("--json", default=None)
    args = p.parse_args()
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    epr, slots, n = 8, 2, args.size // 2
    plan, _ = make_plan(args.workload, world, slots, epr, top_k=2)
    base = TorchBaselines(plan, rank, epr, n)
    master = master_weights(rank, epr, n)
    offsets = [int(x) for x in args.offsets.split(",")]
    bufs = {o: at_offset(slots * n * 2, o).view(torch.bfloat16).view(slots, n) for o in offsets}
    want = expected_slots(plan, rank, epr, n)
    times: dict[int, list[float]] = {o: [] for o in offsets}
    wrong = 0
    for i in range(args.rounds + 1):  # round 0: warm-up
        for o in round_order(offsets, i):
            bufs[o].zero_()
            dist.barrier()
            t0 = time.perf_counter()
            base.p2p_weights(master, bufs[o])
            dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
            dist.all_reduce(dt, op=dist.ReduceOp.MAX)
            wrong += sum(int((bufs[o][s] != w).sum()) for s, w in want.items())
            if i:
                times[o].append(float(dt) * 1e6)
    wrong_t = torch.tensor([wrong], dtype=torch.int64)
    dist.all_reduce(wrong_t)
    moved = int((plan.slot_src >= 0).sum()) * args.size
    if rank == 0:
        print(
            f"# gloo receives into slot buffers at page offsets {offsets}: world {world}, {args.workload}, "
            f"{args.size} B experts, {args.rounds} rounds; bytes counted: {moved} (every replica once)"
        )
        print(f"# {'offset':>6} {'time(us)':>10} {'algbw':>7} {'vs offset ' + str(offsets[0]):>34} {'#wrong':>6}")
        rows = []
        for o in offsets:
            med = statistics.median(times[o])
            c = compare([(times[o], times[offsets[0]])])
            print(
                f"  {o:>6} {med:>10.1f} {moved / med / 1e3:>7.2f} "
                f"{f'{c.median:.3f} [{c.lo:.3f}, {c.hi:.3f}] {c.verdict}':>34} {int(wrong_t):>6}"
            )
            rows.append(
                dict(
                    offset=o,
                    time_us=med,
                    algbw_GBps=moved / med / 1e3,
                    times_us=times[o],
                    ratio=c.median,
                    ci=[c.lo, c.hi],
                    verdict=c.verdict,
                )
            )
        if args.json:
            with open(args.json, "w") as f:
                json.dump(
                    dict(
                        world=world,
                        size=args.size,
                        workload=args.workload,
                        rounds=args.rounds,
                        wrong=int(wrong_t),
                        rows=rows,
                    ),
                    f,
                    indent=1,
                )
    dist.destroy_process_group()
    return 0 if int(wrong_t) == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
