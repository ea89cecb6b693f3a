"""Single-GPU measurements of the tma data plane, side by side with CUDA/torch baselines (issue 8, section 6).

Everything runs on ONE GPU: the tile mover is ultracomm's persistent kernel over a one-GPU
loopback domain (``ultracomm.cuda.loopback``: every rank's window on this GPU, all ranks in
one launch) running the schedules ultracomm builds.  A "hop" is therefore HBM -> HBM, not
NVLink.  CTAs per rank are what a Context would use (``ultracomm.cuda.sm_budget``) unless a
section sweeps them.

Sections (each prints a table like nccl-tests and goes into the JSON):

  copy      1 -> 1 copy of S bytes: tile mover (world 2, one expert, default CTAs) vs
            cudaMemcpyAsync D2D (libcudart through ctypes) vs torch ``Tensor.copy_``
  fanout    1 -> N (N = 2, 4, 8): one multicast (world N+1, direct) vs N cudaMemcpyAsync copies
  sweep     tile mover copy of 256 MiB with 1..32 CTAs: fraction of cudaMemcpyAsync's rate
  reduce    home grad += k replica grads (k = 2, 4, 8; fp32, bf16, fp16; fp32 accumulation in
            schedule order) vs ``torch.sum`` of the pre-stacked ``[k + 1, n]`` sources; the tile
            mover twice per case: ``tile mover`` (reduce_path="hunk", register hunks) and ``tile
            mover tma-staged`` (reduce_path="tma": operands staged in shared memory by bulk copies,
            sm_90+), same bytes, same #wrong check, the staged row's note giving its rate as a share
            of the hunk row's; ``reduce_sweep`` runs both paths too
  flag      release -> acquire round trip between two CTAs (``_cuda`` ping-pong microkernel)
  relay     chains of D = 1..4 hops (world D+1, relay forced, verified to be a chain):
            fill: S = one chunk (32 KiB .. 4 MiB), per-hop cost = slope of time over D;
            stream: S = 64 MiB, chunked at 32 KiB .. 4 MiB: does per-chunk signalling cost rate
  launch    empty kernel (``_cuda``) and a persistent launch with no tasks (world 1), each timed
            eagerly (the Python enqueue rate) and as 100 launches in one replayed CUDA graph
  control   the device control plane of one layer and micro-batch at EP8, EP16, EP64 and EP288
            (loopback, zipf loads): k_load_exchange, k_quota, k_build_slot, k_reroute and the
            whole step, eagerly and inside replayed CUDA graphs (note "graph replay"), beside the
            host path; #wrong against the host builds
  lb_prefetch  DeepEP's ``lb_prefetch_weights`` at its published test shape (issue 37; LB_SHAPE,
            LB_MEMBERS): 8 loopback ranks, 64 experts, 8 redundant slots per rank, 64 MiB fp8 weights
            + 16 KiB + 4 KiB fp32 scales per expert, 25% empty slots, a seeded random mapping (no
            expert twice on a rank, none on its home): DeepEP's way (one ``copy_`` per slot and
            tensor, direct from the home) vs ultracomm's multicast of one 3-member layout (one
            launch, relay off), both also graph-replayed, and the deepep_lb adapter's own
            ``LBBuffer.lb_prefetch_weights`` driven for every rank from one thread; #wrong over all
            three tensors of every slot (empty slots keep the sentinel); ~10 GiB of device memory
            (skipped with a note when less is free)
  copy_engine  the ``copy_engine`` transport (since issue 35 not zero-SM: gate kernels, one CTA
            per destination stream, copy behind flag waits; stream flag writes) on the same loopback domains as the tile mover's copy
            (1 -> 1, copy sizes) and fan-out (1 -> N) rows: same schedule, bytes and dtype, same
            #wrong check; last, because a failed copy_engine operation leaves internal streams
            blocked (no device-wide synchronize may follow: later sections are skipped and the
            process ends without tearing CUDA down)

Bytes counted (say exactly what a rate means):
  size      bytes of ONE source buffer (an expert's weights or grads: S)
  algbw     payload / time: bytes delivered to outputs (copy S, fan-out N*S, reduce S (the
            output), relay stream D*S (every hop's replica), relay fill D*S)
  busbw     HBM traffic / time: copy 2S (read + write); fan-out, one multicast (1+N)S, N copies
            2NS; copy_engine 2NS (each destination's copy reads the source); reduce (k+2)S (k sources, read and write the output), torch.sum (k+2)S too
            (k+1 stacked rows, one output); relay 2DS; lb_prefetch (size B = one expert's three
            tensors, F filled slots, D distinct experts mapped): payload F*B, copies 2FB, the tile
            mover's and the adapter's multicasts (D+F)B (each mapped expert read once, every slot
            written); extra: sent_per_rank and critical_bytes (the busiest home's bytes, DeepEP's figure)
  time      GPU time per operation: CUDA events around ``reps`` back-to-back operations
            (median of 3 trials); ``cpu-bound`` marks rows whose enqueueing took longer than the GPU.
            Rows whose note says "graph replay" (extra timing=graph): the operation captured N
            times into one CUDA graph, events around R replays, time / (N x R) (``Timer.graph``,
            the one graph timer of the bench): device time with graph-node gaps, no host
  #wrong    bytes (copies) or elements (reductions) that differ from the reference, checked on
            the first and on the last operation of a row: the source bytes for copies (the
            destinations are filled with 0xA5 first), the fp32 ordered sum rounded once to the
            grad dtype for reductions (bit patterns compared; torch.sum's row is informational:
            its order is torch's)

Goals (printed PASS/MISS): the tile mover reaches >= 90% of cudaMemcpyAsync D2D with <= 16
CTAs (sweep, best row with <= 16 CTAs at 256 MiB); reduction >= 85% of torch.sum's bandwidth
(largest size, every k and dtype).  Then a line per target of issues 33 and 34 (``target_lines``:
value, bound, PASS / MISS / not measured and the rows read; in the JSON under ``targets``): the
graph-replayed control step at EP8 / EP64 (the better of ``device step`` and ``device step, PDL``),
EP64's four kernels, an empty kernel's graph node; copy per CTA and with 16 CTAs, reduce k=2 fp32
64 MiB per CTA and at 23 CTAs (the better of the two reduce impls), all-SM reduce vs torch.sum,
fp16 vs bf16 at k=8, relay stream D=1 / D=4 at 128 KiB chunks, 1 -> 8 fan-out, per-task overhead.

Hardware profile (``--profile``, default ``$OUT/<date>_<device>_profile.json``; schema
``ultracomm.hwprofile/1``, validated by ``ultracomm.cuda.hwprofile.validate`` before writing, read
by ``ultracomm.cuda.sm_budget`` and ``ultracomm.sim`` through ``ultracomm.cuda.hwprofile.find_profile``):
``d2d_copy_bw`` (cudaMemcpyAsync payload rate at the largest copy), ``per_sm_copy_bw`` (1-CTA
sweep row), ``per_sm_reduce_bw`` (1-CTA fp32 k=2 reduction), ``sm_sweep`` [[CTAs, payload
B/s]], ``reduce_bw`` / ``torch_reduce_bw`` (fp32, largest k, largest size), ``flag_rtt_s``,
``launch_s`` (empty kernel), ``relay_hop_s`` [[chunk bytes, per-hop s]], ``chunk_overhead_s``
and ``hop_bw`` (intercept and 1/slope of per-hop cost against chunk bytes), plus device,
compute capability, SM count, date, torch and CUDA versions.  Unmeasured fields are null.

    python perf/bench_gpu.py [--quick] [--out DIR] [--json FILE] [--profile FILE] [--only copy,sweep]
                             [--budget-s SECONDS]

The results JSON (and the profile, once the copy section measured cudaMemcpyAsync) are rewritten
after every section, so a run stopped from outside keeps what it measured.  ``--budget-s``: no
section or row starts after that many seconds (rows not started say so); 30 s are kept for
copy_engine, and 30 s for lb_prefetch by the sections before it.  Without a CUDA device it prints
why and exits with status 2 (nothing measured).

This file is the entry point (arguments, main, the results JSON); the bench's parts are the package
perf/single_gpu, loaded by its path, one idea a module: constants (sections, sizes, shapes, impl
names), rows (Row, the tables), targets (goal_lines, target_lines), hw_profile (build_profile),
timing (Timer, graph_note, load_cudart), loopback (Loopback), lb_rows and lb_domain (lb_prefetch's
rows and LBDomain), gpu (Gpu: the device and its bookkeeping) and its sections by what they
measure: launch (launch, flag), control, copies (copy, fanout, sweep, copy_engine), reduce (reduce,
reduce_sweep), relay, lb_prefetch.  The names the tests and perf/bench_nvlink.py read are still
importable from here (``__all__``).
"""

