"""What of the GPU-only paths a machine without a GPU can check, so that a device's first run does
not fail on it: the ctypes signatures of the driver and runtime calls against the CUDA headers,
the primary-context binding of threads that make driver calls, the arguments the Python side
hands ``ultracomm._cuda`` (converted by the real binding up to its first CUDA call), the CPU half
of the CUDA loopback tests' harness, and that every ``gpu``-marked test collects and skips here."""

from __future__ import annotations

import ctypes
import glob
import os
import re
import shutil
import subprocess
import sys
import types

import numpy as np
import pytest
import torch

from ultracomm import ExpertLayout, Member, ReplicaPlan, _core
from ultracomm.cuda.driver import SIGNATURES, Driver
from ultracomm.records import Op
from ultracomm.schedule import build_schedule

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CUDA_INCLUDE = next(
    (
        d
        for d in (os.path.join(os.environ.get("CUDA_HOME", "/usr/local/cuda"), "include"), "/usr/local/cuda/include")
        if os.path.exists(os.path.join(d, "cuda.h"))
    ),
    None,
)
CC = shutil.which("cc") or shutil.which("gcc")
needs_headers = pytest.mark.skipif(CUDA_INCLUDE is None or CC is None, reason="no CUDA headers or C compiler here")

# C parameter types of the prototypes -> the ctypes type of that width and kind
C_TYPES = {
    "CUdeviceptr": ctypes.c_uint64,
    "cuuint64_t": ctypes.c_uint64,
    "size_t": ctypes.c_size_t,
    "CUstream": ctypes.c_void_p,
    "CUcontext": ctypes.c_void_p,
    "CUdevice": ctypes.c_int,
    "CUresult": ctypes.c_int,
    "unsigned int": ctypes.c_uint,
    "int": ctypes.c_int,
    "CUstream *": ctypes.POINTER(ctypes.c_void_p),
    "CUcontext *": ctypes.POINTER(ctypes.c_void_p),
    "CUdevice *": ctypes.POINTER(ctypes.c_int),
    "const char **": ctypes.POINTER(ctypes.c_char_p),
    "void *": ctypes.c_void_p,
    "const void *": ctypes.c_void_p,
    "enum cudaMemcpyKind": ctypes.c_int,
    "cudaStream_t": ctypes.c_void_p,
    # the copy_engine gate kernel's module load and launch
    "CUmodule *": ctypes.POINTER(ctypes.c_void_p),
    "CUfunction *": ctypes.POINTER(ctypes.c_void_p),
    "CUmodule": ctypes.c_void_p,
    "CUfunction": ctypes.c_void_p,
    "const char *": ctypes.c_char_p,
    "void **": ctypes.POINTER(ctypes.c_void_p),
}


def preprocess(header: str, names) -> tuple[dict[str, str], str]:
    """({API name: the symbol the header binds it to}, preprocessed text) as a C file including
    ``header`` without per-thread default streams sees them."""
    src = f"#include <{header}>\n" + "".join(f"UC_SYMBOL_{n} = {n};\n" for n in names)
    out = subprocess.run(
        [CC, "-E", "-P", f"-I{CUDA_INCLUDE}", "-x", "c", "-"], input=src, capture_output=True, text=True, check=True
    ).stdout
    return dict(re.findall(r"UC_SYMBOL_(\w+) = (\w+);", out)), out


def prototype(text: str, symbol: str) -> list:
    """The ctypes types of ``symbol``'s parameters in preprocessed header text."""
    m = re.search(r"\b(?:CUresult|cudaError_t)\s+" + symbol + r"\s*\(([^)]*)\)\s*;", text)
    assert m, f"no prototype of {symbol}"
    types_ = []
    for p in m.group(1).split(","):
        p = " ".join(p.replace("*", " * ").split())
        c_type = re.sub(r"\s*\b\w+$", "", p).replace("* *", "**")  # drop the parameter's name
        assert c_type in C_TYPES, f"{symbol}: parameter type {c_type!r} has no ctypes mapping here"
        types_.append(C_TYPES[c_type])
    return types_


