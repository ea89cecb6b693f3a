"""Configuration: the only place ``ULTRACOMM_*`` environment variables are read.

Every tuning knob is a field of the frozen :class:`Config`.  ``Config.from_env()``
reads the variables below (unset or empty = default); ``config.replace(**overrides)``
returns a validated copy with per-call overrides (Python values, or strings in the
same syntax as the variables).

==========================  ================  ====================  ==================  =====================================================
variable                    field             type                  default             meaning
==========================  ================  ====================  ==================  =====================================================
ULTRACOMM_NUM_WORKERS       num_workers       int 1..1024           min(4, cpu_count)   host executor worker threads per rank (CPU analogue of SMs)
ULTRACOMM_MULTICAST_SMS     multicast_sms     int 0..4096 | auto    auto (0)            SMs (thread blocks) the GPU executor uses for multicast; auto: see "SM defaults"
ULTRACOMM_REDUCE_SMS        reduce_sms        int 0..4096 | auto    auto (0)            SMs (thread blocks) the GPU executor uses for gradient reduction; auto: see "SM defaults"
ULTRACOMM_TRANSPORT         transport         choice                auto                auto | host | tma | copy_engine | p2p | split (host within a memory domain, p2p across: ultracomm.dataplane.domains)
ULTRACOMM_WINDOW            window            choice                auto                auto | host_shm | local | cuda_ipc | torch_symm | nvshmem | cuda_local (one-GPU loopback) | private (p2p: no peer mapping)
ULTRACOMM_TILE_BYTES        tile_bytes        size (bytes)          32768 (32K)         bytes moved per tile; a positive multiple of 16, at most 1024G
ULTRACOMM_CHUNK_BYTES       chunk_bytes       size (bytes)          1048576 (1M)        bytes per flagged chunk (relay granularity); a multiple of tile_bytes, at most 1024G
ULTRACOMM_RELAY             relay_mode        choice                auto                auto (relay when the cost model says so) | off (direct) | force
ULTRACOMM_RELAY_MAX_DEPTH   max_depth         int 1..65535          8                   deepest relay tree the schedule builder may use (a cap: depth is chosen by predicted time; relay=force uses at least 2)
ULTRACOMM_SPLIT_ROUTE       split_route       choice                auto                transport split on the CPU: auto (per operation, by the alpha-beta model: ultracomm.alpha_beta.split_route) | split (shared memory inside a domain, messages across) | messages (every edge a message, the direct schedule)
ULTRACOMM_REDUCE_PATH       reduce_path       choice                hunk                how the tma transport's kernel adds gradients, bit-identical either way (ultracomm.transports.tma, "Reduce paths"): hunk (register hunks) | tma (TMA-staged through shared memory; sm_90+, the transport raises on older GPUs)
ULTRACOMM_SCHEDULE_BUILDER  schedule_builder  choice                host                host (csrc/schedule/schedule_builder.cpp) | portable (include/ultracomm/impl/sched_build.h, the device control plane's builder: shared-memory transports only, message transports keep host; relay=off gives direct trees, relay=force is not honoured)
ULTRACOMM_PLAN_CHECK        plan_check        choice                auto                how ranks make sure they run the same plan: auto | agree | window (see "Plan checks")
ULTRACOMM_DETERMINISTIC     deterministic     bool                  true                fixed-order fp32 gradient reduction (bit-identical runs)
ULTRACOMM_TIMEOUT_S         timeout_s         float in [0.1, 1e8]   100                 seconds any wait for a peer (flag, setup, plan agreement) may take before raising UltracommTimeout
ULTRACOMM_LOG_LEVEL         log_level         choice                warning             debug | info | warning | error
ULTRACOMM_INTRA_BW          intra_bw          bandwidth (bytes/s)   370e9               intra-node link bandwidth for the schedule cost model
ULTRACOMM_INTER_BW          inter_bw          bandwidth (bytes/s)   50e9                inter-node link bandwidth for the schedule cost model
ULTRACOMM_DEBUG_JITTER_US   jitter_us         int 0..1000000        0                   testing aid: random delay up to this many us before each host task
ULTRACOMM_HW_PROFILE        hw_profile        path                  (search)            hardware profile JSON for the SM defaults (ultracomm/cuda/hwprofile.py); unset: newest perf/gpu/*profile*.json of this GPU
ULTRACOMM_PROFILE           profile           path                  (empty: off)        directory a Context records its load profile into (``ultracomm.profile``; one ``rank<r>`` subdirectory per rank when world > 1; a rerun writes into a fresh ``run<n>`` subdirectory; must be this user's and not group- or world-writable)
ULTRACOMM_DOMAIN            domain            domain                (empty: detect)     this rank's memory domain, overriding detection (``ultracomm.dataplane.domains``): one key, or one key per rank of the Context's group
ULTRACOMM_PDL               pdl               bool                  true                programmatic dependent launch of the device control plane's kernels (k_quota, k_build_slot, k_reroute after k_load_exchange) on sm_90+; process-wide, see "Process-wide fields"
==========================  ================  ====================  ==================  =====================================================

Syntax:

* size: an integer byte count, optionally with a binary suffix ``K``/``M``/``G``
  (KiB/MiB/GiB; ``KiB``, ``KB`` and lower case accepted), e.g. ``256K``, ``1M``.
* bandwidth: a number of bytes/s, e.g. ``370e9``, or with a *decimal* suffix
  ``K``/``M``/``G``/``T`` (10^3 .. 10^12; an optional trailing ``B`` or ``B/s``),
  e.g. ``370G``.
* bool: ``1/0``, ``true/false``, ``yes/no``, ``on/off`` (case-insensitive).
* choice: one of the listed words (case-insensitive).
* path: a file or directory name, used as given (surrounding blanks stripped); empty = unset.
* domain: a key of 1 to 128 characters from ``A-Z a-z 0-9 . _ : / @ + -`` (e.g. ``node0``), or a
  comma-separated list of such keys, one per rank of the Context's group (``a,a,b,b``: rank
  ``r`` takes entry ``r``; every rank must then declare the same list, and its length must be
  the group size, checked when the Context is built).  Ranks with one key share memory: on the
  CPU they must run on one host (else the Context refuses the declaration).  For machines whose
  hosts cannot be told apart, and to run several "nodes" on one machine (tests).

Process-wide fields: ``pdl`` is a property of the process's CUDA module, not of a Context:
``ultracomm.cuda.support`` reads it (:func:`process_field`) when it first loads
``ultracomm._cuda`` and sets ``_cuda.set_programmatic_launch``; a Config passed to a Context
does not change it (``ultracomm._cuda.set_programmatic_launch`` does, at run time).  With it on,
a device of compute capability 9.0 or newer launches ``k_quota``, ``k_build_slot`` and
``k_reroute`` with programmatic stream serialization, each kernel waiting (``griddepcontrol.wait``)
for its predecessor before it reads anything (csrc/cuda/pdl.h); older devices are unaffected.
``0`` launches them as plain kernels (e.g. to compare, or where a driver refuses the attribute
under graph capture).

Plan checks (``plan_check``): every rank must pass the same valid plan to ``weight_sync``.

* ``agree``: a bounded collective over the process group before each ``weight_sync``
  compares every rank's plan and schedule digest; a rank whose plan is invalid or differs
  makes every rank raise, naming the ranks, before anything moves.
* ``window``: no collective per operation.  Each rank publishes its schedule digest beside
  its ready flag; the executor compares the digest of every peer it exchanges data with and
  raises ``PlanMismatchError`` (a ``PlanError``) naming both digests before any byte moves
  between them.  A rank whose own plan is invalid raises its error and publishes a rejection
  there, so the peers that exchange data with it fail at once ("rank r rejected its plan")
  rather than after ``timeout_s``.  Ranks that exchange nothing in either plan do not learn of
  the difference.  Needs a transport with window flags: host, tma, copy_engine, split on CUDA
  (not p2p, not split on the CPU).  Under the CUDA split a rejection reaches the ranks of the
  rejecting rank's domain at once and the others at their timeout.
* ``auto`` (the default): ``window`` wherever the transport has window flags (``host``, ``tma``,
  ``copy_engine``, ``split`` on CUDA: no store or ``torch.distributed`` call per operation; on
  a GPU a collective would also synchronise the host with the device), else ``agree`` (``p2p``,
  ``split`` on the CPU).  A digest does not say which layer or micro-batch a plan is for;
  ``ReplicaManager.step`` names them in its loads' exchange, which every rank joins (load board
  or store), so ranks out of step -- a rank running its layers in another order -- raise
  ``PlanMismatchError`` there, on every rank, before any byte moves, whichever check runs.

SM defaults (``multicast_sms`` / ``reduce_sms`` = ``auto``, resolved by
``ultracomm.cuda.sm_budget.choose_sms`` when a GPU transport is built; the chosen value and
its source are logged at ``ULTRACOMM_LOG_LEVEL=debug``)::

    sms = clamp(ceil(intra_bw / per_cta_rate), 1, min(32, SMs of the device))

``intra_bw`` is the link bandwidth a rank's operation can use (``ULTRACOMM_INTRA_BW``, NVLink),
``per_cta_rate`` the bytes/s ONE CTA of the operation moves on that link, measured: the hardware
profile's ``per_cta_bw["nvlink"]["multicast" | "reduce"]`` when the profile of this GPU has it
(``perf/bench_gpu.py``), else a fallback measured per CTA on one H200 (HBM -> HBM; no NVLink
per-CTA rate is measured yet): multicast 34.5e9 B/s (the tile mover with 16 CTAs, 552 GB/s / 16,
perf/gpu/2026-12-04_nvidia-h200_run2), reduce 14.6e9 B/s of traffic (k=2 fp32 64 MiB at 23 CTAs
in 802 us, perf/gpu/2026-12-04_nvidia-h200_run1).  With the defaults: multicast ceil(370 / 34.5)
= 11, reduce ceil(370 / 14.6) = 26.  Not an all-SM copy rate divided by the SM count: with every
SM copying, HBM is the bottleneck and each SM's share (15.8 GB/s) says nothing about one CTA.
An explicit positive value is used as given.

Errors are :class:`ultracomm.errors.ConfigError` naming the variable, the bad value and
what is accepted.  Every number is bounded so that what the executors compute from it
(chunk counts, window offsets, thread counts, int32/uint32 fields) cannot overflow: e.g.
``ULTRACOMM_CHUNK_BYTES=18446744073709518848`` (2^64 - 32768) is rejected here rather than
becoming zero chunks later.  ``ULTRACOMM_*`` names that are close to a known one but not known
(typos) trigger a warning.
"""

