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
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib
import importlib.util
import json
import os
import statistics
import sys
import time
import traceback
from typing import Callable, Optional, Sequence

import numpy as np


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
from single_gpu.hw_profile import build_profile, hop_costs, linear_fit  # noqa: E402
from single_gpu.lb_rows import lb_bytes, lb_case, lb_mapping, lb_members_text, lb_memory_bytes, lb_row  # noqa: E402
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
    "LAUNCH_PER_GRAPH",
    "LAUNCH_REPLAYS",
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
    "fmt_size",
    "format_table",
    "goal_lines",
    "graph_note",
    "hop_costs",
    "lb_bytes",
    "lb_case",
    "lb_mapping",
    "lb_members_text",
    "lb_memory_bytes",
    "lb_row",
    "linear_fit",
    "load_cudart",
    "main",
    "results_record",
    "row_name",
    "target_lines",
    "unavailable_reason",
    "write_json",
    "write_results",
    "wrong_total",
]

# ----------------------------------------------------------------------------- pure helpers (CPU-tested)


def copy_engine_row(
    case: str,
    n: int,
    size: int,
    time_s: Optional[float],
    wrong: Optional[int],
    note: str = "",
    tile: Optional[Row] = None,
) -> Row:
    """The copy_engine row of a 1 -> n multicast of ``size`` bytes: payload nS, traffic 2nS (each
    destination's copy reads the source); since issue 35 its copies run in gate kernels, one CTA
    per destination stream (n SMs at most), not on copy engines; ``tile``: the tile mover's row
    of the same case and size, whose rate it is compared to."""
    row = Row(
        "copy_engine",
        case,
        "copy engine",
        size,
        time_s,
        n * size,
        2 * n * size,
        wrong,
        ", ".join(x for x in ("" if time_s is None else f"{n} CTA{'s' * (n > 1)} (gate kernels)", note) if x),
        dict(sms=n, destinations=n),
    )
    if tile is not None and tile.algbw and row.algbw:
        row.note += f", {100 * row.algbw / tile.algbw:.1f}% of tile mover"
        row.extra["vs_tile_mover"] = row.algbw / tile.algbw
    return row


def tile_row(rows: Sequence[Row], n: int, size: int) -> Optional[Row]:
    """The tile mover's measured row of a 1 -> n multicast of ``size`` bytes (copy or fanout)."""
    section = "copy" if n == 1 else "fanout"
    got = [
        r
        for r in rows
        if r.section == section and r.impl == "tile mover" and r.case == f"1->{n}" and r.size == size and r.time_s
    ]
    return got[0] if got else None


def control_graph_rows(
    label: str,
    E: int,
    times: dict,
    wrong: dict,
    notes: Optional[dict] = None,
    per_graph: int = CONTROL_PER_GRAPH,
    replays: int = CONTROL_REPLAYS,
) -> list[Row]:
    """Rows of one control-plane shape timed inside replayed CUDA graphs: one per kernel of
    CONTROL_KERNELS (case ``<label> <kernel>``) and the whole step (``<label>
    exchange+plan+build+reroute`` / ``device step``: the four kernels in one graph), named as the
    eager rows are, told apart by the note ("graph replay") and ``extra["timing"] == "graph"``;
    then the step's graph with programmatic dependent launch (key ``pdl``: the same case, impl
    ``device step, PDL``, ``extra["pdl"]`` True; the plain step row has it False).
    ``times`` / ``wrong`` / ``notes``: by key (the case suffix); a missing time is "not measured"
    with ``notes[key]`` saying why."""
    notes = notes or {}
    rows = []
    for key, impl in (*CONTROL_KERNELS, CONTROL_STEP, CONTROL_STEP_PDL):
        t = times.get(key)
        more = notes.get(key, "")
        pdl = key == CONTROL_STEP_PDL[0]
        if pdl:  # the step again, in the same case as the plain one
            more = "programmatic dependent launch" + (f"; {more}" if more else "")
        note = (
            graph_note(per_graph, replays, more)
            if t is not None
            else f"not measured (graph replay): {notes.get(key) or 'no time'}"
        )
        case = f"{label} {CONTROL_STEP[0] if pdl else key}"
        extra = dict(timing="graph", per_graph=per_graph, replays=replays)
        if key in (CONTROL_STEP[0], CONTROL_STEP_PDL[0]):
            extra["pdl"] = pdl
        rows.append(Row("control", case, impl, E, t, 0, 0, wrong.get(key) if t is not None else None, note, extra))
    return rows


def unavailable_reason() -> Optional[str]:
    """Why nothing can be measured here (no torch CUDA device), or None."""
    try:
        from ultracomm.cuda.support import torch_cuda_reason
    except Exception as e:  # noqa: BLE001 - an unbuilt package is a reason too
        return f"ultracomm does not import ({e})"
    return torch_cuda_reason()


# ----------------------------------------------------------------------------- device side


def _core_records(name: str):
    from ultracomm import records

    return getattr(records, name)


