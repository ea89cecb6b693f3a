"""Hardware costs beyond the links: defaults with their sources, SM budgets, and hardware profiles.

No GPU run of this project exists yet, so every default below is an *assumption* derived
from a published figure (cited in :data:`SOURCES`) or a plain estimate (said so).
``perf/bench_gpu.py`` measures what one GPU can tell and writes a hardware profile
(:mod:`ultracomm.cuda.hwprofile`, schema ``ultracomm.hwprofile/1``); :func:`apply_profile` puts
its values into a :class:`~ultracomm.sim.fabric.Fabric` (``python -m ultracomm.sim
--profile FILE``; without ``--profile`` the CLI and the report use
:func:`ultracomm.cuda.hwprofile.find_profile`: ``ULTRACOMM_HW_PROFILE``, else the newest
``perf/gpu/*profile*.json``, else these defaults).

==================  =========  ==========================================  =====================
Fabric field        default    what                                        hwprofile field
==================  =========  ==========================================  =====================
sm_copy_bw          25 GB/s    payload one SM copies to a peer             per_sm_copy_bw
sm_reduce_bw        22.5 GB/s  source bytes one SM adds into fp32          per_sm_reduce_bw
hbm_bw              preset     HBM copy, read + write counted              2 x d2d_copy_bw
chunk_overhead_s    0.5 us     flag / sync cost per chunk                  chunk_overhead_s
intra_latency_s     2 us       one NVLink hop                              (not on one GPU)
inter_latency_s     5 us       one RDMA hop                                (not on one GPU)
launch_s            4 us       kernel launch floor                         launch_s
sms                 preset     SMs per GPU (132 H100/H200, 148 B200)       sm_count
multicast_sms       auto       ultracomm's SM default, see below           (per_sm_copy_bw)
reduce_sms          auto       ultracomm's SM default, see below           (per_sm_reduce_bw)
host_build_s        30 us      one rank's schedule build                   --
d2h_latency_s       10 us      plan / split sizes to the host              --
h2d_latency_s       10 us      task lists to the device                    --
h2d_bw              25 GB/s    host-to-device copy                         --
==================  =========  ==========================================  =====================

SM budgets.  The presets charge what ultracomm's GPU executor runs with when
``ULTRACOMM_MULTICAST_SMS`` / ``ULTRACOMM_REDUCE_SMS`` are ``auto``:
:func:`ultracomm.cuda.sm_budget.choose_sms` with the fabric's own link bandwidth (as a user sets
``ULTRACOMM_INTRA_BW`` for the builder), i.e. ``clamp(ceil(intra_bw / per-CTA rate), 1,
min(32, SMs))`` with the profile's per-CTA rates on NVLink when one is applied, else ultracomm's
measured per-CTA fallback (multicast 34.5 GB/s, reduce 14.6 GB/s): 11 / 26 SMs on NVLink4,
22 / 32 on NVLink5.  The simulated throughput of those SMs
uses ``sm_copy_bw`` / ``sm_reduce_bw`` (above), not the floor.
"""

from __future__ import annotations

from typing import Optional, Union