from __future__ import annotations

import argparse
import datetime
import importlib.util
import json
import os
import sys
import traceback
from typing import Optional, Sequence


def _load_parts():
    """perf/single_gpu, this bench's modules (perf/ is no package and is not put on sys.path, where its
    other scripts would shadow modules), shared with whoever loaded it first under the name ``single_gpu``."""
    mod = sys.modules.get("single_gpu")
    if mod is None:
        here = os.path.join(os.path.dirname(os.path.abspath(__file__)), "single_gpu")
        spec = importlib.util.spec_from_file_location(
            "single_gpu", os.path.join(here, "__init__.py"), submodule_search_locations=[here]
        )
        mod = importlib.util.module_from_spec(spec)
        sys.modules["single_gpu"] = mod
        spec.loader.exec_module(mod)
    return mod


single_gpu = _load_parts()
from single_gpu.constants import (  # noqa: E402
    CE_RESERVE_S,
    CONTROL_KERNELS,
    CONTROL_PER_GRAPH,
    CONTROL_REPLAYS,
    CONTROL_SHAPES,
    CONTROL_STEP,
    CONTROL_STEP_PDL,
    FANOUT_BYTES,
    GOAL_COPY,
    GOAL_COPY_SMS,
    GOAL_REDUCE,
    LAUNCH_PER_GRAPH,
    LAUNCH_REPLAYS,
    LB_ADAPTER,
    LB_COPIES,
    LB_EMPTY,
    LB_MEMBERS,
    LB_MULTICAST,
    LB_PER_GRAPH,
    LB_REPLAYS,
    LB_RESERVE_S,
    LB_SEED,
    LB_SHAPE,
    REDUCE_IMPLS,
    SECTIONS,
    SENTINEL,
    MiB,
)
from single_gpu.copies import copy_engine_row, tile_row  # noqa: E402
from single_gpu.control import control_graph_rows  # noqa: E402
from single_gpu.gpu import Gpu  # noqa: E402
from single_gpu.hw_profile import build_profile, hop_costs, linear_fit  # noqa: E402
from single_gpu.lb_domain import LBDomain, lb_fill, lb_wrong  # noqa: E402
from single_gpu.lb_rows import lb_bytes, lb_case, lb_mapping, lb_members_text, lb_memory_bytes, lb_row  # noqa: E402
from single_gpu.loopback import Loopback, one_expert, ordered_sum  # noqa: E402
from single_gpu.rows import Row, fmt_size, format_table  # noqa: E402
from single_gpu.targets import (  # noqa: E402
    LOOPBACK_CHUNK,
    TARGET_CONTROL_US,
    TARGET_COPY_16_TBS,
    TARGET_COPY_PER_CTA_GBS,
    TARGET_EMPTY_NODE_US,
    TARGET_EP64_KERNEL_US,
    TARGET_FANOUT_TBS,
    TARGET_FP16_VS_BF16,
    TARGET_REDUCE_BYTES,
    TARGET_REDUCE_CTAS,
    TARGET_REDUCE_K2_US,
    TARGET_REDUCE_PER_CTA_GBS,
    TARGET_REDUCE_VS_TORCH,
    TARGET_RELAY_BYTES,
    TARGET_RELAY_US,
    TARGET_TASK_US,
    goal_lines,
    row_name,
    target_lines,
)
from single_gpu.timing import CUDA_MEMCPY_DEVICE_TO_DEVICE, CUDART_MEMCPY_ASYNC_ARGTYPES, Timer, graph_note, load_cudart  # noqa: E402

