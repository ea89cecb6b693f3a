"""perf/bench_gpu.py's sections driven end to end on the CPU (no GPU), so that every line of their
device paths runs before a device loan does: torch.cuda is a fake (events on a fake clock, graphs
that capture by running, streams that do nothing), the tile mover is the host executor
(``_core.run_host``, one thread per rank) behind the real ``CudaLoopback`` code (its ``DevicePlan``
and ``Runner`` faked), ``_cuda``'s microkernels and control-plane calls are host stand-ins working on
the tensors' host addresses, and the sizes are shrunk (``MiB``, patched in every module of the bench
that binds it) while every row name stays what a device run writes.  Checked: no section fails, the rows' names and ``extra`` keys are the ones
``target_lines`` reads (every target of issues 33 and 34 is measured from them), #wrong is 0 where
the host executor did the work."""

from __future__ import annotations

import ctypes
import inspect
import sys
import threading
import time
import types

import numpy as np
import perf_modules
import pytest

torch = pytest.importorskip("torch")

bg = perf_modules.load("bench_gpu", fresh=True)


def patch_bench(monkeypatch, name: str, value) -> None:
    """Set ``name`` in bench_gpu and in every module of its package (perf/single_gpu) that binds it:
    each module reads its own binding (``from .constants import MiB``), so patching bench_gpu alone
    would not reach the sections' code.  Every binding is the same object before the patch."""
    mods = [bg, *(m for m in vars(bg.single_gpu).values() if isinstance(m, types.ModuleType))]
    bound = [m for m in mods if name in vars(m)]
    assert bound, f"no module of the bench binds {name}"
    assert all(vars(m)[name] is vars(bound[0])[name] for m in bound), name
    for m in bound:
        monkeypatch.setattr(m, name, value)


REAL_MIB = 1 << 20
SMALL_MIB = 1 << 16  # "64 MiB" rows move 4 MiB here (relay streams of 4 MiB are still chains)


# ----------------------------------------------------------------------------- fake torch.cuda


class FakeCudaNS:
    """The torch.cuda calls the bench makes, on the CPU: each event record advances a fake clock by 1 ms;
    a graph captures by running its calls (replays do nothing)."""

    def __init__(self):
        self.clock = 0.0
        self.graphs = 0
        self.replays = False
        fake = self

        class Stream:
            cuda_stream = 0

            def __init__(self, *a, **k):
                pass

            def wait_stream(self, other):
                pass

            def synchronize(self):
                pass

        class Event:
            def __init__(self, enable_timing=False):
                self.t = None

            def record(self, stream=None):
                fake.clock += 1e-3
                self.t = fake.clock

            def synchronize(self):
                pass

            def elapsed_time(self, other):
                return (other.t - self.t) * 1e3

        class Graph:
            fn = None

            def replay(self):
                # with ``fake.replays``: the first replay runs the captured ``fn`` once more (what
                # is checked after Timer.graph's ``prepare`` must come from it); later ones nothing
                fn, self.fn = self.fn, None
                if fn is not None and fake.replays:
                    fn()

        class Ctx:
            def __init__(self, g, stream=None, **k):
                self.g = g

            def __enter__(self):
                fake.graphs += 1
                # Timer.graph captures its ``fn``: what a replay runs (read from its frame)
                self.g.fn = sys._getframe(1).f_locals.get("fn")

            def __exit__(self, *a):
                return False

        self.Stream, self.Event, self.CUDAGraph, self.graph = Stream, Event, Graph, Ctx

    def current_stream(self, device=None):
        return self.Stream()

    def synchronize(self, device=None):
        pass

    def empty_cache(self):
        pass

    def mem_get_info(self, device=None):
        return (1 << 45, 1 << 45)

    def get_device_capability(self, device=None):
        return (9, 0)


class TorchProxy:
    """torch with a fake ``cuda``."""

    def __init__(self):
        self.cuda = FakeCudaNS()

    def __getattr__(self, name):
        return getattr(torch, name)