class Gpu:
    """Measurements; each section appends Rows and never raises (failures become notes)."""

    def __init__(
        self, quick: bool, budget_s: Optional[float] = None, reserve_s: float = 0.0, lb_reserve_s: float = 0.0
    ):
        import torch

        import ultracomm
        from ultracomm.cuda import support as cuda_support

        self.torch, self.uc = torch, ultracomm
        self.quick = quick
        self.dev = torch.device("cuda", torch.cuda.current_device())
        props = torch.cuda.get_device_properties(self.dev)
        self.info = dict(
            name=props.name,
            cc=f"{props.major}.{props.minor}",
            sms=props.multi_processor_count,
            torch=torch.__version__,
            cuda=str(torch.version.cuda),
        )
        self.timer = Timer(torch, reps=5 if quick else 20)
        self.rows: list[Row] = []
        self.errors: list[str] = []
        self.deadline = None if budget_s is None else time.monotonic() + budget_s
        self.reserve_s = reserve_s  # kept for copy_engine by the sections before it
        self.lb_reserve_s = lb_reserve_s  # kept for lb_prefetch by the sections before it
        self.poisoned: Optional[str] = None  # why no device-wide synchronize may run any more
        self.kept: list = []  # what blocked copy_engine streams may still write: never freed
        from ultracomm.cuda.driver import driver_reason

        self.ce_reason = driver_reason()
        self.tma_reason = cuda_support.cuda_module_reason()
        self.cuda = cuda_support.cuda_module()
        if self.tma_reason is None:
            ok, why = self.cuda.available(self.dev.index)  # driver, compute capability (sm_80+)
            self.tma_reason = None if ok else f"ultracomm._cuda cannot run here: {why}"
        self.cuda_reason = self.tma_reason  # what the _cuda microkernels need
        if self.tma_reason is None:
            try:
                importlib.import_module("ultracomm.cuda.loopback")
            except ImportError as e:
                self.tma_reason = f"ultracomm.cuda.loopback does not load ({e})"
        try:
            self.cudart = load_cudart()
            self.cudart_reason = None
        except Exception as e:  # noqa: BLE001
            self.cudart, self.cudart_reason = None, str(e)

    # -- helpers
    def stream(self) -> int:
        return self.torch.cuda.current_stream(self.dev).cuda_stream

    def memcpy(self, dst, src, nbytes: int) -> None:
        rc = self.cudart.cudaMemcpyAsync(
            ctypes.c_void_p(dst.data_ptr()),
            ctypes.c_void_p(src.data_ptr()),
            nbytes,
            CUDA_MEMCPY_DEVICE_TO_DEVICE,
            ctypes.c_void_p(self.stream()),
        )
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync returned {rc}")

    def wrong_bytes(self, got, want) -> int:
        return int((got.view(self.torch.uint8) != want.view(self.torch.uint8)).sum())

    def late(self, section: str, case: str = "-", reserve: bool = True) -> bool:
        """True (and a row saying so) when the budget leaves no time for this row (``reserve``: keep
        the copy_engine section's share, and the lb_prefetch section's in the sections before it)."""
        keep = 0.0
        if reserve:
            keep = self.reserve_s
            if section in SECTIONS and SECTIONS.index(section) < SECTIONS.index("lb_prefetch"):
                keep += getattr(self, "lb_reserve_s", 0.0)
        if self.deadline is None or time.monotonic() + keep < self.deadline:
            return False
        self.rows.append(Row(section, case, "-", 0, None, 0, 0, None, "not measured: out of time (--budget-s)"))
        return True

    def section(self, name: str, fn: Callable[[], None]) -> None:
        t0 = time.perf_counter()
        if self.poisoned:
            self.rows.append(Row(name, "-", "-", 0, None, 0, 0, None, f"not measured: {self.poisoned}"))
            return
        if self.late(name, reserve=name != "copy_engine"):
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - one failing section must not hide the others
            self.errors.append(f"{name}: {type(e).__name__}: {e}")
            self.rows.append(Row(name, "-", "-", 0, None, 0, 0, None, f"FAILED: {type(e).__name__}: {e}"))
            traceback.print_exc()
        print(f"bench_gpu: section {name} took {time.perf_counter() - t0:.1f} s", file=sys.stderr)

    def binding(self, name: str) -> tuple[Optional[Callable], str]:
        """A ``_cuda`` microkernel launcher, or ``None`` and why it is missing."""
        fn = getattr(self.cuda, name, None) if self.cuda is not None and not self.cuda_reason else None
        return fn, "" if fn is not None else (self.cuda_reason or f"this _cuda build has no {name}")

    def baseline_copies(
        self, section: str, case: str, impl: str, src, dsts: list, fn: Callable[[], None], note: str = ""
    ) -> Row:
        """Row of a copy baseline that writes ``src`` into every one of ``dsts`` (verified before and after)."""
        for d in dsts:
            d.fill_(SENTINEL)
        fn()
        w0 = sum(self.wrong_bytes(d, src) for d in dsts)
        t, cpu = self.timer(fn)
        size, n = src.numel(), len(dsts)
        return Row(
            section,
            case,
            impl,
            size,
            t,
            n * size,
            2 * n * size,
            w0 + sum(self.wrong_bytes(d, src) for d in dsts),
            ", ".join(x for x in (note, cpu * "cpu-bound") if x),
        )

    def mover_missing(self, section: str, case: str, size: int) -> None:
        self.rows.append(Row(section, case, "tile mover", size, None, 0, 0, None, f"not measured: {self.tma_reason}"))

    # -- loopback domains through the tma transport
    def domain(self, world: int, slot_src: np.ndarray, nbytes: int, grad_dtype, **cfg) -> "Loopback":
        return Loopback(self, world, slot_src, nbytes, grad_dtype, **cfg)

    # -- sections
    def run_launch(self) -> None:
        """The launch floor two ways: Python calls timed by events (the host's enqueue rate, flagged
        cpu-bound) and LAUNCH_PER_GRAPH launches captured in one CUDA graph, replayed (device time per
        launch, graph-node gaps included): an empty kernel, and the persistent kernel with no tasks."""
        torch = self.torch
        launch_empty, why = self.binding("launch_empty")
        gnote = graph_note(LAUNCH_PER_GRAPH, LAUNCH_REPLAYS)
        gextra = dict(timing="graph", per_graph=LAUNCH_PER_GRAPH, replays=LAUNCH_REPLAYS)
        if launch_empty is None:
            self.rows.append(Row("launch", "floor", "empty kernel", 0, None, 0, 0, None, f"not measured: {why}"))
        else:
            t, cpu = self.timer(lambda: launch_empty(self.stream()), reps=200)
            self.rows.append(
                Row(
                    "launch",
                    "floor",
                    "empty kernel",
                    0,
                    t,
                    0,
                    0,
                    0,
                    "cpu-bound (launch rate)" if cpu else "",
                    dict(timing="eager"),
                )
            )
            t = self.timer.graph(lambda: launch_empty(self.stream()), LAUNCH_PER_GRAPH, LAUNCH_REPLAYS)
            self.rows.append(Row("launch", "floor", "empty kernel", 0, t, 0, 0, 0, gnote, gextra))
        if self.tma_reason:
            self.mover_missing("launch", "no tasks", 0)
            return
        d = self.domain(1, np.full((1, 1), -1, np.int32), 1024, torch.float32)
        try:
            t, cpu = self.timer(lambda: d.run("multicast"), reps=200)
            d.check()
            self.rows.append(
                Row(
                    "launch",
                    "no tasks",
                    "tile mover",
                    0,
                    t,
                    0,
                    0,
                    0,
                    "persistent launch, world 1, one CTA (no task)" + (", cpu-bound" if cpu else ""),
                    dict(timing="eager"),
                )
            )
            t = self.timer.graph(lambda: d.run("multicast"), LAUNCH_PER_GRAPH, LAUNCH_REPLAYS)
            d.check()
            self.rows.append(
                Row(
                    "launch",
                    "no tasks",
                    "tile mover",
                    0,
                    t,
                    0,
                    0,
                    0,
                    graph_note(LAUNCH_PER_GRAPH, LAUNCH_REPLAYS, "persistent launch, world 1, one CTA (no task)"),
                    gextra,
                )
            )
        finally:
            d.close()

    def run_control(self) -> None:
        """The device control plane per layer and micro-batch (issues 19 and 33) on the CONTROL_SHAPES
        loads (EP8 .. EP288, zipf), every rank of a W-rank loopback world on this GPU: the loads'
        all-gather (``k_load_exchange``, every rank in one launch), the plan (``k_quota``), rank 0's
        schedule build into a plan-arena slot (``k_build_slot``) and its reroute table (``k_reroute``),
        each alone and as the whole step, timed two ways: eagerly from Python (CUDA events around
        back-to-back calls; small rows there are the host's enqueue rate, flagged cpu-bound) and
        inside a replayed CUDA graph (``Timer.graph``: device time, note "graph replay", extra
        timing=graph; the whole step's graph also with programmatic dependent launch, impl
        "device step, PDL", sm_90+; every other row without it), beside the host path they replace
        (loads copied to the host, the same planner's host build, the table built and uploaded).  #wrong: plan, build (status, task
        counts, digest) and table entries that differ from the host build's, gathered counts that
        differ from the posted ones, and nonzero exchange statuses."""
        if self.cuda_reason or not hasattr(self.cuda, "quota_plan"):
            self.rows.append(
                Row(
                    "control",
                    "-",
                    "-",
                    0,
                    None,
                    0,
                    0,
                    None,
                    f"not measured: {self.cuda_reason or 'this _cuda build has no quota_plan'}",
                )
            )
            return
        for label, W, epr in CONTROL_SHAPES:
            if self.late("control", label):
                continue
            try:
                self.control_shape(label, W, epr)
            except Exception as e:  # noqa: BLE001 - the next shape still runs
                self.errors.append(f"control {label}: {type(e).__name__}: {e}")
                self.rows.append(
                    Row("control", label, "-", W * epr, None, 0, 0, None, f"FAILED: {type(e).__name__}: {e}")
                )
                traceback.print_exc()
            finally:
                self.torch.cuda.synchronize(self.dev)
                self.torch.cuda.empty_cache()

    def control_shape(self, label: str, W: int, epr: int) -> None:
        """One shape's control rows.  Every row runs without programmatic dependent launch
        (``_cuda.set_programmatic_launch(False)``; the rows before it had none) except the step's
        graph row ``device step, PDL``, which turns it on (sm_90+; else the row says why)."""
        pdl_prev = self.cuda.programmatic_launch() if hasattr(self.cuda, "programmatic_launch") else None
        if pdl_prev is not None:
            self.cuda.set_programmatic_launch(False)
        try:
            self._control_shape(label, W, epr)
        finally:
            if pdl_prev is not None:
                self.cuda.set_programmatic_launch(pdl_prev)

    def _control_shape(self, label: str, W: int, epr: int) -> None:
        torch = self.torch
        from ultracomm import scenarios as workloads
        from ultracomm.moe.board_layout import BoardLayout
        from ultracomm.moe.reroute import RerouteTable
        from ultracomm.planners import Domain, get_planner
        from ultracomm.planners import device as dp

        E, S = W * epr, 2
        dom = Domain.flat(W, epr)
        load = workloads.zipf_load(W, E, 8192, 8, 2.0, seed=1)
        loads = torch.as_tensor(load, dtype=torch.int32, device=self.dev)
        host_plan = get_planner("device")
        out = dp.plan_on_gpu(loads, dom, S)
        t_plan, cpu = self.timer(lambda: dp.plan_on_gpu(loads, dom, S, out=out), reps=20)
        first = RerouteTable.from_plan(loads, out["slot_src"], out["slot_quota"], 0, epr, "echo")
        tab = dict(
            bounds=first.bounds,
            columns=first.columns,
            scratch=torch.empty(self.cuda.reroute_scratch_bytes(W, E) // 8, dtype=torch.int64, device=self.dev),
        )

        def device_path():
            dp.plan_on_gpu(loads, dom, S, out=out)
            RerouteTable.from_plan(loads, out["slot_src"], out["slot_quota"], 0, epr, "echo", out=tab)

        t_all, cpu_all = self.timer(device_path, reps=20)
        torch.cuda.synchronize(self.dev)
        ref = host_plan(load, dom, S)
        want_q = np.where(ref.slot_src >= 0, ref.slot_moves.sum(0), 0)
        ht = RerouteTable.from_plan(
            *(
                x.cpu()
                for x in (
                    loads,
                    torch.as_tensor(ref.slot_src, dtype=torch.int32),
                    torch.as_tensor(want_q, dtype=torch.int64),
                )
            ),
            0,
            epr,
            "echo",
        )

        def wrong_plan() -> int:
            return int(
                (out["slot_src"].cpu().numpy() != ref.slot_src).sum()
                + (out["slot_quota"].cpu().numpy() != want_q).sum()
            )

        def wrong_table(t) -> int:
            return int((t["bounds"].cpu() != ht.bounds).sum() + (t["columns"].cpu() != ht.columns).sum())

        wrong = wrong_plan() + wrong_table(dict(bounds=first.bounds, columns=first.columns))
        info = dp.decode_result(out["result"].cpu())
        note = f"probes {info['probes']}, rounds {info['rounds']}, replicas {info['replicas']}"
        self.rows.append(
            Row(
                "control",
                f"{label} plan",
                "k_quota",
                E,
                t_plan,
                0,
                0,
                wrong,
                note + (", cpu-bound" if cpu else ""),
                dict(timing="eager"),
            )
        )
        self.rows.append(
            Row(
                "control",
                f"{label} plan+reroute",
                "k_quota+k_reroute",
                E,
                t_all,
                0,
                0,
                wrong,
                note + (", cpu-bound" if cpu_all else ""),
                dict(timing="eager"),
            )
        )

        def host_path():
            res = host_plan(loads.cpu().numpy().astype(np.int64), dom, S)
            RerouteTable.from_result(res, 0, "echo").to(self.dev)
            torch.cuda.current_stream(self.dev).synchronize()

        host_path()
        ts = []
        for _ in range(3 if self.quick or W > 64 else 20):
            t0 = time.perf_counter()
            host_path()
            ts.append(time.perf_counter() - t0)
        self.rows.append(
            Row(
                "control",
                f"{label} plan+reroute",
                "host (D2H, plan, H2D)",
                E,
                statistics.median(ts),
                0,
                0,
                None,
                "wall time incl. the host sync",
                dict(timing="wall"),
            )
        )

        # the loads' all-gather: W loopback ranks' boards on this GPU, one (cooperative) launch
        L = BoardLayout(W, E)
        boards = torch.zeros((W, L.total_bytes), dtype=torch.uint8, device=self.dev)
        bases = torch.tensor([boards[r].data_ptr() for r in range(W)], dtype=torch.int64, device=self.dev)
        gathered = torch.zeros((W, W, E), dtype=torch.int32, device=self.dev)
        status = torch.zeros((W, 8), dtype=torch.int32, device=self.dev)
        seq = torch.zeros((W, 1), dtype=torch.int64, device=self.dev)
        entries = [
            dict(
                counts=loads[r].data_ptr(),
                out=gathered[r].data_ptr(),
                status=status[r].data_ptr(),
                bases=bases.data_ptr(),
                seq=seq[r].data_ptr(),
                rank=r,
            )
            for r in range(W)
        ]

        def exchange():
            self.cuda.load_exchange(entries, L.world, L.num_experts, L.entries, L.record_bytes, 10.0, self.stream())

        def wrong_exchange() -> int:
            return int((gathered.cpu() != loads.cpu().unsqueeze(0)).sum()) + int(status[:, 0].cpu().ne(0).sum())

        x_note = f"all {W} ranks in one launch (per rank: its own CTA)"
        fit = self.cuda.load_exchange_max_coresident(W) if hasattr(self.cuda, "load_exchange_max_coresident") else None
        if fit is not None:
            x_note += f"; {fit} CTAs fit at once"
        t_x, cpu_x = self.timer(exchange, reps=20)
        torch.cuda.synchronize(self.dev)
        wrong_x = wrong_exchange()
        self.rows.append(
            Row(
                "control",
                f"{label} exchange",
                "k_load_exchange",
                E,
                t_x,
                0,
                0,
                wrong_x,
                x_note + (", cpu-bound" if cpu_x else ""),
                dict(timing="eager"),
            )
        )

        def plan():
            dp.plan_on_gpu(gathered[0], dom, S, out=out)

        def reroute():
            RerouteTable.from_plan(gathered[0], out["slot_src"], out["slot_quota"], 0, epr, "echo", out=tab)

        build, wrong_build, b_note = self.control_build(W, epr, S, out)
        kernels = dict(exchange=exchange, plan=plan, build=build, reroute=reroute)
        step = tuple(kernels.values())  # not kernels itself: the step's own entry is added below

        def whole():
            for fn in step:
                fn()

        notes = {}
        if build is None:
            notes["build"] = notes[CONTROL_STEP[0]] = b_note
        else:
            t_all, cpu_all = self.timer(whole, reps=20)
            torch.cuda.synchronize(self.dev)
            self.rows.append(
                Row(
                    "control",
                    f"{label} {CONTROL_STEP[0]}",
                    CONTROL_STEP[1],
                    E,
                    t_all,
                    0,
                    0,
                    wrong_plan() + wrong_table(tab) + wrong_exchange() + wrong_build(),
                    "the whole control plane of one layer and micro-batch" + (", cpu-bound" if cpu_all else ""),
                    dict(timing="eager"),
                )
            )
            notes["build"] = b_note
        # the same kernels inside replayed CUDA graphs (one graph per row; the step: all four)
        times = {}
        if build is not None:
            kernels[CONTROL_STEP[0]] = whole
        for key, fn in kernels.items():
            if fn is None:
                continue
            try:
                times[key] = self.timer.graph(fn)
            except Exception as e:  # noqa: BLE001 - the row says why
                notes[key] = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize(self.dev)
        torch.cuda.synchronize(self.dev)
        wx, wp, wt = wrong_exchange(), wrong_plan(), wrong_table(tab)
        wb = wrong_build() if build is not None else None
        wrong_g = dict(exchange=wx, plan=wp, reroute=wt, build=wb)
        wrong_g[CONTROL_STEP[0]] = wx + wp + wt + (wb or 0)
        # the step's graph again, captured with programmatic dependent launch; #wrong from its outputs
        key = CONTROL_STEP_PDL[0]
        if build is None:
            notes[key] = b_note
        elif not hasattr(self.cuda, "programmatic_launch"):
            notes[key] = "this _cuda build has no programmatic launch switch"
        else:
            self.cuda.set_programmatic_launch(True)
            try:
                if not self.cuda.programmatic_launch(self.dev.index):
                    cc = torch.cuda.get_device_capability(self.dev)
                    notes[key] = f"sm_{cc[0]}{cc[1]} has no programmatic dependent launch (sm_90+)"
                else:

                    def stale() -> None:  # after the capture: what is checked was written by PDL replays only
                        for t in (gathered, out["slot_src"], out["slot_quota"], tab["bounds"], tab["columns"]):
                            t.fill_(-7)  # a value a replay did not rewrite shows as #wrong

                    times[key] = self.timer.graph(whole, prepare=stale)
                    torch.cuda.synchronize(self.dev)
                    wrong_g[key] = wrong_exchange() + wrong_plan() + wrong_table(tab) + wrong_build()
            except Exception as e:  # noqa: BLE001 - the row says why
                notes[key] = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize(self.dev)
            finally:
                self.cuda.set_programmatic_launch(False)
        notes["exchange"] = x_note
        notes["plan"] = note
        self.rows.extend(control_graph_rows(label, E, times, wrong_g, notes))

    def control_build(self, W: int, epr: int, S: int, out: dict):
        """(build fn, its #wrong fn, note) for rank 0's schedule build into a plan-arena slot
        (k_build_slot, a DeepSeek-V3-sized expert: 3 x 7168 x 2048 bf16 weights, fp32 grads, 1 MiB
        chunks), after one eager row; (None, None, why) when this _cuda build or shape has none.
        #wrong: the build's status, task counts and digest against its host build (_core.build_into_views)."""
        torch = self.torch
        from ultracomm import _core

        if not hasattr(self.cuda.Runner, "build_slot"):
            return None, None, "this _cuda build has no Runner.build_slot"
        E = W * epr
        wb, gb, chunk = 3 * 7168 * 2048 * 2, 3 * 7168 * 2048 * 4, 1 << 20
        wl = _core.window_layout(S, wb, gb, chunk)
        runner = self.cuda.Runner(self.dev.index)
        tasks = ((epr + S) * wl["weight_chunks"], (epr + S) * wl["grad_chunks"])
        arena = self.cuda.PlanArena(
            self.dev.index, 1, nranks=1, world=W, num_experts=E, masters=epr, slots=S, tasks=tasks, refs=(W * S, W * S)
        )
        for op in (0, 1):  # rank 0's static part (addresses are never dereferenced: nothing is launched)
            entry = dict(
                op=op,
                rank=0,
                world=W,
                slots=S,
                weight_slot_bytes=wl["weight_slot_bytes"],
                grad_slot_bytes=wl["grad_slot_bytes"],
                chunk_bytes=wl["chunk_bytes"],
                window_bases=[(r + 1) << 32 for r in range(W)],
                member_off=[0],
                member_bytes=[wb if op == 0 else gb],
                master_ptrs=[(64 + i) << 24 for i in range(epr)],
                local_index_of=[e if e < epr else -1 for e in range(E)],
                grad_dtype=0,
                my_slots=[-1] * S,
                tasks=np.zeros(0, _core_records("TASK_DTYPE")),
                refs=np.zeros(0, _core_records("REF_DTYPE")),
                timeout_s=10.0,
                slot_parent=[-1] * S,
                digest=1,
            )
            runner.write_template(arena, 0, [entry], self.stream())
        home = torch.arange(E, dtype=torch.int32, device=self.dev) // epr
        hop = 740

        def build():
            runner.build_slot(
                arena,
                0,
                0,
                slot_src=out["slot_src"].data_ptr(),
                home_of=home.data_ptr(),
                node_of=0,
                world=W,
                slots=S,
                num_experts=E,
                rank=0,
                max_depth=8,
                weight_bytes=wb,
                grad_bytes=gb,
                chunk_bytes=chunk,
                hop_bytes=hop,
                stream=self.stream(),
            )

        def wrong_build() -> int:
            got = arena.build_result(0)
            want = _core.build_into_views(
                out["slot_src"].cpu().numpy(),
                home.cpu().numpy(),
                None,
                wb,
                gb,
                chunk,
                0,
                8,
                hop,
                list(tasks),
                [W * S, W * S],
            )
            return (
                int(got["status"] != 0)
                + int(got["digest"] != want["digest"])
                + sum(int(got["num_tasks"][i] != want[n]["num_tasks"]) for i, n in enumerate(("multicast", "reduce")))
            )

        t_build, cpu = self.timer(build, reps=20)
        self.torch.cuda.synchronize(self.dev)
        got = arena.build_result(0)
        note = f"tasks {got['num_tasks'][0]}/{got['num_tasks'][1]}, depth {got['depth'][0]}/{got['depth'][1]}"
        self.rows.append(
            Row(
                "control",
                f"{f'EP{W}'} build",
                "k_build_slot",
                E,
                t_build,
                0,
                0,
                wrong_build(),
                note + (", cpu-bound" if cpu else ""),
                dict(timing="eager"),
            )
        )
        return build, wrong_build, note

    def run_flag(self) -> None:
        torch = self.torch
        pingpong, why = self.binding("flag_pingpong")
        if pingpong is None:
            self.rows.append(Row("flag", "rtt", "release/acquire", 0, None, 0, 0, None, f"not measured: {why}"))
            return
        iters = 2000 if self.quick else 20000
        flags = torch.zeros(64, dtype=torch.int64, device=self.dev)  # ping at [0], pong at [32]: 256 B apart
        out = torch.zeros(2, dtype=torch.int64, device=self.dev)
        base = 0
        pingpong(flags.data_ptr(), flags.data_ptr() + 256, base, iters, int(5e9), out.data_ptr(), self.stream())
        torch.cuda.synchronize()
        ns, failed = (int(x) for x in out.tolist())
        wrong = int(failed != 0) + int(int(flags[0]) != base + iters) + int(int(flags[32]) != base + iters)
        self.rows.append(
            Row(
                "flag",
                "rtt",
                "release/acquire",
                8,
                ns / 1e9 / iters,
                0,
                0,
                wrong,
                f"{iters} round trips between 2 CTAs" + (f"; timed out at {failed}" if failed else ""),
            )
        )

    def run_copy(self) -> None:
        torch = self.torch
        for size in self.copy_sizes():
            if self.late("copy", fmt_size(size)):
                return
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.dev)
            dst = torch.empty_like(src)
            if self.cudart is not None:
                self.rows.append(
                    self.baseline_copies(
                        "copy", "1->1", "cudaMemcpyAsync", src, [dst], lambda: self.memcpy(dst, src, size)
                    )
                )
            else:
                self.rows.append(
                    Row(
                        "copy", "1->1", "cudaMemcpyAsync", size, None, 0, 0, None, f"not measured: {self.cudart_reason}"
                    )
                )
            self.rows.append(self.baseline_copies("copy", "1->1", "torch copy_", src, [dst], lambda: dst.copy_(src)))
            if self.tma_reason:
                self.mover_missing("copy", "1->1", size)
                continue
            self.rows.append(self.mover_multicast("copy", "1->1", 1, size))

    def copy_sizes(self) -> list[int]:
        return [MiB, 16 * MiB, 256 * MiB] if self.quick else [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 << 30]

    def mover_multicast(self, section: str, case: str, n: int, size: int, **cfg) -> Row:
        """Home rank 0 multicasts one expert of ``size`` bytes into ``n`` replicas (direct)."""
        d = self.domain(n + 1, one_expert(n), size, self.torch.float32, relay_mode="off", **cfg)
        try:
            t, cpu, wrong = d.timed_multicast(self.timer)
            (note, ctas, grid), tasks, chunk = d.cta_note("multicast"), d.num_tasks("multicast"), d.sched.chunk_bytes
        finally:
            d.close()
        return Row(
            section,
            case,
            "tile mover",
            size,
            t,
            n * size,
            (1 + n) * size,
            wrong,
            note + (", cpu-bound" if cpu else ""),
            dict(ctas=ctas, tasks=tasks, chunk=chunk, grid=grid),
        )

    def run_fanout(self) -> None:
        torch = self.torch
        size = FANOUT_BYTES
        for n in (2, 4, 8):
            if self.late("fanout", f"1->{n}"):
                return
            if self.cudart is not None:
                src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.dev)
                dsts = [torch.empty_like(src) for _ in range(n)]

                def copies():
                    for d in dsts:
                        self.memcpy(d, src, size)

                self.rows.append(self.baseline_copies("fanout", f"1->{n}", f"{n} x cudaMemcpyAsync", src, dsts, copies))
                del src, dsts
            if self.tma_reason:
                self.mover_missing("fanout", f"1->{n}", size)
            else:
                self.rows.append(self.mover_multicast("fanout", f"1->{n}", n, size))

    def run_sweep(self) -> None:
        torch = self.torch
        size = 256 * MiB
        if self.cudart is not None:
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.dev)
            dst = torch.empty_like(src)
            self.rows.append(
                self.baseline_copies(
                    "sweep",
                    "1->1",
                    "cudaMemcpyAsync",
                    src,
                    [dst],
                    lambda: self.memcpy(dst, src, size),
                    "reference for the fractions",
                )
            )
            del src, dst
        ref = self.rows[-1].algbw if self.cudart is not None else None
        for ctas in (1, 2, 4, 8, 16, 32) if self.quick else (1, 2, 4, 6, 8, 12, 16, 24, 32):
            if self.late("sweep", f"{ctas} CTAs"):
                return
            if self.tma_reason:
                self.mover_missing("sweep", f"{ctas} CTAs", size)
                continue
            row = self.mover_multicast("sweep", f"{ctas} CTAs", 1, size, multicast_sms=ctas)
            if ref and row.algbw:
                row.note += f", {100 * row.algbw / ref:.1f}% of cudaMemcpyAsync"
                row.extra["fraction"] = row.algbw / ref
            self.rows.append(row)

    def run_reduce(self) -> None:
        torch = self.torch
        size_elems = (16 * MiB) if self.quick else (64 * MiB)  # elements of the output
        cases = [(k, dt) for dt in ("fp32", "bf16", "fp16") for k in (2, 4, 8)]
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        for k, name in cases + [(2, "fp32-1cta")]:
            dt = dtypes[name.split("-")[0]]
            n = size_elems // dt.itemsize if name != "fp32-1cta" else 4 * MiB // 4
            nbytes = n * dt.itemsize
            case = f"k={k} {name}"
            if self.late("reduce", case):
                return
            if name != "fp32-1cta":
                stacked = torch.randn((k + 1, n), device=self.dev).to(dt)
                out = torch.empty(n, dtype=dt, device=self.dev)
                want = ordered_sum(torch, stacked)
                torch.sum(stacked, dim=0, out=out)
                w0 = self.wrong_bytes(out, want) // dt.itemsize
                t, cpu = self.timer(lambda: torch.sum(stacked, dim=0, out=out))
                self.rows.append(
                    Row(
                        "reduce",
                        case,
                        "torch.sum",
                        nbytes,
                        t,
                        nbytes,
                        (k + 2) * nbytes,
                        w0 + self.wrong_bytes(out, want) // dt.itemsize,
                        "informational #wrong: torch's order" + (", cpu-bound" if cpu else ""),
                        dict(k=k, dtype=name),
                    )
                )
                del stacked, out, want
            for path in REDUCE_IMPLS:
                row = self.reduce_row("reduce", case, k, dt, nbytes, name, 1 if name == "fp32-1cta" else 0, path)
                self.rows.append(row)

    def staged_reason(self) -> Optional[str]:
        """Why the tile mover's TMA-staged reduce cannot run here (None: it can): sm_90+ only."""
        cc = tuple(int(x) for x in str(self.info.get("cc", "0.0")).split("."))
        return None if cc >= (9, 0) else f"reduce_path='tma' needs sm_90+ (bulk copies); this GPU is sm_{cc[0]}{cc[1]}"

    def reduce_row(
        self, section: str, case: str, k: int, dt, nbytes: int, name: str, ctas: int, path: str = "hunk"
    ) -> Row:
        """The tile mover's row of one reduce case through reduce path ``path`` (impl REDUCE_IMPLS[path]),
        or the row saying why it was not measured; a staged row's note compares it with the hunk row
        of the same section, case and size measured before it."""
        why = self.tma_reason or (self.staged_reason() if path == "tma" else None)
        if why:
            return Row(section, case, REDUCE_IMPLS[path], nbytes, None, 0, 0, None, f"not measured: {why}")
        row = self.mover_reduce(case, k, dt, nbytes, name, ctas, path)
        row.section = section
        hunk = [r for r in self.rows if (r.section, r.case, r.size, r.impl) == (section, case, nbytes, "tile mover")]
        if path != "hunk" and hunk and hunk[-1].algbw and row.algbw:
            row.extra["vs_hunk"] = row.algbw / hunk[-1].algbw
            row.note += f", {100 * row.extra['vs_hunk']:.1f}% of tile mover's rate"
        return row

    def reduce_sweep_cases(self) -> list[tuple[int, str, int]]:
        """reduce_sweep's (k, dtype, CTAs), in the order they run: each case at the device's SM count
        first (the all-SM rows issue 34's "reduce with every SM vs torch.sum" reads: rank 0 holds
        every task of the pulled reduce, the k idle ranks one CTA each, so the grid is SMs + k and
        runs the shared TMA ring; first, so a bench cut short by its budget still has them), then
        each case at 1..32 CTAs."""
        cases = ((2, "fp32"), (8, "bf16"), (8, "fp16"))
        ctas = [1, 2, 4, 8, 16, 32] if self.quick else [1, 2, 4, 8, 12, 16, 23, 32]
        sms = self.info.get("sms")
        first = [(k, name, int(sms)) for k, name in cases] if sms and int(sms) not in ctas else []
        return first + [(k, name, c) for k, name in cases for c in ctas]

    def run_reduce_sweep(self) -> None:
        """Reduce CTA sweep (issue 34): one rank's reduce at the device's SM count and at 1..32 CTAs
        (reduce_sweep_cases), k=2 fp32 and k=8 fp16/bf16 (64 MiB of output, as the reduce section's
        torch.sum rows; 16 MiB with --quick), each row with its traffic per CTA ((k + 2) x S / time /
        CTAs: the per-SM rate the SM budget needs)."""
        torch = self.torch
        size = (16 * MiB) if self.quick else (64 * MiB)
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        for k, name, ctas in self.reduce_sweep_cases():
            case = f"k={k} {name} {ctas} CTAs"
            if self.late("reduce_sweep", case):
                return
            for path in REDUCE_IMPLS:  # each CTA count through both reduce paths, hunk first
                row = self.reduce_row("reduce_sweep", case, k, dtypes[name], size, name, ctas, path)
                used = row.extra.get("ctas") or ctas
                if row.busbw:
                    row.extra["per_cta_busbw"] = row.busbw / used
                    row.note += f", {row.busbw / used / 1e9:.1f} GB/s per CTA"
                self.rows.append(row)

    def mover_reduce(self, case: str, k: int, dt, nbytes: int, name: str, ctas: int, path: str = "hunk") -> Row:
        cfg = dict(reduce_sms=ctas) if ctas else {}
        d = self.domain(k + 1, one_expert(k), nbytes, dt, relay_mode="off", reduce_path=path, **cfg)
        try:
            d.run("multicast")  # the plan's first operation; the reduce reads the replicas' grads
            want = d.seed_grads()
            d.run("reduce")
            w0 = d.reduce_wrong(want)
            t, cpu = self.timer(lambda: d.run("reduce"))
            d.check()
            want = d.seed_grads()  # the timed runs accumulated: check one more from a fresh state
            d.run("reduce")
            wrong = w0 + d.reduce_wrong(want)
            note, used, grid = d.cta_note("reduce")
        finally:
            d.close()
        return Row(
            "reduce",
            case,
            REDUCE_IMPLS[path],
            nbytes,
            t,
            nbytes,
            (k + 2) * nbytes,
            wrong,
            note + (", cpu-bound" if cpu else ""),
            dict(k=k, dtype=name, ctas=used, reduce_path=path, grid=grid),
        )

    def run_relay(self) -> None:
        chunks = [32 << 10, 1 << 20, 4 << 20] if self.quick else [32 << 10, 128 << 10, 512 << 10, 1 << 20, 4 << 20]
        if self.tma_reason:
            self.mover_missing("relay", "chain", 0)
            return
        for chunk in chunks:
            for mode, size in (("fill", chunk), ("stream", 64 * MiB)):
                for depth in (1, 2, 3, 4):
                    if self.late("relay", f"D={depth} chunk={fmt_size(chunk)} {mode}"):
                        return
                    d = self.domain(
                        depth + 1,
                        one_expert(depth),
                        size,
                        self.torch.float32,
                        chunk_bytes=chunk,
                        relay_mode="force" if depth > 1 else "off",
                        max_depth=max(depth, 2),
                    )
                    try:
                        chain = d.is_chain(depth)
                        t, cpu, wrong = d.timed_multicast(self.timer)
                        ctas = d.ctas
                    finally:
                        d.close()
                    self.rows.append(
                        Row(
                            "relay",
                            f"D={depth} chunk={fmt_size(chunk)} {mode}",
                            "tile mover",
                            size,
                            t,
                            depth * size,
                            2 * depth * size,
                            wrong,
                            ", ".join(
                                x
                                for x in ("" if chain else "NOT a chain: excluded from the fit", cpu * "cpu-bound")
                                if x
                            ),
                            dict(mode=mode, depth=depth, chunk=chunk, chain=chain, ctas=ctas, senders=depth),
                        )
                    )

    # -- lb_prefetch (issue 37): DeepEP's lb_prefetch_weights test shape
    def free_bytes(self) -> int:
        return int(self.torch.cuda.mem_get_info(self.dev)[0])

    def sync(self) -> None:
        """Wait for this device's current stream (not the device: see Timer)."""
        if self.dev.type == "cuda":
            self.torch.cuda.current_stream(self.dev).synchronize()

    def run_lb_prefetch(
        self,
        shape: tuple = LB_SHAPE,
        members: Sequence[tuple] = LB_MEMBERS,
        empty: float = LB_EMPTY,
        seed: int = LB_SEED,
    ) -> None:
        """DeepEP's ``lb_prefetch_weights`` at its test's shape (LB_SHAPE, LB_MEMBERS: 8 ranks in
        loopback, 64 experts, 8 redundant slots per rank, 64 MiB fp8 weights + 16 KiB + 4 KiB fp32
        scales per expert, 25% empty slots, a seeded random mapping (lb_mapping): no expert twice on
        a rank, none on its home), every rank's masters and slots on this GPU.  Rows, same bytes and
        dtypes, timed the same way (CUDA events around back-to-back operations, median of trials):
          - ``copy_ per (slot, tensor)``: DeepEP's way, a direct push from each home, one
            ``Tensor.copy_`` (a cudaMemcpyAsync D2D) per filled slot and tensor;
          - ``tile mover, 3-member layout``: ultracomm's multicast of one ExpertLayout of the three
            members (grad=False) through build_schedule and CudaLoopback, every rank in one launch,
            relay off (LBDomain: Loopback generalised to several experts per rank and members);
          - both again inside a replayed CUDA graph (note "graph replay", timing=graph);
          - ``deepep_lb.LBBuffer``: the adapter's own calls, ``lb_prefetch_weights`` of each rank
            in turn from this thread (its pools: one Context each, tma over cuda_local windows, the
            last rank's call launches a pool's domain), the mapping a CPU tensor; eager only.
        #wrong: bytes of a filled slot (all three tensors) that differ from its expert's, and of an
        empty slot that differ from the sentinel, after the first operation and after the timed
        ones (destinations refilled with the sentinel before each).  Skipped, with a note, when the
        device has less free memory than lb_memory_bytes."""
        torch = self.torch
        W, epr, S = shape
        mapping = lb_mapping(W, epr, S, empty, seed)
        per_expert = sum(n for _, n, _ in members)
        need, free = lb_memory_bytes(W, epr, S, per_expert), self.free_bytes()
        if free < need:
            why = f"not measured: needs {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB free"
            for impl in (LB_COPIES, LB_MULTICAST, LB_ADAPTER):
                self.rows.append(lb_row(impl, mapping, epr, members, None, None, why))
            return
        dtypes = [getattr(torch, dt) for _, _, dt in members]
        layout = self.uc.ExpertLayout(
            tuple(
                self.uc.Member(name, (n // dt.itemsize,), dt, grad=False) for (name, n, _), dt in zip(members, dtypes)
            )
        )
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        masters = [
            [
                torch.randint(0, 256, (epr, n), dtype=torch.uint8, device=self.dev, generator=gen).view(dt)
                for (_, n, _), dt in zip(members, dtypes)
            ]
            for _ in range(W)
        ]
        d = LBDomain(torch, self.dev, layout, masters, mapping, epr)
        try:
            pairs = d.copy_pairs()

            def copies():
                for dst, src in pairs:
                    dst.copy_(src)

            def copies_rows():
                t, cpu, wrong = self.lb_timed(copies, d.slot, masters, mapping, epr)
                self.rows.append(
                    lb_row(
                        LB_COPIES,
                        mapping,
                        epr,
                        members,
                        t,
                        wrong,
                        f"{len(pairs)} copies" + (", cpu-bound" if cpu else ""),
                    )
                )
                t, wrong = self.lb_timed_graph(copies, d.slot, masters, mapping, epr)
                self.rows.append(
                    lb_row(
                        LB_COPIES,
                        mapping,
                        epr,
                        members,
                        t,
                        wrong,
                        f"{len(pairs)} copies",
                        graph=(LB_PER_GRAPH, LB_REPLAYS),
                    )
                )

            def multicast_rows():
                if self.tma_reason:
                    self.rows.append(
                        lb_row(LB_MULTICAST, mapping, epr, members, None, None, f"not measured: {self.tma_reason}")
                    )
                    return
                d.setup_cuda(self)
                what = f"{d.cta_note()}, {W} ranks in one launch, relay off"
                t, cpu, wrong = self.lb_timed(d.run, d.slot, masters, mapping, epr, d.check)
                self.rows.append(
                    lb_row(
                        LB_MULTICAST,
                        mapping,
                        epr,
                        members,
                        t,
                        wrong,
                        what + (", cpu-bound" if cpu else ""),
                        dict(ctas=d.ctas, senders=W),
                    )
                )
                t, wrong = self.lb_timed_graph(d.run, d.slot, masters, mapping, epr, d.check)
                self.rows.append(
                    lb_row(
                        LB_MULTICAST,
                        mapping,
                        epr,
                        members,
                        t,
                        wrong,
                        what,
                        dict(ctas=d.ctas, senders=W),
                        graph=(LB_PER_GRAPH, LB_REPLAYS),
                    )
                )

            self.lb_try(LB_COPIES, mapping, epr, members, copies_rows)
            self.lb_try(LB_MULTICAST, mapping, epr, members, multicast_rows)
        finally:
            d.close()
            self.free_cache()
        if self.tma_reason:
            self.rows.append(lb_row(LB_ADAPTER, mapping, epr, members, None, None, f"not measured: {self.tma_reason}"))
        else:
            self.lb_try(LB_ADAPTER, mapping, epr, members, lambda: self.lb_adapter(masters, mapping, epr, members))
        masters.clear()  # the last references to the masters' 4 GiB
        self.free_cache()

    def free_cache(self) -> None:
        if self.dev.type == "cuda" and not self.poisoned:
            self.sync()
            self.torch.cuda.empty_cache()

    def lb_try(
        self, impl: str, mapping: np.ndarray, epr: int, members: Sequence[tuple], fn: Callable[[], None]
    ) -> None:
        """One lb_prefetch measurement; a failure becomes its row (FAILED: ...) and an error."""
        if self.late("lb_prefetch", f"{lb_case(mapping.shape[0], epr, mapping.shape[1])} {impl}"):
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the other rows still run; the error is reported
            self.errors.append(f"lb_prefetch {impl}: {type(e).__name__}: {e}")
            self.rows.append(lb_row(impl, mapping, epr, members, None, None, f"FAILED: {type(e).__name__}: {e}"))
            traceback.print_exc()

    def lb_wrong(
        self, slot: Callable, masters: list, mapping: np.ndarray, epr: int, check: Optional[Callable[[], None]] = None
    ) -> int:
        self.sync()
        if check is not None:
            check()
        return lb_wrong(self.torch, slot, masters, mapping, epr)

    def lb_timed(
        self,
        fn: Callable[[], None],
        slot: Callable,
        masters: list,
        mapping: np.ndarray,
        epr: int,
        check: Optional[Callable[[], None]] = None,
    ) -> tuple[float, bool, int]:
        """(seconds per operation, cpu-bound, #wrong of the first and of the timed operations)."""
        lb_fill(self.torch, slot, mapping, len(masters[0]), SENTINEL)
        fn()
        w0 = self.lb_wrong(slot, masters, mapping, epr, check)
        lb_fill(self.torch, slot, mapping, len(masters[0]), SENTINEL)
        t, cpu = self.timer(fn)
        return t, cpu, w0 + self.lb_wrong(slot, masters, mapping, epr, check)

    def lb_timed_graph(
        self,
        fn: Callable[[], None],
        slot: Callable,
        masters: list,
        mapping: np.ndarray,
        epr: int,
        check: Optional[Callable[[], None]] = None,
    ) -> tuple[float, int]:
        """(device seconds per operation inside a replayed graph, #wrong after the replays: the
        destinations are refilled with the sentinel between the capture and the first replay)."""
        t = self.timer.graph(
            fn, LB_PER_GRAPH, LB_REPLAYS, prepare=lambda: lb_fill(self.torch, slot, mapping, len(masters[0]), SENTINEL)
        )
        return t, self.lb_wrong(slot, masters, mapping, epr, check)

    def lb_adapter(self, masters: list, mapping: np.ndarray, epr: int, members: Sequence[tuple]) -> None:
        """The deepep_lb adapter's row: an LBBuffer per rank (made in the ranks' threads: making one
        is collective), its pools planned as DeepEP's test plans them (one per tensor), then every
        rank's lb_prefetch_weights in turn from this thread."""
        torch = self.torch
        from ultracomm import LoopbackDomain
        from ultracomm.integrations import deepep_lb

        W, S = mapping.shape
        opts = dict(device=str(self.dev), transport="tma", window="cuda_local", relay_mode="off", timeout_s=10.0)

        def make(group):
            plan = deepep_lb.BufferAllocator()
            pools = [plan.allocate((S, *t.shape[1:]), t.dtype) for t in masters[group.rank]]
            return deepep_lb.LBBuffer(group, plan, epr, **opts), pools

        made = LoopbackDomain(W).run(make)
        lbs, pools = [m[0] for m in made], [m[1] for m in made]
        del made
        try:
            table = torch.as_tensor(mapping, dtype=torch.int32)  # on the host: no device-to-host copy per call

            def prefetch():
                for r in range(W):
                    lbs[r].lb_prefetch_weights(pools[r], masters[r], table)

            def slot(r, c, m):
                return pools[r][m][c]

            def check():  # a kernel's recorded failure (a timeout naming rank and expert) raises here
                for lb in lbs:
                    for p in lb.pools:
                        p.ctx.synchronize()

            t, cpu, wrong = self.lb_timed(prefetch, slot, masters, mapping, epr, check)
            sms = lbs[0].lb_get_theoretical_num_sms()
            self.rows.append(
                lb_row(
                    LB_ADAPTER,
                    mapping,
                    epr,
                    members,
                    t,
                    wrong,
                    f"the adapter's API: {W} ranks' lb_prefetch_weights from one thread, "
                    f"{len(members)} pools (a launch each), {sms} CTAs/rank, relay off"
                    + (", cpu-bound" if cpu else ""),
                    dict(ctas=sms, senders=W),
                )
            )
        finally:
            pools.clear()
            for lb in lbs:
                lb.destroy()

    def run_copy_engine(self) -> None:
        cases = [(1, size) for size in self.copy_sizes()] + [(n, FANOUT_BYTES) for n in (2, 4, 8)]
        for n, size in cases:
            if self.ce_reason:
                self.rows.append(copy_engine_row(f"1->{n}", n, size, None, None, f"not measured: {self.ce_reason}"))
                continue
            if self.late("copy_engine", f"1->{n} {fmt_size(size)}", reserve=False):
                return
            d = self.domain(n + 1, one_expert(n), size, self.torch.float32, relay_mode="off", transport="copy_engine")
            try:
                t, cpu, wrong = d.timed_multicast(self.timer)
            finally:
                d.close()
            self.rows.append(
                copy_engine_row(f"1->{n}", n, size, t, wrong, "cpu-bound" if cpu else "", tile_row(self.rows, n, size))
            )


def one_expert(n: int) -> np.ndarray:
    """``slot_src`` of world n+1: expert 0 (home rank 0) in slot 0 of ranks 1..n."""
    ss = np.full((n + 1, 1), -1, np.int32)
    ss[1:, 0] = 0
    return ss


def ordered_sum(torch, stacked):
    """fp32 sum of the rows in order (row 0 = the destination's old value), rounded once."""
    acc = stacked[0].float()
    for i in range(1, stacked.shape[0]):
        acc = acc + stacked[i].float()
    return acc.to(stacked.dtype)


class Loopback:
    """A one-GPU loopback domain of ``world`` ranks holding one expert of ``nbytes`` (weights and
    grads, slot 0), over the schedule ultracomm builds for the plan, run by
    ``ultracomm.cuda.loopback`` (``transport="tma"``: all ranks in ONE persistent launch; CTAs of
    each rank with a task in the op: ``multicast_sms`` / ``reduce_sms`` when given, else what a
    Context would use (``ultracomm.cuda.sm_budget``), capped so the whole grid is co-resident; a
    rank with no task gets one CTA (``CudaLoopback.launch_ctas``), so rank 0 of a pushed multicast
    or a pulled reduce may have every co-resident CTA but one per idle rank) or by one
    ``copy_engine`` transport per rank (multicast only; the rank completing each set enqueues every
    rank's commands, as in a Context)."""

    def __init__(
        self,
        gpu: Gpu,
        world: int,
        slot_src: np.ndarray,
        nbytes: int,
        grad_dtype,
        *,
        multicast_sms: int = 0,
        reduce_sms: int = 0,
        chunk_bytes: int = 1 << 20,
        relay_mode: str = "off",
        max_depth: int = 8,
        timeout_s: float = 10.0,
        transport: str = "tma",
        reduce_path: str = "hunk",
    ):
        torch, uc = gpu.torch, gpu.uc
        self.reduce_path = reduce_path  # the tma kernel's reduce path (REDUCE_IMPLS)
        from ultracomm import _core
        from ultracomm.records import Op
        from ultracomm.schedule import build_schedule

        self.gpu, self.torch, self.world = gpu, torch, world
        self.lb, self.ce, self.plans = None, [], {}
        n = nbytes // grad_dtype.itemsize
        if n * grad_dtype.itemsize != nbytes:
            raise ValueError(f"{nbytes} bytes is not a whole number of {grad_dtype} elements")
        self.glayout = (n, grad_dtype)
        # weights and grads are both nbytes: one member whose dtype is the grad dtype
        layout = uc.ExpertLayout((uc.Member("w", (n,), grad_dtype),), grad_dtype=grad_dtype)
        plan = uc.ReplicaPlan.make(slot_src, experts_per_rank=1)
        self.sched = build_schedule(
            plan,
            layout.weight_bytes,
            layout.grad_bytes,
            chunk_bytes=chunk_bytes,
            relay_mode=relay_mode,
            max_depth=max_depth,
        )
        self.wl = _core.window_layout(1, layout.weight_bytes, layout.grad_bytes, chunk_bytes)
        self.windows = [torch.zeros(self.wl["total_bytes"], dtype=torch.uint8, device=gpu.dev) for _ in range(world)]
        self.weights = [
            torch.randint(-8, 8, (n,), device=gpu.dev).to(grad_dtype)
            if r == 0
            else torch.zeros(n, dtype=grad_dtype, device=gpu.dev)
            for r in range(world)
        ]
        self.grads = [torch.zeros(n, dtype=grad_dtype, device=gpu.dev) for _ in range(world)]
        self.ops = {"multicast": Op.MULTICAST, "reduce": Op.REDUCE}
        self.epoch = 0  # the kernel runs max(requested, last + 1); copy_engine runs it as given
        if transport == "copy_engine":
            self._copy_engine(plan, layout, timeout_s)
            return
        from ultracomm.cuda.loopback import CudaLoopback
        from ultracomm.env import Config
        from ultracomm.cuda.sm_budget import choices_for_device

        cfg = Config()
        mc, rd = choices_for_device(multicast_sms, reduce_sms, cfg.intra_bw, gpu.info["sms"], gpu.info["name"])
        self.lb = CudaLoopback(world, self.wl, self.windows, timeout_s=timeout_s)
        slots = [plan.slot_src[r].tolist() for r in range(world)]
        lio = [plan.local_index_of.tolist()] * world
        self.plans = {}
        for op, masters, offs, sizes in (
            (Op.MULTICAST, self.weights, layout.weight_offsets, layout.weight_sizes),
            (Op.REDUCE, self.grads, layout.grad_offsets, layout.grad_sizes),
        ):
            self.plans[op] = self.lb.plan(
                op,
                tasks=[self.sched.tasks(op, r) for r in range(world)],
                refs=[self.sched.refs(op, r) for r in range(world)],
                member_off=list(offs),
                member_bytes=list(sizes),
                master_ptrs=[[m.data_ptr()] for m in masters],
                local_index_of=lio,
                my_slots=slots,
                grad_dtype=grad_dtype,
                slot_parent=[p.tolist() for p in self.sched.tree(op)[0]],
                digest=self.sched.digest,
            )
        # one launch runs every rank, all its CTAs co-resident (the launch is cooperative): ranks with
        # a task get ctas_per_rank, ranks without one, so the cap is what the whole grid leaves
        # (CudaLoopback.max_ctas_per_rank), not max_coresident // world
        cap_mc = max(1, self.lb.max_ctas_per_rank(self.plans[Op.MULTICAST]))
        cap_rd = max(1, self.lb.max_ctas_per_rank(self.plans[Op.REDUCE]))
        self.ctas, self.reduce_ctas = min(mc.sms, cap_mc), min(rd.sms, cap_rd)
        self.op_capped = {"multicast": self.ctas < mc.sms, "reduce": self.reduce_ctas < rd.sms}
        self.capped = any(self.op_capped.values())

    def launch_layout(self, op: str) -> list[int]:
        """CTAs of each rank in one launch of ``op`` (``CudaLoopback.launch_ctas``, the rule the launch
        applies); [] for the copy_engine transport."""
        if self.lb is None:
            return []
        return self.lb.launch_ctas(self.plans[self.ops[op]], self.ctas if op == "multicast" else self.reduce_ctas)

    def cta_note(self, op: str) -> tuple[str, int, int]:
        """(note, rank 0's CTAs, grid) of one launch of ``op``: "N CTAs/rank" when every rank has a
        task, else "N CTAs on rank 0, 1 per idle rank" (or on each rank with a task); the
        co-residency cap when it lowered the count; the grid when it exceeds the SMs (a loopback
        grid larger than the SM count runs the shared, shallower TMA ring)."""
        ctas = self.launch_layout(op)
        grid = sum(ctas)
        busy = [r for r in range(self.world) if len(self.sched.tasks(self.ops[op], r))]
        n = self.ctas if op == "multicast" else self.reduce_ctas
        if len(busy) == self.world:
            note = f"{n} CTAs/rank"
        elif busy == [0]:
            note = f"{n} CTAs on rank 0, 1 per idle rank"
        else:
            note = f"{n} CTAs on each of {len(busy)} ranks with tasks, 1 per idle rank"
        if self.op_capped[op]:
            note += " (co-residency cap)"
        sms = self.gpu.info.get("sms")
        if self.world > 1 and sms and grid > sms and self.lb.runner.mover == "tma":
            note += f", grid {grid} > {sms} SMs: shared ring"
        return note, (ctas[0] if ctas else 0), grid

    def _copy_engine(self, plan, layout, timeout_s: float) -> None:
        """One CopyEngineTransport per rank over cuda_local-like windows (every rank's window on
        this GPU, one dict shared by the domain) and each rank's masters (its weights)."""
        from types import SimpleNamespace

        from ultracomm.transports.copy_engine import CopyEngineTransport
        from ultracomm.transports.host import Masters

        shared: dict = {}
        bases = [w.data_ptr() for w in self.windows]
        n = self.glayout[0]
        self.ctas = self.reduce_ctas = 0
        self.capped, self.op_capped = False, {"multicast": False, "reduce": False}
        self.slots = [plan.slot_src[r].tolist() for r in range(self.world)]
        self.lio = plan.local_index_of.tolist()
        self.masters = [Masters.of((self.weights[r].view(1, n),), None, 1, ["w"]) for r in range(self.world)]
        for r in range(self.world):
            win = SimpleNamespace(
                provider="cuda_local",
                rank=r,
                world=self.world,
                local=self.windows[r],
                peer_bases=bases,
                loopback=True,
                shared=shared,
            )
            self.ce.append(
                CopyEngineTransport(
                    rank=r, world=self.world, window=win, wlayout=self.wl, layout=layout, timeout_s=timeout_s
                )
            )

    def slot(self, r: int, region: str):
        """Rank r's slot 0 in the weights or grads region of its window (a view)."""
        off = self.wl["weights_off"] if region == "weights" else self.wl["grads_off"]
        n, dt = self.glayout
        return self.windows[r][off : off + n * dt.itemsize].view(dt)

    def run(self, op: str) -> None:
        self.epoch += 1
        o = self.ops[op]
        if self.ce:
            if op != "multicast":
                raise ValueError("the bench runs copy_engine's multicast only (its reduce is the tma kernel)")
            stream = self.torch.cuda.current_stream(self.gpu.dev).cuda_stream
            for r, t in enumerate(self.ce):  # the last rank's call enqueues the whole set
                t.run(o, self.sched, self.epoch, self.masters[r], self.slots[r], self.lio, "weight_sync", stream=stream)
            return
        self.lb.launch(
            self.plans[o],
            self.epoch,
            ctas_per_rank=self.ctas if op == "multicast" else self.reduce_ctas,
            op_name="weight_sync" if op == "multicast" else "grad_reduce",
            reduce_path=self.reduce_path,
        )

    def num_tasks(self, op: str) -> int:
        """Tasks of one ``op`` over every rank's schedule (a 1 -> 1 direct copy: one per chunk)."""
        return sum(len(self.sched.tasks(self.ops[op], r)) for r in range(self.world))

    def check(self) -> None:
        self.torch.cuda.current_stream(self.gpu.dev).synchronize()
        for t in self.ce:
            t.check_error()
        if self.lb is not None:
            self.lb.check_error()

    def timed_multicast(self, timer: Timer) -> tuple[float, bool, int]:
        """(seconds per multicast, cpu-bound, #wrong of the first and the last one)."""
        self.fill_replicas(SENTINEL)
        self.run("multicast")
        w0 = self.multicast_wrong()
        self.fill_replicas(SENTINEL)
        t, cpu = timer(lambda: self.run("multicast"))
        return t, cpu, w0 + self.multicast_wrong()

    def fill_replicas(self, value: int) -> None:
        for r in range(1, self.world):
            self.slot(r, "weights").view(self.torch.uint8).fill_(value)

    def multicast_wrong(self) -> int:
        self.check()
        return sum(self.gpu.wrong_bytes(self.slot(r, "weights"), self.weights[0]) for r in range(1, self.world))

    def seed_grads(self):
        """Fresh master and replica grads; returns the expected master grad (ordered fp32 sum)."""
        torch = self.torch
        self.check()
        n, dt = self.glayout
        rows = [torch.randn(n, device=self.gpu.dev).to(dt) for _ in range(self.world)]
        self.grads[0].copy_(rows[0])
        for r in range(1, self.world):
            self.slot(r, "grads").copy_(rows[r])
        return ordered_sum(torch, torch.stack(rows))

    def reduce_wrong(self, want) -> int:
        self.check()
        return self.gpu.wrong_bytes(self.grads[0], want) // want.element_size()

    def is_chain(self, depth: int) -> bool:
        pr, _, dep = self.sched.tree("multicast")
        return [int(x) for x in pr[:, 0]] == [-1, *range(depth)] and int(dep.max()) == depth

    def close(self) -> None:
        ce, self.ce = self.ce, []
        for t in ce:
            t.quiesce()  # every copy_engine operation in flight ends, done or failed
        if any(t.abandoned_streams() for t in ce):
            # internal streams stay blocked on flags and may still copy into these windows: no
            # device-wide synchronize, no cudaFree (it synchronises the device) from now on
            self.gpu.poisoned = "a copy_engine operation failed earlier and left its streams blocked"
            self.gpu.kept.append(self.windows)
            for t in ce:
                t.close()
            return
        self.torch.cuda.synchronize()
        for t in ce:
            t.close()
        self.plans, self.windows, self.lb = {}, [], None
        self.torch.cuda.empty_cache()


def lb_fill(torch, slot: Callable, mapping: np.ndarray, members: int, value: int) -> None:
    """Every slot ``slot(rank, column, member)`` of every rank (filled or empty), every member, to the
    byte ``value``."""
    W, S = mapping.shape
    for r in range(W):
        for c in range(S):
            for m in range(members):
                slot(r, c, m).view(torch.uint8).fill_(value)


def lb_wrong(torch, slot: Callable, masters: list, mapping: np.ndarray, epr: int) -> int:
    """Bytes of the slots ``slot(rank, column, member)`` that differ from the expert ``mapping`` names
    there (``masters[home][member][local]``), or, for an empty slot (-1), from SENTINEL."""
    wrong = 0
    W, S = mapping.shape
    for r in range(W):
        for c in range(S):
            e = int(mapping[r, c])
            for m in range(len(masters[0])):
                got = slot(r, c, m).view(torch.uint8)
                if e < 0:
                    wrong += int((got != SENTINEL).sum())
                else:
                    wrong += int((got != masters[e // epr][m][e % epr].view(torch.uint8)).sum())
    return wrong


class LBDomain:
    """The lb_prefetch shape on a one-GPU loopback domain, as Loopback but with several experts per
    rank and several members: ``masters[r][m]`` (``[experts_per_rank, n]`` of member m's dtype) are
    rank r's home experts; ``windows[r]`` (``_core.window_layout`` of ``slots`` slots of the layout's
    weight bytes) hold its replica slots; the multicast of ``mapping`` (``[world, slots]``) runs the
    schedule ultracomm builds (``build_schedule``, relay off by default) on ``CudaLoopback`` (every
    rank in one persistent launch; ``setup_cuda``) -- the data plane the deepep_lb adapter and a
    Context use.  ``rank_args(r)`` are rank r's arguments of ``CudaLoopback.plan`` and, identically,
    of the host executor's ``_core.run_host`` (how the CPU test checks them)."""

    def __init__(
        self,
        torch,
        dev,
        layout,
        masters: list,
        mapping: np.ndarray,
        experts_per_rank: int,
        *,
        chunk_bytes: int = 1 << 20,
        relay_mode: str = "off",
    ):
        import ultracomm as uc
        from ultracomm import _core
        from ultracomm.records import Op
        from ultracomm.schedule import build_schedule

        self.torch, self.layout, self.masters, self.epr = torch, layout, masters, experts_per_rank
        self.mapping = np.asarray(mapping, np.int32)
        self.world, self.slots = self.mapping.shape
        self.op = Op.MULTICAST
        self.plan = uc.ReplicaPlan.make(self.mapping, experts_per_rank=experts_per_rank)
        self.sched = build_schedule(
            self.plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=chunk_bytes, relay_mode=relay_mode
        )
        self.wl = _core.window_layout(self.slots, layout.weight_bytes, layout.grad_bytes, chunk_bytes)
        self.windows = [torch.zeros(self.wl["total_bytes"], dtype=torch.uint8, device=dev) for _ in range(self.world)]
        self.lb, self.dplan, self.ctas, self.capped, self.epoch = None, None, 0, False, 0

    def rank_args(self, r: int) -> dict:
        """Rank r's per-rank arguments: masters as ``[local expert * M + member]`` addresses."""
        M = len(self.layout.members)
        return dict(
            member_off=list(self.layout.weight_offsets),
            member_bytes=list(self.layout.weight_sizes),
            master_ptrs=[self.masters[r][m][i].data_ptr() for i in range(self.epr) for m in range(M)],
            local_index_of=[int(x) for x in self.plan.local_index_of.tolist()],
            my_slots=[int(x) for x in self.plan.slot_src[r].tolist()],
            tasks=self.sched.tasks(self.op, r),
            refs=self.sched.refs(self.op, r),
            slot_parent=[int(x) for x in self.sched.tree(self.op)[0][r]],
            digest=self.sched.digest,
        )

    def slot(self, r: int, s: int, m: int):
        """Member m of rank r's slot s (a view of its window, in the member's dtype)."""
        off = self.wl["weights_off"] + s * self.wl["weight_stride"] + self.layout.weight_offsets[m]
        return self.windows[r][off : off + self.layout.weight_sizes[m]].view(self.layout.members[m].dtype)

    def copy_pairs(self) -> list:
        """(destination slot, source master row) of every filled slot and member: DeepEP's direct pushes."""
        out = []
        for r in range(self.world):
            for c in range(self.slots):
                e = int(self.mapping[r, c])
                if e >= 0:
                    out += [
                        (self.slot(r, c, m), self.masters[e // self.epr][m][e % self.epr])
                        for m in range(len(self.layout.members))
                    ]
        return out

    def setup_cuda(self, gpu: "Gpu", timeout_s: float = 10.0) -> None:
        """CudaLoopback over the windows and the multicast's plan (validated and uploaded once);
        CTAs per rank with tasks as Loopback (what a Context would use, capped so the whole grid --
        one CTA for each rank without a task -- fits at once)."""
        from ultracomm.cuda.loopback import CudaLoopback
        from ultracomm.cuda.sm_budget import choices_for_device
        from ultracomm.env import Config

        mc, _ = choices_for_device(0, 0, Config().intra_bw, gpu.info["sms"], gpu.info["name"])
        self.lb = CudaLoopback(self.world, self.wl, self.windows, timeout_s=timeout_s)
        a = [self.rank_args(r) for r in range(self.world)]
        self.dplan = self.lb.plan(
            self.op,
            tasks=[x["tasks"] for x in a],
            refs=[x["refs"] for x in a],
            member_off=a[0]["member_off"],
            member_bytes=a[0]["member_bytes"],
            master_ptrs=[x["master_ptrs"] for x in a],
            local_index_of=[x["local_index_of"] for x in a],
            my_slots=[x["my_slots"] for x in a],
            grad_dtype=self.layout.grad_dtype,
            slot_parent=[x["slot_parent"] for x in a],
            digest=a[0]["digest"],
        )
        cap = max(1, self.lb.max_ctas_per_rank(self.dplan))  # the whole grid co-resident
        self.ctas, self.capped = min(mc.sms, cap), mc.sms > cap
        self.idle = sum(1 for x in a if not len(x["tasks"]))

    def cta_note(self) -> str:
        """What the launch runs: "N CTAs/rank", or "N CTAs per rank with tasks, 1 per idle rank"
        (runner.h launch_ctas), and the co-residency cap when it lowered N."""
        note = (
            f"{self.ctas} CTAs per rank with tasks, 1 per idle rank ({self.idle})"
            if self.idle
            else f"{self.ctas} CTAs/rank"
        )
        return note + (" (co-residency cap)" if self.capped else "")

    def run(self) -> None:
        self.epoch += 1
        self.lb.launch(self.dplan, self.epoch, ctas_per_rank=self.ctas, op_name="weight_sync")

    def check(self) -> None:
        if self.lb is not None:
            self.lb.check_error()

    def close(self) -> None:
        self.dplan, self.lb, self.windows = None, None, []


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
