"""Multi-node NVLink fabric membership of a GPU (NVL72-class racks), read from NVML.

GPUs on different hosts that sit in one NVLink fabric (a GB200 NVL72 rack, for instance) can
address each other's memory, so for a CUDA Context they form one memory domain.  NVML reports
the fabric a GPU registered with: ``nvmlDeviceGetGpuFabricInfoV`` fills
``nvmlGpuFabricInfo_v2_t`` (``version``, ``clusterUuid[16]``, ``status``, ``cliqueId``,
``state``, ``healthMask``); GPUs with the same cluster UUID and clique id share the fabric once
``state`` is ``NVML_GPU_FABRIC_STATE_COMPLETED`` (3) and ``status`` is ``NVML_SUCCESS``.

:func:`gpu_fabric_info` asks nvidia-ml-py (``pynvml``) when it imports, else ``libnvidia-ml.so.1``
through ctypes, else reports nothing (no NVML, no driver, a GPU without fabric support: every
failure is "no fabric info", never an error).  Nothing here ran on an NVL72 system: the key logic
is tested with injected fabric records only.
"""

from __future__ import annotations

import ctypes
import dataclasses
import logging
from typing import Any, Callable, Optional

log = logging.getLogger("ultracomm")

__all__ = ["FabricInfo", "FABRIC_STATE_COMPLETED", "gpu_fabric_info", "fabric_key"]

FABRIC_STATE_COMPLETED = 3  # NVML_GPU_FABRIC_STATE_COMPLETED
_UUID_LEN = 16  # NVML_GPU_FABRIC_UUID_LEN
_NVML_SUCCESS = 0


@dataclasses.dataclass(frozen=True)
class FabricInfo:
    """One GPU's fabric registration: ``cluster_uuid`` (16 bytes as 32 hex digits), ``clique_id``,
    ``state`` (NVML_GPU_FABRIC_STATE_*: 0 not supported, 1 not started, 2 in progress, 3 completed)
    and ``status`` (an nvmlReturn_t, meaningful once completed)."""

    cluster_uuid: str
    clique_id: int
    state: int
    status: int = _NVML_SUCCESS

    @property
    def registered(self) -> bool:
        """Registration completed without error, with a nonzero cluster UUID."""
        return (
            self.state == FABRIC_STATE_COMPLETED and self.status == _NVML_SUCCESS and self.cluster_uuid.strip("0") != ""
        )


class _FabricInfoV2(ctypes.Structure):
    """``nvmlGpuFabricInfo_v2_t`` (nvml.h; nvmlGpuFabricState_t is an unsigned char)."""

    _fields_ = [
        ("version", ctypes.c_uint),
        ("clusterUuid", ctypes.c_uint8 * _UUID_LEN),
        ("status", ctypes.c_int),
        ("cliqueId", ctypes.c_uint32),
        ("state", ctypes.c_uint8),
        ("healthMask", ctypes.c_uint32),
    ]


#: nvmlGpuFabricInfo_v2 = NVML_STRUCT_VERSION(GpuFabricInfo, 2): the struct size | 2 << 24
FABRIC_INFO_V2_VERSION = ctypes.sizeof(_FabricInfoV2) | (2 << 24)


def _from_struct(s: Any) -> FabricInfo:
    return FabricInfo(bytes(s.clusterUuid).hex(), int(s.cliqueId), int(s.state), int(s.status))


def _via_pynvml(uuid: str) -> Optional[FabricInfo]:
    import pynvml  # nvidia-ml-py

    pynvml.nvmlInit()
    try:
        handle = pynvml.nvmlDeviceGetHandleByUUID(uuid)
        info = pynvml.c_nvmlGpuFabricInfoV_t()  # sets version = nvmlGpuFabricInfo_v2
        pynvml.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info))
        return _from_struct(info)
    finally:
        pynvml.nvmlShutdown()


def _via_ctypes(uuid: str) -> Optional[FabricInfo]:
    lib = ctypes.CDLL("libnvidia-ml.so.1")
    if lib.nvmlInit_v2() != _NVML_SUCCESS:
        return None
    try:
        handle = ctypes.c_void_p()
        if lib.nvmlDeviceGetHandleByUUID(uuid.encode(), ctypes.byref(handle)) != _NVML_SUCCESS:
            return None
        info = _FabricInfoV2(version=FABRIC_INFO_V2_VERSION)
        if lib.nvmlDeviceGetGpuFabricInfoV(handle, ctypes.byref(info)) != _NVML_SUCCESS:
            return None
        return _from_struct(info)
    finally:
        lib.nvmlShutdown()


def device_uuid(device: Any) -> str:
    """``device``'s UUID as nvidia-smi prints it (``GPU-...`` / ``MIG-...``): one GPU's identity
    across processes."""
    import torch

    uuid = str(torch.cuda.get_device_properties(device).uuid)
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def gpu_fabric_info(device: Any) -> Optional[FabricInfo]:
    """The NVLink fabric registration of CUDA ``device`` (an index or ``torch.device``), or ``None``
    when NVML is missing, the GPU has no fabric, or anything fails (logged at debug level)."""
    try:
        uuid = device_uuid(device)
    except Exception as e:  # noqa: BLE001 - no GPU, no CUDA torch: no fabric info
        log.debug("ultracomm: no fabric info for %s: %s", device, e)
        return None
    for how in (_via_pynvml, _via_ctypes):
        try:
            return how(uuid)
        except Exception as e:  # noqa: BLE001 - ImportError, OSError, NVMLError: try the next way
            log.debug("ultracomm: fabric info of %s via %s failed: %s", uuid, how.__name__, e)
    return None


def fabric_key(info: Optional[FabricInfo]) -> Optional[str]:
    """``nvlink:<cluster uuid>/<clique id>`` for a completed registration, else ``None``."""
    if info is None or not info.registered:
        return None
    return f"nvlink:{info.cluster_uuid}/{info.clique_id}"


FabricQuery = Callable[[Any], Optional[FabricInfo]]
