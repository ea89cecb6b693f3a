"""The few CUDA driver calls the ``copy_engine`` transport makes, through ``dlopen`` (ctypes).

ultracomm links no libcuda: ``libcuda.so.1`` is opened when the transport is built, so a CPU
machine imports everything and only asking for ``copy_engine`` says "not available: ...".
Calls (driver API, unified addressing: peer-mapped and IPC-mapped addresses are plain
``CUdeviceptr`` values, streams are torch's ``stream.cuda_stream`` handles):

* ``cuMemcpyAsync(dst, src, bytes, stream)``: a copy engine moves the bytes (no SM);
* ``cuStreamWriteValue64(stream, addr, value, 0)``: after the stream's earlier work, a fenced
  write of a flag (default flags: the write is preceded by a memory fence);
* ``cuStreamWaitValue64(stream, addr, value, CU_STREAM_WAIT_VALUE_GEQ)``: later work on the
  stream waits until the flag reaches ``value`` -- on the device, no host round trip;
  ``CU_STREAM_WAIT_VALUE_EQ``: until it equals ``value``.  Used only on host words this process
  can write (the caller's joins): a peer's flag is waited for by the gate kernel instead;
* ``cuModuleLoadData`` / ``cuModuleGetFunction`` / ``cuLaunchKernel``: the gate kernel's PTX
  (:mod:`ultracomm.transports.copy_engine.gate`), JIT-compiled once per context.

Addresses may be device memory (windows, peers' windows) or pinned host memory (``cudaHostAlloc``:
with unified addressing its host pointer is its device pointer): the watchdog's words.

Each call binds the symbol cuda.h binds (:data:`SIGNATURES`: ``cuStreamWaitValue64_v2`` and
co. on CUDA 12+), else the original where an older driver lacks it.  Every thread that makes
these calls first makes the device's primary context current (:meth:`Driver.bind`).
"""

from __future__ import annotations

import ctypes
import functools
from typing import Optional

from ..errors import UltracommError
from .support import NotAvailableError

__all__ = [
    "Driver",
    "DriverError",
    "SIGNATURES",
    "driver",
    "driver_reason",
    "CU_STREAM_WAIT_VALUE_GEQ",
    "CU_STREAM_WAIT_VALUE_EQ",
]

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_NON_BLOCKING = 0x1
_CUDA_SUCCESS = 0

_U64, _PTR, _UINT, _INT = ctypes.c_uint64, ctypes.c_void_p, ctypes.c_uint, ctypes.c_int
# API name -> (the symbol cuda.h binds it to without per-thread default streams, argtypes), all
# returning CUresult.  Pinned, not guessed: libcuda also exports older versions under the plain
# names (cuStreamDestroy, cuStreamWaitValue64 are v1), and a "_v2" of an API whose header binds
# the plain name would be another function.  tests/cuda/test_gpu_paths_cpu.py checks this table
# against cuda.h's prototypes.
SIGNATURES: dict[str, tuple[str, list]] = {
    "cuMemcpyAsync": ("cuMemcpyAsync", [_U64, _U64, ctypes.c_size_t, _PTR]),
    "cuStreamWriteValue64": ("cuStreamWriteValue64_v2", [_PTR, _U64, _U64, _UINT]),
    "cuStreamWaitValue64": ("cuStreamWaitValue64_v2", [_PTR, _U64, _U64, _UINT]),
    "cuGetErrorString": ("cuGetErrorString", [_INT, ctypes.POINTER(ctypes.c_char_p)]),
    "cuStreamCreateWithPriority": ("cuStreamCreateWithPriority", [ctypes.POINTER(_PTR), _UINT, _INT]),
    "cuStreamDestroy": ("cuStreamDestroy_v2", [_PTR]),
    "cuInit": ("cuInit", [_UINT]),
    "cuDeviceGet": ("cuDeviceGet", [ctypes.POINTER(_INT), _INT]),
    "cuDevicePrimaryCtxRetain": ("cuDevicePrimaryCtxRetain", [ctypes.POINTER(_PTR), _INT]),
    "cuCtxGetCurrent": ("cuCtxGetCurrent", [ctypes.POINTER(_PTR)]),
    "cuCtxSetCurrent": ("cuCtxSetCurrent", [_PTR]),
    "cuModuleLoadData": ("cuModuleLoadData", [ctypes.POINTER(_PTR), _PTR]),
    "cuModuleGetFunction": ("cuModuleGetFunction", [ctypes.POINTER(_PTR), _PTR, ctypes.c_char_p]),
    "cuLaunchKernel": (
        "cuLaunchKernel",
        [_PTR, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _UINT, _PTR, ctypes.POINTER(_PTR), ctypes.POINTER(_PTR)],
    ),
}


class DriverError(UltracommError):
    """A driver call returned an error code (an :class:`~ultracomm.errors.UltracommError`, so a
    ``RuntimeError``, as ``_cuda.CudaError`` is)."""


