"""Section 6b of perf/README.md: relay_gloo and relay_split against naive point-to-point (p2p_gloo),
world 4 and 8, 1/8/32 MiB experts, zipf 1.5/2/3, both ops -- measured, then tabulated.

    python perf/bench_transports.py run --reps 3 --out perf/out/transports    # torchrun per (rep, world, size)
    python perf/bench_transports.py table perf/out/transports                 # markdown rows + summary

``run``: one ``torchrun -m ultracomm.tools.bench all --interleave`` per repetition, world and size (the three
methods set up together and timed round-robin, one iteration each in turn, the order rotated each
round, so drifting load on a shared machine hits them alike); each writes
``w{world}_s{size}_r{rep}.json`` (with the load average at its start and end).  ``table``: per row
the median over repetitions of each run's median time (slowest rank), the ratios to p2p_gloo, the
schedule choice the builder made (the same in every repetition: the plan is seeded) and the load
averages.
"""
from __future__ import annotations

import argparse
import glob
import json
import os
import statistics
import subprocess
import sys

WORLDS = (4, 8)
SIZES = ("1M", "8M", "32M")
METHODS = "p2p_gloo,relay_gloo,relay_split"


def run(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for rep in range(args.reps):
        for world in args.worlds:
            for size in args.sizes:
                path = os.path.join(args.out, f"w{world}_s{size}_r{rep}.json")
                if os.path.exists(path):  # a resumed sweep keeps what it measured
                    continue
                cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
                       "-m", "ultracomm.tools.bench", "all", "--workload", "zipf:1.5,2,3", "--methods", METHODS,
                       "--top-k", "2", "--experts-per-rank", "8", "--iters", str(args.iters), "--interleave",
                       "--min-bytes", size, "--max-bytes", size, "--json", path]
                print(f"# rep {rep} world {world} size {size}", flush=True)
                p = subprocess.run(cmd, env=env, capture_output=True, text=True)
                if p.returncode != 0:
                    print(p.stdout[-3000:] + p.stderr[-3000:], file=sys.stderr)
                    return p.returncode
    return 0


def table(args) -> int:
    runs: dict[tuple, list[dict]] = {}
    loads: list[tuple[str, float, float]] = []
    for path in sorted(glob.glob(os.path.join(args.dir, "w*_s*_r*.json"))):
        rec = json.load(open(path))
        if "loadavg" in rec:  # the 1-minute load average when the run started and ended
            loads.append((os.path.basename(path), rec["loadavg"]["before"][0], rec["loadavg"]["after"][0]))
        for r in rec["rows"]:
            runs.setdefault((r["op"], rec["world"], r["size"], r["workload"]), []).append(r)
    print("| op | world | size | workload | repl | runs | p2p_gloo ms | relay_gloo ms | relay_gloo / p2p_gloo | "
          "relay_gloo choice | relay_split ms | relay_split / p2p_gloo | relay_split choice | gloo bytes of relay_split |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {"relay_gloo": [], "relay_split": []}
    wrong = 0
    for op in ("weight_sync", "grad_reduce"):
        for key in sorted(k for k in runs if k[0] == op):
            rows = runs[key]
            wrong += sum(r["wrong"] for r in rows)
            by = {m: [r for r in rows if r["method"] == m] for m in ("p2p_gloo", "relay_gloo", "relay_split")}
            ms = {m: statistics.median(r["time_us"] for r in v) / 1e3 for m, v in by.items()}
            for m in ratios:
                ratios[m].append(ms[m] / ms["p2p_gloo"])
            split = by["relay_split"][0]
            print(f"| {op} | {key[1]} | {key[2]} | {key[3]} | {split['replicas']} | {len(by['p2p_gloo'])} | "
                  f"{ms['p2p_gloo']:.2f} | {ms['relay_gloo']:.2f} | {ms['relay_gloo'] / ms['p2p_gloo']:.2f} | "
                  f"{by['relay_gloo'][0]['choice']} | {ms['relay_split']:.2f} | "
                  f"{ms['relay_split'] / ms['p2p_gloo']:.2f} | {split['choice']} | "
                  f"{split['cross_bytes']} of {split['moved_bytes']} |")
    print()
    for m, v in ratios.items():
        print(f"- {m}/p2p_gloo: median {statistics.median(v):.2f}, min {min(v):.2f}, max {max(v):.2f}, "
              f"rows > 1: {sum(x > 1 for x in v)}/{len(v)}")
    print(f"- #wrong summed over all runs: {wrong}")
    if loads:
        every = [x for _, b, a in loads for x in (b, a)]
        print(f"- load average (1 min) at the start and end of each run: {min(every):.1f}-{max(every):.1f} "
              f"({', '.join(f'{n[:-5]} {b:.1f}/{a:.1f}' for n, b, a in loads)})")
    return 1 if wrong else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--iters", type=int, default=7)
    r.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=list(WORLDS))
    r.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    r.add_argument("--out", default="perf/out/transports")
    t = sub.add_parser("table")
    t.add_argument("dir")
    args = p.parse_args(argv)
    return run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    raise SystemExit(main())