from __future__ import annotations

import dataclasses
import difflib
import math
import os
import warnings
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Optional

from .errors import ConfigError
from .env_values import (  # the parsers of the values (public ones re-exported)
    _Bad,
    _choice,
    _parse_float,
    _parse_int,
    _parse_sms,
    domain_keys,
    parse_bandwidth,
    parse_bool,
    parse_domain,
    parse_size,
)

__all__ = [
    "Config",
    "VARIABLES",
    "parse_size",
    "parse_bandwidth",
    "parse_bool",
    "parse_domain",
    "domain_keys",
    "check_window_layout",
    "MAX_CHUNK_BYTES",
    "process_field",
]

TRANSPORTS = ("auto", "host", "tma", "copy_engine", "p2p", "split")
WINDOWS = ("auto", "host_shm", "local", "cuda_ipc", "torch_symm", "nvshmem", "cuda_local", "private")
RELAY_MODES = ("auto", "off", "force")
SPLIT_ROUTES = ("auto", "split", "messages")
REDUCE_PATHS = ("hunk", "tma")
PLAN_CHECKS = ("auto", "agree", "window")
SCHEDULE_BUILDERS = ("host", "portable")
LOG_LEVELS = ("debug", "info", "warning", "error")

# ULTRACOMM_* names used outside the runtime (build configuration); never warned about.
_OTHER_KNOWN = frozenset({"ULTRACOMM_BUILD_CUDA"})


