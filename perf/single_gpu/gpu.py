"""Gpu: the device the bench measures, its bookkeeping (budget, failures, baselines) and its sections,
one mixin per idea (launch, control, copies, reduce, relay, lb_prefetch)."""

from __future__ import annotations

import ctypes
import importlib
import sys
import time
import traceback
from typing import Callable, Optional

import numpy as np

from .constants import SECTIONS, SENTINEL
from .control import ControlSection
from .copies import CopySections
from .launch import LaunchSections
from .lb_prefetch import LbPrefetchSection
from .loopback import Loopback
from .reduce import ReduceSections
from .relay import RelaySection
from .rows import Row
from .timing import CUDA_MEMCPY_DEVICE_TO_DEVICE, Timer, load_cudart


class Gpu(LaunchSections, ControlSection, CopySections, ReduceSections, RelaySection, LbPrefetchSection):
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