# ----------------------------------------------------------------------------- fake _cuda and loopback


def i64(addr: int) -> ctypes.c_int64:
    return ctypes.c_int64.from_address(addr)


def host_array(addr: int, n: int, dtype) -> np.ndarray:
    ct = {np.int32: ctypes.c_int32, np.int64: ctypes.c_int64}[dtype]
    return np.ctypeslib.as_array((ct * n).from_address(addr))


def signature(real) -> inspect.Signature:
    """``real``'s signature; a pybind11 function's from its docstring's first line."""
    try:
        return inspect.signature(real)
    except ValueError:
        pass
    head = real.__doc__.strip().splitlines()[0]
    body = head[head.index("(") + 1 : head.rindex(") ->")]
    parts, depth, cur = [], 0, ""
    for ch in body:
        depth += ch in "[(" and 1 or (ch in "])" and -1 or 0)
        if ch == "," and depth == 0:
            parts.append(cur)
            cur = ""
        else:
            cur += ch
    parts.append(cur)
    params = []
    for p in (x.strip() for x in parts if x.strip()):
        name = p.split(":")[0].split("=")[0].strip()
        if name == "self":
            continue
        params.append(
            inspect.Parameter(name, inspect.Parameter.POSITIONAL_OR_KEYWORD, default=0 if "=" in p else inspect._empty)
        )
    return inspect.Signature(params)


def checked(real, impl):
    """``impl`` called with arguments that bind to ``real``'s signature (pybind11's: its docstring's)."""
    sig = signature(real)

    def call(*a, **k):
        sig.bind(*a, **k)
        return impl(*a, **k)

    return call


class FakeRunner:
    """_cuda.Runner: launches run the host executor (one thread per rank); the CTA rules are the compiled ones."""

    mover = "tma"

    def __init__(self, device=0, rules=None):
        self.rules, self.launches, self.error = rules, [], None

    def max_coresident(self, grad_dtype=0):
        return 264  # 2 x 132 SMs

    def launch_ctas(self, plan, ctas):
        return list(self.rules.launch_ctas(plan.rank_tasks, ctas))

    def max_ctas_per_rank(self, plan, grid):
        return int(self.rules.max_ctas_per_rank(plan.rank_tasks, grid))

    def take_error(self):
        e, self.error = self.error, None
        return e

    def launch(self, plan, epoch, ctas_per_rank, stream, force_vector=False, reduce_path="hunk"):
        from ultracomm import _core

        assert reduce_path in ("hunk", "tma") and isinstance(stream, int)
        self.launches.append((plan.op, ctas_per_rank, reduce_path))
        errs = {}

        def body(a):
            try:
                _core.run_host(epoch=epoch, num_workers=1, **a)
            except Exception as e:  # noqa: BLE001
                errs[a["rank"]] = e

        th = [threading.Thread(target=body, args=(a,)) for a in plan.ranks]
        for t in th:
            t.start()
        for t in th:
            t.join(60)
        assert not errs, errs

    # the control plane's build (k_build_slot): the host build of the same slot into the arena's result
    def write_template(self, arena, slot, ranks, stream):
        assert len(ranks) == 1 and {"op", "rank", "world", "tasks", "refs", "digest"} <= set(ranks[0])
        arena.templates[(slot, ranks[0]["op"])] = ranks[0]

    def build_slot(self, arena, slot, entry, **kw):
        from ultracomm import _core

        W, S, E = kw["world"], kw["slots"], kw["num_experts"]
        got = _core.build_into_views(
            host_array(kw["slot_src"], W * S, np.int32).reshape(W, S).copy(),
            host_array(kw["home_of"], E, np.int32).copy(),
            None,
            kw["weight_bytes"],
            kw["grad_bytes"],
            kw["chunk_bytes"],
            kw["rank"],
            kw["max_depth"],
            kw["hop_bytes"],
            list(arena.tasks),
            list(arena.refs),
        )
        arena.results[(slot, entry)] = dict(
            generation=1,
            status=got["status"],
            num_tasks=(got["multicast"]["num_tasks"], got["reduce"]["num_tasks"]),
            depth=(2, 2),
            digest=got["digest"],
        )