@needs_headers
def test_driver_binds_the_header_symbols_with_their_argument_types():
    symbols, text = preprocess("cuda.h", SIGNATURES)
    assert "typedef unsigned long long CUdeviceptr_v2;" in text  # 64-bit device pointers
    for name, (symbol, argtypes) in SIGNATURES.items():
        assert symbols[name] == symbol, f"cuda.h binds {name} to {symbols[name]}, the driver wrapper to {symbol}"
        assert argtypes == prototype(text, symbol), name
    for const, value in (
        ("CU_STREAM_WAIT_VALUE_GEQ", 0),
        ("CU_STREAM_WAIT_VALUE_EQ", 1),
        ("CU_STREAM_NON_BLOCKING", 1),
        ("CU_STREAM_WRITE_VALUE_DEFAULT", 0),
    ):
        assert re.search(rf"\b{const}\s*=\s*0x0*{value}\b", text), const


def bench():
    """perf/bench_gpu.py as the module ``bench_gpu`` (loaded once)."""
    import perf_modules

    return perf_modules.load("bench_gpu")


@needs_headers
def test_bench_cudart_memcpy_matches_the_runtime_header():
    bg = bench()
    symbols, text = preprocess("cuda_runtime_api.h", ["cudaMemcpyAsync"])
    assert symbols["cudaMemcpyAsync"] == "cudaMemcpyAsync"
    assert bg.CUDART_MEMCPY_ASYNC_ARGTYPES == prototype(text, "cudaMemcpyAsync")
    assert re.search(rf"\bcudaMemcpyDeviceToDevice\s*=\s*{bg.CUDA_MEMCPY_DEVICE_TO_DEVICE}\b", text)


class FakeLib:
    """libcuda's entry points as ctypes-like callables recording (symbol, args); one current
    context per thread, as the driver keeps it."""

    def __init__(self, symbols):
        import threading

        self.calls, self.local, self.primary = [], threading.local(), 0xC0
        for s in symbols:
            setattr(self, s, self._fn(s))

    def _fn(self, sym):
        lib = self

        class Fn:
            argtypes = restype = None

            def __call__(self, *args):
                lib.calls.append((sym, args))
                if sym == "cuDevicePrimaryCtxRetain":
                    ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = lib.primary
                elif sym == "cuCtxGetCurrent":
                    ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = getattr(lib.local, "ctx", 0)
                elif sym == "cuCtxSetCurrent":
                    lib.local.ctx = args[0]
                return 0

        return Fn()


def test_driver_binds_the_primary_context_once_per_thread():
    import threading

    both = {s for name, (s, _) in SIGNATURES.items()} | set(SIGNATURES)
    lib = FakeLib(both)
    drv = Driver(lib)
    assert drv.symbols == {name: s for name, (s, _) in SIGNATURES.items()}  # the header's, not the plain v1
    assert all(
        getattr(lib, s).argtypes == a and getattr(lib, s).restype is ctypes.c_int for s, a in SIGNATURES.values()
    )
    drv.bind(0)
    drv.bind(0)  # already current: no second set
    sets = lambda: [a for s, a in lib.calls if s == "cuCtxSetCurrent"]  # noqa: E731
    assert sets() == [(0xC0,)] and [s for s, _ in lib.calls].count("cuDevicePrimaryCtxRetain") == 1
    t = threading.Thread(target=drv.bind, args=(0,))  # a new thread has no current context
    t.start()
    t.join()
    assert sets() == [(0xC0,), (0xC0,)] and [s for s, _ in lib.calls].count("cuDevicePrimaryCtxRetain") == 1
    old = Driver(FakeLib(SIGNATURES))  # a driver without the _v2 entry points: the originals
    assert old.symbols["cuStreamWaitValue64"] == "cuStreamWaitValue64"


