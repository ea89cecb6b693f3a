"""Two-GPU measurement of the tile mover over NVLink against a peer cudaMemcpyAsync (issue 34's row).

    torchrun --nproc-per-node 2 perf/bench_nvlink.py [--sizes 1M,16M,64M,256M] [--ctas 4,8,12,16] [--out DIR]
    torchrun --nproc-per-node 2 perf/bench_nvlink.py --dry-run-host [--sizes 64K]   # CPU: the harness only
    python perf/bench_nvlink.py                # no torchrun / no 2 GPUs: "not measured" rows, exit 0

Needs a machine with two GPUs (one rank per GPU: rank r on cuda:LOCAL_RANK), ``ultracomm._cuda`` built,
and torch.distributed with gloo (``--backend nccl`` is accepted and untested: ultracomm's setup uses
object collectives, which gloo serves without a device).  Each rank builds a real ``ultracomm.Context``
(``transport="tma"``, ``window="cuda_ipc"``: every rank's window mapped into the other's CUDA context
through CUDA IPC, so a kernel on GPU 0 stores into GPU 1's memory over NVLink), world 2, one expert per
rank, one replica slot per rank, one layer; the plan puts rank 0's expert 0 into rank 1's slot 0
(``slot_src = [[-1], [0]]``, relay off).  CTAs per rank are forced per row (``multicast_sms`` and
``reduce_sms`` = the row's CTA count), one Context per (size, CTA count).

Rows (section ``nvlink``; names are stable, scripts match them):

  case ``1->1 peer N CTAs``  impl ``tile mover``       ``Context.weight_sync``: rank 0's master (S bytes) ->
                                                       rank 1's replica slot, the persistent kernel with N
                                                       CTAs per rank (both ranks launch; rank 0's CTAs push)
  case ``1->1 peer``         impl ``cudaMemcpyAsync``  rank 0 copies the same S bytes from the same master
                                                       to the same slot address of rank 1's window, through
                                                       the IPC-mapped pointer (``peer_bases[1]``), on its
                                                       current torch stream (libcudart, ctypes); rank 1 idle
  case ``reduce 2->1 peer N CTAs``  impl ``tile mover``  ``Context.grad_reduce`` (fp32): rank 0's master
                                                       grad += rank 1's replica grad, pulled over NVLink
  case ``reduce 2->1 peer``  impl ``torch add_ (peer view)``  rank 0: ``master_grad.add_(peer view of rank
                                                       1's replica grad)`` -- the same bytes, dtype and link
                                                       (torch's elementwise kernel reads the IPC mapping);
                                                       no NCCL baseline: it would use another transport
                                                       (``--no-reduce`` drops the reduce rows)

A tile mover row's note gives its rate as a percentage of its baseline's (same size and timing) and
``extra.vs_baseline`` the fraction.  Goal (issue 34): the best tile mover copy row with <= 12 CTAs
reaches >= 90% of peer cudaMemcpyAsync at the largest size (printed PASS/MISS).

Bytes counted (what a rate means):
  size    S, the bytes of one expert's buffer (the weights for copies, the fp32 grads for reduces)
  algbw   bytes written to the destination / time: S (the replica slot for copies, the master grad
          for reduces)
  busbw   bytes that cross the link (NVLink) / time: S for a copy (every written byte comes from the
          other GPU), S for a reduce (the replica grad read from the peer; the master is local) --
          nccl-tests' sendrecv convention, busbw = algbw; NOT bench_gpu.py's HBM traffic
  time    per operation: CUDA events on each rank around ``--reps`` back-to-back operations after a
          warm-up and one aligning operation (a peer operation completes on a rank only once both ranks
          ran it, so both ranks' start events fall within one operation of each other); per trial the
          slowest rank's time (for the one-sided baselines, rank 0's), median over ``--trials``.
          ``cpu-bound`` marks rows whose enqueueing took >= 90% of the GPU time.  Rows whose note says
          "graph replay" (extra ``timing="graph"``): ``--per-graph`` operations captured into one CUDA
          graph, replayed ``--replays`` times between the events (bench_gpu.py's convention)
  #wrong  copies: bytes of rank 1's slot that differ from rank 0's source after the row's last
          operation (the slot is filled with 0xA5 before the row); reduces: bytes of rank 0's master
          grad that differ from master + K x replica (K = the operations the row ran; small integer
          values, so every fp32 sum is exact and torch's and ultracomm's results are bit-identical)

Without two ranks under torchrun, two visible GPUs, a CUDA torch or a usable ``ultracomm._cuda``, it
prints one line saying why, writes the JSON with every row "not measured: <why>" and exits 0.

``--dry-run-host``: the same harness on the CPU (``transport="host"``, ``window="host_shm"``, gloo,
``torchrun --nproc-per-node 2``): the host executor with N worker threads for "N CTAs", ``memmove``
(ctypes, through rank 1's mapped segment) in the place of cudaMemcpyAsync, host wall-clock timing, no
graph rows.  Every row's note says "host dry run, not NVLink".  It checks the setup, plan, rows,
verification, table and JSON here; its rates mean nothing for NVLink.

``--same-gpu``: both ranks on cuda:0 (a one-GPU machine): exercises tma + cuda_ipc + the peer copy on
one device; notes say "two ranks on one GPU, not NVLink".  Two processes' persistent kernels then
time-slice one GPU: rows may be slow or time out (``--timeout-s``), which says nothing about NVLink.

``--corrupt-for-test``: flips one byte of every row's destination after its timed loop, before the
check (tests/tools/test_bench_nvlink.py: #wrong must then be > 0).

Output: the table (nccl-tests-like, ``bench_gpu.format_table``), the goal line, and
``OUT/bench_nvlink.json``: ``{"bench", "mode", "date", "commit", "devices", "topology", "args",
"goals", "errors", "wrong_total", "rows": [...]}``, each row ``bench_gpu.Row.to_dict()`` (section,
case, impl, size, time_s, payload_bytes, traffic_bytes, algbw, busbw, algbw_per_cta, wrong, note)
plus ``ctas`` (CTAs per rank the transport was given; None for baselines), ``timing``, ``dtype``,
``chunk_bytes``, ``tile_bytes`` (the transport's; None where the tma kernel uses its own), ``reps`` or
``per_graph``/``replays``, ``trials``, and for mover rows ``vs_baseline``.  Exit status 1 when a row
failed or #wrong > 0 (measured runs), else 0.  No two-GPU device has run this yet (issue 34).
"""

