"""How many SMs (CTAs) the GPU executor uses per operation: the env value, or a budget from per-CTA rates.

The formula is documented in ``ultracomm/env.py`` ("SM defaults"); this module computes it.  The
link a rank drives during multicast (its egress) or reduction (its ingress) moves ``intra_bw``
bytes/s at best, so more CTAs than ``intra_bw / per_cta_rate`` only take SMs from the GEMMs the
operation overlaps with; fewer leave the link idle.  ``per_cta_rate`` is what ONE CTA of the
operation moves on the link the operation uses (:data:`LINKS`), measured, never an all-SM rate
spread over the SMs (a copy with every SM runs at 15.8 GB/s per SM on an H200 because HBM is the
bottleneck there, not because one SM is that slow: perf/gpu/README.md, review 2026-12-06 1.4).

Where the rate comes from, first match:

1. the hardware profile's ``per_cta_bw[link][kind]`` (a per-CTA rate ``perf/bench_gpu.py``
   measured on that link);
2. for ``link == "local"`` only, the profile's one-CTA HBM->HBM figures: ``per_sm_copy_bw``
   (multicast) and ``per_sm_reduce_bw`` (reduce; an output rate, times
   :data:`REDUCE_TRAFFIC_PER_OUTPUT` to count traffic like the fallback does);
3. :data:`FALLBACK_PER_CTA_BW`: per-CTA rates measured by the committed H200 runs (sources in
   :data:`FALLBACK_SOURCES`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .hwprofile import HwProfile, find_profile
from ..errors import InputError

__all__ = [
    "LINKS",
    "KINDS",
    "FALLBACK_PER_CTA_BW",
    "FALLBACK_SOURCES",
    "REDUCE_TRAFFIC_PER_OUTPUT",
    "MAX_DEFAULT_SMS",
    "SmChoice",
    "default_sms",
    "per_cta_rate",
    "choose_sms",
    "choices_for_device",
]

#: The links an operation's bytes cross: ``nvlink`` (a peer GPU's memory: multicast egress and
#: reduce ingress between GPUs, what ``ULTRACOMM_INTRA_BW`` describes) and ``local`` (this GPU's
#: HBM: a loopback window).
LINKS = ("nvlink", "local")
KINDS = ("multicast", "reduce")

#: Fallback bytes/s ONE CTA moves, measured (one H200, HBM -> HBM: no per-CTA rate over NVLink has
#: been measured yet, perf/gpu/README.md "Nothing here measured NVLink"; a profile's
#: ``per_cta_bw["nvlink"]`` replaces these).
#:
#: * multicast 34.5e9: the tile mover's copy with 16 CTAs, 552.2 GB/s of payload / 16 (the
#:   per-CTA rate is flat from 1 to 32 CTAs: 39.1 GB/s at 1, 29.2 at 32).
#: * reduce 14.6e9: the reduce kernel, k=2 fp32 64 MiB at 23 CTAs in 802 us, 268 MB of traffic
#:   (``bench_gpu.py`` counts 4 bytes per output byte at k=2) / 802 us / 23.  Traffic, not output:
#:   the sources a reducing CTA reads are the bytes its ingress link carries.
FALLBACK_PER_CTA_BW = {"multicast": 34.5e9, "reduce": 14.6e9}
FALLBACK_SOURCES = {
    "multicast": "perf/gpu/2026-12-04_nvidia-h200_run2/bench_gpu.json sweep '16 CTAs' tile mover: "
    "552.2e9 B/s payload / 16 CTAs, H200 HBM->HBM",
    "reduce": "perf/gpu/2026-12-04_nvidia-h200_run1/bench_gpu.json reduce 'k=2 fp32' tile mover: "
    "268435456 B traffic / 802 us / 23 CTAs, H200 HBM->HBM",
}
#: Traffic bytes ``perf/bench_gpu.py`` counts per output byte of a k=2 reduction (its ``traffic_bytes``).
REDUCE_TRAFFIC_PER_OUTPUT = 4
#: The default never takes more than this many SMs (the bench's SM sweep goes to 32).
MAX_DEFAULT_SMS = 32


@dataclass(frozen=True)
class SmChoice:
    """The SM count of one operation kind and why (``source`` is what the debug log prints)."""

    sms: int
    source: str


def default_sms(link_bw: float, per_cta_bw: float, device_sms: Optional[int] = None) -> int:
    """``clamp(ceil(link_bw / per_cta_bw), 1, min(MAX_DEFAULT_SMS, device_sms))``."""
    if not (link_bw > 0 and per_cta_bw > 0):
        raise InputError(f"ultracomm: link_bw and per_cta_bw must be > 0, got {link_bw!r}, {per_cta_bw!r}")
    cap = MAX_DEFAULT_SMS if device_sms is None else max(1, min(MAX_DEFAULT_SMS, int(device_sms)))
    return max(1, min(cap, math.ceil(link_bw / per_cta_bw)))


def _check(kind: str, link: str) -> None:
    if kind not in KINDS:
        raise InputError(f"ultracomm: kind must be 'multicast' or 'reduce', got {kind!r}")
    if link not in LINKS:
        raise InputError(f"ultracomm: link must be one of {LINKS}, got {link!r}")


def per_cta_rate(kind: str, link: str = "nvlink", profile: Optional[HwProfile] = None) -> tuple[float, str]:
    """``(bytes/s one CTA of kind moves on link, where that figure comes from)`` (module docstring order)."""
    _check(kind, link)
    if profile is not None:
        where = f"from {profile.path or 'profile'} ({profile.device}, {profile.date})"
        rate = profile.per_cta_bw.get(link, {}).get(kind)
        if rate:
            return rate, f"per_cta_bw[{link}][{kind}]={rate:.4g} B/s {where}"
        if link == "local" and kind == "multicast" and profile.per_sm_copy_bw:
            return profile.per_sm_copy_bw, f"per_sm_copy_bw={profile.per_sm_copy_bw:.4g} B/s {where}"
        if link == "local" and kind == "reduce" and profile.per_sm_reduce_bw:
            rate = profile.per_sm_reduce_bw * REDUCE_TRAFFIC_PER_OUTPUT
            return rate, (
                f"per_sm_reduce_bw={profile.per_sm_reduce_bw:.4g} B/s x {REDUCE_TRAFFIC_PER_OUTPUT} (traffic) {where}"
            )
    rate = FALLBACK_PER_CTA_BW[kind]
    return rate, (
        f"measured per-CTA fallback {rate:.4g} B/s ({FALLBACK_SOURCES[kind]}; no profile figure for {kind} on {link})"
    )


def choose_sms(
    kind: str,
    configured: int,
    link_bw: float,
    device_sms: Optional[int] = None,
    profile: Optional[HwProfile] = None,
    link: str = "nvlink",
) -> SmChoice:
    """SMs for ``kind`` (``multicast`` or ``reduce``): ``configured`` when > 0 (the env value or a
    per-Context override), else :func:`default_sms` with :func:`per_cta_rate` of ``kind`` on ``link``."""
    _check(kind, link)
    env = "ULTRACOMM_MULTICAST_SMS" if kind == "multicast" else "ULTRACOMM_REDUCE_SMS"
    if configured > 0:
        return SmChoice(configured, f"{env}={configured}")
    rate, where = per_cta_rate(kind, link, profile)
    sms = default_sms(link_bw, rate, device_sms)
    cap = MAX_DEFAULT_SMS if device_sms is None else min(MAX_DEFAULT_SMS, device_sms)
    return SmChoice(sms, f"auto: ceil({link} bw {link_bw:.4g} / {where}) clamped to [1, {cap}]")


def choices_for_device(
    multicast_sms: int,
    reduce_sms: int,
    link_bw: float,
    device_sms: Optional[int],
    device_name: Optional[str],
    profile_path: str = "",
    link: str = "nvlink",
) -> tuple[SmChoice, SmChoice]:
    """Both choices for one device; the profile is looked up only when a value is ``auto``: the
    file ``profile_path`` names, else the newest profile of ``device_name`` (none without a device)."""
    profile = None
    if (multicast_sms <= 0 or reduce_sms <= 0) and (profile_path or device_name):
        profile = find_profile(device=device_name, path=profile_path or None)
    return (
        choose_sms("multicast", multicast_sms, link_bw, device_sms, profile, link),
        choose_sms("reduce", reduce_sms, link_bw, device_sms, profile, link),
    )
