"""Transports: how a schedule's tasks are executed on this rank.

Every transport runs the same schedule with the same protocol (``include/ultracomm/task.h``);
they differ only in how a chunk moves and how a flag is read and written.

===========  ========================================================  ==========================
name         executor                                                  status
===========  ========================================================  ==========================
host         C++ worker threads over host windows (the reference)      built everywhere
tma          persistent CUDA kernel, TMA bulk copies (stream-ordered)  needs _cuda and a GPU
p2p          torch.distributed point-to-point (gloo on CPU, NCCL on GPU)  built everywhere
copy_engine  cudaMemcpyAsync on side streams                           arrives with the CUDA plane
===========  ========================================================  ==========================

A transport class has ``name``, ``window_providers`` (the windows it can run over) and
``stream_ordered`` (``True``: ``run(..., stream=)`` only enqueues work on a CUDA stream and
failures are collected by ``check_error()``; absent/``False``: ``run`` blocks until done).
``tma`` is imported when first asked for, so ultracomm imports without ``_cuda`` or a GPU.
"""
from __future__ import annotations

import importlib

from ..cuda_support import NotAvailableError, require
from .host import HostTransport
from .p2p import P2PTransport

TRANSPORTS: dict[str, type] = {"host": HostTransport, "p2p": P2PTransport}
GPU_TRANSPORTS = ("tma",)  # transports whose windows and masters live on a CUDA device


def _load_tma() -> type:
    require("transport 'tma'")
    try:
        return importlib.import_module(".tma", __name__).TmaTransport
    except (ImportError, AttributeError) as e:
        raise NotAvailableError(f"ultracomm: transport 'tma' is not available: its Python side "
                                f"(ultracomm.transports.tma.TmaTransport) does not load: {e}") from e


def resolve_transport(name: str, device_type: str = "cpu") -> type:
    """Map a transport name to its class; ``auto`` picks ``tma`` for a CUDA Context
    (``device_type="cuda"``) and ``host`` for a CPU one.  A GPU transport this machine cannot
    run raises :class:`~ultracomm.cuda_support.NotAvailableError` naming what is missing."""
    if name == "auto":
        name = "tma" if device_type == "cuda" else "host"
    if name in TRANSPORTS:
        return TRANSPORTS[name]
    if name == "tma":
        TRANSPORTS["tma"] = _load_tma()
        return TRANSPORTS["tma"]
    raise ValueError(
        f"ultracomm: transport {name!r} is not available in this build; "
        f"transports: {sorted({*TRANSPORTS, *GPU_TRANSPORTS})} (set ULTRACOMM_TRANSPORT or transport=...)"
    )


__all__ = ["HostTransport", "P2PTransport", "TRANSPORTS", "GPU_TRANSPORTS", "resolve_transport"]