from __future__ import annotations

import argparse
import ctypes
import datetime
import importlib.util
import os
import statistics
import subprocess
import sys
import time
import traceback
from typing import Callable, Optional, Sequence


def _load_bench_gpu():
    """perf/bench_gpu.py (perf/ is no package; not put on sys.path, where its other scripts would
    shadow modules), shared with whoever loaded it first under the name ``bench_gpu``."""
    mod = sys.modules.get("bench_gpu")
    if mod is None:
        path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "bench_gpu.py")
        spec = importlib.util.spec_from_file_location("bench_gpu", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules["bench_gpu"] = mod
        spec.loader.exec_module(mod)
    return mod


_bg = _load_bench_gpu()
# its row, table and timing conventions; load_cudart: libcudart as torch loaded it
Row, fmt_size, format_table, graph_note, load_cudart = (
    _bg.Row,
    _bg.fmt_size,
    _bg.format_table,
    _bg.graph_note,
    _bg.load_cudart,
)
MiB, SENTINEL, CUDA_MEMCPY_DEVICE_TO_DEVICE = _bg.MiB, _bg.SENTINEL, _bg.CUDA_MEMCPY_DEVICE_TO_DEVICE
wrong_total, write_json = (
    _bg.wrong_total,
    _bg.write_json,
)  # #wrong of ultracomm's and CUDA's rows; a whole-file JSON write

SECTION = "nvlink"
DEFAULT_SIZES = (MiB, 16 * MiB, 64 * MiB, 256 * MiB)
DRY_RUN_SIZES = (64 << 10, MiB)
DEFAULT_CTAS = (4, 8, 12, 16)
GOAL_FRACTION, GOAL_CTAS = 0.90, 12
MOVER = "tile mover"
MEMCPY = "cudaMemcpyAsync"
MEMMOVE = "memmove"  # the dry run's stand-in for cudaMemcpyAsync
TORCH_ADD = "torch add_ (peer view)"
HOST_NOTE = "host dry run, not NVLink"
SAME_GPU_NOTE = "two ranks on one GPU, not NVLink"
# reduce values: small integers, so master + K x replica is exact in fp32 for every K the rows run
MASTER_MOD, REPLICA_MOD = 2039, 17


# ----------------------------------------------------------------------------- pure helpers (CPU-tested)


def copy_case(ctas: Optional[int] = None) -> str:
    return "1->1 peer" + (f" {ctas} CTAs" if ctas is not None else "")


def reduce_case(ctas: Optional[int] = None) -> str:
    return "reduce 2->1 peer" + (f" {ctas} CTAs" if ctas is not None else "")


def parse_list(text: str, parse: Callable[[str], int]) -> list[int]:
    out = [parse(x) for x in text.split(",") if x.strip()]
    if not out or any(v <= 0 for v in out):
        raise ValueError(f"expected a comma-separated list of positive values, got {text!r}")
    return out


def row(
    case: str,
    impl: str,
    size: int,
    time_s: Optional[float],
    wrong: Optional[int],
    note: str,
    ctas: Optional[int],
    timing: str = "eager",
    **extra,
) -> Row:
    """One nvlink row: payload S (bytes written to the destination), traffic S (bytes over the link)."""
    return Row(SECTION, case, impl, size, time_s, size, size, wrong, note, dict(ctas=ctas, timing=timing, **extra))


def planned_rows(sizes: Sequence[int], ctas: Sequence[int], reduce: bool, baseline: str) -> list[tuple]:
    """(case, impl, size, ctas) of every row a run makes, in order."""
    out = []
    for size in sizes:
        out.append((copy_case(), baseline, size, None))
        out += [(copy_case(c), MOVER, size, c) for c in ctas]
        if reduce:
            out.append((reduce_case(), TORCH_ADD, size, None))
            out += [(reduce_case(c), MOVER, size, c) for c in ctas]
    return out


def not_measured_rows(sizes: Sequence[int], ctas: Sequence[int], reduce: bool, why: str) -> list[Row]:
    return [
        row(case, impl, size, None, None, f"not measured: {why}", c)
        for case, impl, size, c in planned_rows(sizes, ctas, reduce, MEMCPY)
    ]


def add_ratios(rows: Sequence[Row]) -> None:
    """Note each tile mover row's rate as a percentage of its baseline's (same section kind, size and
    timing); ``extra["vs_baseline"]`` the fraction."""
    for r in rows:
        if r.impl != MOVER or not r.algbw:
            continue
        kind = "reduce" if r.case.startswith("reduce") else "copy"
        base = [
            b
            for b in rows
            if b.impl != MOVER
            and b.algbw
            and b.size == r.size
            and b.extra.get("timing") == r.extra.get("timing")
            and b.case.startswith("reduce") == (kind == "reduce")
        ]
        if base:
            frac = r.algbw / base[0].algbw
            r.extra["vs_baseline"] = frac
            r.note = ", ".join(x for x in (r.note, f"{100 * frac:.1f}% of {base[0].impl}") if x)


def goal_lines(rows: Sequence[Row], dry_run: bool = False) -> list[str]:
    """Issue 34's NVLink goal per timing: best tile mover copy with <= 12 CTAs at the largest measured
    size vs the peer cudaMemcpyAsync of that size."""
    if dry_run:
        return [f"goal nvlink: not evaluated ({HOST_NOTE})"]
    out = []
    copies = [r for r in rows if r.algbw and not r.case.startswith("reduce")]
    for timing in ("eager", "graph"):
        mine = [r for r in copies if r.extra.get("timing") == timing]
        ref = [r for r in mine if r.impl == MEMCPY]
        if not ref:
            continue
        top = max(r.size for r in ref)
        ref = [r for r in ref if r.size == top][0]
        movers = [r for r in mine if r.impl == MOVER and r.size == top and (r.extra.get("ctas") or 0) <= GOAL_CTAS]
        if not movers:
            out.append(f"goal nvlink ({timing}): not measured (no tile mover row with <= {GOAL_CTAS} CTAs)")
            continue
        best = max(movers, key=lambda r: r.algbw)
        frac = best.algbw / ref.algbw
        out.append(
            f"goal nvlink ({timing}): tile mover {best.algbw / 1e9:.1f} GB/s with {best.extra['ctas']} CTAs = "
            f"{100 * frac:.1f}% of peer cudaMemcpyAsync {ref.algbw / 1e9:.1f} GB/s at {fmt_size(top)} "
            f"(goal >= {100 * GOAL_FRACTION:.0f}% with <= {GOAL_CTAS} CTAs): {'PASS' if frac >= GOAL_FRACTION else 'MISS'}"
        )
    return out or ["goal nvlink: not measured (no peer cudaMemcpyAsync row)"]


def order_rows(rows: Sequence[Row]) -> list[Row]:
    """Per size: the copy rows (baseline, then the tile mover by CTA count), then the reduce rows;
    eager before graph-replayed rows of a case."""

    def key(r: Row):
        return (
            r.size,
            r.case.startswith("reduce"),
            r.impl == MOVER,
            r.extra.get("ctas") or 0,
            r.extra.get("timing") == "graph",
        )

    return sorted(rows, key=key)


def combine_times(per_rank: Sequence[Optional[list]]) -> Optional[float]:
    """Per trial the slowest rank that timed it, median over trials; None if no rank timed."""
    timed = [t for t in per_rank if t]
    if not timed:
        return None
    n = min(len(t) for t in timed)
    return statistics.median(max(t[i] for t in timed) for i in range(n))


def record(mode: str, stamp: str, devices, topology, args: dict, rows: Sequence[Row], errors, dry_run: bool) -> dict:
    return dict(
        bench="bench_nvlink",
        mode=mode,
        date=stamp,
        commit=_commit(),
        devices=devices,
        topology=topology,
        args=args,
        goals=goal_lines(rows, dry_run),
        errors=list(errors),
        wrong_total=wrong_total(rows),
        rows=[r.to_dict() for r in rows],
    )


def _commit() -> Optional[str]:
    try:
        p = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            cwd=os.path.dirname(os.path.abspath(__file__)),
            capture_output=True,
            text=True,
            timeout=10,
        )
        return p.stdout.strip() or None
    except Exception:  # noqa: BLE001 - no git here: no commit
        return None


