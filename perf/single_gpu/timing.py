"""How the bench times: CUDA events around back-to-back calls, or a replayed CUDA graph (Timer, and the
note of a graph-replayed row); libcudart's cudaMemcpyAsync through ctypes (the copy baseline)."""

from __future__ import annotations

import ctypes
import ctypes.util
import statistics
import time
from typing import Callable, Optional

from .constants import CONTROL_PER_GRAPH, CONTROL_REPLAYS


def graph_note(per_graph: int, replays: int, more: str = "") -> str:
    """The note of a graph-replayed row (device time, not the host's enqueue rate)."""
    return f"graph replay: {per_graph} per graph x {replays} replays, device time" + (f"; {more}" if more else "")


class Timer:
    """GPU time per call of ``fn`` (CUDA events, median of trials) and whether enqueueing was the bottleneck."""

    def __init__(self, torch_mod, reps: int, trials: int = 3):
        self.torch, self.reps, self.trials = torch_mod, reps, trials

    def __call__(self, fn: Callable[[], None], reps: Optional[int] = None) -> tuple[float, bool]:
        torch = self.torch
        reps = reps or self.reps
        fn()
        torch.cuda.current_stream().synchronize()  # not the device: a failed copy_engine op's streams stay blocked
        times, cpu_bound = [], False
        for _ in range(self.trials):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            t0 = time.perf_counter()
            a.record()
            for _ in range(reps):
                fn()
            b.record()
            host = time.perf_counter() - t0
            b.synchronize()
            gpu = a.elapsed_time(b) / 1e3
            times.append(gpu / reps)
            cpu_bound |= host >= 0.9 * gpu
        return statistics.median(times), cpu_bound

    def graph(
        self,
        fn: Callable[[], None],
        per_graph: int = CONTROL_PER_GRAPH,
        replays: int = CONTROL_REPLAYS,
        prepare: Optional[Callable[[], None]] = None,
    ) -> float:
        """Device time per call of ``fn`` inside a replayed CUDA graph (the one graph timer of the
        bench: control kernels, the device step, the launch rows): ``fn`` runs once eagerly (its
        one-time setup, and the check that it works), is captured ``per_graph`` times into one
        graph on a side stream, the graph is replayed once to warm, then CUDA events around
        ``replays`` back-to-back ``graph.replay()`` calls; median over trials of elapsed /
        (replays x per_graph).  ``fn`` must enqueue on the current stream and never synchronise.
        ``prepare``: called once after the capture, before the first replay (e.g. refill destinations,
        so that what is checked afterwards was written by replays only)."""
        torch = self.torch
        fn()
        torch.cuda.current_stream().synchronize()
        g = torch.cuda.CUDAGraph()
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side):
            for _ in range(per_graph):
                fn()
        torch.cuda.current_stream().wait_stream(side)
        if prepare is not None:
            prepare()
        g.replay()
        torch.cuda.current_stream().synchronize()
        times = []
        for _ in range(self.trials):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            for _ in range(replays):
                g.replay()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) / 1e3 / (replays * per_graph))
        del g
        return statistics.median(times)


# cudaMemcpyAsync(void *dst, const void *src, size_t count, enum cudaMemcpyKind kind, cudaStream_t stream)
# (tests/cuda/test_gpu_paths_cpu.py checks both against cuda_runtime_api.h)
CUDART_MEMCPY_ASYNC_ARGTYPES = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
CUDA_MEMCPY_DEVICE_TO_DEVICE = 3


def load_cudart():
    """libcudart already loaded by torch (found in /proc/self/maps), for cudaMemcpyAsync."""
    path = None
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libcudart.so" in line:
                    path = line.split()[-1]
                    break
    except OSError:
        pass
    if path is None:
        path = ctypes.util.find_library("cudart")
    if path is None:
        raise RuntimeError("libcudart not found in this process or on the library path")
    lib = ctypes.CDLL(path)
    lib.cudaMemcpyAsync.argtypes = CUDART_MEMCPY_ASYNC_ARGTYPES
    lib.cudaMemcpyAsync.restype = ctypes.c_int
    return lib
