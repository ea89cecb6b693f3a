"""Section 6b of perf/README.md: relay_gloo and relay_split against naive point-to-point (p2p_gloo),
world 4 and 8, 1/8/32 MiB experts, zipf 1.5/2/3, both ops -- measured, then tabulated.

    python perf/bench_transports.py run --reps 3 --out perf/out/transports    # torchrun per (rep, world, size)
    python perf/bench_transports.py table perf/out/transports                 # markdown rows + summary

``run``: one ``torchrun -m ultracomm.tools.bench all --interleave`` per repetition, world and size (the three
methods set up together and timed round-robin, one iteration each in turn, the order rotated each
round, so drifting load on a shared machine hits them alike); each writes
``w{world}_s{size}_r{rep}.json`` (with the load average at its start and end).  ``table``: per row
the median over repetitions of each run's median time (slowest rank); each method against
p2p_gloo round by round (one iteration of every method per round, back to back): the median
of the per-round ratios, its 95% confidence interval (order statistics, ultracomm.tools.paired)
and the verdict -- faster / same / slower, by whether the interval lies below 1, holds 1 or lies
above; the schedule choice (the same in every repetition: the plan is seeded), the split
transport's route, and the load averages.  A row some method of which was not measured (a
sweep stopped part-way) is printed as partial.

``--pairs WORLD:SIZE[,...]`` (default ``8:32M``): sizes whose three methods do not fit in memory at
once (8 ranks x 3 Contexts of 32 MiB weights / 64 MiB grads per expert were OOM-killed on a 24 GB
machine) run as two interleaved pairs instead, ``p2p_gloo,relay_gloo`` then ``p2p_gloo,relay_split``
(``w{world}_s{size}_r{rep}_gloo.json`` / ``_split.json``); the table gives each ratio to the
p2p_gloo of its own runs and shows both p2p_gloo times (``a / b``).
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
#: (world, size) run as two pairs by default: all three methods at once ran out of memory
PAIRS = ("8:32M",)
#: rounds (interleaved iterations) per run by size: a paired ratio's interval narrows with the rounds
ROUNDS = {"1M": 90, "8M": 30, "32M": 18}  # multiples of 6: every order of three methods alike
#: the pairs' file suffix and methods
PAIR_RUNS = (("_gloo", "p2p_gloo,relay_gloo"), ("_split", "p2p_gloo,relay_split"))


def run(args) -> int:
    os.makedirs(args.out, exist_ok=True)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    for rep in range(args.reps):
        for world in args.worlds:
            for size in args.sizes:
                runs = PAIR_RUNS if f"{world}:{size}" in args.pairs else (("", METHODS),)
                for suffix, methods in runs:
                    path = os.path.join(args.out, f"w{world}_s{size}_r{rep}{suffix}.json")
                    if os.path.exists(path):  # a resumed sweep keeps what it measured
                        continue
                    cmd = [
                        sys.executable,
                        "-m",
                        "torch.distributed.run",
                        "--standalone",
                        f"--nproc-per-node={world}",
                        "-m",
                        "ultracomm.tools.bench",
                        "all",
                        "--workload",
                        "zipf:1.5,2,3",
                        "--methods",
                        methods,
                        "--top-k",
                        "2",
                        "--experts-per-rank",
                        "8",
                        "--iters",
                        str(args.rounds.get(size, args.iters)),
                        "--interleave",
                        "--min-bytes",
                        size,
                        "--max-bytes",
                        size,
                        "--json",
                        path,
                    ]
                    print(f"# rep {rep} world {world} size {size} {methods}", flush=True)
                    p = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    if p.returncode != 0:
                        print(p.stdout[-3000:] + p.stderr[-3000:], file=sys.stderr)
                        return p.returncode
    return 0


def _paired(mine: list[dict], m: str):
    """``m`` against p2p_gloo round by round over the runs ``mine`` that timed both
    (ultracomm.tools.paired), or None when a run kept no per-iteration times (JSON older than
    ``times_us``)."""
    from ultracomm.tools.paired import compare

    if any("times_us" not in run[m] or "times_us" not in run["p2p_gloo"] for run in mine):
        return None
    return compare([(run[m]["times_us"], run["p2p_gloo"]["times_us"]) for run in mine])


def table(args) -> int:
    # per (op, world, size, workload): one {method: row} per run (a run: one JSON file)
    runs: dict[tuple, list[dict]] = {}
    loads: list[tuple[str, float, float]] = []
    for path in sorted(glob.glob(os.path.join(args.dir, "w*_s*_r*.json"))):
        rec = json.load(open(path))
        if "loadavg" in rec:  # the 1-minute load average when the run started and ended
            loads.append((os.path.basename(path), rec["loadavg"]["before"][0], rec["loadavg"]["after"][0]))
        per: dict[tuple, dict] = {}
        for r in rec["rows"]:
            per.setdefault((r["op"], rec["world"], r["size"], r["workload"]), {})[r["method"]] = r
        for key, by_method in per.items():
            runs.setdefault(key, []).append(by_method)
    methods = ("relay_gloo", "relay_split")
    print(
        "| op | world | size | workload | repl | runs x rounds | p2p_gloo ms | relay_gloo ms | relay_gloo / p2p_gloo "
        "per round: median [95% CI] | verdict | relay_gloo choice | relay_split ms | relay_split / p2p_gloo per "
        "round: median [95% CI] | verdict | relay_split route and choice | gloo bytes of relay_split |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
    ratios: dict[str, list[float]] = {m: [] for m in methods}
    verdicts: dict[str, dict[str, int]] = {m: {} for m in methods}
    spread: list[float] = []  # p2p_gloo against itself: its slowest / fastest run of a row (the noise floor)
    wrong = 0
    for op in ("weight_sync", "grad_reduce"):
        for key in sorted(k for k in runs if k[0] == op):
            row_runs = runs[key]
            wrong += sum(r["wrong"] for run in row_runs for r in run.values())
            mine = {m: [run for run in row_runs if m in run and "p2p_gloo" in run] for m in methods}
            if not all(mine.values()):
                print(f"| {op} | {key[1]} | {key[2]} | {key[3]} | (a partial run: not every method measured) |")
                continue
            ms, base, count, cell = {}, {}, {}, {}
            for m in methods:  # each method against the p2p_gloo of the runs it was timed in
                ms[m] = statistics.median(run[m]["time_us"] for run in mine[m]) / 1e3
                base[m] = statistics.median(run["p2p_gloo"]["time_us"] for run in mine[m]) / 1e3
                count[m] = len(mine[m])
                pr = _paired(mine[m], m)
                if pr is None:  # no per-round times: the ratio of the medians
                    ratios[m].append(ms[m] / base[m])
                    cell[m] = (f"{ms[m] / base[m]:.2f} (medians)", "-")
                else:
                    ratios[m].append(pr.median)
                    verdicts[m][pr.verdict] = verdicts[m].get(pr.verdict, 0) + 1
                    cell[m] = (f"{pr.median:.2f} [{pr.lo:.2f}, {pr.hi:.2f}]", pr.verdict)
            own = [run["p2p_gloo"]["time_us"] for run in row_runs if "p2p_gloo" in run]
            if len(own) > 1:
                spread.append(max(own) / min(own))
            paired = any(len(run) < 3 for run in row_runs)
            gloo = next(run["relay_gloo"] for run in row_runs if "relay_gloo" in run)
            split = next(run["relay_split"] for run in row_runs if "relay_split" in run)
            rounds = len(gloo.get("times_us", ())) or "?"
            p2p = f"{base['relay_gloo']:.2f}" if not paired else f"{base['relay_gloo']:.2f} / {base['relay_split']:.2f}"
            n = (
                f"{count['relay_gloo']} x {rounds}"
                if not paired
                else f"{count['relay_gloo']}+{count['relay_split']} x {rounds} (pairs)"
            )
            print(
                f"| {op} | {key[1]} | {key[2]} | {key[3]} | {split['replicas']} | {n} | "
                f"{p2p} | {ms['relay_gloo']:.2f} | {cell['relay_gloo'][0]} | {cell['relay_gloo'][1]} | "
                f"{gloo['choice']} | {ms['relay_split']:.2f} | {cell['relay_split'][0]} | {cell['relay_split'][1]} | "
                f"{split['choice']} | {split['cross_bytes']} of {split['moved_bytes']} |"
            )
    print()
    for m, v in ratios.items():
        if not v:
            continue
        said = ", ".join(f"{k} {c}" for k, c in sorted(verdicts[m].items()))
        print(
            f"- {m}/p2p_gloo per row (the median of its per-round ratios; the ratio of the medians where a run "
            f"kept no per-round times): median {statistics.median(v):.2f}, "
            f"min {min(v):.2f}, max {max(v):.2f}, rows > 1: {sum(x > 1 for x in v)}/{len(v)}"
            + (f"; verdicts at 95%: {said}" if said else "")
        )
    if spread:
        print(
            f"- p2p_gloo against itself (its slowest / fastest run of a row, {len(spread)} rows with more than "
            f"one run): median {statistics.median(spread):.2f}, max {max(spread):.2f}"
        )
    print(f"- #wrong summed over all runs: {wrong}")
    if loads:
        every = [x for _, b, a in loads for x in (b, a)]
        print(
            f"- load average (1 min) at the start and end of each run: {min(every):.1f}-{max(every):.1f} "
            f"({', '.join(f'{n[:-5]} {b:.1f}/{a:.1f}' for n, b, a in loads)})"
        )
    return 1 if wrong else 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run")
    r.add_argument("--reps", type=int, default=3)
    r.add_argument("--iters", type=int, default=7, help="rounds per run for sizes --rounds does not name")
    r.add_argument(
        "--rounds",
        type=lambda s: {k: int(v) for k, v in (x.split(":") for x in s.split(",") if x)},
        default=dict(ROUNDS),
        help="rounds per run by size, SIZE:N[,...] (default %(default)s): small "
        "sizes are cheap and noisy, so they get more rounds",
    )
    r.add_argument("--worlds", type=lambda s: [int(x) for x in s.split(",")], default=list(WORLDS))
    r.add_argument("--sizes", type=lambda s: s.split(","), default=list(SIZES))
    r.add_argument("--out", default="perf/out/transports")
    r.add_argument(
        "--pairs",
        type=lambda s: [x for x in s.split(",") if x],
        default=list(PAIRS),
        help="WORLD:SIZE cases run as two pairs of methods (memory); empty: none",
    )
    t = sub.add_parser("table")
    t.add_argument("dir")
    args = p.parse_args(argv)
    return run(args) if args.cmd == "run" else table(args)


if __name__ == "__main__":
    raise SystemExit(main())
