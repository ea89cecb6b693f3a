"""Transports: how a schedule's tasks are executed on this rank.

Every transport runs the same schedule with the same protocol (``include/ultracomm/records/task.h``);
they differ only in how a chunk moves and how a flag is read and written.

===========  ========================================================  ==========================
name         executor                                                  status
===========  ========================================================  ==========================
host         C++ worker threads over host windows (the reference)      built everywhere
tma          persistent CUDA kernel, TMA bulk copies (stream-ordered)  needs _cuda and a GPU
p2p          torch.distributed point-to-point (gloo on CPU, NCCL on GPU)  built everywhere
split        CPU: host inside each memory domain, p2p (gloo) across      built everywhere
             CUDA: tma inside a domain, NCCL across (stream-ordered)   needs _cuda and a GPU
copy_engine  cuMemcpyAsync per destination stream + stream flag ops      needs a GPU (reduce: tma)
             (stream-ordered; host watchdog bounds its stream waits)
===========  ========================================================  ==========================

A transport class has ``name``, ``window_providers`` (the windows it can run over) and
``stream_ordered`` (``True``: ``run(..., stream=)`` only enqueues work on a CUDA stream and
failures are collected by ``check_error()``; absent/``False``: ``run`` blocks until done).
``tma``, ``copy_engine`` and the CUDA ``split`` are imported when first asked for, so
ultracomm imports without ``_cuda``, a driver or a GPU.  ``auto`` is decided with the ranks' memory domains by
:mod:`ultracomm.dataplane.domains`; :func:`resolve_transport` alone maps it by device.
"""

from __future__ import annotations

import importlib

from ..cuda.support import NotAvailableError, require
from .host import HostTransport
from .p2p import P2PTransport
from .split import SplitTransport
from ..errors import InputError

TRANSPORTS: dict[str, type] = {"host": HostTransport, "p2p": P2PTransport, "split": SplitTransport}
GPU_TRANSPORTS = ("tma", "copy_engine")  # transports whose windows and masters live on a CUDA device


def _load_tma() -> type:
    require("transport 'tma'")
    try:
        return importlib.import_module(".tma", __name__).TmaTransport
    except (ImportError, AttributeError) as e:
        raise NotAvailableError(
            f"ultracomm: transport 'tma' is not available: its Python side "
            f"(ultracomm.transports.tma.TmaTransport) does not load: {e}"
        ) from e


def _load_copy_engine() -> type:
    require("transport 'copy_engine'", need_module=False)
    from ..cuda.driver import driver

    driver()  # NotAvailableError: no libcuda
    return importlib.import_module(".copy_engine", __name__).CopyEngineTransport


def _load_split_cuda() -> type:
    require("transport 'split' on CUDA")
    from ..cuda.driver import driver

    driver()  # NotAvailableError: no libcuda
    return importlib.import_module(".split.cuda", __name__).SplitCudaTransport


def resolve_transport(name: str, device_type: str = "cpu") -> type:
    """Map a transport name to its class; ``auto`` picks ``tma`` for a CUDA Context
    (``device_type="cuda"``) and ``host`` for a CPU one; ``split`` is the CPU or the CUDA split
    by ``device_type``.  A GPU transport this machine cannot
    run raises :class:`~ultracomm.cuda.support.NotAvailableError` naming what is missing."""
    if name == "auto":
        name = "tma" if device_type == "cuda" else "host"
    if name == "split" and device_type == "cuda":  # the GPU split (transports/split/cuda.py), loaded when asked for
        return _load_split_cuda()
    if name in TRANSPORTS:
        return TRANSPORTS[name]
    if name == "tma":
        TRANSPORTS["tma"] = _load_tma()
        return TRANSPORTS["tma"]
    if name == "copy_engine":
        TRANSPORTS["copy_engine"] = _load_copy_engine()
        return TRANSPORTS["copy_engine"]
    raise InputError(
        f"ultracomm: transport {name!r} is not available in this build; "
        f"transports: {sorted({*TRANSPORTS, *GPU_TRANSPORTS})} (set ULTRACOMM_TRANSPORT or transport=...)"
    )


__all__ = ["HostTransport", "P2PTransport", "SplitTransport", "TRANSPORTS", "GPU_TRANSPORTS", "resolve_transport"]
