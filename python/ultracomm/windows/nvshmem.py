"""``nvshmem`` windows: the window on NVSHMEM's symmetric heap (``nvshmem4py``, optional extra
``ultracomm[nvshmem]`` = ``nvshmem4py-cu13``, imported as ``nvshmem.core``).

The provider for multi-node NVLink domains (NVL72-class) where CUDA IPC handles do not reach:
NVSHMEM maps every PE's symmetric heap that the fabric can reach, and ``peer_bases[r]`` is
``nvshmem_ptr`` of rank ``r``'s window (``nvshmem.core.get_peer_tensor``).  A peer the fabric
cannot reach by load/store (``nvshmem_ptr`` is NULL, e.g. across an RDMA link) fails window
setup, naming the rank: such ranks need ``transport="p2p"``.

Bootstrap: rank 0 creates NVSHMEM's unique id, the Context's process group carries it to every
rank (a bounded ``comm.agree``), then every rank calls ``nvshmem.core.init(..., uid=...,
initializer_method="uid")`` with its group rank as PE.  NVSHMEM is process-wide: the first
window initialises it, later windows on the same group reuse it (another group raises).

Lifetime: NVSHMEM frees symmetric memory and finalises collectively, so ``close()`` (which must
stay collective-free) only drops this rank's views; :func:`finalize` -- called by every rank,
after every Context over nvshmem windows is closed -- frees the heap allocations and finalises
NVSHMEM.  A process that exits without it leaves the cleanup to NVSHMEM's own teardown.

Where nvshmem4py is not installed, or the machine has no GPU, the provider is "not available"
with the reason (:class:`~ultracomm.cuda.support.NotAvailableError`), never an ImportError.
"""

from __future__ import annotations

import importlib
import threading
from types import ModuleType
from typing import Any, Optional

import numpy as np
import torch

from ..comm import Comm
from ..cuda.support import NotAvailableError, resolve_device, torch_cuda_reason
from .base import Window
from .gpu_common import zero_and_barrier
from ..errors import InputError

__all__ = ["NvshmemWindow", "nvshmem_module", "nvshmem_reason", "finalize"]

_LOCK = threading.Lock()
_STATE: dict[str, Any] = {"group": None, "tensors": []}  # (world, rank) NVSHMEM was initialised for


def nvshmem_module() -> tuple[Optional[ModuleType], Optional[str]]:
    """``(nvshmem.core, None)``, or ``(None, why it does not import)``."""
    try:
        return importlib.import_module("nvshmem.core"), None
    except Exception as e:  # noqa: BLE001 - ImportError, or a missing shared library underneath
        return None, (
            f"nvshmem4py does not import ({type(e).__name__}: {e}); install the optional extra "
            "ultracomm[nvshmem] (pip install nvshmem4py-cu13)"
        )


def nvshmem_reason(comm: Optional[Comm] = None) -> Optional[str]:
    """Why the nvshmem window cannot work here (``None`` when it can be tried)."""
    if comm is not None and comm.kind != "torch":
        return (
            "nvshmem needs a torch.distributed process group (one process per GPU); for a LoopbackGroup use cuda_local"
        )
    reasons = [r for r in (nvshmem_module()[1], torch_cuda_reason()) if r]
    return "; ".join(reasons) or None


def _uid_bytes(nv: ModuleType) -> bytes:
    return nv.get_unique_id(empty=False)._data.view(np.int8).tobytes()


def _uid_from(nv: ModuleType, data: bytes) -> Any:
    uid = nv.get_unique_id(empty=True)
    uid._data.view(np.int8)[:] = np.frombuffer(data, dtype=np.int8)
    return uid


def _init(nv: ModuleType, comm: Comm, dev: torch.device, op: str) -> None:
    """Initialise NVSHMEM for ``comm`` once per process (PE = group rank)."""
    with _LOCK:
        if _STATE["group"] is not None:
            if _STATE["group"] != (comm.world, comm.rank):
                raise NotAvailableError(
                    f"ultracomm: window 'nvshmem' is not available: NVSHMEM is already initialised in this process for "
                    f"a group of {_STATE['group'][0]} ranks (as PE {_STATE['group'][1]}); every Context over nvshmem "
                    "windows must use that group (call ultracomm.windows.nvshmem.finalize() first to switch)"
                )
            return
    uid = comm.agree(lambda: _uid_bytes(nv) if comm.rank == 0 else None, op=op, what="nvshmem unique id")[0]
    try:  # cuda-core comes with nvshmem4py; older releases keep Device under .experimental
        from cuda.core import Device
    except ImportError:
        from cuda.core.experimental import Device

    comm.agree(
        lambda: nv.init(
            device=Device(dev.index),
            uid=_uid_from(nv, uid),
            rank=comm.rank,
            nranks=comm.world,
            initializer_method="uid",
        ),
        op=op,
        what="nvshmem init",
    )
    with _LOCK:
        _STATE["group"] = (comm.world, comm.rank)


class NvshmemWindow(Window):
    provider = "nvshmem"
    device_type = "cuda"

    def __init__(self, rank: int, world: int, local: torch.Tensor, peer_bases: list[int]):
        self.rank, self.world, self.nbytes = rank, world, local.numel()
        self.local = local
        self.peer_bases = peer_bases

    @staticmethod
    def unavailable_reason(comm: Comm) -> str | None:
        return nvshmem_reason(comm)

    @classmethod
    def create(cls, comm: Comm, nbytes: int, op: str = "window setup", device: Any = None) -> "NvshmemWindow":
        why = nvshmem_reason(comm)
        if why:
            raise NotAvailableError(f"ultracomm: window 'nvshmem' is not available: {why}")
        nv = nvshmem_module()[0]
        dev = resolve_device(device)
        torch.cuda.set_device(dev)
        _init(nv, comm, dev, op)
        local = nv.tensor((nbytes,), dtype=torch.uint8)  # collective: the symmetric heap

        def peers() -> list[int]:
            bases = []
            for r in range(comm.world):
                t = local if r == comm.rank else nv.get_peer_tensor(local, r)
                if t is None or t.data_ptr() == 0:
                    raise InputError(
                        f"ultracomm: rank {comm.rank} cannot reach rank {r}'s nvshmem window by load/store "
                        "(nvshmem_ptr is NULL: not in this NVLink domain); use transport='p2p' for ranks "
                        "across domains"
                    )
                bases.append(t.data_ptr())
            return bases

        try:
            bases = comm.agree(peers, op=op, what="nvshmem peer pointers")[comm.rank]
        except BaseException:
            with _LOCK:
                _STATE["tensors"].append(local)  # freed by finalize(): nvshmem_free is collective
            raise
        with _LOCK:
            _STATE["tensors"].append(local)
        zero_and_barrier(comm, local, op)
        return cls(comm.rank, comm.world, local, bases)

    def close(self) -> None:
        # collective-free: the heap allocation stays until finalize()
        self.peer_bases = []


def finalize() -> None:
    """Free every nvshmem window's symmetric memory and finalise NVSHMEM (collective: every
    rank of the group, after closing every Context over nvshmem windows).  A no-op when NVSHMEM
    was never initialised here."""
    with _LOCK:
        if _STATE["group"] is None:
            return
        tensors, _STATE["tensors"] = _STATE["tensors"], []
        _STATE["group"] = None
    nv = nvshmem_module()[0]
    for t in tensors:
        nv.free_tensor(t)
    nv.finalize()