@dataclass(frozen=True)
class _Var:
    field: str
    env: str
    kind: str  # int | float | bool | str (python type of the field)
    parse: Callable[[str], Any]
    check: Callable[[Any], Optional[str]]  # returns an error text or None
    meaning: str


#: Largest tile or chunk (1 TiB): far above any useful size, far below where byte counts,
#: chunk counts and window offsets (uint64) could overflow.
MAX_CHUNK_BYTES = 1 << 40
MAX_TIMEOUT_S = 1e8  # ~3 years: "never" in practice; still a finite timedelta for the store
MIN_TIMEOUT_S = 0.1  # below this a Context setup (a few store round trips) cannot finish: every call would time out


def _between(lo: int, hi: int) -> Callable[[Any], Optional[str]]:
    return lambda v: None if lo <= v <= hi else f"must be in [{lo}, {hi}]"


def _positive_finite(v: float) -> Optional[str]:
    return None if math.isfinite(v) and v > 0 else "must be a finite number > 0"


def _timeout_check(v: float) -> Optional[str]:
    if math.isfinite(v) and MIN_TIMEOUT_S <= v <= MAX_TIMEOUT_S:
        return None
    return f"must be a number of seconds in [{MIN_TIMEOUT_S:g}, {MAX_TIMEOUT_S:g}]"


