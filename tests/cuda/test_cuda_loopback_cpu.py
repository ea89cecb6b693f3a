"""test_cuda_loopback.py's ``gpu`` tests run whole on the CPU, so that a device loan spends no time on
a stale one: the tests' own code (their Domain, plans, grids, expected texts, waits, graph capture)
against the real ``CudaLoopback`` with only the device faked -- tensors the tests put on "cuda" stay
on the CPU, ``torch.cuda`` is a stand-in (events done at once, a graph captures launches and
replays them), and the launch runs the host executor (``_core.run_host``, one thread per rank) at
the epoch the device would (``max(epoch, last epoch of the op + 1)``), when the test waits.  The
runner's CTA rules are the compiled ones (``_cuda.launch_ctas`` / ``max_ctas_per_rank``, an H100's
132 SMs, two CTAs per SM), the plan's checks ``run_host``'s own (the ``validate`` DevicePlan runs,
here on scratch copies).  What this cannot check is the kernel itself: its bytes against the host
executor's are the device run's question."""

from __future__ import annotations

import contextlib
import ctypes
import threading
import types

import numpy as np
import pytest
import torch

from ultracomm import _core
from ultracomm.cuda.support import cuda_module

import test_cuda_loopback as tcl

SMS, PER_SM = 132, 2  # an H100: the shared ring's occupancy (k_persistent.cu persistent_max_coresident)


def grid_makeup(ctas) -> str:
    """runner.cpp's grid_makeup (the co-residency error's words)."""
    n = len(ctas)
    ranks = f"{n} rank" + ("" if n == 1 else "s")
    if all(c == ctas[0] for c in ctas):
        return f"{ranks} x {ctas[0]} CTA" + ("" if ctas[0] == 1 else "s")
    idle = sum(c == 1 for c in ctas)
    return f"{ranks} ({n - idle} with tasks x {max(ctas)} CTAs, {idle} without x 1 CTA)"


class FakePlan:
    """_cuda.DevicePlan: the rank entries, checked by run_host's validate on scratch windows and masters."""

    def __init__(self, ranks, device):
        self.ranks = [dict(r) for r in ranks]
        self.op, self.grad_dtype, self.nranks = ranks[0]["op"], ranks[0]["grad_dtype"], len(ranks)
        self.rank_tasks = [len(r["tasks"]) for r in ranks]
        for r in ranks:  # nothing of the real windows or masters is touched: an aborted run on copies
            L = _core.window_layout(r["slots"], r["weight_slot_bytes"], r["grad_slot_bytes"], r["chunk_bytes"])
            wins = [np.zeros(L["total_bytes"], np.uint8) for _ in r["window_bases"]]
            masters = [np.zeros(max(r["member_bytes"], default=0) + 64, np.uint8) for _ in r["master_ptrs"]]
            abort = np.ones(1, np.uint64)
            args = dict(r, window_bases=[w.ctypes.data for w in wins], master_ptrs=[m.ctypes.data for m in masters])
            try:
                _core.run_host(epoch=1, num_workers=1, abort_word=abort.ctypes.data, **args)
            except ValueError:
                raise
            except Exception:  # noqa: BLE001,S110 - validated; the abort stopped it
                pass


class FakeRunner:
    """_cuda.Runner: launches queue until the stream is waited for, then run the host executor."""

    mover, sm_count, compute_capability = "tma", SMS, (9, 0)

    def __init__(self, cuda, device=0):
        self.cuda, self.last, self.queue, self.error, self.names = cuda, {}, [], None, {}
        self.capture = None  # a FakeGraph while one captures

    def max_coresident(self, grad_dtype=0):
        return SMS * PER_SM

    def launch_ctas(self, plan, ctas_per_rank):
        return list(cuda_module().launch_ctas(plan.rank_tasks, int(ctas_per_rank)))

    def max_ctas_per_rank(self, plan, max_grid):
        return int(cuda_module().max_ctas_per_rank(plan.rank_tasks, int(max_grid)))

    def launch(self, plan, epoch, ctas_per_rank, stream, force_vector=False, reduce_path="hunk"):
        assert isinstance(stream, int) and reduce_path in ("hunk", "tma") and epoch >= 1
        ctas = self.launch_ctas(plan, ctas_per_rank)
        if plan.nranks > 1 and sum(ctas) > self.max_coresident(plan.grad_dtype):
            raise ValueError(
                f"ultracomm._cuda.Runner.launch: a loopback launch of {grid_makeup(ctas)} = {sum(ctas)} CTAs cannot "
                f"be co-resident on device 0 (at most {self.max_coresident()} on its {SMS} SMs); every rank's CTAs "
                "must run at once, lower ctas_per_rank"
            )
        (self.capture.launches if self.capture is not None else self.queue).append((plan, int(epoch)))

    def drain(self, lb):
        while self.queue:
            plan, epoch = self.queue.pop(0)
            epoch = max(epoch, self.last.get(plan.op, 0) + 1)
            self.last[plan.op] = epoch
            name = lb._names.get(epoch)
            errs = []

            def body(a, name=name, epoch=epoch, errs=errs):
                try:
                    _core.run_host(epoch=epoch, num_workers=2, op_name=name, **a)
                except Exception as e:  # noqa: BLE001 - the launch's one record: the first failure
                    errs.append(e)

            th = [threading.Thread(target=body, args=(a,)) for a in plan.ranks]
            for t in th:
                t.start()
            for t in th:
                t.join(60)
            if errs and self.error is None:
                self.error = errs[0]

    def take_error(self):
        e, self.error = self.error, None
        return e