class FakePlanArena:
    def __init__(self, device, num_slots, *, nranks, world, num_experts, masters, slots, tasks, refs):
        self.tasks, self.refs, self.templates, self.results = tasks, refs, {}, {}

    def build_result(self, slot, entry=0):
        return self.results[(slot, entry)]


class FakeDevicePlan:
    def __init__(self, ranks, device):
        self.ranks = ranks
        self.op = ranks[0]["op"]
        self.grad_dtype = ranks[0]["grad_dtype"]
        self.rank_tasks = [len(r["tasks"]) for r in ranks]


def fake_cuda_module(real):
    """_cuda with host stand-ins for what the bench calls (launches on host addresses)."""
    state = dict(pdl=True, empty=0)

    def launch_empty(stream):
        state["empty"] += 1

    def flag_pingpong(ping, pong, base, iters, timeout_ns, out, stream):
        i64(ping).value = base + iters
        i64(pong).value = base + iters
        i64(out).value, i64(out + 8).value = 1500 * iters, 0

    def load_exchange(ranks, world, num_experts, entries, record_bytes, timeout_s, stream):
        assert len(ranks) == world
        n = world * num_experts
        for r in ranks:
            assert {"counts", "out", "status", "bases", "seq", "rank"} <= set(r)
            out = host_array(r["out"], n, np.int32)
            for q in ranks:
                out[q["rank"] * num_experts : (q["rank"] + 1) * num_experts] = host_array(
                    q["counts"], num_experts, np.int32
                )
            host_array(r["status"], 4, np.int32)[:] = 0

    def programmatic_launch(device=None):
        return state["pdl"]

    def set_programmatic_launch(on):
        state["pdl"] = bool(on)

    rules = real

    class Runner(FakeRunner):
        def __init__(self, device=0):
            super().__init__(device, rules)

    m = types.SimpleNamespace(
        state=state,
        launch_empty=checked(real.launch_empty, launch_empty),
        flag_pingpong=checked(real.flag_pingpong, flag_pingpong),
        load_exchange=checked(real.load_exchange, load_exchange),
        load_exchange_max_coresident=lambda nranks: 4 * 132,
        reroute_scratch_bytes=real.reroute_scratch_bytes,
        quota_plan=None,
        programmatic_launch=checked(real.programmatic_launch, programmatic_launch),
        set_programmatic_launch=checked(real.set_programmatic_launch, set_programmatic_launch),
        Runner=Runner,
        PlanArena=FakePlanArena,
        DevicePlan=FakeDevicePlan,
    )
    return m


