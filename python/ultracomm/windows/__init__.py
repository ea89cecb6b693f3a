"""Symmetric-memory windows: every rank's buffers addressable by its peers.

A window is one byte range per rank, of the same size and layout on every rank
(``WindowLayout`` in ``include/ultracomm/records/window_layout.h``).  Executors see only a pointer
table: ``peer_bases[r]`` is rank ``r``'s window as addressed from this process.

Providers:

===========  ==========================================================  ============
name         how                                                         device
===========  ==========================================================  ============
host_shm     POSIX shared memory, names exchanged over the group          CPU
local        buffers of one process (loopback domains: ranks as threads)  CPU
torch_symm   torch.distributed._symmetric_memory empty + rendezvous       CUDA
cuda_ipc     device allocation + CUDA IPC handles over the group          CUDA (one host)
cuda_local   loopback domain on one GPU (ranks as threads)                CUDA
private      this rank's pool only, no peer mapping (the p2p transport)   CPU or CUDA
nvshmem      NVSHMEM symmetric heap, nvshmem_ptr peers (nvshmem4py)       CUDA (NVLink domain)
===========  ==========================================================  ============

``auto`` picks, for a CPU Context: ``local`` (loopback) or ``host_shm``; for a CUDA Context:
``cuda_local`` (loopback), else ``torch_symm`` when torch has it, else ``cuda_ipc``
(restricted to what the transport accepts; a transport that accepts only ``private``, such as
``p2p``, gets it on either device).  GPU providers zero the window and pass a
barrier before returning.  ``nvshmem`` (optional extra ``ultracomm[nvshmem]``) is named
explicitly or taken by ``auto`` only when the others are not available here.
"""

from __future__ import annotations

import logging
from typing import Any, Sequence

from ..comm import Comm
from ..cuda.support import NotAvailableError
from .base import Window
from .cuda_ipc import CudaIpcWindow
from .cuda_local import CudaLocalWindow
from .host_shm import HostShmWindow
from .local import LocalWindow
from .nvshmem import NvshmemWindow
from .private import PrivateWindow
from .torch_symm import TorchSymmWindow
from ..errors import InputError

log = logging.getLogger("ultracomm")

PROVIDERS = {
    "host_shm": HostShmWindow,
    "local": LocalWindow,
    "torch_symm": TorchSymmWindow,
    "cuda_ipc": CudaIpcWindow,
    "cuda_local": CudaLocalWindow,
    "private": PrivateWindow,
    "nvshmem": NvshmemWindow,
}
CPU_PROVIDERS = ("local", "host_shm")
GPU_PROVIDERS = ("cuda_local", "torch_symm", "cuda_ipc", "nvshmem")  # auto's order of preference


def device_type_of(provider: str) -> str:
    """``"cpu"``, ``"cuda"`` or ``"any"`` (``private``: where the Context's device says): where
    ``provider``'s windows live."""
    return getattr(PROVIDERS[provider], "device_type", "cpu")


def _auto(comm: Comm, device_type: str, allowed: Sequence[str] | None) -> str:
    if allowed is not None and tuple(allowed) == ("private",):
        return "private"
    if device_type == "cpu":
        return "local" if comm.kind == "loopback" else "host_shm"
    reasons = []
    for name in GPU_PROVIDERS:
        if allowed is not None and name not in allowed:
            reasons.append(f"{name}: not accepted by the transport")
            continue
        why = PROVIDERS[name].unavailable_reason(comm)
        if why is None:
            return name
        reasons.append(f"{name}: {why}")
    raise NotAvailableError("ultracomm: no GPU window is available here: " + "; ".join(reasons))


def resolve_provider(provider: str, comm: Comm, device_type: str = "cpu", allowed: Sequence[str] | None = None) -> str:
    """``auto`` -> the best provider for ``device_type`` (``cpu``/``cuda``) among ``allowed``
    (the transport's providers; ``None``: any); other names are checked and returned."""
    if provider == "auto":
        chosen = _auto(comm, device_type, allowed)
        log.info("ultracomm: rank %d: window auto -> %s", comm.rank, chosen)
        return chosen
    if provider not in PROVIDERS:
        raise InputError(
            f"ultracomm: window provider {provider!r} is not available in this build; "
            f"choose one of {sorted(PROVIDERS)} (ULTRACOMM_WINDOW or window=...)"
        )
    return provider


def open_window(
    provider: str,
    comm: Comm,
    nbytes: int,
    op: str = "window setup",
    device: Any = None,
    reach: Sequence[bool] | None = None,
) -> Window:
    """Collectively create a window of ``nbytes`` per rank with ``provider`` (or ``auto``);
    bounded by ``comm.timeout_s``.  ``op`` names the caller's operation in errors.  ``device``:
    the CUDA device of a GPU provider (``None``: the current one); CPU providers take none.
    ``reach`` (``host_shm``, ``cuda_ipc``): map only the ranks marked ``True`` (this rank's memory
    domain); ignored by providers whose ranks all share one process (``local``, ``cuda_local``)."""
    name = resolve_provider(provider, comm, "cuda" if device is not None else "cpu")
    if reach is not None and name in ("host_shm", "cuda_ipc"):
        kw = {"device": device} if name == "cuda_ipc" else {}
        return PROVIDERS[name].create(comm, nbytes, op=op, reach=list(reach), **kw)
    if device_type_of(name) in ("cuda", "any"):
        return PROVIDERS[name].create(comm, nbytes, op=op, device=device)
    return PROVIDERS[name].create(comm, nbytes, op=op)


__all__ = [
    "Window",
    "HostShmWindow",
    "LocalWindow",
    "CudaIpcWindow",
    "CudaLocalWindow",
    "TorchSymmWindow",
    "PrivateWindow",
    "NvshmemWindow",
    "open_window",
    "resolve_provider",
    "device_type_of",
    "PROVIDERS",
    "CPU_PROVIDERS",
    "GPU_PROVIDERS",
]