class FakeCuda:
    """torch.cuda as the tests call it; waiting for anything runs the queued launches."""

    def __init__(self):
        self.loopbacks = []
        fake = self

        class Stream:
            cuda_stream = 0x5700

            def __init__(self, *a, **k):
                pass

            def wait_stream(self, other):
                pass

            def synchronize(self):
                fake.synchronize()

        class Event:
            def record(self, stream=None):
                pass

            def query(self):
                fake.synchronize()
                return True

            def synchronize(self):
                fake.synchronize()

        class CUDAGraph:
            def __init__(self):
                self.launches = []

            def replay(self):
                for lb in fake.loopbacks:
                    lb.runner.queue.extend((p, e) for p, e in self.launches if p in lb.plans)

        self.Stream, self.Event, self.CUDAGraph = Stream, Event, CUDAGraph

    def synchronize(self, device=None):
        for lb in self.loopbacks:
            fake_runner = lb.runner  # not _cuda's Runner: tests/cuda/test_binding_calls.py reads `runner.`
            fake_runner.drain(lb)

    @contextlib.contextmanager
    def graph(self, g, stream=None, **k):
        for lb in self.loopbacks:
            lb.runner.capture = g
        try:
            yield
        finally:
            for lb in self.loopbacks:
                lb.runner.capture = None

    @contextlib.contextmanager
    def stream(self, s):
        yield

    def current_stream(self, device=None):
        return self.Stream()

    def current_device(self):
        return 0

    def get_device_capability(self, device=None):
        return (9, 0)


class TorchProxy:
    def __init__(self, cuda):
        self.cuda = cuda

    def zeros(self, *a, device=None, **k):
        return torch.zeros(*a, **k)

    def __getattr__(self, name):
        return getattr(torch, name)


def host_bench(fake):
    """_cuda's launch_empty and flag_pingpong as their kernels leave memory (k_bench.cu)."""

    def flag_pingpong(ping, pong, base, iters, timeout_ns, out, stream):
        for addr in (ping, pong):
            ctypes.c_uint64.from_address(addr).value = base + iters
        ctypes.c_uint64.from_address(out).value, ctypes.c_uint64.from_address(out + 8).value = 1500 * iters, 0

    real = cuda_module()
    return types.SimpleNamespace(
        launch_empty=lambda stream: real.launch_ctas([0], 1),
        flag_pingpong=flag_pingpong,
        Runner=lambda device: FakeRunner(fake, device),
        DevicePlan=FakePlan,
    )


@pytest.fixture
def cpu_device(monkeypatch):
    import ultracomm.cuda.loopback as cl
    import ultracomm.cuda.support as support

    if cuda_module() is None:
        pytest.skip("ultracomm._cuda is not built here (its CTA rules are the compiled ones)")
    fake = FakeCuda()
    mod = host_bench(fake)

    class CpuLoopback(cl.CudaLoopback):
        def __init__(self, world, wlayout, windows, *, timeout_s=10.0):
            assert len(windows) == world and all(w.numel() >= wlayout["total_bytes"] for w in windows)
            self.world, self.wlayout, self.windows, self.device = world, dict(wlayout), list(windows), 0
            self.timeout_s = float(timeout_s)
            self._cuda, self.runner, self._names, self.plans = mod, mod.Runner(0), {}, []
            fake.loopbacks.append(self)

        def plan(self, *a, **k):
            p = super().plan(*a, **k)
            self.plans.append(p)
            return p

        def check_error(self):
            e = self.runner.take_error()
            if e is not None:
                raise e

    monkeypatch.setattr(cl, "CudaLoopback", CpuLoopback)
    monkeypatch.setattr(support, "cuda_runtime", lambda device, what="": mod)
    monkeypatch.setattr(tcl, "torch", TorchProxy(fake))
    monkeypatch.setattr(cl, "torch", TorchProxy(fake))
    monkeypatch.setattr(torch.Tensor, "cuda", lambda self, *a, **k: self.clone())
    to = torch.Tensor.to
    monkeypatch.setattr(
        torch.Tensor, "to", lambda self, *a, **k: to(self, *("cpu" if x == "cuda" else x for x in a), **k)
    )
    return fake


def gpu_cases():
    """(test name, its parameter sets) of test_cuda_loopback.py's gpu tests."""
    out = []
    for name in sorted(n for n in dir(tcl) if n.startswith("test_")):
        fn = getattr(tcl, name)
        marks = [m for m in getattr(fn, "pytestmark", []) if m.name == "parametrize"]
        cases = [{}]
        for m in marks:
            names = [s.strip() for s in m.args[0].split(",")] if isinstance(m.args[0], str) else list(m.args[0])
            vals = [v if len(names) > 1 else (v,) for v in m.args[1]]
            cases = [dict(c, **dict(zip(names, v))) for c in cases for v in vals]
        out += [pytest.param(name, c, id=f"{name}-{i}") for i, c in enumerate(cases)]
    return out


@pytest.mark.parametrize(("name", "kwargs"), gpu_cases())
def test_gpu_test_runs_on_the_cpu_device(cpu_device, name, kwargs):
    getattr(tcl, name)(**kwargs)