def _tile_check(v: int) -> Optional[str]:
    if not 0 < v <= MAX_CHUNK_BYTES or v % 16:
        return f"must be a positive multiple of 16 bytes, at most {MAX_CHUNK_BYTES} (1024G)"
    return None


def _chunk_check(v: int) -> Optional[str]:
    if not 0 < v <= MAX_CHUNK_BYTES or v % 16:
        return f"must be a positive multiple of 16 bytes (and of tile_bytes), at most {MAX_CHUNK_BYTES} (1024G)"
    return None


def _file_or_empty(v: str) -> Optional[str]:
    return None if not v or os.path.isfile(v) else "no such file (give the path of a hardware profile JSON)"


def _profile_check(v: str) -> Optional[str]:
    # at parse time, so that /dev/null or someone else's directory fails naming the variable
    from .private_dir import why_not_a_dir

    why = why_not_a_dir(v) if v else None
    return None if why is None else f"it {why}"


def _in(options: tuple[str, ...]) -> Callable[[Any], Optional[str]]:
    return lambda v: None if v in options else f"expected one of {', '.join(options)}"


#: Every variable, in documentation order.
VARIABLES: tuple[_Var, ...] = (
    _Var(
        "num_workers",
        "ULTRACOMM_NUM_WORKERS",
        "int",
        _parse_int,
        _between(1, 1024),
        "host executor worker threads per rank (CPU analogue of SMs)",
    ),
    _Var(
        "multicast_sms",
        "ULTRACOMM_MULTICAST_SMS",
        "int",
        _parse_sms,
        _between(0, 4096),
        "SMs the GPU executor uses for multicast (0 = auto)",
    ),
    _Var(
        "reduce_sms",
        "ULTRACOMM_REDUCE_SMS",
        "int",
        _parse_sms,
        _between(0, 4096),
        "SMs the GPU executor uses for gradient reduction (0 = auto)",
    ),
    _Var(
        "transport",
        "ULTRACOMM_TRANSPORT",
        "str",
        _choice(TRANSPORTS),
        _in(TRANSPORTS),
        "executor: " + " | ".join(TRANSPORTS),
    ),
    _Var(
        "window",
        "ULTRACOMM_WINDOW",
        "str",
        _choice(WINDOWS),
        _in(WINDOWS),
        "symmetric-memory provider: " + " | ".join(WINDOWS),
    ),
    _Var("tile_bytes", "ULTRACOMM_TILE_BYTES", "int", parse_size, _tile_check, "bytes per tile (multiple of 16)"),
    _Var(
        "chunk_bytes",
        "ULTRACOMM_CHUNK_BYTES",
        "int",
        parse_size,
        _chunk_check,
        "bytes per flagged chunk (multiple of tile_bytes)",
    ),
    _Var(
        "relay_mode",
        "ULTRACOMM_RELAY",
        "str",
        _choice(RELAY_MODES),
        _in(RELAY_MODES),
        "relay trees: " + " | ".join(RELAY_MODES),
    ),
    _Var(
        "max_depth",
        "ULTRACOMM_RELAY_MAX_DEPTH",
        "int",
        _parse_int,
        _between(1, 65535),
        "deepest relay tree allowed (a cap; relay=force uses at least 2)",
    ),
    _Var(
        "split_route",
        "ULTRACOMM_SPLIT_ROUTE",
        "str",
        _choice(SPLIT_ROUTES),
        _in(SPLIT_ROUTES),
        "CPU split transport route: " + " | ".join(SPLIT_ROUTES),
    ),
    _Var(
        "reduce_path", "ULTRACOMM_REDUCE_PATH", "str", _choice(REDUCE_PATHS), _in(REDUCE_PATHS), "tma adds: hunk | tma"
    ),
    _Var(
        "schedule_builder",
        "ULTRACOMM_SCHEDULE_BUILDER",
        "str",
        _choice(SCHEDULE_BUILDERS),
        _in(SCHEDULE_BUILDERS),
        "schedule builder: " + " | ".join(SCHEDULE_BUILDERS),
    ),
    _Var(
        "plan_check",
        "ULTRACOMM_PLAN_CHECK",
        "str",
        _choice(PLAN_CHECKS),
        _in(PLAN_CHECKS),
        "same-plan check: " + " | ".join(PLAN_CHECKS),
    ),
    _Var(
        "deterministic",
        "ULTRACOMM_DETERMINISTIC",
        "bool",
        parse_bool,
        lambda v: None,
        "fixed-order fp32 gradient reduction",
    ),
    _Var(
        "timeout_s",
        "ULTRACOMM_TIMEOUT_S",
        "float",
        _parse_float,
        _timeout_check,
        "seconds any wait for a peer may take before raising UltracommTimeout",
    ),
    _Var("log_level", "ULTRACOMM_LOG_LEVEL", "str", _choice(LOG_LEVELS), _in(LOG_LEVELS), " | ".join(LOG_LEVELS)),
    _Var(
        "intra_bw",
        "ULTRACOMM_INTRA_BW",
        "float",
        parse_bandwidth,
        _positive_finite,
        "intra-node bytes/s for the cost model",
    ),
    _Var(
        "inter_bw",
        "ULTRACOMM_INTER_BW",
        "float",
        parse_bandwidth,
        _positive_finite,
        "inter-node bytes/s for the cost model",
    ),
    _Var(
        "jitter_us",
        "ULTRACOMM_DEBUG_JITTER_US",
        "int",
        _parse_int,
        _between(0, 1_000_000),
        "testing aid: random delay (us) before each host task",
    ),
    _Var(
        "hw_profile",
        "ULTRACOMM_HW_PROFILE",
        "str",
        lambda t: t.strip(),
        _file_or_empty,
        "hardware profile JSON for the SM defaults (empty: search perf/gpu)",
    ),
    _Var(
        "profile", "ULTRACOMM_PROFILE", "str", str.strip, _profile_check, "directory for the load profile (empty: off)"
    ),
    _Var(
        "domain",
        "ULTRACOMM_DOMAIN",
        "str",
        lambda t: parse_domain(t) if t.strip() else "",
        lambda v: None,
        "this rank's memory domain key, or one key per rank (empty: detect)",
    ),
    _Var(
        "pdl",
        "ULTRACOMM_PDL",
        "bool",
        parse_bool,
        lambda v: None,
        "programmatic dependent launch of the control-plane kernels on sm_90+ (process-wide)",
    ),
)
_BY_FIELD = {v.field: v for v in VARIABLES}
_BY_ENV = {v.env: v for v in VARIABLES}


