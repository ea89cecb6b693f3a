"""Symmetric-memory windows: every rank's buffers addressable by its peers.

A window is one byte range per rank, of the same size and layout on every rank
(``WindowLayout`` in ``include/ultracomm/window_layout.h``).  Executors see only a pointer
table: ``peer_bases[r]`` is rank ``r``'s window as addressed from this process.

Providers:

===========  ==========================================================  ============
name         how                                                         device
===========  ==========================================================  ============
host_shm     POSIX shared memory, names exchanged over the group          CPU
local        buffers of one process (loopback domains: ranks as threads)  CPU
===========  ==========================================================  ============

GPU providers (cuda_ipc, torch_symm, nvshmem) arrive with the CUDA data plane.
"""
from __future__ import annotations

from ..comm import Comm
from .base import Window
from .host_shm import HostShmWindow
from .local import LocalWindow

PROVIDERS = {"host_shm": HostShmWindow, "local": LocalWindow}


def resolve_provider(provider: str, comm: Comm) -> str:
    """``auto`` -> ``local`` for loopback groups, ``host_shm`` for process groups; checks the name."""
    if provider == "auto":
        provider = "local" if comm.kind == "loopback" else "host_shm"
    if provider not in PROVIDERS:
        raise ValueError(
            f"ultracomm: window provider {provider!r} is not available in this build; "
            f"choose one of {sorted(PROVIDERS)} (ULTRACOMM_WINDOW or window=...)"
        )
    return provider


def open_window(provider: str, comm: Comm, nbytes: int, op: str = "window setup") -> Window:
    """Collectively create a window of ``nbytes`` per rank with ``provider`` (or ``auto``);
    bounded by ``comm.timeout_s``.  ``op`` names the caller's operation in errors."""
    return PROVIDERS[resolve_provider(provider, comm)].create(comm, nbytes, op=op)


__all__ = ["Window", "HostShmWindow", "LocalWindow", "open_window", "resolve_provider", "PROVIDERS"]