#: What this module gives its readers (the bench's tests, perf/bench_nvlink.py) besides main: the names
#: it held before its parts moved to perf/single_gpu, each defined in the module named above
__all__ = [
    "CE_RESERVE_S",
    "CONTROL_KERNELS",
    "CONTROL_PER_GRAPH",
    "CONTROL_REPLAYS",
    "CONTROL_SHAPES",
    "CONTROL_STEP",
    "CONTROL_STEP_PDL",
    "CUDART_MEMCPY_ASYNC_ARGTYPES",
    "CUDA_MEMCPY_DEVICE_TO_DEVICE",
    "FANOUT_BYTES",
    "GOAL_COPY",
    "GOAL_COPY_SMS",
    "GOAL_REDUCE",
    "Gpu",
    "LAUNCH_PER_GRAPH",
    "LAUNCH_REPLAYS",
    "LBDomain",
    "LB_ADAPTER",
    "LB_COPIES",
    "LB_EMPTY",
    "LB_MEMBERS",
    "LB_MULTICAST",
    "LB_PER_GRAPH",
    "LB_REPLAYS",
    "LB_RESERVE_S",
    "LB_SEED",
    "LB_SHAPE",
    "LOOPBACK_CHUNK",
    "Loopback",
    "MiB",
    "REDUCE_IMPLS",
    "Row",
    "SECTIONS",
    "SENTINEL",
    "TARGET_CONTROL_US",
    "TARGET_COPY_16_TBS",
    "TARGET_COPY_PER_CTA_GBS",
    "TARGET_EMPTY_NODE_US",
    "TARGET_EP64_KERNEL_US",
    "TARGET_FANOUT_TBS",
    "TARGET_FP16_VS_BF16",
    "TARGET_REDUCE_BYTES",
    "TARGET_REDUCE_CTAS",
    "TARGET_REDUCE_K2_US",
    "TARGET_REDUCE_PER_CTA_GBS",
    "TARGET_REDUCE_VS_TORCH",
    "TARGET_RELAY_BYTES",
    "TARGET_RELAY_US",
    "TARGET_TASK_US",
    "Timer",
    "build_profile",
    "control_graph_rows",
    "copy_engine_row",
    "fmt_size",
    "format_table",
    "goal_lines",
    "graph_note",
    "hop_costs",
    "lb_bytes",
    "lb_case",
    "lb_fill",
    "lb_mapping",
    "lb_members_text",
    "lb_memory_bytes",
    "lb_row",
    "lb_wrong",
    "linear_fit",
    "load_cudart",
    "main",
    "one_expert",
    "ordered_sum",
    "results_record",
    "row_name",
    "target_lines",
    "tile_row",
    "unavailable_reason",
    "write_json",
    "write_results",
    "wrong_total",
]