#: Where each default comes from (Fabric field -> source); the report prints this table.
SOURCES: dict[str, str] = {
    "sm_copy_bw": "DeepEP's intranode kernels move 337 GB/s with their default 20 SMs on H20 and the maintainers "
    "answer 'use more SMs' for more (deepseek-ai/DeepEP#16): >= 17 GB/s per SM with per-token work; "
    "~40 SMs saturate an H100 PCIe's ~2 TB/s HBM (zejia-lin/BulletServe#1): ~50 GB/s read+write, "
    "25 GB/s payload per SM. Assumed, not measured here.",
    "sm_reduce_bw": "0.9 x sm_copy_bw: a bulk reduce-store ran at ~90% of a bulk store on H200 "
    "(microsoft/mscclpp#853). Assumed.",
    "hbm_bw": "H200 device-to-device copy through PyTorch, 4.3 TB/s read+write (FACTS.md); H100 3.0 and B200 7.2 "
    "TB/s assumed from the vendor peaks.",
    "chunk_overhead_s": "Estimate: a release/acquire flag round and a bulk-store drain per chunk.",
    "intra_latency_s": "Estimate: one NVLink hop, data and flag visible at the receiver.",
    "inter_latency_s": "Estimate: one RDMA hop.",
    "launch_s": "Estimate: a kernel launch floor.",
    "intra_bw": "NVLink4 370 GB/s achieved (NCCL's model 20.6 GB/s x 18; p2p copies 371-380 GB/s, FACTS.md); "
    "NVLink5 740 GB/s = 900 x 370/450, assumed.",
    "sms": "Vendor: 132 SMs per H100 / H200 SXM, 148 per B200.",
    "multicast_sms": "ultracomm's auto SM default (ultracomm.cuda.sm_budget) for this fabric's link bandwidth.",
    "reduce_sms": "ultracomm's auto SM default (ultracomm.cuda.sm_budget) for this fabric's link bandwidth.",
    "host_build_s": "One rank's schedule build at world 64 measured 11-27 us on a 2-core CI VM "
    "(perf/bench_schedule.py; a host CPU figure).",
    "d2h_latency_s": "Estimate: one small device-to-host copy and its synchronisation.",
    "h2d_latency_s": "Estimate: one small host-to-device copy.",
    "h2d_bw": "Estimate: PCIe Gen5 x16 host-to-device.",
}

# Defaults (the table above); the Fabric and the presets take them from here.
SM_COPY_BW = 25e9
SM_REDUCE_BW = 0.9 * SM_COPY_BW
HOP_LATENCY_S = 2e-6
RDMA_HOP_LATENCY_S = 5e-6
CHUNK_OVERHEAD_S = 0.5e-6
LAUNCH_S = 4e-6
A2A_STARTUP_S = 10e-6  # estimate: NCCL all_to_all_single launch + setup
A2A_PER_PEER_S = 0.3e-6  # estimate: one send/recv pair posted per peer
HOST_BUILD_S = 30e-6
D2H_LATENCY_S = 10e-6
H2D_LATENCY_S = 10e-6
H2D_BW = 25e9


def auto_budgets(intra_bw: float, sms: int, profile=None) -> dict[str, int]:
    """``{"multicast_sms", "reduce_sms"}``: ultracomm's auto SM default for a rank whose link
    moves ``intra_bw`` bytes/s on a GPU with ``sms`` SMs (:func:`ultracomm.cuda.sm_budget.choose_sms`,
    with ``profile``'s per-SM rates when given)."""
    from ..cuda.sm_budget import choose_sms

    return {f"{k}_sms": choose_sms(k, 0, intra_bw, sms or None, profile).sms for k in ("multicast", "reduce")}


def apply_profile(fabric, profile: Union[str, "object"], budgets: bool = True):
    """``fabric`` with what a hardware profile measured (a path, or an
    :class:`ultracomm.cuda.hwprofile.HwProfile`): HBM copy rate, launch floor, per-chunk overhead,
    per-SM copy and reduce rates, SM count; with ``budgets`` the SM budgets are recomputed by
    ultracomm's auto rule from the profile's per-SM rates.  The profile's hop cost is HBM to
    HBM on one GPU, so the link latencies stay as they were."""
    from ..cuda.hwprofile import load_profile

    prof = load_profile(profile) if isinstance(profile, str) else profile
    over = dict(prof.fabric_overrides())
    if prof.per_sm_copy_bw:
        over["sm_copy_bw"] = prof.per_sm_copy_bw
    if prof.per_sm_reduce_bw:
        over["sm_reduce_bw"] = prof.per_sm_reduce_bw
    over["sms"] = prof.sm_count
    over["profile"] = f"{prof.device}, {prof.date}" + (f" ({prof.path})" if prof.path else "")
    fab = fabric.replace(**over)
    return fab.replace(**auto_budgets(fab.intra_bw, fab.sms, prof)) if budgets else fab


def default_profile(path: Optional[str] = None):
    """The hardware profile the CLI and the report use: ``path``, else ``ULTRACOMM_HW_PROFILE``,
    else the newest ``perf/gpu/*profile*.json`` (:func:`ultracomm.cuda.hwprofile.find_profile`);
    None when there is none (then the defaults above stand)."""
    from ..env import Config
    from ..cuda.hwprofile import find_profile

    return find_profile(path=path or Config.from_env().hw_profile or None)