# ------------------------------------------------------------------------------ ultracomm._cuda


@pytest.fixture
def real_cuda():
    from ultracomm.cuda.support import cuda_module, cuda_module_reason

    if cuda_module() is None:
        pytest.skip(f"ultracomm._cuda not built here ({cuda_module_reason()})")
    if torch.cuda.is_available():
        pytest.skip("a GPU is here: the gpu tests run these calls for real")
    return cuda_module()


class Bindings:
    """The real ``_cuda`` bindings, except ``Runner`` (its constructor needs a device)."""

    def __init__(self, cuda):
        self._cuda = cuda

    def __getattr__(self, name):
        return getattr(self._cuda, name)

    def PlanArena(self, device, num_slots, **bounds):  # noqa: N802 - needs a device to allocate
        self._cuda.plan_arena_bytes(num_slots, **bounds)  # the real bounds check
        return types.SimpleNamespace(device=device, num_slots=num_slots, bounds=bounds)

    def Runner(self, device):  # noqa: N802 - the binding's name
        def launch_slot(arena, slot, op, ranks, *a, **kw):
            if ranks is None:
                pytest.fail("launched without a plan")
            self._cuda.DevicePlan(ranks, device)  # converts and validates every entry, then needs the device

        return types.SimpleNamespace(
            sm_count=132,
            mover="tma",
            max_coresident=lambda dtype=0: 1024,
            launch=lambda *a: pytest.fail("launched without a plan"),
            launch_slot=launch_slot,
        )


def small_case():
    layout = ExpertLayout(
        (Member("fc1", (8, 6), torch.bfloat16), Member("fc2", (10,), torch.bfloat16)), grad_dtype=torch.float32
    )
    plan = ReplicaPlan.make(np.array([[-1], [0], [0]], np.int32), experts_per_rank=1)
    wl = _core.window_layout(1, layout.weight_bytes, layout.grad_bytes, 64)
    sched = build_schedule(plan, wl["weight_slot_bytes"], wl["grad_slot_bytes"], chunk_bytes=64)
    return layout, plan, wl, sched


def assert_reached_cuda(excinfo):
    """The binding converted every argument and failed at its first CUDA call (no driver here)."""
    assert type(excinfo.value).__name__ == "CudaError" or "CUDA driver" in str(excinfo.value), excinfo.value
    assert "lacks" not in str(excinfo.value) and "incompatible function arguments" not in str(excinfo.value)


@pytest.mark.parametrize("loopback", [False, True])
def test_tma_transport_arguments_convert_in_the_real_binding(real_cuda, monkeypatch, loopback):
    from ultracomm.transports import tma as tma_mod
    from ultracomm.transports.host import Masters

    monkeypatch.setattr(tma_mod, "cuda_runtime", lambda device, what="": Bindings(real_cuda))
    layout, plan, wl, sched = small_case()
    shared: dict = {}
    ts = []
    for r in range(3):
        win = types.SimpleNamespace(
            provider="cuda_local" if loopback else "cuda_ipc",
            world=3,
            loopback=loopback,
            shared=shared,
            local=types.SimpleNamespace(device=torch.device("cuda", 0)),
            peer_bases=[0x7000_0000_0000 + (i << 32) for i in range(3)],
        )
        ts.append(
            tma_mod.TmaTransport(
                rank=r,
                world=3,
                window=win,
                wlayout=wl,
                layout=layout,
                num_workers=1,
                timeout_s=2.0,
                multicast_sms=2,
                reduce_sms=2,
            )
        )
    w = tuple(torch.zeros((1, *m.shape), dtype=m.dtype) for m in layout.members)
    g = tuple(torch.zeros((1, *m.shape), dtype=layout.grad_dtype) for m in layout.members)
    masters = Masters.of(w, g, 1, [m.name for m in layout.members])
    for op in (Op.MULTICAST, Op.REDUCE):
        with pytest.raises(RuntimeError) as ei:
            for t in ts:  # a loopback set reaches the binding at its last rank
                t.run(op, sched, 1, masters, plan.slot_src[t.rank].tolist(), plan.local_index_of.tolist(), "x", 0)
        assert_reached_cuda(ei)
    with pytest.raises(RuntimeError) as ei:
        ts[0].reject(Op.MULTICAST, 2, stream=0)
    assert_reached_cuda(ei)


