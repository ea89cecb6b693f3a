"""How many SMs (CTAs) the GPU executor uses per operation: the env value, or the analytic default.

The formula and the source of its constant are documented in ``ultracomm/env.py`` ("SM
defaults"); this module computes it.  The link a rank drives during multicast (its egress)
or reduction (its ingress) moves ``intra_bw`` bytes/s at best, so more CTAs than
``intra_bw / per_sm_rate`` only take SMs from the GEMMs the operation overlaps with.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

from .hwprofile import HwProfile, find_profile

__all__ = ["ANALYTIC_PER_SM_BW", "MAX_DEFAULT_SMS", "SmChoice", "default_sms", "choose_sms"]

#: Payload bytes/s one SM sustains when all SMs copy: 4.3e12 B/s (H200 D2D copy through PyTorch,
#: read + write counted; FACTS.md) / 2 (payload) / 132 (H200 SMs).  A floor of one SM's rate.
ANALYTIC_PER_SM_BW = 4.3e12 / 2 / 132
#: The default never takes more than this many SMs (the bench's SM sweep goes to 32).
MAX_DEFAULT_SMS = 32


@dataclass(frozen=True)
class SmChoice:
    """The SM count of one operation kind and why (``source`` is what the debug log prints)."""

    sms: int
    source: str


def default_sms(link_bw: float, per_sm_bw: float, device_sms: Optional[int] = None) -> int:
    """``clamp(ceil(link_bw / per_sm_bw), 1, min(MAX_DEFAULT_SMS, device_sms))``."""
    if not (link_bw > 0 and per_sm_bw > 0):
        raise ValueError(f"ultracomm: link_bw and per_sm_bw must be > 0, got {link_bw!r}, {per_sm_bw!r}")
    cap = MAX_DEFAULT_SMS if device_sms is None else max(1, min(MAX_DEFAULT_SMS, int(device_sms)))
    return max(1, min(cap, math.ceil(link_bw / per_sm_bw)))


def choose_sms(kind: str, configured: int, link_bw: float, device_sms: Optional[int] = None,
               profile: Optional[HwProfile] = None) -> SmChoice:
    """SMs for ``kind`` (``multicast`` or ``reduce``): ``configured`` when > 0 (the env value or a
    per-Context override), else :func:`default_sms` with the profile's per-SM rate for ``kind``
    when the profile has one, else :data:`ANALYTIC_PER_SM_BW`."""
    if kind not in ("multicast", "reduce"):
        raise ValueError(f"ultracomm: kind must be 'multicast' or 'reduce', got {kind!r}")
    env = "ULTRACOMM_MULTICAST_SMS" if kind == "multicast" else "ULTRACOMM_REDUCE_SMS"
    if configured > 0:
        return SmChoice(configured, f"{env}={configured}")
    field = "per_sm_copy_bw" if kind == "multicast" else "per_sm_reduce_bw"
    rate = getattr(profile, field) if profile is not None else None
    if rate:
        where = f"{field}={rate:.4g} B/s from {profile.path or 'profile'} ({profile.device}, {profile.date})"
    else:
        rate = ANALYTIC_PER_SM_BW
        where = f"analytic per-SM floor {rate:.4g} B/s (H200 D2D 4.3e12 / 2 / 132; no profile {field})"
    sms = default_sms(link_bw, rate, device_sms)
    cap = MAX_DEFAULT_SMS if device_sms is None else min(MAX_DEFAULT_SMS, device_sms)
    return SmChoice(sms, f"auto: ceil(intra_bw {link_bw:.4g} / {where}) clamped to [1, {cap}]")


def choices_for_device(multicast_sms: int, reduce_sms: int, link_bw: float, device_sms: Optional[int],
                       device_name: Optional[str], profile_path: str = "") -> tuple[SmChoice, SmChoice]:
    """Both choices for one device; the profile is looked up only when a value is ``auto``: the
    file ``profile_path`` names, else the newest profile of ``device_name`` (none without a device)."""
    profile = None
    if (multicast_sms <= 0 or reduce_sms <= 0) and (profile_path or device_name):
        profile = find_profile(device=device_name, path=profile_path or None)
    return (choose_sms("multicast", multicast_sms, link_bw, device_sms, profile),
            choose_sms("reduce", reduce_sms, link_bw, device_sms, profile))
