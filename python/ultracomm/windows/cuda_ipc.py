"""``cuda_ipc`` windows: one device allocation per rank, CUDA IPC handles exchanged over the group.

Each rank allocates its window with torch's CUDA allocator and exports it with the same
machinery ``torch.multiprocessing`` uses for CUDA tensors (``UntypedStorage._share_cuda_``:
the allocation's IPC handle, the window's offset in it, torch's cross-process reference
counter).  Peers open the handle **on their own device** (``_new_shared_cuda`` with the
local device index: ``cudaIpcOpenMemHandle`` with lazy peer access in this rank's context,
as NCCL and DeepEP do), so a kernel on this rank's GPU can dereference every
``peer_bases[r]`` over NVLink.  torch's path also covers allocations from expandable
segments, which a raw ``cudaIpcGetMemHandle`` would not.

CUDA IPC works between processes of one host; ranks on several hosts (a multi-node NVLink
domain) need ``torch_symm``.  No new dependency: torch only.
"""

from __future__ import annotations

import socket
from typing import Any

import torch

from ..comm import Comm
from ..cuda.support import resolve_device, torch_cuda_reason
from .base import Window
from .gpu_common import check_usable, zero_and_barrier
from ..errors import InputError


def _export(local: torch.Tensor) -> dict:
    """What a peer needs to open ``local`` (picklable: bytes and ints)."""
    (_dev, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync) = (
        local.untyped_storage()._share_cuda_()
    )
    return dict(
        host=socket.gethostname(),
        handle=handle,
        storage_bytes=size,
        storage_offset=offset,
        ref_handle=ref_handle,
        ref_offset=ref_offset,
        event_handle=event_handle,
        event_sync=event_sync,
        tensor_offset=local.storage_offset(),
        nbytes=local.numel(),
    )


def _open(peer: dict, device: torch.device) -> torch.UntypedStorage:
    """Map a peer's exported window into this process, on ``device`` (this rank's GPU)."""
    return torch.UntypedStorage._new_shared_cuda(
        device.index,
        peer["handle"],
        peer["storage_bytes"],
        peer["storage_offset"],
        peer["ref_handle"],
        peer["ref_offset"],
        peer["event_handle"],
        peer["event_sync"],
    )


class CudaIpcWindow(Window):
    provider = "cuda_ipc"
    device_type = "cuda"

    def __init__(self, rank: int, world: int, local: torch.Tensor, peer_storages: list[Any], peer_bases: list[int]):
        self.rank, self.world, self.nbytes = rank, world, local.numel()
        self.local = local
        self._peer_storages = peer_storages  # keep the mappings open (closed when dropped)
        self.peer_bases = peer_bases

    @staticmethod
    def unavailable_reason(comm: Comm) -> str | None:
        if comm.kind != "torch":
            return (
                "cuda_ipc exchanges handles between processes of a torch.distributed group; "
                "for a LoopbackGroup use cuda_local"
            )
        return torch_cuda_reason()

    @classmethod
    def create(
        cls, comm: Comm, nbytes: int, op: str = "window setup", device: Any = None, reach: list[bool] | None = None
    ) -> "CudaIpcWindow":
        """``reach`` (the GPU ``split`` transport): open only the ranks marked ``True`` (this rank's
        memory domain, one host); the others get ``peer_bases[r] == 0``."""
        check_usable(cls, comm)
        dev = resolve_device(device)
        mine: dict[str, Any] = {}

        def allocate() -> dict:
            mine["local"] = torch.empty(nbytes, dtype=torch.uint8, device=dev)
            return _export(mine["local"])

        exports = comm.agree(allocate, op=op, what="cuda_ipc window allocation")
        local = mine["local"]
        hosts = sorted({e["host"] for r, e in enumerate(exports) if reach is None or reach[r]})
        if len(hosts) > 1:
            raise InputError(
                f"ultracomm: cuda_ipc needs every rank on one host, the group spans {hosts}; "
                "use window='torch_symm' for a multi-node NVLink domain"
            )

        def open_peers() -> None:
            storages: list[Any] = []
            bases: list[int] = []
            for r, e in enumerate(exports):
                if r == comm.rank:  # a process cannot open its own handle: use the tensor itself
                    storages.append(None)
                    bases.append(local.data_ptr())
                    continue
                if reach is not None and not reach[r]:  # another memory domain: never opened here
                    storages.append(None)
                    bases.append(0)
                    continue
                if e["nbytes"] != nbytes:
                    raise InputError(
                        f"rank {r}'s window has {e['nbytes']} bytes, this rank's {nbytes}: ranks disagree on the layout"
                    )
                s = _open(e, dev)
                storages.append(s)
                bases.append(s.data_ptr() + e["tensor_offset"])
            mine["storages"], mine["bases"] = storages, bases

        comm.agree(open_peers, op=op, what="cuda_ipc handle import")
        zero_and_barrier(comm, local, op)
        return cls(comm.rank, comm.world, local, mine["storages"], mine["bases"])

    def peer_view(self, r: int) -> torch.Tensor:
        """Rank ``r``'s window as a uint8 tensor on this device (tests, debugging)."""
        if r == self.rank:
            return self.local
        storage = self._peer_storages[r]
        flat = torch.empty(0, dtype=torch.uint8, device=self.local.device).set_(storage)
        off = self.peer_bases[r] - storage.data_ptr()
        return flat[off : off + self.nbytes]

    def close(self) -> None:
        self._peer_storages = []
        self.peer_bases = []