@pytest.fixture
def cpu_bench(monkeypatch):
    """A Gpu on the CPU (fake torch.cuda, fake _cuda, the host executor as tile mover), sizes shrunk."""
    import ultracomm
    import ultracomm.cuda.loopback as cl
    from ultracomm.moe.reroute import RerouteTable
    from ultracomm.planners import device as dp
    from ultracomm.planners import get_planner

    real = perf_modules.compiled_cuda()
    fake = fake_cuda_module(real)

    class CpuLoopback(cl.CudaLoopback):
        def __init__(self, world, wlayout, windows, *, timeout_s=10.0):
            assert len(windows) == world and all(w.numel() >= wlayout["total_bytes"] for w in windows)
            self.world, self.wlayout, self.windows, self.device = world, dict(wlayout), list(windows), 0
            self.timeout_s = float(timeout_s)
            self._cuda, self.runner, self._names = fake, fake.Runner(0), {}

        def launch(self, plan, epoch, *, stream=None, **kw):  # the default stream is real torch's
            return super().launch(plan, epoch, stream=0, **kw)

    monkeypatch.setattr(cl, "CudaLoopback", CpuLoopback)

    # the device planner and reroute on host tensors, through their real signatures
    real_plan, real_from_plan = dp.plan_on_gpu, RerouteTable.from_plan.__func__
    host = get_planner("device")

    def plan_on_gpu(loads, domain, slots_per_rank, *, out=None, **kw):
        assert loads.dtype == torch.int32 and loads.is_contiguous()
        res = host(loads.numpy().astype(np.int64), domain, slots_per_rank)
        q = np.where(res.slot_src >= 0, res.slot_moves.sum(0), 0)
        if out is None:
            W, E = loads.shape
            out = dict(
                slot_src=torch.empty((W, slots_per_rank), dtype=torch.int32),
                slot_quota=torch.empty((W, slots_per_rank), dtype=torch.int64),
                expert_load=torch.empty(E, dtype=torch.int64),
                result=torch.zeros(3, dtype=torch.int64),
                scratch=torch.empty(8, dtype=torch.int64),
            )
        out["slot_src"].copy_(torch.as_tensor(res.slot_src))
        out["slot_quota"].copy_(torch.as_tensor(q))
        out["result"].copy_(torch.tensor([4 << 32, 1 | (3 << 32), 0]))
        return out

    def from_plan(cls, loads, slot_src, slot_quota, rank, experts_per_rank, layout="echo", out=None):
        t = real_from_plan(cls, loads, slot_src, slot_quota, rank, experts_per_rank, layout)
        if out:
            out["bounds"].copy_(t.bounds)
            out["columns"].copy_(t.columns)
            return cls(out["bounds"], out["columns"], t.num_columns)
        return t

    monkeypatch.setattr(dp, "plan_on_gpu", checked(real_plan, plan_on_gpu))
    monkeypatch.setattr(RerouteTable, "from_plan", classmethod(from_plan))

    class Cudart:
        def cudaMemcpyAsync(self, dst, src, n, kind, stream):
            assert kind == bg.CUDA_MEMCPY_DEVICE_TO_DEVICE
            ctypes.memmove(dst.value, src.value, n)
            return 0

    for name, v in (("FANOUT_BYTES", 64 * SMALL_MIB), ("TARGET_REDUCE_BYTES", 64 * SMALL_MIB)):
        patch_bench(monkeypatch, name, v)
    patch_bench(monkeypatch, "TARGET_RELAY_BYTES", 64 * SMALL_MIB)
    patch_bench(monkeypatch, "MiB", SMALL_MIB)
    # fmt_size keeps real units: the relay cases name their chunks (32K .. 4M) as a device run does
    real_fmt = bg.fmt_size

    def fmt_size(n):
        for unit, div in (("G", 1 << 30), ("M", REAL_MIB), ("K", 1 << 10)):
            if n >= div and n % div == 0:
                return f"{n // div}{unit}"
        return str(n)

    assert real_fmt(1 << 10) == "1K"
    patch_bench(monkeypatch, "fmt_size", fmt_size)

    tp = TorchProxy()
    g = object.__new__(bg.Gpu)
    g.__dict__.update(
        torch=tp,
        uc=ultracomm,
        quick=False,
        dev=torch.device("cpu"),
        info=dict(name="NVIDIA H100 80GB HBM3", cc="9.0", sms=132, torch=torch.__version__, cuda="13.0"),
        timer=bg.Timer(tp, reps=2, trials=1),
        rows=[],
        errors=[],
        deadline=None,
        reserve_s=0.0,
        lb_reserve_s=0.0,
        poisoned=None,
        kept=[],
        ce_reason="no copy engine here",
        tma_reason=None,
        cuda=fake,
        cuda_reason=None,
        cudart=Cudart(),
        cudart_reason=None,
    )
    # the copy sizes without the 1 GiB literal
    g.copy_sizes = lambda: [SMALL_MIB * m for m in (1, 4, 16, 64, 256)]
    return g