class Driver:
    """``libcuda.so.1``'s copy, stream-write and stream-wait entry points."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        self.symbols: dict[str, str] = {}  # API name -> the symbol bound
        self._memcpy = self._fn("cuMemcpyAsync")
        self._write = self._fn("cuStreamWriteValue64")
        self._wait = self._fn("cuStreamWaitValue64")
        self._err = self._fn("cuGetErrorString")
        self._create = self._fn("cuStreamCreateWithPriority")
        self._destroy = self._fn("cuStreamDestroy")
        self._init = self._fn("cuInit")
        self._device_get = self._fn("cuDeviceGet")
        self._retain = self._fn("cuDevicePrimaryCtxRetain")
        self._get_ctx = self._fn("cuCtxGetCurrent")
        self._set_ctx = self._fn("cuCtxSetCurrent")
        self._load_data = self._fn("cuModuleLoadData")
        self._get_function = self._fn("cuModuleGetFunction")
        self._launch = self._fn("cuLaunchKernel")
        self._functions: dict[tuple[int, str], int] = {}  # (context, kernel) -> CUfunction
        self._primary: dict[int, int] = {}  # device ordinal -> its primary context (retained once)

    def _fn(self, name: str):
        symbol, argtypes = SIGNATURES[name]
        # the header's symbol; the plain name only where a driver predates it (same arguments)
        for sym in dict.fromkeys((symbol, name)):
            f = getattr(self.lib, sym, None)
            if f is not None:
                f.argtypes, f.restype = argtypes, ctypes.c_int
                self.symbols[name] = sym
                return f
        raise NotAvailableError(f"ultracomm: transport 'copy_engine' is not available: the driver has no {symbol}")

    def _check(self, rc: int, what: str) -> None:
        if rc != _CUDA_SUCCESS:
            s = ctypes.c_char_p()
            self._err(rc, ctypes.byref(s))
            raise DriverError(f"ultracomm: {what} failed: CUDA driver error {rc} ({(s.value or b'?').decode()})")

    def bind(self, device: int) -> None:
        """Make ``device``'s primary context (the one torch's runtime uses) current on this thread.
        Driver calls need a current context, and a thread gets one only from its first runtime
        call that needs it (torch skips ``cudaSetDevice`` when the device already matches): a
        watchdog thread or a rank's thread may have made none yet."""
        ctx = self._primary.get(device)
        if ctx is None:
            dev, c = ctypes.c_int(), ctypes.c_void_p()
            self._check(self._init(0), "cuInit")  # done by torch's runtime already; idempotent
            self._check(self._device_get(ctypes.byref(dev), int(device)), "cuDeviceGet")
            self._check(self._retain(ctypes.byref(c), dev), "cuDevicePrimaryCtxRetain")
            ctx = self._primary.setdefault(device, int(c.value or 0))
        cur = ctypes.c_void_p()
        self._check(self._get_ctx(ctypes.byref(cur)), "cuCtxGetCurrent")
        if int(cur.value or 0) != ctx:
            self._check(self._set_ctx(ctx), "cuCtxSetCurrent")

    def stream_create(self, priority: int = 0) -> int:
        """A new non-blocking stream of the current context (its own, not one of torch's pooled
        streams, so no other code's work shares it); ``priority``: lower is higher."""
        s = ctypes.c_void_p()
        self._check(self._create(ctypes.byref(s), CU_STREAM_NON_BLOCKING, priority), "cuStreamCreateWithPriority")
        return int(s.value or 0)

    def stream_destroy(self, stream: int) -> None:
        """Release ``stream`` (work still queued on it completes first, as cuStreamDestroy says)."""
        self._check(self._destroy(stream), "cuStreamDestroy")

    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None:
        self._check(self._memcpy(dst, src, nbytes, stream), "cuMemcpyAsync")

    def write_value(self, stream: int, addr: int, value: int) -> None:
        self._check(self._write(stream, addr, value, 0), "cuStreamWriteValue64")

    def function(self, ptx: str, name: str) -> int:
        """Kernel ``name`` of ``ptx``, JIT-compiled once per current context (the gate kernel)."""
        cur = ctypes.c_void_p()
        self._check(self._get_ctx(ctypes.byref(cur)), "cuCtxGetCurrent")
        key = (int(cur.value or 0), name)
        f = self._functions.get(key)
        if f is None:
            mod, fn = ctypes.c_void_p(), ctypes.c_void_p()
            self._check(self._load_data(ctypes.byref(mod), ptx.encode() + b"\0"), "cuModuleLoadData")
            self._check(self._get_function(ctypes.byref(fn), mod, name.encode()), f"cuModuleGetFunction({name})")
            f = self._functions[key] = int(fn.value or 0)
        return f

    def launch(self, function: int, threads: int, stream: int, args: list) -> None:
        """One CTA of ``threads`` threads of ``function`` on ``stream``; ``args``: ctypes values."""
        params = (ctypes.c_void_p * len(args))(*[ctypes.cast(ctypes.byref(a), ctypes.c_void_p) for a in args])
        self._check(self._launch(function, 1, 1, 1, threads, 1, 1, 0, stream, params, None), "cuLaunchKernel")

    def wait_value(self, stream: int, addr: int, value: int, equal: bool = False) -> None:
        """Later work on ``stream`` waits until ``*addr >= value`` (``equal``: ``== value``)."""
        mode = CU_STREAM_WAIT_VALUE_EQ if equal else CU_STREAM_WAIT_VALUE_GEQ
        self._check(self._wait(stream, addr, value, mode), "cuStreamWaitValue64")


@functools.lru_cache(maxsize=1)
def _load() -> tuple[Optional[Driver], Optional[str]]:
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return None, f"the CUDA driver library libcuda.so.1 does not load ({e}): no NVIDIA driver on this machine"
    try:
        return Driver(lib), None
    except NotAvailableError as e:
        return None, str(e)


def driver_reason() -> Optional[str]:
    """Why the driver calls are not available here, or ``None``."""
    return _load()[1]


def driver() -> Driver:
    """The loaded driver, or :class:`NotAvailableError` saying why not."""
    drv, why = _load()
    if drv is None:
        raise NotAvailableError(f"ultracomm: transport 'copy_engine' is not available: {why}")
    return drv
