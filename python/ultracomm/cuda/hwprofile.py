"""Hardware profiles: what ``perf/bench_gpu.py`` measured on one GPU, for the SM defaults and the simulator.

A profile is one JSON object (``perf/gpu/<date>_<device>_profile.json``); this module is
its schema, the only writer's validator and every reader's loader.

Schema ``ultracomm.hwprofile/1``.  "Payload" bytes are the bytes an operation delivers to
its output(s): a copy of ``n`` bytes has payload ``n`` (HBM traffic ``2n``: read + write), a
1->N fan-out ``N*n``, a reduction into an ``n``-byte output ``n``.  All rates are payload
bytes per second unless the name says otherwise; times are seconds.  ``null`` = not measured
(the ``_cuda`` build lacked that microkernel, or the section failed; the bench says which).

=====================  ========================  ==============================================
field                  type                      meaning
=====================  ========================  ==============================================
schema                 str                       ``"ultracomm.hwprofile/1"``
device                 str                       ``torch.cuda.get_device_name()``
compute_capability     str                       ``"9.0"``
sm_count               int                       SMs on the device
date                   str                       ISO 8601 UTC time of the run
torch, cuda            str                       versions the run used
source                 str                       what wrote it (``perf/bench_gpu.py``)
d2d_copy_bw            float                     ``cudaMemcpyAsync`` D2D payload rate, largest size
per_sm_copy_bw         float | null              tile mover payload rate with one CTA (HBM -> HBM)
per_sm_reduce_bw       float | null              reduce kernel output rate with one CTA (2 sources)
sm_sweep               [[int, float], ...]       (CTAs, tile mover payload rate), CTAs ascending
reduce_bw              float | null              ultracomm reduction output rate (k sources), largest size
torch_reduce_bw        float | null              ``torch.sum`` of the stacked sources, same sizes
flag_rtt_s             float | null              one release -> acquire round trip between two CTAs
launch_s               float | null              launch-to-completion floor of an empty kernel
relay_hop_s            [[int, float], ...]       (chunk bytes, per-hop cost of a relay chain), chunk ascending
chunk_overhead_s       float | null              intercept of ``relay_hop_s`` against chunk bytes (flag + handling)
hop_bw                 float | null              1 / slope of that fit: payload rate of one relay stage
per_cta_bw (optional)  {link: {kind: float}}     bytes/s ONE CTA of ``kind`` (``multicast``: payload,
                                                 ``reduce``: traffic) moves on ``link`` (``nvlink``: a
                                                 peer GPU's memory; ``local``: this GPU's HBM); absent = {}
=====================  ========================  ==============================================

``per_cta_bw`` is what :mod:`ultracomm.cuda.sm_budget` budgets SMs from (the link the
operation uses); it may be absent (older profiles).

The simulator takes :meth:`HwProfile.fabric_overrides` (``hbm_bw`` counts read + write
there, hence ``2 * d2d_copy_bw``).  Single-GPU figures say nothing about NVLink: a hop
here is HBM -> HBM, so ``chunk_overhead_s`` is the flag/handling part of a hop, not its
link latency.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import logging
import math
import os
from dataclasses import dataclass
from typing import Any, Optional

from ..errors import ConfigError

__all__ = ["SCHEMA", "HwProfile", "validate", "load_profile", "profile_paths", "find_profile", "DEFAULT_DIR"]

SCHEMA = "ultracomm.hwprofile/1"
log = logging.getLogger("ultracomm")


def _default_dir() -> str:
    """``perf/gpu`` of the source checkout this module runs from: the nearest ancestor holding
    ``perf/`` (``python/ultracomm`` in an editable install, ``build/inplace/ultracomm`` in the
    fallback build); in an installed wheel there is none and nothing is found there."""
    package = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))  # ultracomm/ (this file: cuda/)
    here = package
    for _ in range(4):
        here = os.path.dirname(here)
        if os.path.isdir(os.path.join(here, "perf")):
            return os.path.join(here, "perf", "gpu")
    return os.path.join(os.path.dirname(package), "perf", "gpu")


#: Where ``perf/bench_gpu.py``'s profiles are committed (``perf/gpu`` of the source checkout).
DEFAULT_DIR = _default_dir()

_STR = ("schema", "device", "compute_capability", "date", "torch", "cuda", "source")
_RATE = ("d2d_copy_bw",)
_OPT_RATE = ("per_sm_copy_bw", "per_sm_reduce_bw", "reduce_bw", "torch_reduce_bw", "hop_bw")
_OPT_TIME = ("flag_rtt_s", "launch_s", "chunk_overhead_s")
_PAIRS = ("sm_sweep", "relay_hop_s")


@dataclass(frozen=True)
class HwProfile:
    """One validated profile (fields as in the module's table; ``path``: the file it came from)."""

    schema: str
    device: str
    compute_capability: str
    sm_count: int
    date: str
    torch: str
    cuda: str
    source: str
    d2d_copy_bw: float
    per_sm_copy_bw: Optional[float]
    per_sm_reduce_bw: Optional[float]
    sm_sweep: tuple[tuple[int, float], ...]
    reduce_bw: Optional[float]
    torch_reduce_bw: Optional[float]
    flag_rtt_s: Optional[float]
    launch_s: Optional[float]
    relay_hop_s: tuple[tuple[int, float], ...]
    chunk_overhead_s: Optional[float]
    hop_bw: Optional[float]
    per_cta_bw: dict = dataclasses.field(default_factory=dict)  # {link: {kind: B/s}}
    path: str = ""

    def to_dict(self) -> dict[str, Any]:
        """The JSON object (without ``path``)."""
        d = dataclasses.asdict(self)
        d.pop("path")
        if not d["per_cta_bw"]:
            d.pop("per_cta_bw")  # optional: older readers' schema
        d["sm_sweep"] = [list(p) for p in self.sm_sweep]
        d["relay_hop_s"] = [list(p) for p in self.relay_hop_s]
        return d

    def fabric_overrides(self) -> dict[str, float]:
        """``ultracomm.sim.Fabric`` fields this profile measured (``hbm_bw`` counts read + write)."""
        out = {"hbm_bw": 2.0 * self.d2d_copy_bw}
        if self.launch_s is not None:
            out["launch_s"] = self.launch_s
        if self.chunk_overhead_s is not None:
            out["chunk_overhead_s"] = self.chunk_overhead_s
        return out


def _bad(where: str, field: str, why: str) -> ConfigError:
    return ConfigError(
        f"ultracomm: hardware profile {where}: field {field!r} {why} (schema {SCHEMA}; see ultracomm/cuda/hwprofile.py)"
    )


def _number(where: str, name: str, v: Any, optional: bool, allow_zero: bool = False) -> Optional[float]:
    if v is None and optional:
        return None
    if (
        isinstance(v, bool)
        or not isinstance(v, (int, float))
        or not math.isfinite(v)
        or v < 0
        or (v == 0 and not allow_zero)
    ):
        raise _bad(where, name, f"must be a finite number > 0{' or null' if optional else ''}, got {v!r}")
    return float(v)


def _pairs(where: str, name: str, v: Any) -> tuple[tuple[int, float], ...]:
    if not isinstance(v, list):
        raise _bad(where, name, f"must be a list of [int, number] pairs, got {type(v).__name__}")
    out = []
    for p in v:
        if not (
            isinstance(p, (list, tuple))
            and len(p) == 2
            and isinstance(p[0], int)
            and not isinstance(p[0], bool)
            and p[0] > 0
        ):
            raise _bad(where, name, f"must hold [positive int, number] pairs, got {p!r}")
        out.append((int(p[0]), _number(where, name, p[1], optional=False)))
    if [a for a, _ in out] != sorted({a for a, _ in out}):
        raise _bad(where, name, "must be sorted by its first element, without repeats")
    return tuple(out)


def validate(d: Any, where: str = "<dict>") -> HwProfile:
    """Check a profile object against the schema; :class:`~ultracomm.errors.ConfigError` (a
    ``ValueError``) names the bad field."""
    if not isinstance(d, dict):
        raise ConfigError(f"ultracomm: hardware profile {where} must be a JSON object, got {type(d).__name__}")
    if d.get("schema") != SCHEMA:
        raise _bad(where, "schema", f"must be {SCHEMA!r}, got {d.get('schema')!r}")
    known = {f.name for f in dataclasses.fields(HwProfile)} - {"path"}
    missing = sorted(known - set(d) - {"per_cta_bw"})
    if missing:
        raise _bad(where, missing[0], "is missing" + (f" (also {missing[1:]})" if len(missing) > 1 else ""))
    extra = sorted(set(d) - known)
    if extra:
        raise _bad(where, extra[0], "is not part of the schema")
    kw: dict[str, Any] = {}
    for f in _STR:
        if not isinstance(d[f], str) or not d[f]:
            raise _bad(where, f, f"must be a non-empty string, got {d[f]!r}")
        kw[f] = d[f]
    if isinstance(d["sm_count"], bool) or not isinstance(d["sm_count"], int) or d["sm_count"] < 1:
        raise _bad(where, "sm_count", f"must be an int >= 1, got {d['sm_count']!r}")
    kw["sm_count"] = d["sm_count"]
    for f in _RATE:
        kw[f] = _number(where, f, d[f], optional=False)
    for f in _OPT_RATE:
        kw[f] = _number(where, f, d[f], optional=True)
    for f in _OPT_TIME:
        kw[f] = _number(where, f, d[f], optional=True, allow_zero=True)
    for f in _PAIRS:
        kw[f] = _pairs(where, f, d[f])
    kw["per_cta_bw"] = _per_cta(where, d.get("per_cta_bw", {}))
    return HwProfile(**kw, path=where if where != "<dict>" else "")


#: ``per_cta_bw``'s keys (``ultracomm.cuda.sm_budget.LINKS`` / ``KINDS``)
_LINKS = ("nvlink", "local")
_KINDS = ("multicast", "reduce")


def _per_cta(where: str, v: Any) -> dict:
    if not isinstance(v, dict):
        raise _bad(where, "per_cta_bw", f"must be an object {{link: {{kind: rate}}}}, got {type(v).__name__}")
    out: dict = {}
    for link, rates in v.items():
        if link not in _LINKS:
            raise _bad(where, "per_cta_bw", f"has link {link!r}; links are {list(_LINKS)}")
        if not isinstance(rates, dict) or not set(rates) <= set(_KINDS):
            raise _bad(where, "per_cta_bw", f"[{link!r}] must map kinds {list(_KINDS)} to rates, got {rates!r}")
        out[link] = {k: _number(where, f"per_cta_bw[{link}][{k}]", r, optional=False) for k, r in rates.items()}
    return out


def load_profile(path: str) -> HwProfile:
    """Read and validate one profile file (errors name the file and the field)."""
    try:
        with open(path) as f:
            d = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ConfigError(f"ultracomm: cannot read hardware profile {path}: {e}") from e
    return validate(d, path)


def profile_paths(directory: Optional[str] = None) -> list[str]:
    """Profile files (``*profile*.json``) in ``directory`` (default :data:`DEFAULT_DIR`), sorted by name."""
    return sorted(glob.glob(os.path.join(directory or DEFAULT_DIR, "*profile*.json")))


def find_profile(
    device: Optional[str] = None, directory: Optional[str] = None, path: Optional[str] = None
) -> Optional[HwProfile]:
    """The profile to use: ``path`` when given (must be valid), else the newest (by ``date``) valid
    profile in ``directory`` whose ``device`` equals ``device`` (any device when ``None``), else
    ``None``.  Invalid files found by the search are skipped with a warning naming them."""
    if path:
        return load_profile(path)
    best: Optional[HwProfile] = None
    for p in profile_paths(directory):
        try:
            prof = load_profile(p)
        except ValueError as e:
            log.warning("%s; skipped", e)
            continue
        if device is not None and prof.device != device:
            continue
        if best is None or prof.date > best.date:
            best = prof
    return best