def run_sections(g, *names):
    for name in names:
        g.section(name, getattr(g, f"run_{name}"))
    assert not g.errors, g.errors
    failed = [r for r in g.rows if r.note.startswith(("FAILED", "not measured"))]
    return failed


def test_launch_and_flag_sections_on_the_cpu(cpu_bench):
    g = cpu_bench
    assert run_sections(g, "launch", "flag") == []
    got = [(r.section, r.case, r.impl, r.extra.get("timing"), r.wrong) for r in g.rows]
    assert got == [
        ("launch", "floor", "empty kernel", "eager", 0),
        ("launch", "floor", "empty kernel", "graph", 0),
        ("launch", "no tasks", "tile mover", "eager", 0),
        ("launch", "no tasks", "tile mover", "graph", 0),
        ("flag", "rtt", "release/acquire", None, 0),
    ]
    assert g.rows[-1].time_s == pytest.approx(1.5e-6)  # ns / 1e9 / iters


def test_data_plane_sections_on_the_cpu_feed_every_issue_34_target(cpu_bench):
    g = cpu_bench
    failed = run_sections(g, "copy", "fanout", "sweep", "reduce", "reduce_sweep", "relay")
    assert failed == [], [(r.section, r.case, r.impl, r.note) for r in failed]
    wrong = [(r.section, r.case, r.impl, r.wrong) for r in g.rows if r.wrong and not r.note.startswith("informational")]
    assert wrong == []
    for r in g.rows:
        if r.impl.startswith("tile mover"):
            assert r.extra.get("ctas"), (r.section, r.case, r.impl)
    # relay notes: the chain and cpu-bound remarks as a list (they ran together: "... the fit cpu-bound")
    relay = [r.note for r in g.rows if r.section == "relay"]
    assert "NOT a chain: excluded from the fit, cpu-bound" in relay and "cpu-bound" in relay
    assert all(x in ("", "cpu-bound") or x.startswith("NOT a chain") for x in relay), set(relay)
    targets = {t["target"]: t for t in bg.target_lines(g.rows, g.info["sms"]) if t["issue"] == 34}
    missing = {k: t["line"] for k, t in targets.items() if t["value"] is None}
    assert missing == {}


def test_control_section_on_the_cpu_feeds_every_issue_33_target(cpu_bench, monkeypatch):
    g = cpu_bench
    patch_bench(monkeypatch, "CONTROL_SHAPES", (("EP8", 8, 32), ("EP64", 64, 4)))
    failed = run_sections(g, "launch", "control")
    assert failed == [], [(r.section, r.case, r.impl, r.note) for r in failed]
    names = [(r.case, r.impl, r.extra.get("timing")) for r in g.rows if r.section == "control"]
    for label in ("EP8", "EP64"):
        for key, impl in (*bg.CONTROL_KERNELS, bg.CONTROL_STEP):
            assert (f"{label} {key}", impl, "graph") in names
        assert (f"{label} {bg.CONTROL_STEP[0]}", bg.CONTROL_STEP_PDL[1], "graph") in names
    assert g.cuda.state["pdl"] is True  # the switch is restored
    wrong = [(r.case, r.impl, r.wrong) for r in g.rows if r.wrong and r.extra.get("timing") == "eager"]
    assert wrong == []
    targets = [t for t in bg.target_lines(g.rows, g.info["sms"]) if t["issue"] == 33]
    assert len(targets) == 7 and [t["line"] for t in targets if t["value"] is None] == []


