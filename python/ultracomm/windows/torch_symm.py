"""``torch_symm`` windows: ``torch.distributed._symmetric_memory`` (``empty`` + ``rendezvous``).

torch allocates the window as symmetric memory and maps every peer's buffer into this
process; ``handle.buffer_ptrs[r]`` is rank ``r``'s buffer as addressed from here.  The
window tensor may sit at an offset inside its symmetric block; that offset is the same on
every rank (symmetric allocation), so ``peer_bases[r] = buffer_ptrs[r] + offset``.

torch's backend decides the mechanism (CUDA IPC within a host; fabric handles across a
multi-node NVLink domain where the driver has them), which is why ``window="auto"``
prefers this provider on process groups when torch has it.
"""

from __future__ import annotations

import importlib
import socket
import warnings
from typing import Any

import torch

from ..comm import Comm
from ..cuda.fabric import device_uuid
from ..cuda.support import resolve_device, torch_cuda_reason
from .base import Window
from .gpu_common import check_usable, zero_and_barrier
from ..errors import InputError, UltracommError


def _symm_module():
    """``torch.distributed._symmetric_memory`` with the two calls we use, or ``None``."""
    try:
        mod = importlib.import_module("torch.distributed._symmetric_memory")
    except ImportError:
        return None
    return mod if hasattr(mod, "empty") and hasattr(mod, "rendezvous") else None


def _group_of(comm: Comm) -> Any:
    import torch.distributed as dist

    return comm.group if getattr(comm, "group", None) is not None else dist.group.WORLD


class TorchSymmWindow(Window):
    provider = "torch_symm"
    device_type = "cuda"

    def __init__(self, rank: int, world: int, local: torch.Tensor, handle: Any, peer_bases: list[int], offset: int):
        self.rank, self.world, self.nbytes = rank, world, local.numel()
        self.local = local
        self._handle = handle  # owns the peer mappings
        self.peer_bases = peer_bases
        self._offset = offset  # of the window in its symmetric buffer (bytes, the same on every rank)

    @staticmethod
    def unavailable_reason(comm: Comm) -> str | None:
        if comm.kind != "torch":
            return "torch_symm needs a torch.distributed process group; for a LoopbackGroup use cuda_local"
        if _symm_module() is None:
            return (
                f"torch {torch.__version__} has no torch.distributed._symmetric_memory.empty/rendezvous "
                "(torch >= 2.5 has them); use window='cuda_ipc'"
            )
        return torch_cuda_reason()

    @classmethod
    def create(cls, comm: Comm, nbytes: int, op: str = "window setup", device: Any = None) -> "TorchSymmWindow":
        check_usable(cls, comm)
        symm = _symm_module()
        dev = resolve_device(device)
        group = _group_of(comm)
        name = group.group_name
        # torch < 2.7 needs symmetric memory switched on per group; later versions deprecate the call
        enabled = getattr(symm, "is_symm_mem_enabled_for_group", None)
        if enabled is not None and hasattr(symm, "enable_symm_mem_for_group") and not enabled(name):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore", category=FutureWarning)
                warnings.simplefilter("ignore", category=DeprecationWarning)
                symm.enable_symm_mem_for_group(name)
        # torch's rendezvous refuses two ranks on one device ("allocations from overlapping devices"):
        # say so, with the ranks and the provider that works there, before anything is allocated
        where = comm.agree(lambda: (socket.gethostname(), device_uuid(dev)), op=op, what="torch_symm devices")
        for r, w in enumerate(where):
            q = where.index(w)
            if q != r:
                raise InputError(
                    f"ultracomm: window 'torch_symm' needs one GPU per rank, but ranks {q} and {r} use "
                    f"the same GPU ({dev} on {w[0]}); use window='cuda_ipc' for ranks that share a GPU"
                )
        mine: dict[str, Any] = {}

        def allocate() -> None:  # everywhere first: a rank that cannot must not leave peers in rendezvous
            mine["local"] = symm.empty(nbytes, dtype=torch.uint8, device=dev)

        comm.agree(allocate, op=op, what="torch_symm window allocation")
        local = mine["local"]
        handle = symm.rendezvous(local, name)  # collective (torch's own)

        def mapped() -> int:
            ptrs = [int(p) for p in handle.buffer_ptrs]
            offset = local.data_ptr() - ptrs[comm.rank] if len(ptrs) == comm.world else -1
            if offset < 0:
                raise UltracommError(
                    f"rendezvous returned {len(ptrs)} buffers (world {comm.world}) with this rank's "
                    f"tensor at offset {offset}"
                )
            mine["ptrs"] = ptrs
            return offset

        # symmetric allocation puts the tensor at the same offset everywhere; check, do not assume
        offsets = comm.agree(mapped, op=op, what="torch_symm rendezvous")
        if len(set(offsets)) != 1:
            raise UltracommError(f"ultracomm: torch_symm tensors sit at different offsets of their buffers {offsets}")
        offset = offsets[comm.rank]
        zero_and_barrier(comm, local, op)
        return cls(comm.rank, comm.world, local, handle, [p + offset for p in mine["ptrs"]], offset)

    def peer_view(self, r: int) -> torch.Tensor:
        """Rank ``r``'s window as a uint8 tensor on this device (tests, debugging)."""
        if r == self.rank:
            return self.local
        return self._handle.get_buffer(r, (self.nbytes,), torch.uint8, self._offset)

    def close(self) -> None:
        self.peer_bases = []
        self._handle = None