def _default_workers() -> int:
    return min(4, os.cpu_count() or 1)


def _coerce(var: _Var, value: Any) -> Any:
    """Python value (or string in variable syntax) -> field value; raises _Bad."""
    if isinstance(value, str):
        return var.parse(value)
    if var.kind == "int":
        if isinstance(value, bool) or not isinstance(value, int):
            raise _Bad("expected an int")
        return int(value)
    if var.kind == "float":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise _Bad("expected a number")
        return float(value)
    if var.kind == "bool":
        if not isinstance(value, bool):
            raise _Bad("expected a bool")
        return value
    raise _Bad("expected a string")


def _error(var: _Var, value: Any, why: str, source: str) -> ConfigError:
    shown = f"{value!r}"
    if source == "env":
        return ConfigError(f"{var.env}={shown} is invalid: {why} (config field {var.field})")
    return ConfigError(f"{var.field}={shown} is invalid: {why} (environment variable {var.env})")


@dataclass(frozen=True)
class Config:
    """All ultracomm tuning knobs; see the module docstring for the variables.

    Construct with :meth:`from_env`; derive per-call variants with :meth:`replace`.
    Direct construction validates too.
    """

    num_workers: int = field(default_factory=_default_workers)
    multicast_sms: int = 0  # auto
    reduce_sms: int = 0  # auto
    transport: str = "auto"
    window: str = "auto"
    tile_bytes: int = 32768
    chunk_bytes: int = 1 << 20
    relay_mode: str = "auto"
    max_depth: int = 8
    split_route: str = "auto"
    reduce_path: str = "hunk"
    schedule_builder: str = "host"
    plan_check: str = "auto"
    deterministic: bool = True
    timeout_s: float = 100.0
    log_level: str = "warning"
    intra_bw: float = 370e9
    inter_bw: float = 50e9
    jitter_us: int = 0
    hw_profile: str = ""
    profile: str = ""
    domain: str = ""
    pdl: bool = True  # process-wide: read when ultracomm._cuda loads (process_field)

    def __post_init__(self) -> None:
        for var in VARIABLES:
            value = getattr(self, var.field)
            try:
                coerced = _coerce(var, value)
            except _Bad as e:
                raise _error(var, value, str(e), "field") from None
            why = var.check(coerced)
            if why:
                raise _error(var, value, why, "field")
            object.__setattr__(self, var.field, coerced)
        if self.chunk_bytes % self.tile_bytes:
            raise ConfigError(
                f"chunk_bytes={self.chunk_bytes} (ULTRACOMM_CHUNK_BYTES) is not a multiple of "
                f"tile_bytes={self.tile_bytes} (ULTRACOMM_TILE_BYTES); make the chunk a whole "
                "number of tiles, e.g. ULTRACOMM_CHUNK_BYTES=1M with ULTRACOMM_TILE_BYTES=32K"
            )

    @classmethod
    def from_env(cls, environ: Optional[Mapping[str, str]] = None) -> "Config":
        """Parse the ``ULTRACOMM_*`` variables of ``environ`` (default ``os.environ``).

        Unset or empty variables take their defaults.  Raises :class:`ConfigError`
        naming the variable, the bad value and the accepted values.
        """
        env = os.environ if environ is None else environ
        values: dict[str, Any] = {}
        for var in VARIABLES:
            raw = env.get(var.env)
            if raw is None or raw.strip() == "":
                continue
            try:
                parsed = var.parse(raw)
            except _Bad as e:
                raise _error(var, raw, str(e), "env") from None
            why = var.check(parsed)
            if why:
                raise _error(var, raw, why, "env")
            values[var.field] = parsed
        for name in env:
            if name.startswith("ULTRACOMM_") and name not in _BY_ENV and name not in _OTHER_KNOWN:
                close = difflib.get_close_matches(name, list(_BY_ENV), n=1, cutoff=0.8)
                if close:
                    warnings.warn(
                        f"{name} is not an ultracomm variable and is ignored; did you mean {close[0]}?", stacklevel=2
                    )
        return cls(**values)

    def replace(self, **overrides: Any) -> "Config":
        """A copy with ``overrides`` applied (field names; Python values or strings in
        the variable syntax, e.g. ``tile_bytes="64K"``), validated like :meth:`from_env`."""
        unknown = sorted(set(overrides) - set(_BY_FIELD))
        if unknown:
            raise ConfigError(f"unknown config field(s) {unknown}; known fields are {sorted(_BY_FIELD)}")
        return dataclasses.replace(self, **overrides)

    @property
    def relay(self) -> "Any":
        """``relay_mode`` as ``ultracomm.records.RelayMode`` (what the C++ core takes)."""
        from .records import RelayMode

        return RelayMode[self.relay_mode.upper()]

    def to_dict(self) -> dict[str, Any]:
        """Field name -> value."""
        return dataclasses.asdict(self)

    def describe(self) -> str:
        """A table of every variable: name, current value, default, meaning.  Values
        that differ from the default are marked ``*``."""
        default = Config()
        rows = [("variable", "value", "default", "meaning")]
        for var in VARIABLES:
            cur, dft = getattr(self, var.field), getattr(default, var.field)
            mark = "*" if cur != dft else ""
            rows.append((var.env, f"{_fmt(cur)}{mark}", _fmt(dft), var.meaning))
        widths = [max(len(r[i]) for r in rows) for i in range(3)]
        lines = []
        for i, r in enumerate(rows):
            lines.append("  ".join(c.ljust(w) for c, w in zip(r[:3], widths)) + "  " + r[3])
            if i == 0:
                lines.append("  ".join("-" * w for w in widths) + "  " + "-" * 7)
        return "\n".join(lines)