def test_lb_prefetch_multicast_rows_on_the_cpu(cpu_bench):
    """The tile mover's lb_prefetch rows (LBDomain.setup_cuda, cta_note, run, check) through the host
    executor at a small shape: measured, #wrong 0 over every slot; the adapter's row (a CUDA
    Context) fails here and says so in its own row."""
    g = cpu_bench
    shape, members = (4, 2, 4), (("weights", 4096, "float8_e4m3fn"), ("sf0", 256, "float32"), ("sf1", 64, "float32"))
    g.run_lb_prefetch(shape, members)
    # (a fake graph's replays do nothing: the graph rows' #wrong counts the sentinel refilled before them)
    got = [
        (r.impl, r.extra.get("timing"), r.wrong if r.extra["timing"] == "eager" else "-") for r in g.rows if r.time_s
    ]
    assert got == [
        (bg.LB_COPIES, "eager", 0),
        (bg.LB_COPIES, "graph", "-"),
        (bg.LB_MULTICAST, "eager", 0),
        (bg.LB_MULTICAST, "graph", "-"),
    ], [(r.impl, r.note) for r in g.rows]
    assert g.rows[-1].impl == bg.LB_ADAPTER and g.rows[-1].note.startswith("FAILED: InputError")
    mc = [r for r in g.rows if r.impl == bg.LB_MULTICAST]
    assert all(r.extra["ctas"] >= 1 and r.extra["senders"] == 4 for r in mc)
    assert "4 ranks in one launch, relay off" in mc[0].note


def test_main_writes_results_and_profile_and_stops_at_sigint(cpu_bench, monkeypatch, tmp_path):
    """main() with --only and --budget-s on the CPU bench: the results JSON after every section, a
    schema-valid profile once cudaMemcpyAsync was measured; a SIGINT in a section keeps what was
    measured, says so, and runs no later section."""
    import json

    from ultracomm.cuda.hwprofile import validate

    g = cpu_bench
    made = []

    def make(quick, budget_s, reserve_s, lb_reserve_s):
        made.append((quick, budget_s, reserve_s, lb_reserve_s))
        g.deadline = None if budget_s is None else time.monotonic() + budget_s
        g.reserve_s, g.lb_reserve_s = reserve_s, lb_reserve_s
        return g

    monkeypatch.setattr(bg, "unavailable_reason", lambda: None)
    monkeypatch.setattr(bg, "Gpu", make)

    def interrupted():
        raise KeyboardInterrupt

    monkeypatch.setattr(g, "run_fanout", interrupted)
    rc = bg.main(["--only", "launch,copy,fanout,sweep", "--budget-s", "600", "--out", str(tmp_path)])
    assert made == [(False, 600.0, 0.0, 0.0)] and rc == 1
    rec = json.load(open(tmp_path / "bench_gpu.json"))
    assert rec["sections"] == ["launch", "copy", "fanout", "sweep"]
    assert rec["errors"] == ["fanout: interrupted (SIGINT); later sections not run"]
    assert not [r for r in rec["rows"] if r["section"] == "sweep"]
    assert rec["rows"][-1]["note"] == "interrupted (SIGINT): the rest not measured"
    prof = [p for p in tmp_path.iterdir() if p.name.endswith("_profile.json")]
    assert len(prof) == 1 and prof[0].name.endswith("_NVIDIA-H100-80GB-HBM3_profile.json")
    validate(json.load(open(prof[0])))


# ----------------------------------------------------------------------------- copy_engine: a fake driver


class StreamSim:
    """Device streams over host memory: per-stream FIFO queues of (ready, run); whatever is ready
    runs as soon as it is enqueued (the order a device may pick), a blocked head waits for a later
    enqueue or write.  Thread-safe (the watchdogs read through a side stream)."""

    def __init__(self):
        self.lock = threading.RLock()
        self.queues: dict[int, list] = {}
        self.handles = iter(range(0x1000, 1 << 40))

    def push(self, stream: int, ready, run, what: str) -> None:
        with self.lock:
            self.queues.setdefault(int(stream), []).append((ready, run, what))
            self.progress()

    def progress(self) -> None:
        with self.lock:
            moved = True
            while moved:
                moved = False
                for q in self.queues.values():
                    while q and q[0][0]():
                        q.pop(0)[1]()
                        moved = True

    def blocked(self) -> dict:
        with self.lock:
            self.progress()
            return {hex(s): q[0][2] for s, q in self.queues.items() if q}


