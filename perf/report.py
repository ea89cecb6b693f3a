"""Write perf/README.md: simulated and measured weight_sync / grad_reduce figures, with plots.

    python perf/report.py [--quick] [--nproc 4]        (or: bash scripts/report.sh)

Sections (each says whether it is simulated or measured, and where):
1. simulated (``ultracomm.sim``): Qwen3-235B-A22B on GB200 NVL72 at EP64, 2 slots per rank,
   imbalance 1.5/2/3 — all-to-all (Megatron MoE ECHO), direct, relay, lower bound; plot.
2. simulated goal sweep (7 models x EP 8/16/64/72 x slots 1/2/4 x imbalance 1.5/2/3) with
   the two planners the simulator knows how to drive (greedy, quota).
3. simulated calibration against UltraEP's published EP64 figures.
4. measured on this machine: ``torchrun -m ultracomm.bench`` (host executor over POSIX
   shared memory; baselines over gloo) on Zipf workloads; table and plot.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def machine() -> str:
    cpu = platform.processor() or "?"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{platform.node() or 'host'}: {os.cpu_count()} CPU cores ({cpu}), {gpu}; Python "
            f"{platform.python_version()}, torch {torch.__version__}")


def md_table(hdr, rows) -> str:
    out = ["| " + " | ".join(hdr) + " |", "|" + "---|" * len(hdr)]
    out += ["| " + " | ".join(str(c) for c in r) + " |" for r in rows]
    return "\n".join(out)


def sim_plot(rows, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, key, name in ((axes[0], "weight_sync_ms", "weight_sync"), (axes[1], "grad_reduce_ms", "grad_reduce")):
        xs = [r["imbalance"] for r in rows]
        for m, label in (("a2a", "all-to-all (ECHO)"), ("direct", "ultracomm direct"), ("relay", "ultracomm relay"),
                         ("lb", "lower bound")):
            ax.plot(xs, [r[key][m] for r in rows], marker="o", label=label, linestyle="--" if m == "lb" else "-")
        ax.set_title(f"{name} (simulated)")
        ax.set_xlabel("max:mean rank load before balancing")
        ax.set_ylabel("time (ms)")
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def goals_at_a_glance(goal_json: dict) -> str:
    """Issue 3's three goals, counted over the simulated sweep of every planner run."""
    rows, misses = [], []
    for planner, cases in goal_json.items():
        n = len(cases)
        ws = sum(c["weight_sync_relay_over_lb"] <= 1.10 for c in cases)
        gr = sum(c["grad_reduce_relay_over_lb"] <= 1.10 for c in cases)
        ep64 = [c for c in cases if c["ep"] == 64 and c["imbalance"] >= 2]
        a2a = sum(c["weight_sync_a2a_over_relay"] >= 2 for c in ep64)
        a2a_gr = sum(c["grad_reduce_a2a_over_relay"] >= 2 for c in ep64)
        gw = sum(c["grad_over_weight"] <= 2.2 for c in cases)
        rows.append([planner, f"{ws}/{n}", f"{gr}/{n}", f"{a2a}/{len(ep64)}", f"{a2a_gr}/{len(ep64)}", f"{gw}/{n}"])
        misses += [c for c in ep64 if c["weight_sync_a2a_over_relay"] < 2]
    return ("## Goals at a glance (simulated)\n\nCases of the goal sweep (section 2) that meet each goal of issue 3, "
            "per planner that made the plans:\n\n"
            + md_table(["planner", "weight_sync relay <= 1.10x LB", "grad_reduce relay <= 1.10x LB",
                        "EP64 imb>=2: relay >= 2x a2a (weight_sync)", "same, grad_reduce",
                        "grad_reduce <= 2.2x weight_sync"], rows)
            + "\n\nWhere relay stays above 1.10x of DESIGN.md's lower bound the cause is known for the largest "
            "misses: (a) the bound is not reachable by any tree that moves whole experts (e.g. Mixtral at EP8 with "
            "one slot: every possible relay is also a sending home, ~2.0x); (b) small experts (Qwen3-30B, 9.4 MB) "
            "at EP64 where a whole-expert send is only ~3x a hop's latency, so depth costs as much as fan-out; the "
            "builder's `stats()['tree_lower_bound_s']` bounds what any tree of a plan can reach in its own cost "
            "model, and for the quota-planned 1-slot chains it equals the chosen tree's prediction.\n"
            + (f"\nIn the {len(misses)} EP64 cases where relay is less than 2x faster than all-to-all "
               f"({', '.join(sorted({c['model'] for c in misses}))}), relay is already within "
               f"{max(c['weight_sync_relay_over_lb'] for c in misses):.3f}x of the lower bound: no schedule "
               "could be 2x faster than all-to-all there.\n" if misses else ""))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="smaller sweeps (for a smoke test)")
    ap.add_argument("--nproc", type=int, default=4, help="ranks of the measured torchrun bench")
    ap.add_argument("--out", default=HERE, help="folder for README.md, PNGs and JSON")
    a = ap.parse_args()
    from ultracomm import sim

    os.makedirs(a.out, exist_ok=True)
    t0 = time.time()
    imbs = (1.5, 2.0, 3.0)
    parts = [f"# ultracomm performance report\n\nGenerated by `bash scripts/report.sh` (`python perf/report.py`) "
             f"on {time.strftime('%Y-%m-%d')}.\n\n**Machine:** {machine()}.\n\n"
             "**What is measured and what is simulated.** Sections 1–3 are *simulated* by `ultracomm.sim` "
             "(a flow-level fabric model; no byte moves; GPU fabrics modelled from vendor and published "
             "figures, see `python/ultracomm/sim.py`). Section 4 is *measured* on the machine above with the "
             "host executor (C++ threads over POSIX shared memory); no GPU figure in this report was measured.\n"]

    # 1. the headline case
    fab = sim.get_fabric("nvl72", 64)
    rows = sim.run_case("qwen3-235b-a22b", fab, 64, 2, imbs, planner="greedy")
    sim_plot(rows, os.path.join(a.out, "sim_qwen3-235b_nvl72_ep64.png"),
             "Qwen3-235B-A22B, GB200 NVL72, EP64, 2 replica slots per rank (simulated)")
    parts.append("## 1. Simulated: Qwen3-235B-A22B, NVL72, EP64, 2 slots per rank\n\n"
                 "`python -m ultracomm.sim --model qwen3-235b-a22b --domain nvl72 --ep 64 --slots 2 --imbalance "
                 "1.5,2,3` — Zipf loads (8192 tokens per rank, top-8), plan by `workloads.greedy_replicas`. Times "
                 f"in ms. Fabric: {fab.describe()}.\n\n"
                 + md_table(sim._HDR, [sim._fmt_row(r) for r in rows])
                 + "\n\n`ws`/`gr`: weight_sync / grad_reduce; `a2a`: Megatron MoE ECHO's all-to-all; `rly/LB`: "
                 "relay over the lower bound; `a2a/rly`: how much faster relay is than all-to-all; `gr/ws`: "
                 "grad_reduce (fp32 grads) over weight_sync (bf16 weights).\n\n"
                 "![simulated](sim_qwen3-235b_nvl72_ep64.png)\n")

    # 2. goal sweep
    goal_text = []
    goal_json = {}
    for planner in ("greedy", "quota"):
        res = sim.goals((1.5, 2.0) if a.quick else imbs, slots_list=(2,) if a.quick else (1, 2, 4),
                        planner=planner)
        goal_json[planner] = res["cases"]
        goal_text.append(f"**planner {planner}** ({len(res['cases'])} cases)\n\n```\n"
                         + sim._goal_summary(res["cases"]) + "\n```\n")
    parts.append("## 2. Simulated goal sweep\n\nEvery model preset at EP 8 (h200x8), 16 (2 nodes of 8 over "
                 "400 Gb/s RDMA), 64 and 72 (nvl72), slots 1/2/4, imbalance 1.5/2/3 (`python -m ultracomm.sim "
                 "--goals`). Models whose expert count does not divide EP are run with the count rounded up "
                 "(\"padded\"). Goals: relay within 1.10x of the lower bound; relay >= 2x faster than all-to-all "
                 "at imbalance >= 2 at EP64; grad_reduce <= 2.2x weight_sync.\n\n" + "\n".join(goal_text))

    parts.insert(1, goals_at_a_glance(goal_json))

    # 3. calibration
    cal = sim.calibrate()
    crow = []
    for r in cal["rows"]:
        p, s = r["published"], r["sim_over_published"]
        crow.append([f"{r['imbalance']:g}", f"{r['replicas_max']}/{r['replicas_total']}", p["replicas"],
                     f"{r['weight_sync_ms']['direct']:.3f}", f"{p['weight_sync_direct_ms']:.3f}",
                     f"{s['weight_sync_direct']:.2f}", f"{r['weight_sync_ms']['relay']:.3f}",
                     f"{p['weight_sync_relay_ms']:.3f}", f"{s['weight_sync_relay']:.2f}",
                     f"{r['grad_reduce_ms']['relay']:.3f}", "1.9–2.4"])
    parts.append("## 3. Simulated vs published (UltraEP)\n\n" + cal["setting"] + ". Times in ms.\n\n"
                 + md_table(["imb", "replicas max/total", "published", "direct", "published", "sim/pub", "relay",
                             "published", "sim/pub", "grad_reduce", "published"], crow)
                 + "\n\nThe gap is byte accounting rather than the model: with two redundant slots the busiest "
                 "rank must receive 2 x 88,080,384 B = 176 MB, which takes 0.196 ms even at NVLink5's 900 GB/s "
                 "peak, so the published 0.19 ms relay figure implies fewer bytes per expert than bf16 "
                 "DeepSeek-V3 (see `python/ultracomm/sim.py`). UltraEP's grad_reduce is measured overlapped "
                 "with GEMMs on 42 SMs; ours is the link-bound time on an idle fabric. Constants were not tuned "
                 "to close the gap.\n")

    # 4. measured
    bench_json = os.path.join(a.out, "bench_cpu.json")
    bench_png = os.path.join(a.out, "bench_cpu.png")
    size = "1M" if a.quick else "8M"
    # max:mean can never exceed the rank count: keep the targets a world of nproc can reach
    zipf = "zipf:" + ",".join(f"{x:g}" for x in (1.5, 2, 3) if x < a.nproc)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={a.nproc}", "-m",
           "ultracomm.bench", "all", "--workload", zipf, "--experts-per-rank", "8", "--top-k", "2",
           "--slots", "2", "--min-bytes", size, "--max-bytes", size, "--iters", "3" if a.quick else "7",
           "--chunk-bytes", "256K", "--json", bench_json, "--plot", bench_png]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    p = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if p.returncode != 0:
        print(p.stdout[-4000:], p.stderr[-4000:], file=sys.stderr)
        raise SystemExit(f"measured bench failed (rc {p.returncode})")
    bench = json.load(open(bench_json))
    brow = [[r["op"], r["workload"], f"{r['imbalance']:.2f}" if r["imbalance"] else "-", r["method"], r["size"],
             r["replicas"], r["depth"], f"{r['time_us'] / 1e3:.2f}", f"{r['p90_us'] / 1e3:.2f}",
             f"{r['algbw_GBps']:.2f}", f"{r['cpbw_GBps']:.2f}", f"{r['lb_ratio']:.2f}", r["wrong"]]
            for r in bench["rows"]]
    ratios = [line[2:] for line in p.stdout.splitlines() if line.startswith("# ") and "a2a / relay" in line]
    parts.append(f"## 4. Measured on this machine (CPU)\n\n`torchrun --nproc-per-node {a.nproc} -m ultracomm.bench "
                 f"all --workload {zipf} ...`: ultracomm's host executor over POSIX shared memory vs the same "
                 "operations written with torch.distributed over gloo (ECHO-style all-to-all, P2P). "
                 f"{bench['world']} ranks as processes on {os.cpu_count()} cores, so ranks and worker threads "
                 "share cores: these figures show the protocol working and the ratios on a CPU, not GPU "
                 "bandwidth. The baselines move bytes through gloo's TCP loopback while ultracomm uses shared "
                 "memory, so the ratios to `a2a`/`p2p` here mostly measure that difference; the GPU comparison is "
                 "simulated in sections 1-2. Times in ms (median and p90 of the slowest rank), bandwidths in GB/s; `size` is one "
                 "expert (bf16 weights / fp32 grads); `algbw` = replicas x size / time; `cpbw` = busiest rank's "
                 "link bytes / time; `lb` = busiest bytes / lower bound; `#wrong` checks every byte.\n\n"
                 + md_table(["op", "workload", "max:mean", "method", "size", "repl", "depth", "time", "p90",
                             "algbw", "cpbw", "lb", "#wrong"], brow)
                 + "\n\n" + "\n".join(f"- {x}" for x in ratios) + "\n\n![measured](bench_cpu.png)\n")
    parts.append(f"\n_Report generated in {time.time() - t0:.0f} s._\n")
    with open(os.path.join(a.out, "README.md"), "w") as f:
        f.write("\n".join(parts))
    with open(os.path.join(a.out, "report.json"), "w") as f:
        json.dump({"headline": rows, "goals": goal_json, "calibration": cal, "measured": bench}, f, indent=1,
                  default=lambda o: o.tolist() if hasattr(o, "tolist") else str(o))
    print(f"wrote {os.path.join(a.out, 'README.md')}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
