"""Transports: how a schedule's tasks are executed on this rank.

Every transport runs the same schedule with the same protocol (``include/ultracomm/task.h``);
they differ only in how a chunk moves and how a flag is read and written.

=========  ====================================================  =========================
name       executor                                              status
=========  ====================================================  =========================
host       C++ worker threads over host windows (the reference)  built everywhere
tma        persistent CUDA kernel, TMA bulk copies                arrives with the CUDA plane
copy_engine  cudaMemcpyAsync on side streams                     arrives with the CUDA plane
nccl       torch.distributed P2P                                  arrives with the CUDA plane
=========  ====================================================  =========================
"""
from __future__ import annotations

from .host import HostTransport

TRANSPORTS = {"host": HostTransport}


def resolve_transport(name: str) -> type:
    """Map a transport name (``auto`` picks the best built one) to its class."""
    if name == "auto":
        name = "host"
    try:
        return TRANSPORTS[name]
    except KeyError:
        raise ValueError(
            f"ultracomm: transport {name!r} is not available in this build; "
            f"built transports: {sorted(TRANSPORTS)} (set ULTRACOMM_TRANSPORT or transport=...)"
        ) from None


__all__ = ["HostTransport", "TRANSPORTS", "resolve_transport"]