def byte_pattern(torch, n: int, device, seed: int):
    """``n`` deterministic bytes (the same on every rank and device, no RNG): the copy rows' source."""
    i = torch.arange(n, dtype=torch.int32, device=device)
    return ((((i & 0xFFFF) * 131) ^ (i >> 9) ^ (i >> 17)) + seed).bitwise_and(255).to(torch.uint8)


def int_pattern(torch, n: int, device, mod: int, mul: int):
    """``n`` fp32 small integers in [-(mod // 2), mod // 2]: the reduce rows' grads."""
    i = torch.arange(n, dtype=torch.int64, device=device)
    return ((i * mul) % mod - mod // 2).to(torch.float32)


def unavailable_reason(args, env: Optional[dict] = None) -> Optional[str]:
    """Why this run cannot measure (the same answer on every rank), or None.  Decided before any
    process group exists, so nothing waits on a peer."""
    env = os.environ if env is None else env
    world, local_world = int(env.get("WORLD_SIZE", "1")), int(env.get("LOCAL_WORLD_SIZE", env.get("WORLD_SIZE", "1")))
    if not args.dry_run_host:
        try:
            from ultracomm.cuda.support import cuda_module, cuda_module_reason, torch_cuda_reason
        except Exception as e:  # noqa: BLE001 - an unbuilt package is a reason too
            return f"ultracomm does not import ({e})"
        why = torch_cuda_reason() or cuda_module_reason()
        if why:
            return why
        import torch

        need = 1 if args.same_gpu else 2
        if torch.cuda.device_count() < need:
            return (
                f"{torch.cuda.device_count()} CUDA device(s) visible, this bench needs 2 (one rank per GPU; "
                "--same-gpu runs both ranks on one, not NVLink)"
            )
        for d in range(need):
            ok, why = cuda_module().available(d)
            if not ok:
                return f"ultracomm._cuda cannot run on cuda:{d}: {why}"
    if world != 2 or local_world != 2:
        return (
            f"needs exactly 2 ranks on one host (WORLD_SIZE={world}, LOCAL_WORLD_SIZE={local_world}): "
            "run under torchrun --nproc-per-node 2"
        )
    return None


# ----------------------------------------------------------------------------- runtimes (GPU and host dry run)


class GpuRt:
    """CUDA events, cudaMemcpyAsync on the current stream, IPC peer views."""

    kind, graphs, baseline = "gpu", True, MEMCPY

    def __init__(self, torch, dev):
        self.torch, self.dev = torch, dev
        self.cudart = load_cudart()

    def stream(self) -> int:
        return self.torch.cuda.current_stream(self.dev).cuda_stream

    def sync(self) -> None:
        self.torch.cuda.current_stream(self.dev).synchronize()

    def mark(self):
        e = self.torch.cuda.Event(enable_timing=True)
        e.record()
        return e, time.perf_counter()

    def elapsed(self, a, b) -> tuple[float, float]:
        """(device seconds, host enqueue seconds) between two marks."""
        b[0].synchronize()
        return a[0].elapsed_time(b[0]) / 1e3, b[1] - a[1]

    def raw_copy(self, dst: int, src: int, n: int) -> None:
        rc = self.cudart.cudaMemcpyAsync(
            ctypes.c_void_p(dst), ctypes.c_void_p(src), n, CUDA_MEMCPY_DEVICE_TO_DEVICE, ctypes.c_void_p(self.stream())
        )
        if rc != 0:
            raise RuntimeError(f"cudaMemcpyAsync returned {rc}")

    def peer_bytes(self, ctx, r: int, off: int, n: int):
        return ctx.window.peer_view(r)[off : off + n]


class HostRt:
    """The dry run: wall clock around synchronous host operations, memmove, mapped shm views."""

    kind, graphs, baseline = "host", False, MEMMOVE

    def __init__(self, torch):
        self.torch, self.dev = torch, torch.device("cpu")

    def sync(self) -> None:
        pass

    def mark(self):
        return time.perf_counter()

    def elapsed(self, a, b) -> tuple[float, float]:
        return b - a, 0.0  # host time is the operation's time: never "cpu-bound"

    def raw_copy(self, dst: int, src: int, n: int) -> None:
        ctypes.memmove(dst, src, n)

    def peer_bytes(self, ctx, r: int, off: int, n: int):
        addr = ctx.window.peer_bases[r] + off
        return self.torch.frombuffer((ctypes.c_uint8 * n).from_address(addr), dtype=self.torch.uint8)


# ----------------------------------------------------------------------------- the harness (every rank runs it)


class Bench:
    """Collective: every rank makes the same calls in the same order (each collective at a fixed
    point; a rank whose step failed skips its work but still joins them), so a failure on one rank
    becomes a FAILED row on every rank instead of a hang."""

    def __init__(self, args, rt, dist, rank: int):
        import torch

        self.args, self.rt, self.dist, self.torch, self.rank = args, rt, dist, torch, rank
        self.rows: list[Row] = []
        self._want = None
        self.errors: list[str] = []
        self.dry = rt.kind == "host"
        self.timings = (
            ["eager"]
            if self.dry or args.timing == "eager"
            else (["graph"] if args.timing == "graph" else ["eager", "graph"])
        )
        self.mode_note = HOST_NOTE if self.dry else (SAME_GPU_NOTE if args.same_gpu else "")

    # -- collectives
    def gather(self, obj) -> list:
        out = [None] * self.dist.get_world_size()
        self.dist.all_gather_object(out, obj)
        return out

    def barrier(self) -> None:
        self.dist.barrier()

    # -- a Context per (size, CTA count)
    def context(self, size: int, ctas: int):
        import ultracomm
        from ultracomm import Context, ExpertLayout, Member

        torch, a = self.torch, self.args
        layout = ExpertLayout((Member("w", (size // 4,), torch.float32),), grad_dtype=torch.float32)
        kw = dict(
            relay_mode="off",
            timeout_s=a.timeout_s,
            multicast_sms=ctas,
            reduce_sms=ctas,
            num_workers=ctas,
            profile=False,
        )
        if a.chunk_bytes:
            kw["chunk_bytes"] = a.chunk_bytes
        if a.tile_bytes:
            kw["tile_bytes"] = a.tile_bytes
        if self.dry:
            kw.update(transport="host", window="host_shm")
        else:
            kw.update(transport="tma", window="cuda_ipc", device=self.rt.dev)
        ctx = Context(None, layout, 1, 1, num_layers=1, **kw)  # collective: every rank raises if one fails
        dev = self.rt.dev
        w = torch.empty((1, size // 4), dtype=torch.float32, device=dev)
        g = torch.zeros((1, size // 4), dtype=torch.float32, device=dev)
        # rank 0's master is the copies' source; rank 1's differs (a copy from the wrong rank shows)
        w.view(torch.uint8).view(-1).copy_(byte_pattern(torch, size, dev, seed=self.rank))
        ctx.register_masters(0, [w], [g])
        plan = ultracomm.ReplicaPlan.make([[-1], [0]], experts_per_rank=1)
        vid = ctx.begin(0)
        return ctx, w, g, plan, vid

    def run(self) -> None:
        for size in self.args.sizes:
            for i, ctas in enumerate(self.args.ctas):
                self.one_context(size, ctas, first=i == 0)
                self.barrier()  # both ranks closed the Context: neither maps the other's window any more
                if not self.dry:  # give its window and masters back (IPC-shared blocks wait for ipc_collect)
                    self.torch.cuda.ipc_collect()
                    self.torch.cuda.empty_cache()
            self._want = None

    def want(self, size: int):
        """The copies' source bytes (rank 0's master), made once per size for the checks."""
        if self._want is None or self._want.numel() != size:
            self._want = None
            self._want = byte_pattern(self.torch, size, self.rt.dev, seed=0)
        return self._want

    def one_context(self, size: int, ctas: int, first: bool) -> None:
        a = self.args
        err = None
        ctx = None
        try:
            ctx, w, g, plan, vid = self.context(size, ctas)
        except Exception as e:  # noqa: BLE001 - Context setup agrees: every rank gets here
            err = f"Context setup: {type(e).__name__}: {e}"
            traceback.print_exc()
        errs = [x for x in self.gather(err) if x]
        if errs:
            if ctx is not None:
                ctx.close()
            why = f"FAILED: {errs[0]}"
            self.errors.append(f"{fmt_size(size)} {ctas} CTAs: {errs[0]}")
            if first:
                self.rows.append(row(copy_case(), self.rt.baseline, size, None, None, why, None))
            self.rows.append(row(copy_case(ctas), MOVER, size, None, None, why, ctas))
            if not a.no_reduce:
                if first:
                    self.rows.append(row(reduce_case(), TORCH_ADD, size, None, None, why, None))
                self.rows.append(row(reduce_case(ctas), MOVER, size, None, None, why, ctas))
            return
        try:
            extra = dict(
                dtype="float32",
                chunk_bytes=ctx.wlayout.get("chunk_bytes"),
                # the transport's tile (the host executor's); None: the tma kernel's own (mover_limits.h)
                tile_bytes=getattr(ctx.transport, "tile_bytes", None),
            )
            # CTAs per rank the transport was given (the case names keep the count asked for)
            used = ctx.sm_counts.get("multicast", ctas) if not self.dry else ctas
            used_r = ctx.sm_counts.get("reduce", ctas) if not self.dry else ctas
            off_w = ctx.replica_weights[0][0].data_ptr() - ctx.window.local.data_ptr()
            off_g = ctx.replica_grads[0][0].data_ptr() - ctx.window.local.data_ptr()
            dst = ctx.replica_weights[0][0].view(self.torch.uint8).view(-1)  # rank 1's is the destination
            for timing in self.timings:
                if first:  # the baseline: once per size, through this Context's window
                    self.copy_row(
                        copy_case(),
                        timing,
                        size,
                        None,
                        self.rt.baseline,
                        lambda: self.rt.raw_copy(ctx.window.peer_bases[1] + off_w, w.data_ptr(), size),
                        active=self.rank == 0,
                        sync=self.rt.sync,
                        dst=dst,
                        extra=extra,
                    )
                self.copy_row(
                    copy_case(ctas),
                    timing,
                    size,
                    used,
                    MOVER,
                    lambda: ctx.weight_sync(vid, plan),
                    active=True,
                    sync=ctx.synchronize,
                    dst=dst,
                    extra=extra,
                    more="" if self.dry else f"{used} CTAs/rank",
                )
            if not a.no_reduce:
                self.reduce_rows(ctx, size, ctas, used_r, vid, g, off_g, first, extra)
        finally:
            self.barrier()
            ctx.close()

    # -- rows
    def note(self, timing: str, more: str, cpu_bound: bool, worker_threads: Optional[int]) -> str:
        parts = [self.mode_note] if self.mode_note else []
        if worker_threads is not None and self.dry:
            parts.append(f"host executor, {worker_threads} worker threads")
        if more:
            parts.append(more)
        if cpu_bound:
            parts.append("cpu-bound")
        body = ", ".join(parts)
        return graph_note(self.args.per_graph, self.args.replays, body) if timing == "graph" else body

    def copy_row(self, case, timing, size, ctas, impl, fn, active, sync, dst, extra, more="") -> None:
        if self.rank == 1:
            dst.fill_(SENTINEL)
            self.rt.sync()
        self.barrier()
        res = self.measure(fn, active, sync, timing)
        wrong, err = None, None
        if self.rank == 1:
            try:
                if self.args.corrupt_for_test:
                    dst[size // 2] ^= 0xFF
                wrong = int((dst != self.want(size)).sum())
            except Exception as e:  # noqa: BLE001
                err = f"check: {type(e).__name__}: {e}"
        got = self.gather((wrong, err))
        self.finish_row(case, impl, size, ctas, timing, res, got[1][0], [x[1] for x in got], extra, more)

    def reduce_rows(self, ctx, size, asked, ctas, vid, g, off_g, first, extra) -> None:
        torch, n = self.torch, size // 4
        dev = self.rt.dev
        master0 = int_pattern(torch, n, dev, MASTER_MOD, 1)
        replica = int_pattern(torch, n, dev, REPLICA_MOD, 7)
        if self.rank == 1:
            ctx.replica_grads[0][0].copy_(replica)
            self.rt.sync()
        self.barrier()
        peer = self.rt.peer_bytes(ctx, 1, off_g, size).view(torch.float32) if self.rank == 0 else None
        for timing in self.timings:
            if first:
                self.reduce_row(
                    reduce_case(),
                    timing,
                    size,
                    None,
                    TORCH_ADD,
                    lambda: g[0].add_(peer),
                    self.rank == 0,
                    self.rt.sync,
                    g,
                    master0,
                    replica,
                    extra,
                )
            self.reduce_row(
                reduce_case(asked),
                timing,
                size,
                ctas,
                MOVER,
                lambda: ctx.grad_reduce(vid, release=False),
                True,
                ctx.synchronize,
                g,
                master0,
                replica,
                extra,
                more="" if self.dry else f"{ctas} CTAs/rank",
            )

    def reduce_row(self, case, timing, size, ctas, impl, fn, active, sync, g, master0, replica, extra, more="") -> None:
        torch = self.torch
        if self.rank == 0:
            g[0].copy_(master0)
            self.rt.sync()
        self.barrier()
        res = self.measure(fn, active, sync, timing)
        counts = self.gather(res["calls"])
        wrong, err = None, None
        if self.rank == 0:
            try:
                k = counts[0]
                bound = MASTER_MOD // 2 + k * (REPLICA_MOD // 2)
                if bound >= 1 << 24:
                    raise ValueError(f"{k} reductions: values reach {bound}, beyond fp32's exact integers")
                if self.args.corrupt_for_test:
                    g[0].view(torch.uint8)[size // 2] ^= 0xFF
                want = master0 + k * replica
                wrong = int((g[0].view(torch.uint8) != want.view(torch.uint8)).sum())
            except Exception as e:  # noqa: BLE001
                err = f"check: {type(e).__name__}: {e}"
        got = self.gather((wrong, err))
        self.finish_row(case, impl, size, ctas, timing, res, got[0][0], [x[1] for x in got], extra, more)

    def finish_row(self, case, impl, size, ctas, timing, res, wrong, check_errs, extra, more) -> None:
        errs = [e for e in res["errors"] + check_errs if e]
        t = None if errs else res["time_s"]
        if errs:
            note = "FAILED: " + "; ".join(errs)
            self.errors.append(f"{fmt_size(size)} {case} {impl} ({timing}): {'; '.join(errs)}")
        else:
            note = self.note(timing, more, res["cpu_bound"], ctas)
        x = dict(extra)
        if timing == "graph":
            x.update(per_graph=self.args.per_graph, replays=self.args.replays)
        else:
            x.update(reps=self.args.reps)
        x["trials"] = self.args.trials
        self.rows.append(row(case, impl, size, t, None if errs else wrong, note, ctas, timing, **x))

    # -- timing
    def measure(self, fn: Callable[[], None], active: bool, sync: Callable[[], None], timing: str) -> dict:
        """Collective.  ``active`` ranks run ``fn`` (one operation, enqueued on the current stream or,
        on the host, synchronous): a warm-up, then per trial one aligning operation and ``reps``
        (eager) or ``replays`` x ``per_graph`` (graph) timed ones.  Returns time_s (combine_times over
        the active ranks), cpu_bound, calls (operations this rank ran), errors (every rank's)."""
        a, rt, torch = self.args, self.rt, self.torch
        state = dict(err=None, calls=0, times=[], cpu=False, graph=None)

        def guard(f):
            if state["err"] is None and active:
                try:
                    f()
                except Exception as e:  # noqa: BLE001 - joined below: every rank learns of it
                    state["err"] = f"rank {self.rank}: {type(e).__name__}: {e}"
                    traceback.print_exc()

        def once():
            fn()
            state["calls"] += 1

        def warm():
            once()
            sync()

        guard(warm)
        errs = [e for e in self.gather(state["err"]) if e]
        if not errs and timing == "graph":

            def capture():
                g = torch.cuda.CUDAGraph()
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.graph(g, stream=side):
                    for _ in range(a.per_graph):
                        fn()
                torch.cuda.current_stream().wait_stream(side)
                state["graph"] = g

            guard(capture)
            errs = [e for e in self.gather(state["err"]) if e]
            if not errs:

                def replay_warm():
                    state["graph"].replay()
                    state["calls"] += a.per_graph
                    sync()

                guard(replay_warm)
                errs = [e for e in self.gather(state["err"]) if e]
        if not errs:
            for _ in range(a.trials):
                self.barrier()

                def trial():
                    if timing == "graph":
                        g = state["graph"]
                        g.replay()  # aligns the ranks (see the module docstring)
                        start = rt.mark()
                        for _ in range(a.replays):
                            g.replay()
                        end = rt.mark()
                        state["calls"] += a.per_graph * (1 + a.replays)
                        n = a.replays * a.per_graph
                    else:
                        once()  # aligns the ranks
                        start = rt.mark()
                        for _ in range(a.reps):
                            once()
                        end = rt.mark()
                        n = a.reps
                    dev_s, host_s = rt.elapsed(start, end)
                    sync()
                    state["times"].append(dev_s / n)
                    state["cpu"] |= timing == "eager" and rt.kind == "gpu" and host_s >= 0.9 * dev_s

                guard(trial)
            got = self.gather((state["times"] if active else None, state["cpu"], state["err"]))
            errs = [x[2] for x in got if x[2]]
            time_s = combine_times([x[0] for x in got])
            cpu = any(x[1] for x in got)
        else:
            time_s, cpu = None, False
        state["graph"] = None
        return dict(time_s=None if errs else time_s, cpu_bound=cpu, calls=state["calls"], errors=errs)


# ----------------------------------------------------------------------------- main


def device_info(torch, dev, same_gpu: bool) -> dict:
    if dev.type != "cuda":
        return dict(device="cpu", torch=torch.__version__)
    p = torch.cuda.get_device_properties(dev)
    other = 0 if same_gpu else 1 - dev.index
    peer = True if same_gpu else bool(torch.cuda.can_device_access_peer(dev.index, other))
    return dict(
        device=str(dev),
        name=p.name,
        cc=f"{p.major}.{p.minor}",
        sms=p.multi_processor_count,
        peer_access=peer,
        torch=torch.__version__,
        cuda=str(torch.version.cuda),
    )


def topology() -> Optional[str]:
    try:
        p = subprocess.run(["nvidia-smi", "topo", "-m"], capture_output=True, text=True, timeout=15)
        return p.stdout if p.returncode == 0 else None
    except Exception:  # noqa: BLE001 - no nvidia-smi: nothing to record
        return None


def parse_args(argv):
    from ultracomm.env import parse_size

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument(
        "--sizes", help="comma-separated sizes (K/M/G binary suffixes); default 1M,16M,64M,256M (dry run 64K,1M)"
    )
    ap.add_argument(
        "--ctas", default=",".join(map(str, DEFAULT_CTAS)), help="CTA counts per rank (dry run: host worker threads)"
    )
    ap.add_argument("--out", default=os.environ.get("OUT", os.path.join("perf", "out", "nvlink")))
    ap.add_argument("--json", help="results JSON (default OUT/bench_nvlink.json)")
    ap.add_argument("--reps", type=int, default=20, help="timed operations per eager trial")
    ap.add_argument("--trials", type=int, default=3)
    ap.add_argument(
        "--timing", choices=("eager", "graph", "both"), default="both", help="GPU only; the dry run is eager"
    )
    ap.add_argument("--per-graph", type=int, default=10)
    ap.add_argument("--replays", type=int, default=5)
    ap.add_argument("--no-reduce", action="store_true", help="leave out the reduce 2->1 peer rows")
    ap.add_argument("--dry-run-host", action="store_true", help="the harness on the CPU: host transport, host_shm")
    ap.add_argument("--same-gpu", action="store_true", help="both ranks on cuda:0 (not NVLink; see the docstring)")
    ap.add_argument("--backend", choices=("gloo", "nccl"), default="gloo")
    ap.add_argument("--timeout-s", type=float, default=30.0, help="ultracomm's timeout for every wait on a peer")
    ap.add_argument("--chunk-bytes", type=parse_size, help="Context chunk_bytes (default: the Config's)")
    ap.add_argument(
        "--tile-bytes", type=parse_size, help="Context tile_bytes (default: the Config's; the tma kernel keeps its own)"
    )
    ap.add_argument("--corrupt-for-test", action="store_true", help="flip a destination byte before each check")
    args = ap.parse_args(argv)
    try:
        sizes = args.sizes or ",".join(str(s) for s in (DRY_RUN_SIZES if args.dry_run_host else DEFAULT_SIZES))
        args.sizes = parse_list(sizes, parse_size)
        args.ctas = parse_list(args.ctas, int)
    except Exception as e:  # noqa: BLE001
        ap.error(str(e))
    bad = [s for s in args.sizes if s % 16]
    if bad:
        ap.error(f"sizes must be multiples of 16 bytes (one fp32 expert row, 16-byte aligned): {bad}")
    for k in ("reps", "trials", "per_graph", "replays"):
        if getattr(args, k) < 1:
            ap.error(f"--{k.replace('_', '-')} must be >= 1")
    return args


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = parse_args(argv)
    out_json = args.json or os.path.join(args.out, "bench_nvlink.json")
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")
    mode = "host dry run" if args.dry_run_host else ("same gpu" if args.same_gpu else "nvlink")
    rank = int(os.environ.get("RANK", "0"))
    arg_rec = {k: v for k, v in vars(args).items() if k not in ("out", "json")}
    why = unavailable_reason(args)
    if why:
        if rank == 0:
            rows = not_measured_rows(args.sizes, args.ctas, not args.no_reduce, why)
            write_json(out_json, record(mode, stamp, None, None, arg_rec, rows, [], args.dry_run_host))
            print(f"bench_nvlink: not measured: {why} (rows in {out_json})", flush=True)
        return 0

    import torch
    import torch.distributed as dist

    local = int(os.environ.get("LOCAL_RANK", rank))
    if args.dry_run_host:
        rt = HostRt(torch)
    else:
        dev = torch.device("cuda", 0 if args.same_gpu else local)
        torch.cuda.set_device(dev)
        rt = GpuRt(torch, dev)
    # bounded: a peer that never arrives fails the run instead of hanging it
    limit = datetime.timedelta(seconds=max(120.0, 4 * args.timeout_s))
    dist.init_process_group(args.backend, timeout=limit)
    rank = dist.get_rank()
    bench = Bench(args, rt, dist, rank)
    devices = bench.gather(device_info(torch, rt.dev, args.same_gpu))
    topo = topology() if rank == 0 and not args.dry_run_host else None
    if rank == 0:
        d = devices[0]
        print(
            f"bench_nvlink: {mode}: "
            + (
                "CPU, host transport + host_shm (harness check, rates say nothing about NVLink)"
                if args.dry_run_host
                else f"{d['name']} x2 (cc {d['cc']}, {d['sms']} SMs), peer access {[x['peer_access'] for x in devices]}, "
                f"torch {d['torch']}, CUDA {d['cuda']}"
            ),
            flush=True,
        )
    t0 = time.perf_counter()
    try:
        bench.run()
    except Exception as e:  # noqa: BLE001 - ranks out of step: report what was measured
        bench.errors.append(f"run: {type(e).__name__}: {e}")
        traceback.print_exc()
    bench.rows = order_rows(bench.rows)
    add_ratios(bench.rows)
    wrong = wrong_total(bench.rows)
    if rank == 0:
        write_json(out_json, record(mode, stamp, devices, topo, arg_rec, bench.rows, bench.errors, args.dry_run_host))
        print(f"\n## {SECTION}\n{format_table(bench.rows)}")
        print(
            "\nbytes: size = S; algbw = bytes written to the destination / time; busbw = bytes over the link / "
            "time (S: copies write S from the peer, reduces read S from the peer)"
        )
        print("\n".join(goal_lines(bench.rows, args.dry_run_host)))
        print(f"bench_nvlink: #wrong total = {wrong}; {len(bench.errors)} error(s); {time.perf_counter() - t0:.1f} s")
        for e in bench.errors:
            print(f"bench_nvlink: error: {e}")
        print(f"bench_nvlink: results in {out_json}", flush=True)
    try:
        dist.barrier()
        dist.destroy_process_group()
    except Exception:  # noqa: BLE001 - the peer may be gone after a failure; nothing left to agree on
        pass
    return 1 if (bench.errors or wrong) else 0


if __name__ == "__main__":
    sys.exit(main())