def test_cuda_loopback_and_bench_arguments_convert_in_the_real_binding(real_cuda, monkeypatch):
    import ultracomm
    import ultracomm.cuda.loopback as cl

    monkeypatch.setattr(cl, "cuda_runtime", lambda device, what="": Bindings(real_cuda))
    bg = bench()
    # CudaLoopback only checks that its windows are CUDA tensors: these stand in for them
    monkeypatch.setattr(cl, "CudaLoopback", type("CpuLoopback", (cl.CudaLoopback,), {"__init__": _cpu_loopback_init}))
    g = types.SimpleNamespace(
        torch=torch, uc=ultracomm, dev=torch.device("cpu"), info=dict(sms=132, name="NVIDIA H200")
    )
    for dt in (torch.float32, torch.bfloat16):
        with pytest.raises(RuntimeError) as ei:  # the multicast plan, built in the constructor
            bg.Loopback(g, 3, bg.one_expert(2), 3 * 4096, dt, chunk_bytes=4096, relay_mode="off")
        assert_reached_cuda(ei)
    for fn, args in (("launch_empty", (0,)), ("flag_pingpong", (0x1000, 0x1100, 0, 10, int(5e9), 0x1200, 0))):
        with pytest.raises(RuntimeError) as ei:  # the bench's launch and flag sections
            getattr(real_cuda, fn)(*args)
        assert_reached_cuda(ei)
    names = re.findall(r"(\w+):", real_cuda.Runner.launch.__doc__.split("->")[0])
    # the callers' order (reduce_path: a keyword, after every positional the callers pass)
    assert names == ["self", "plan", "epoch", "ctas_per_rank", "stream", "force_vector", "reduce_path"]


def _cpu_loopback_init(self, world, wlayout, windows, *, timeout_s=10.0):
    from ultracomm.cuda.loopback import cuda_runtime

    self.world, self.wlayout, self.windows, self.device, self.timeout_s = (
        world,
        dict(wlayout),
        list(windows),
        0,
        timeout_s,
    )
    self._cuda = cuda_runtime(0)
    self.runner = self._cuda.Runner(0)
    self._names = {}


# ------------------------------------------------------------------------------ the gpu tests here


def test_cuda_loopback_harness_runs_its_host_half():
    """test_cuda_loopback.py's Domain (initial state, the host executor's run) for each hand-built
    tree and a builder schedule of its random plans: what its device tests compare against."""
    import test_cuda_loopback as tcl
    from ultracomm.records import TaskKind
    from ultracomm.tools.reference import tasks_from_trees

    for shape, (world, slots, trees) in sorted(tcl.TREES.items()):
        d = tcl.Domain(
            world,
            slots,
            [1000, 333, 7],
            [250, 3],
            chunk=4096,
            grad_dtype=torch.bfloat16,
            num_experts=world,
            home_of=list(range(world)),
            my_slots=tcl._slots_of(world, slots, trees),
            misalign=3,
        )
        parent = tcl._parents(world, slots, trees)
        for op, kind in ((Op.MULTICAST, TaskKind.COPY), (Op.REDUCE, TaskKind.REDUCE)):
            tasks, refs = tasks_from_trees(world, trees, d.wsb if op == Op.MULTICAST else d.gsb, d.chunk, kind)
            errs = d.run_host(op, tasks, refs, 1 + int(op), parent)
            assert all(e is None for e in errs.values()), (shape, op, errs)
    plan = tcl._random_plan(3, 3, 6, np.random.default_rng(1))
    sch = build_schedule(plan, 4096, 1024, chunk_bytes=1024, relay_mode="auto")
    assert sch.tasks(Op.MULTICAST, 0).dtype.names