class FakeDriver:
    """ultracomm.cuda.driver.Driver on StreamSim: copies and 64-bit writes/waits on host addresses,
    the gate kernel run from its descriptor (the words ``gate.pack`` wrote: waits, copies, writes;
    skipped once the abort word is set), as uc_ce_gate does."""

    def __init__(self, sim: StreamSim):
        self.sim, self.bound, self.destroyed, self.gates = sim, [], [], 0

    def bind(self, device):
        self.bound.append(device)

    def stream_create(self, priority=0):
        with self.sim.lock:
            return next(self.sim.handles)

    def stream_destroy(self, stream):
        self.destroyed.append(stream)

    def memcpy(self, dst, src, nbytes, stream):
        self.sim.push(stream, lambda: True, lambda: ctypes.memmove(dst, src, nbytes), f"copy {nbytes}")

    def write_value(self, stream, addr, value):
        def run():
            i64(addr).value = ctypes.c_int64(value).value

        self.sim.push(stream, lambda: True, run, "write")

    def wait_value(self, stream, addr, value, equal=False):
        from ultracomm.transports.copy_engine.plan import geq

        def ready():
            v = ctypes.c_uint64.from_address(addr).value
            return v == value if equal else geq(v, value)

        self.sim.push(stream, ready, lambda: None, f"wait{'_eq' if equal else ''} {value}")

    def function(self, ptx, name):
        assert name == "uc_ce_gate" and f".entry {name}" in ptx
        return 0xF00

    def launch(self, function, threads, stream, args):
        from ultracomm.transports.copy_engine.gate import _EPOCH_WORD
        from ultracomm.transports.copy_engine.plan import geq

        assert function == 0xF00 and threads == 256 and len(args) == 3
        desc, epoch, abort = args[0].value, args[1].value, args[2].value
        u64 = lambda a: ctypes.c_uint64.from_address(a).value  # noqa: E731
        nw, nc, nr = u64(desc), u64(desc + 8), u64(desc + 16)
        at = desc + 32
        waits = [(u64(at + 24 * i), u64(at + 24 * i + 8), u64(at + 24 * i + 16)) for i in range(nw)]
        at += 24 * nw
        copies = [(u64(at + 24 * i), u64(at + 24 * i + 8), u64(at + 24 * i + 16)) for i in range(nc)]
        at += 24 * nc
        writes = [(u64(at + 16 * i), u64(at + 16 * i + 8)) for i in range(nr)]
        val = lambda v: epoch if v == _EPOCH_WORD else v  # noqa: E731

        def ready():
            if u64(abort):
                return True
            return all((u64(a) == val(v)) if eq else geq(u64(a), val(v)) for a, v, eq in waits)

        def run():
            self.gates += 1
            if u64(abort):
                return
            for dst, src, n in copies:
                ctypes.memmove(dst, src, n)
            for a, v in writes:
                ctypes.c_uint64.from_address(a).value = val(v)

        self.sim.push(stream, ready, run, "gate")