def process_field(name: str, environ: Optional[Mapping[str, str]] = None) -> Any:
    """One field from its variable alone (unset or empty: the default), validated as
    :meth:`Config.from_env` validates it -- for process-wide settings read where no Config is at
    hand (``pdl``: when ``ultracomm._cuda`` loads), so another variable's bad value does not
    fail that load.  Raises :class:`ConfigError` for a bad value of this one."""
    var = _BY_FIELD.get(name)
    if var is None:
        raise ConfigError(f"unknown config field {name!r}; known fields are {sorted(_BY_FIELD)}")
    env = os.environ if environ is None else environ
    raw = env.get(var.env)
    if raw is None or raw.strip() == "":
        return getattr(Config(), name)
    try:
        parsed = var.parse(raw)
    except _Bad as e:
        raise _error(var, raw, str(e), "env") from None
    why = var.check(parsed)
    if why:
        raise _error(var, raw, why, "env")
    return parsed


def _fmt(v: Any) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, float) and v >= 1e6:
        return f"{v:.4g}"
    return str(v)


def check_window_layout(wlayout: Mapping[str, int]) -> None:
    """Raise ``ConfigError`` unless a window layout (``_core.window_layout``) covers its slots:
    every slot's bytes fall in whole chunks, and the regions do not overlap.  Checked when a
    Context is built, before anything moves, so that no size can silently move nothing."""
    chunk = wlayout["chunk_bytes"]
    for kind in ("weight", "grad"):
        nbytes, chunks = wlayout[f"{kind}_slot_bytes"], wlayout[f"{kind}_chunks"]
        if chunk <= 0 or chunks * chunk < nbytes or (nbytes and chunks == 0) or chunks > 2**31 - 1:
            raise ConfigError(
                f"chunk_bytes={chunk} (ULTRACOMM_CHUNK_BYTES) splits a {nbytes}-byte {kind} slot into {chunks} "
                "chunks, which do not cover it within the int32 chunk index; use a chunk size between 16 bytes "
                f"and {MAX_CHUNK_BYTES}, large enough that bytes / chunk_bytes < 2^31"
            )
    slots = wlayout["slots"]
    ends = [
        ("weights", wlayout["weights_off"] + wlayout["weight_stride"] * slots, wlayout["grads_off"]),
        ("grads", wlayout["grads_off"] + wlayout["grad_stride"] * slots, wlayout["ready_off"]),
        ("flags", wlayout["consumed_off"] + 8 * wlayout["grad_chunks"] * slots, wlayout["total_bytes"]),
    ]
    for name, end, nxt in ends:
        if end > nxt or wlayout["total_bytes"] >= 2**63:
            raise ConfigError(
                f"ultracomm: the window layout's {name} region overruns the next one ({end} > {nxt}): "
                "the slot sizes are too large for a window; use fewer or smaller slots"
            )


def cuda_device_max_connections(environ: Optional[Mapping[str, str]] = None) -> Optional[int]:
    """CUDA's ``CUDA_DEVICE_MAX_CONNECTIONS`` (not ultracomm's: read here so that every variable
    ultracomm looks at is in this module), or None when unset or not an integer.  At 1 every
    stream of a device shares one hardware queue: work queued behind a stream memory wait that
    never completes waits with it (the ``split`` transport warns)."""
    env = os.environ if environ is None else environ
    try:
        return int(env.get("CUDA_DEVICE_MAX_CONNECTIONS", ""))
    except ValueError:
        return None