def unavailable_reason() -> Optional[str]:
    """Why nothing can be measured here (no torch CUDA device), or None."""
    try:
        from ultracomm.cuda.support import torch_cuda_reason
    except Exception as e:  # noqa: BLE001 - an unbuilt package is a reason too
        return f"ultracomm does not import ({e})"
    return torch_cuda_reason()


def results_record(
    device: dict, stamp: str, quick: bool, sections: Sequence[str], rows: Sequence[Row], errors: Sequence[str]
) -> dict:
    """The results JSON: device, date, sections asked for, goal lines (issue 8), targets (issues 33 and
    34: target_lines' records), errors, every row."""
    return dict(
        device=device,
        date=stamp,
        quick=quick,
        sections=list(sections),
        goals=goal_lines(rows),
        targets=target_lines(rows, device.get("sms")),
        errors=list(errors),
        rows=[r.to_dict() for r in rows],
    )


def wrong_total(rows: Sequence[Row]) -> int:
    """#wrong over ultracomm's and CUDA's rows (torch.sum's informational rows excluded)."""
    return sum(r.wrong or 0 for r in rows if not r.note.startswith("informational"))


def write_json(path: str, rec: dict) -> None:
    """``rec`` as JSON at ``path``, replaced whole (a run stopped mid-write leaves the previous file)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as f:
        json.dump(rec, f, indent=1)
    os.replace(path + ".tmp", path)


def write_results(gpu: "Gpu", args, only: Sequence[str], stamp: str) -> tuple[str, Optional[str]]:
    """(results JSON path, profile path or None); rewritten after every section."""
    os.makedirs(args.out, exist_ok=True)
    out_json = args.json or os.path.join(args.out, "bench_gpu.json")
    write_json(out_json, results_record(gpu.info, stamp, args.quick, only, gpu.rows, gpu.errors))
    prof = build_profile(gpu.rows, gpu.info, stamp)
    if prof["d2d_copy_bw"] is None:
        return out_json, None
    from ultracomm.cuda.hwprofile import validate

    validate(prof)
    dev = "".join(c if c.isalnum() else "-" for c in gpu.info["name"]).strip("-")
    path = args.profile or os.path.join(args.out, f"{stamp[:10]}_{dev}_profile.json")
    with open(path, "w") as f:
        json.dump(prof, f, indent=1)
    return out_json, path


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--quick", action="store_true", help="fewer sizes and repetitions")
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join("perf", "out", "gpu")))
    ap.add_argument("--json", help="results JSON (default OUT/bench_gpu.json)")
    ap.add_argument("--profile", help="hardware profile JSON (default OUT/<date>_<device>_profile.json)")
    ap.add_argument("--only", help=f"comma-separated sections of {','.join(SECTIONS)}")
    ap.add_argument("--budget-s", type=float, help="start no section or row after this many seconds")
    args = ap.parse_args(argv)
    only = SECTIONS if not args.only else tuple(s.strip() for s in args.only.split(","))
    bad = [s for s in only if s not in SECTIONS]
    if bad:
        ap.error(f"unknown sections {bad}; choose from {', '.join(SECTIONS)}")
    why = unavailable_reason()
    if why:
        print(f"bench_gpu: nothing measured: {why}", file=sys.stderr)
        return 2
    gpu = Gpu(
        args.quick,
        args.budget_s,
        CE_RESERVE_S if "copy_engine" in only else 0.0,
        LB_RESERVE_S if "lb_prefetch" in only else 0.0,
    )
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    print(
        f"bench_gpu: {gpu.info['name']} (cc {gpu.info['cc']}, {gpu.info['sms']} SMs), torch {gpu.info['torch']}, "
        f"CUDA {gpu.info['cuda']}; tile mover: {'available' if not gpu.tma_reason else gpu.tma_reason}; "
        f"copy engine: {'available' if not gpu.ce_reason else gpu.ce_reason}"
    )
    out_json, prof = None, None
    for name in only:
        interrupted = False
        try:
            gpu.section(name, getattr(gpu, f"run_{name}"))
        except KeyboardInterrupt:  # SIGINT (gpu_check.sh's step timeout): keep and print what was measured
            interrupted = True
            gpu.errors.append(f"{name}: interrupted (SIGINT); later sections not run")
            gpu.rows.append(Row(name, "-", "-", 0, None, 0, 0, None, "interrupted (SIGINT): the rest not measured"))
        try:
            out_json, prof = write_results(gpu, args, only, stamp)
        except Exception as e:  # noqa: BLE001 - the next sections still run; the error is reported
            if not any(x.startswith("results:") for x in gpu.errors):
                gpu.errors.append(f"results: {type(e).__name__}: {e}")
                traceback.print_exc()
        rows = [r for r in gpu.rows if r.section == name]
        if rows:  # each section's table as it completes: a run killed later keeps it in its output
            print(f"\n## {name}\n{format_table(rows)}", flush=True)
        if interrupted:
            break
    print("\n" + "\n".join(goal_lines(gpu.rows)))
    print("\n".join(t["line"] for t in target_lines(gpu.rows, gpu.info.get("sms"))))
    wrong = wrong_total(gpu.rows)
    print(f"bench_gpu: #wrong total (ultracomm and CUDA rows) = {wrong}")
    print(f"bench_gpu: results in {out_json}")
    print(
        f"bench_gpu: hardware profile in {prof}"
        if prof
        else "bench_gpu: no profile written (the copy section did not measure cudaMemcpyAsync)"
    )
    rc = 1 if (gpu.errors or wrong) else 0
    if gpu.poisoned:  # tearing CUDA down (cudaFree, a device-wide synchronize) would wait forever
        print(f"bench_gpu: exiting without CUDA teardown: {gpu.poisoned}", file=sys.stderr)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(rc)
    return rc


if __name__ == "__main__":
    sys.exit(main())
