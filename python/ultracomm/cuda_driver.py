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
  ``CU_STREAM_WAIT_VALUE_EQ``: until it equals ``value`` (the plan-digest check).

Addresses may be device memory (windows, peers' windows) or pinned host memory (``cudaHostAlloc``:
with unified addressing its host pointer is its device pointer): the watchdog's words.

The ``_v2`` entry points are used where the driver has them (CUDA 12+), else the originals.
"""
from __future__ import annotations

import ctypes
import functools
from typing import Optional

from .cuda_support import NotAvailableError

__all__ = ["Driver", "driver", "driver_reason", "CU_STREAM_WAIT_VALUE_GEQ", "CU_STREAM_WAIT_VALUE_EQ"]

CU_STREAM_WAIT_VALUE_GEQ = 0x0
CU_STREAM_WAIT_VALUE_EQ = 0x1
CU_STREAM_NON_BLOCKING = 0x1
_CUDA_SUCCESS = 0


class DriverError(RuntimeError):
    """A driver call returned an error code."""


class Driver:
    """``libcuda.so.1``'s copy, stream-write and stream-wait entry points."""

    def __init__(self, lib: ctypes.CDLL):
        self.lib = lib
        u64, ptr = ctypes.c_uint64, ctypes.c_void_p
        self._memcpy = self._fn("cuMemcpyAsync", [u64, u64, ctypes.c_size_t, ptr])
        self._write = self._fn("cuStreamWriteValue64", [ptr, u64, u64, ctypes.c_uint])
        self._wait = self._fn("cuStreamWaitValue64", [ptr, u64, u64, ctypes.c_uint])
        self._err = self._fn("cuGetErrorString", [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)])
        self._create = self._fn("cuStreamCreateWithPriority", [ctypes.POINTER(ptr), ctypes.c_uint, ctypes.c_int])
        self._destroy = self._fn("cuStreamDestroy", [ptr])

    def _fn(self, name: str, argtypes: list):
        for sym in (f"{name}_v2", name):
            f = getattr(self.lib, sym, None)
            if f is not None:
                f.argtypes, f.restype = argtypes, ctypes.c_int
                return f
        raise NotAvailableError(f"ultracomm: transport 'copy_engine' is not available: the driver has no {name}")

    def _check(self, rc: int, what: str) -> None:
        if rc != _CUDA_SUCCESS:
            s = ctypes.c_char_p()
            self._err(rc, ctypes.byref(s))
            raise DriverError(f"ultracomm: {what} failed: CUDA driver error {rc} ({(s.value or b'?').decode()})")

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
