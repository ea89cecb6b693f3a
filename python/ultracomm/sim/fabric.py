"""The modelled scale-up domain: links, latencies, SM budgets and host-side costs, and presets.

Every number a :class:`Fabric` holds is an *assumption* with a source (below and in
:mod:`ultracomm.sim.hardware`); a hardware profile JSON measured by ``perf/bench_gpu.py``
replaces them (:func:`ultracomm.sim.hardware.apply_profile`).  Nothing here was measured on
a GPU in this project.
"""

from __future__ import annotations

import dataclasses
import math
import re
from dataclasses import dataclass
from typing import Optional

import numpy as np

from . import hardware as hw
from ..errors import InputError

GB = 1e9


@dataclass(frozen=True)
class Fabric:
    """A scale-up domain: per-GPU link bandwidths (bytes/s, each direction), latencies, the SM
    budget of the executor and host-side costs.

    Attributes:
        name: preset name.
        world: number of GPUs.
        gpus_per_node: GPUs per node (the NVLink domain size).
        intra_bw: achieved NVLink bandwidth per GPU per direction (egress = ingress).
        inter_bw: achieved RDMA bandwidth per GPU per direction (second tier; unused when
            every GPU is on one node).
        intra_bw_peak, inter_bw_peak: vendor peaks (documentation; not used by the model).
        intra_latency_s, inter_latency_s: per-hop latency (data + flag visible at the
            receiver after the last byte left).
        chunk_overhead_s: handling of one chunk (flag write/poll, next task issue).  Charged
            on the dependency path (a forwarded chunk becomes visible this much later) *and*
            on throughput: the SM that moved a chunk spends this long before its next one
            (see ``multicast_sms``).
        launch_s: start of an op (kernel launch / first task claim).
        hbm_bw: achieved device-to-device copy bandwidth, read + write bytes counted
            (all-to-all baseline's ``index_select`` and ``index_add_``).
        a2a_startup_s, a2a_per_peer_s: the all-to-all collective's startup: fixed + per
            peer (NCCL posts a send/recv pair per peer).
        node_of: node index of each GPU (tuple of ``world`` ints; default: ``gpus_per_node``
            consecutive GPUs per node).
        notes: where the preset's numbers come from.
        sms: SMs per GPU (documentation, and "all SMs" budgets such as UltraEP's weight_sync).
        multicast_sms, reduce_sms: SM budget of weight_sync / grad_reduce per rank (presets:
            ultracomm's auto default, :mod:`ultracomm.sim.hardware`); 0 = SM throughput not
            modelled (only links bound the op).  The all-to-all baseline is charged the same
            budget (its NCCL kernels move bytes with SMs too).
        sm_copy_bw: bytes one SM copies to a peer per second (payload).
        sm_reduce_bw: source bytes one SM accumulates into an fp32 partial per second.
        host_build_s: building this rank's task lists on the host (weight_sync only:
            restore and grad_reduce reuse the schedule).
        d2h_latency_s: bringing the plan (ultracomm) / the split sizes (all-to-all) to the
            host before the op can be issued.
        h2d_latency_s, h2d_bw: copying the task lists to the device (weight_sync only).
        profile: the hardware profile applied (device, date, file), "" for the defaults.
    """

    name: str
    world: int
    gpus_per_node: int
    intra_bw: float
    inter_bw: float
    intra_bw_peak: float
    inter_bw_peak: float
    intra_latency_s: float = hw.HOP_LATENCY_S
    inter_latency_s: float = hw.RDMA_HOP_LATENCY_S
    chunk_overhead_s: float = hw.CHUNK_OVERHEAD_S
    launch_s: float = hw.LAUNCH_S
    hbm_bw: float = 4.3e12
    a2a_startup_s: float = hw.A2A_STARTUP_S
    a2a_per_peer_s: float = hw.A2A_PER_PEER_S
    node_of: Optional[tuple] = None
    notes: str = ""
    sms: int = 0
    multicast_sms: int = 0
    reduce_sms: int = 0
    sm_copy_bw: float = hw.SM_COPY_BW
    sm_reduce_bw: float = hw.SM_REDUCE_BW
    host_build_s: float = 0.0
    d2h_latency_s: float = 0.0
    h2d_latency_s: float = 0.0
    h2d_bw: float = hw.H2D_BW
    profile: str = ""

    def __post_init__(self) -> None:
        if self.world < 1 or self.gpus_per_node < 1:
            raise InputError(f"Fabric {self.name!r}: world and gpus_per_node must be >= 1")
        for f in ("intra_bw", "inter_bw", "hbm_bw", "sm_copy_bw", "sm_reduce_bw", "h2d_bw"):
            v = getattr(self, f)
            if not (v > 0 and math.isfinite(v)):
                raise InputError(f"Fabric {self.name!r}: {f} must be positive, got {v!r}")
        for f in (
            "intra_latency_s",
            "inter_latency_s",
            "chunk_overhead_s",
            "launch_s",
            "a2a_startup_s",
            "a2a_per_peer_s",
            "host_build_s",
            "d2h_latency_s",
            "h2d_latency_s",
        ):
            v = getattr(self, f)
            if not (v >= 0 and math.isfinite(v)):
                raise InputError(f"Fabric {self.name!r}: {f} must be >= 0, got {v!r}")
        for f in ("sms", "multicast_sms", "reduce_sms"):
            v = getattr(self, f)
            if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < 0:
                raise InputError(f"Fabric {self.name!r}: {f} must be an int >= 0 (0: not modelled), got {v!r}")
        if self.node_of is None:
            nodes = tuple(int(r // self.gpus_per_node) for r in range(self.world))
        else:
            nodes = tuple(int(x) for x in self.node_of)
            if len(nodes) != self.world or min(nodes) < 0:
                raise InputError(f"Fabric {self.name!r}: node_of must have {self.world} entries >= 0")
        object.__setattr__(self, "node_of", nodes)

    @property
    def nodes(self) -> np.ndarray:
        """int32 ``[world]`` node of each rank."""
        return np.asarray(self.node_of, dtype=np.int32)

    @property
    def num_nodes(self) -> int:
        return len(set(self.node_of))

    @property
    def multi_node(self) -> bool:
        return self.num_nodes > 1

    def sm_pool_bw(self, op: str, chunk_bytes: Optional[float] = None) -> float:
        """Bytes/s one rank's SM budget moves for ``op`` (``"multicast"`` copies at
        ``sm_copy_bw``, ``"reduce"`` accumulates at ``sm_reduce_bw``); ``inf`` when the budget
        is 0 (not modelled).  With ``chunk_bytes`` each SM also spends ``chunk_overhead_s``
        per chunk: ``sms * chunk / (chunk / rate + overhead)``."""
        sms, rate = (self.multicast_sms, self.sm_copy_bw) if op == "multicast" else (self.reduce_sms, self.sm_reduce_bw)
        if sms <= 0:
            return math.inf
        if not chunk_bytes:
            return sms * rate
        c = float(chunk_bytes)
        return sms * c / (c / rate + self.chunk_overhead_s)

    def for_world(self, world: int) -> "Fabric":
        """The first ``world`` GPUs of this fabric (an EP group of that size).

        A world larger than the fabric is an error: an 8-GPU NVLink preset does not silently
        grow into several nodes (ask for ``"8x8-rdma"`` or ``"nvl72"`` instead)."""
        world = int(world)
        if world < 1:
            raise InputError(f"world must be >= 1, got {world}")
        if world > self.world:
            hint = ""
            if self.gpus_per_node == 8:
                hint = f"; for {world} GPUs use '{-(-world // 8)}x8-rdma' (nodes of 8 over RDMA)" + (
                    " or 'nvl72' (one NVLink domain)" if world <= 72 else ""
                )
            raise InputError(f"fabric {self.name!r} has {self.world} GPUs, cannot host EP {world}{hint}")
        if world == self.world:
            return self
        return dataclasses.replace(self, world=world, node_of=self.node_of[:world])

    def replace(self, **changes) -> "Fabric":
        """A validated copy with ``changes`` (field names of this class)."""
        return dataclasses.replace(self, **changes)

    def describe(self) -> str:
        tier = (
            f", {self.num_nodes} nodes x {self.gpus_per_node}, RDMA {self.inter_bw / GB:.0f} GB/s "
            f"(peak {self.inter_bw_peak / GB:.0f})"
            if self.multi_node
            else ""
        )
        sm = (
            f"; SM budget {self.multicast_sms} (weight_sync) / {self.reduce_sms} (grad_reduce) x "
            f"{self.sm_copy_bw / GB:g} / {self.sm_reduce_bw / GB:g} GB/s per SM"
            if self.multicast_sms or self.reduce_sms
            else "; SM throughput not modelled"
        )
        host = (
            f"; host: build {self.host_build_s * 1e6:g} us, D2H {self.d2h_latency_s * 1e6:g} us, "
            f"H2D {self.h2d_latency_s * 1e6:g} us + bytes / {self.h2d_bw / GB:g} GB/s"
            if self.host_build_s or self.d2h_latency_s or self.h2d_latency_s
            else ""
        )
        return (
            f"{self.name}: {self.world} GPUs, NVLink {self.intra_bw / GB:.0f} GB/s per direction "
            f"achieved (peak {self.intra_bw_peak / GB:.0f}){tier}; hop {self.intra_latency_s * 1e6:.1f} us"
            + (f" / {self.inter_latency_s * 1e6:.1f} us RDMA" if self.multi_node else "")
            + f", chunk overhead {self.chunk_overhead_s * 1e6:.1f} us, launch {self.launch_s * 1e6:.0f} us"
            + sm
            + host
            + (f"; hardware profile: {self.profile}" if self.profile else "; no hardware profile (assumed costs)")
        )


# Hopper NVLink4: 450 GB/s per direction peak; NCCL's own model and p2p copies achieve
# ~370 GB/s (20.6 GB/s x 18 links; 371-380 GB/s measured).  That ratio, 370/450 = 0.822,
# is assumed for NVLink5 too (no measured GB200 figure at hand): 900 -> 740 GB/s.
_HOPPER_EFF = 370.0 / 450.0
_NVL4 = 370 * GB
_NVL5 = 900 * GB * _HOPPER_EFF
_RDMA = 50 * GB  # 400 Gb/s per GPU (one ConnectX-7 per GPU), used at line rate

#: What every GPU preset charges beyond the links: the host-side costs of a GPU transport
#: (defaults and sources in :mod:`ultracomm.sim.hardware`); SM budgets come from ultracomm's
#: own auto rule for the preset's link (:func:`_gpu`).
GPU_COSTS = dict(host_build_s=hw.HOST_BUILD_S, d2h_latency_s=hw.D2H_LATENCY_S, h2d_latency_s=hw.H2D_LATENCY_S)


def _gpu(*args, sms: int, **kw) -> Fabric:
    """A GPU preset: host costs and ultracomm's auto SM budgets for its NVLink bandwidth."""
    return Fabric(*args, sms=sms, **GPU_COSTS, **hw.auto_budgets(args[3], sms), **kw)


FABRICS: dict[str, Fabric] = {
    "h100x8": _gpu(
        "h100x8",
        8,
        8,
        _NVL4,
        _RDMA,
        450 * GB,
        _RDMA,
        hbm_bw=3.0e12,
        sms=132,
        notes="8x H100 SXM, NVLink4 (NVSwitch); HBM3 3.35 TB/s peak, copy ~3.0 TB/s assumed",
    ),
    "h200x8": _gpu(
        "h200x8",
        8,
        8,
        _NVL4,
        _RDMA,
        450 * GB,
        _RDMA,
        hbm_bw=4.3e12,
        sms=132,
        notes="8x H200, NVLink4; D2D copy 4.3 TB/s measured (read+write)",
    ),
    "nvl72": _gpu(
        "nvl72",
        72,
        72,
        _NVL5,
        _RDMA,
        900 * GB,
        _RDMA,
        hbm_bw=7.2e12,
        sms=148,
        notes="GB200 NVL72: 72 GPUs in one NVLink5 domain, 900 GB/s peak per direction, "
        "740 GB/s assumed achieved (Hopper's 370/450); HBM3e 8 TB/s, copy 7.2 TB/s assumed; "
        "148 SMs per B200",
    ),
}


def _rdma_preset(n: int) -> Fabric:
    return _gpu(
        f"{n}x8-rdma",
        8 * n,
        8,
        _NVL4,
        _RDMA,
        450 * GB,
        _RDMA,
        hbm_bw=4.3e12,
        sms=132,
        notes=f"{n} nodes of 8x H100/H200 (NVLink4), 400 Gb/s RDMA per GPU between nodes",
    )


for _n in (2, 4):
    FABRICS[f"{_n}x8-rdma"] = _rdma_preset(_n)


def get_fabric(name: str, world: Optional[int] = None, profile=None) -> Fabric:
    """The preset ``name`` (``h100x8``, ``h200x8``, ``nvl72``, ``<n>x8-rdma``), cut to its first
    ``world`` GPUs when given (a larger world is a ValueError, see :meth:`Fabric.for_world`),
    with a hardware ``profile`` applied when given (:func:`ultracomm.sim.hardware.apply_profile`)."""
    key = str(name).strip().lower()
    if key in FABRICS:
        fab = FABRICS[key]
    else:
        m = re.fullmatch(r"(\d+)x8-rdma", key)
        if not m or int(m.group(1)) < 1:
            raise InputError(f"unknown fabric {name!r}; presets: {', '.join(FABRICS)} (or <n>x8-rdma)")
        fab = _rdma_preset(int(m.group(1)))
    if profile is not None:
        fab = hw.apply_profile(fab, profile)
    return fab if world is None else fab.for_world(world)