@pytest.fixture
def fake_copy_engine(monkeypatch):
    """The copy_engine transport's CUDA calls on StreamSim: its driver, torch.cuda's events,
    external streams and device guard (the transport's own module imports real torch)."""
    import contextlib

    import ultracomm.transports.copy_engine as ce
    from ultracomm.cuda import driver as real_driver

    sim = StreamSim()
    drv = FakeDriver(sim)

    def method(name):  # the fake's method, called with arguments that bind to Driver's
        sig, impl = inspect.signature(getattr(real_driver.Driver, name)), getattr(drv, name)

        def call(*a, **k):
            sig.bind(drv, *a, **k)
            return impl(*a, **k)

        return call

    for name in (
        "bind",
        "stream_create",
        "stream_destroy",
        "memcpy",
        "write_value",
        "wait_value",
        "function",
        "launch",
    ):
        setattr(drv, name, method(name))

    class ExternalStream:
        def __init__(self, handle, device=None):
            self.cuda_stream = int(handle)

        def wait_event(self, ev):
            sim.push(self.cuda_stream, lambda: ev.done, lambda: None, "wait_event")

    class Event:
        def __init__(self, *a, **k):
            self.done = False

        def record(self, stream):
            self.done = False

            def run():
                self.done = True

            sim.push(stream.cuda_stream, lambda: True, run, "record")

        def query(self):
            sim.progress()
            return self.done

    monkeypatch.setattr(ce, "require", lambda *a, **k: None)
    monkeypatch.setattr(ce, "driver", lambda: drv)
    monkeypatch.setattr(ce, "pinned_words", lambda n: torch.zeros(n, dtype=torch.int64))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "ExternalStream", ExternalStream)
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return sim, drv


def test_copy_engine_section_on_the_cpu(cpu_bench, fake_copy_engine, monkeypatch):
    """run_copy_engine through the real CopyEngineTransport (gated commands, fork/join, the
    loopback set, the watchdogs) on a fake driver over host memory: every row measured, #wrong 0,
    every stream drained, no transport left failed, the device not marked poisoned."""
    sim, drv = fake_copy_engine
    g = cpu_bench
    g.ce_reason = None
    blocked = []

    def synchronize(device=None):  # what a device-wide synchronize would wait for
        blocked.append(sim.blocked())

    monkeypatch.setattr(g.torch.cuda, "synchronize", synchronize)
    assert run_sections(g, "copy_engine") == []
    got = [(r.section, r.case, r.size, r.wrong) for r in g.rows]
    sizes = [SMALL_MIB * m for m in (1, 4, 16, 64, 256)]
    assert got == [("copy_engine", "1->1", s, 0) for s in sizes] + [
        ("copy_engine", f"1->{n}", bg.FANOUT_BYTES, 0) for n in (2, 4, 8)
    ], [(r.case, r.note) for r in g.rows]
    assert all(r.impl == "copy engine" and r.time_s for r in g.rows)
    assert g.poisoned is None and g.kept == []
    assert blocked and all(b == {} for b in blocked), blocked
    assert drv.gates > 0 and drv.destroyed
    # since issue 35 the copies run in gate kernels: one CTA per destination stream, not 0 SMs
    assert all(r.extra["sms"] == r.extra["destinations"] and "gate kernels" in r.note for r in g.rows)
    assert not any("0 SMs" in r.note for r in g.rows)


def test_graph_rows_wrong_after_replays_on_the_cpu(cpu_bench, monkeypatch):
    """The graph rows' #wrong checks: a graph's first replay runs what it captured again, after
    Timer.graph's ``prepare`` (control's PDL row refills its outputs with -7, lb_prefetch its slots
    with the sentinel), so a check that reads what the replays did not write, or a ``prepare``
    that spoils what is checked, shows as #wrong here."""
    g = cpu_bench
    g.torch.cuda.replays = True
    patch_bench(monkeypatch, "CONTROL_SHAPES", (("EP8", 8, 32),))
    assert run_sections(g, "launch", "control") == []
    shape, members = (4, 2, 4), (("weights", 4096, "float8_e4m3fn"), ("sf0", 256, "float32"))
    g.run_lb_prefetch(shape, members)
    graph = [(r.section, r.case, r.impl, r.wrong) for r in g.rows if r.extra.get("timing") == "graph" and r.time_s]
    assert len([x for x in graph if x[0] == "control"]) == len(bg.CONTROL_KERNELS) + 2
    assert len([x for x in graph if x[0] == "lb_prefetch"]) == 2
    assert [x for x in graph if x[3]] == [], graph