def test_gpu_context_timeout_test_withholds_on_the_host_transport():
    """test_gpu_context.py's timeout test, whole, on the host transport: its way of withholding the
    home's tasks must reach the schedules weight_sync runs (patching ``Context.schedule_for`` no
    longer did after the Context's split: no rank timed out)."""
    import test_gpu_context as tgc

    tgc.check_timeout_surfaces_at_wait("host")


def test_gpu_context_timeout_test_through_the_stream_ordered_path(monkeypatch):
    """The same test on "tma" as the device runs it -- the error surfacing at ``Work.wait()``
    through ``StreamOrdered.check()``, which names ranks by evidence (issue 35) -- with
    test_stream_ordered's stand-in for the kernel (the host executor, errors only at
    ``check_error()``) and for the CUDA streams."""
    import test_gpu_context as tgc
    import test_stream_ordered as tso

    import ultracomm.cuda.stream_ordered as so
    import ultracomm.transports as transports
    from ultracomm import Context, LoopbackDomain

    monkeypatch.setitem(transports.TRANSPORTS, "tma", tso.FakeStreamTransport)
    monkeypatch.setattr(so, "streams_for", lambda device: tso.FakeStreams())

    def make(world, layout, epr, slots, transport, **kw):  # test_gpu_context.make, its "tma" on host memory
        assert transport == "tma"
        opts = dict(relay_mode="off", chunk_bytes=1024, tile_bytes=256, transport="tma", window="local", num_workers=2)
        ctxs = LoopbackDomain(world).run(lambda g: Context(g, layout, epr, slots, num_layers=1, **opts, **kw))
        regs = [tgc.masters(layout, c.rank, epr, "cpu") for c in ctxs]
        for c, (w, g) in zip(ctxs, regs):
            c.register_masters(0, w, g)
        assert all(c._streams is not None and c._streams.witness is c._witness for c in ctxs)
        return ctxs, regs

    monkeypatch.setattr(tgc, "make", make)
    tgc.check_timeout_surfaces_at_wait("tma")


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is here: the gpu tests run")
def test_every_gpu_test_collects_and_skips_here():
    """What scripts/gpu_check.sh runs (``pytest -m gpu``), here over the files that mark tests gpu
    (the whole suite's collection costs a minute; a collection error elsewhere fails CI anyway)."""
    marker = "pytest.mark." + "gpu"  # spelled apart: this file marks nothing
    files = sorted(  # tests/ mirrors the package: every folder below it
        os.path.relpath(f, os.path.join(ROOT, "tests"))
        for f in glob.glob(os.path.join(ROOT, "tests", "**", "test_*.py"), recursive=True)
        if marker in open(f).read()
    )
    assert {"test_cuda_loopback.py", "test_copy_engine_gpu.py", "test_gpu_context.py"} <= {
        os.path.basename(f) for f in files
    }
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            *(os.path.join("tests", f) for f in files),
            "-m",
            "gpu",
            "-q",
            "-rs",
            "-p",
            "no:cacheprovider",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    tail = p.stdout[-3000:] + p.stderr[-3000:]
    assert p.returncode == 0, tail
    m = re.search(r"(\d+) skipped, (\d+) deselected", p.stdout)
    assert m and int(m.group(1)) >= 60 and "passed" not in p.stdout.splitlines()[-1], tail
    assert "error" not in p.stdout.splitlines()[-1].lower(), tail
    reasons = re.findall(r"^SKIPPED \[\d+\] .*?: (.*)$", p.stdout, re.M)
    assert reasons and all(r.startswith("needs a CUDA device") for r in reasons), set(reasons)
