"""Tests for ultracomm.env: parsing, validation, overrides, and that no other file reads
ULTRACOMM_* environment variables."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

import ultracomm.env as env_mod
from ultracomm.env import VARIABLES, Config, parse_bandwidth, parse_size
from ultracomm.errors import ConfigError, UltracommError
from ultracomm.records import RelayMode

REPO = Path(__file__).resolve().parents[1]


def test_defaults():
    c = Config.from_env({})
    assert c.num_workers == min(4, os.cpu_count() or 1)
    assert (c.multicast_sms, c.reduce_sms) == (0, 0)  # auto: resolved per device by ultracomm.cuda.sm_budget
    assert (c.transport, c.window, c.relay_mode, c.log_level) == ("auto", "auto", "auto", "warning")
    assert (c.tile_bytes, c.chunk_bytes) == (32768, 1 << 20)
    assert c.max_depth == 8 and c.deterministic is True and c.timeout_s == 100.0 and c.plan_check == "auto"
    assert (c.intra_bw, c.inter_bw, c.jitter_us) == (370e9, 50e9, 0)
    assert c == Config()
    assert c.relay is RelayMode.AUTO


def test_reads_os_environ_by_default(monkeypatch):
    monkeypatch.setenv("ULTRACOMM_TIMEOUT_S", "7.5")
    assert Config.from_env().timeout_s == 7.5


def test_empty_means_default():
    assert Config.from_env({"ULTRACOMM_TILE_BYTES": "  "}).tile_bytes == 32768


# every variable: (value text, expected field value)
GOOD = {
    "ULTRACOMM_NUM_WORKERS": ("3", 3),
    "ULTRACOMM_MULTICAST_SMS": ("24", 24),
    "ULTRACOMM_REDUCE_SMS": ("8", 8),
    "ULTRACOMM_TRANSPORT": ("Copy_Engine", "copy_engine"),
    "ULTRACOMM_WINDOW": ("nvshmem", "nvshmem"),
    "ULTRACOMM_TILE_BYTES": ("16K", 16384),
    "ULTRACOMM_CHUNK_BYTES": ("256K", 262144),
    "ULTRACOMM_RELAY": ("force", "force"),
    "ULTRACOMM_SPLIT_ROUTE": ("Messages", "messages"),
    "ULTRACOMM_REDUCE_PATH": ("TMA", "tma"),
    "ULTRACOMM_RELAY_MAX_DEPTH": ("2", 2),
    "ULTRACOMM_SCHEDULE_BUILDER": ("Portable", "portable"),
    "ULTRACOMM_PLAN_CHECK": ("Window", "window"),
    "ULTRACOMM_DETERMINISTIC": ("off", False),
    "ULTRACOMM_TIMEOUT_S": ("2.5", 2.5),
    "ULTRACOMM_LOG_LEVEL": ("DEBUG", "debug"),
    "ULTRACOMM_INTRA_BW": ("900G", 900e9),
    "ULTRACOMM_INTER_BW": ("25e9", 25e9),
    "ULTRACOMM_DEBUG_JITTER_US": ("50", 50),
    "ULTRACOMM_HW_PROFILE": (f" {env_mod.__file__} ", env_mod.__file__),  # any existing file parses
    "ULTRACOMM_PROFILE": (" /tmp/uc-profile ", "/tmp/uc-profile"),
    "ULTRACOMM_DOMAIN": (" n0 , n0,n1:rack/2 ", "n0,n0,n1:rack/2"),
    "ULTRACOMM_PDL": ("off", False),
}


def test_sms_auto_and_zero_mean_the_analytic_default():
    assert Config.from_env({"ULTRACOMM_MULTICAST_SMS": "AUTO", "ULTRACOMM_REDUCE_SMS": "0"}).multicast_sms == 0
    assert Config().replace(reduce_sms="auto").reduce_sms == 0
    with pytest.raises(ConfigError, match=r"ULTRACOMM_REDUCE_SMS='-1' is invalid: must be in \[0, 4096\]"):
        Config.from_env({"ULTRACOMM_REDUCE_SMS": "-1"})
    with pytest.raises(ConfigError, match="ULTRACOMM_MULTICAST_SMS='lots' is invalid: expected an integer"):
        Config.from_env({"ULTRACOMM_MULTICAST_SMS": "lots"})


def test_every_variable_covered():
    assert set(GOOD) == {v.env for v in VARIABLES}
    doc = env_mod.__doc__ or ""
    for v in VARIABLES:
        assert v.env in doc and v.field in doc, f"{v.env} missing from the env.py docstring table"


@pytest.mark.parametrize("name", sorted(GOOD))
def test_each_variable_parsed(name):
    text, want = GOOD[name]
    field = next(v.field for v in VARIABLES if v.env == name)
    c = Config.from_env({name: text})
    assert getattr(c, field) == want
    # all together
    c = Config.from_env({k: t for k, (t, _) in GOOD.items()})
    assert getattr(c, field) == want


BAD = [
    ("ULTRACOMM_NUM_WORKERS", "0", "must be in [1, 1024]"),
    ("ULTRACOMM_NUM_WORKERS", str(2**31), "must be in [1, 1024]"),
    ("ULTRACOMM_NUM_WORKERS", "four", "expected an integer"),
    ("ULTRACOMM_MULTICAST_SMS", "-1", "must be in [0, 4096]"),
    ("ULTRACOMM_REDUCE_SMS", "4097", "must be in [0, 4096]"),
    ("ULTRACOMM_REDUCE_SMS", "1.5", "expected an integer"),
    ("ULTRACOMM_TRANSPORT", "nvlink", "expected one of auto, host, tma, copy_engine, p2p"),
    ("ULTRACOMM_WINDOW", "shm", "expected one of auto, host_shm, local, cuda_ipc, torch_symm, nvshmem"),
    ("ULTRACOMM_TILE_BYTES", "100", "must be a positive multiple of 16 bytes"),
    ("ULTRACOMM_TILE_BYTES", "0", "must be a positive multiple of 16 bytes"),
    ("ULTRACOMM_TILE_BYTES", "1025G", "at most 1099511627776 (1024G)"),
    ("ULTRACOMM_TILE_BYTES", "32X", "suffix K, M or G"),
    ("ULTRACOMM_CHUNK_BYTES", "1.5M", "suffix K, M or G"),
    ("ULTRACOMM_CHUNK_BYTES", "8", "multiple of 16"),
    # 2^64 - 32768: a multiple of the tile that ceil-divides to zero chunks in 64-bit arithmetic
    ("ULTRACOMM_CHUNK_BYTES", str(2**64 - 32768), "at most 1099511627776 (1024G)"),
    ("ULTRACOMM_RELAY", "on", "expected one of auto, off, force"),
    ("ULTRACOMM_SPLIT_ROUTE", "bridge", "expected one of auto, split, messages"),
    ("ULTRACOMM_REDUCE_PATH", "staged", "expected one of hunk, tma"),
    ("ULTRACOMM_RELAY_MAX_DEPTH", "0", "must be in [1, 65535]"),
    ("ULTRACOMM_PLAN_CHECK", "digest", "expected one of auto, agree, window"),
    ("ULTRACOMM_SCHEDULE_BUILDER", "device", "expected one of host, portable"),
    ("ULTRACOMM_RELAY_MAX_DEPTH", "99999999999", "must be in [1, 65535]"),
    ("ULTRACOMM_DETERMINISTIC", "maybe", "expected one of 1, 0, true, false, yes, no, on, off"),
    ("ULTRACOMM_TIMEOUT_S", "0", "must be a number of seconds in [0.1, 1e+08]"),
    ("ULTRACOMM_TIMEOUT_S", "1e-320", "must be a number of seconds in [0.1, 1e+08]"),
    ("ULTRACOMM_TIMEOUT_S", "0.099", "must be a number of seconds in [0.1, 1e+08]"),
    ("ULTRACOMM_TIMEOUT_S", "inf", "must be a number of seconds in [0.1, 1e+08]"),
    ("ULTRACOMM_TIMEOUT_S", "1e300", "must be a number of seconds in [0.1, 1e+08]"),
    ("ULTRACOMM_TIMEOUT_S", "soon", "expected a number"),
    ("ULTRACOMM_LOG_LEVEL", "verbose", "expected one of debug, info, warning, error"),
    ("ULTRACOMM_INTRA_BW", "fast", "bytes/s"),
    ("ULTRACOMM_INTER_BW", "0", "must be a finite number > 0"),
    ("ULTRACOMM_DEBUG_JITTER_US", "-5", "must be in [0, 1000000]"),
    ("ULTRACOMM_DEBUG_JITTER_US", str(2**32), "must be in [0, 1000000]"),
    ("ULTRACOMM_HW_PROFILE", "/nonexistent/gpu_profile.json", "no such file"),
    (
        "ULTRACOMM_PROFILE",
        str(REPO / "pyproject.toml"),
        "it is not a directory; give a directory (created when missing)",
    ),
    ("ULTRACOMM_DOMAIN", "node 0", "key 'node 0' is not 1 to 128 characters from A-Z a-z 0-9 . _ : / @ + -"),
    ("ULTRACOMM_DOMAIN", "a,", "key '' is not 1 to 128 characters"),
    ("ULTRACOMM_DOMAIN", "x" * 129, "is not 1 to 128 characters"),
    ("ULTRACOMM_PDL", "auto", "expected one of 1, 0, true, false, yes, no, on, off"),
]


def test_bad_cases_cover_every_variable():
    assert {b[0] for b in BAD} == {v.env for v in VARIABLES}


@pytest.mark.parametrize("name, text, why", BAD)
def test_bad_values(name, text, why):
    with pytest.raises(ConfigError) as ei:
        Config.from_env({name: text})
    msg = str(ei.value)
    assert msg.startswith(f"ultracomm: {name}={text!r} is invalid: ")
    assert why in msg
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, UltracommError)


def test_chunk_must_be_multiple_of_tile():
    with pytest.raises(
        ConfigError, match=r"chunk_bytes=49152 \(ULTRACOMM_CHUNK_BYTES\) is not a multiple of tile_bytes=32768"
    ):
        Config.from_env({"ULTRACOMM_CHUNK_BYTES": "48K"})
    c = Config.from_env({"ULTRACOMM_CHUNK_BYTES": "48K", "ULTRACOMM_TILE_BYTES": "16K"})
    assert c.chunk_bytes == 3 * c.tile_bytes


def test_size_and_bandwidth_syntax():
    assert parse_size("32768") == 32768
    assert parse_size("256k") == parse_size("256KiB") == parse_size("256KB") == 256 << 10
    assert parse_size("1M") == 1 << 20 and parse_size("2G") == 2 << 30
    assert parse_bandwidth("370e9") == 370e9 == parse_bandwidth("370G") == parse_bandwidth("370GB/s")
    assert parse_bandwidth("1.5T") == 1.5e12 and parse_bandwidth("50000") == 50000.0


def test_replace():
    c = Config.from_env({})
    d = c.replace(tile_bytes="64K", chunk_bytes=1 << 21, transport="TMA", deterministic=False, timeout_s=5)
    assert (d.tile_bytes, d.chunk_bytes, d.transport, d.deterministic, d.timeout_s) == (
        65536,
        1 << 21,
        "tma",
        False,
        5.0,
    )
    assert isinstance(d.timeout_s, float)
    assert c.tile_bytes == 32768  # original untouched
    assert c.replace(deterministic="no").deterministic is False
    assert c.replace(relay_mode="off").relay is RelayMode.OFF


@pytest.mark.parametrize(
    "overrides, msg",
    [
        (
            dict(tile_bytes=100),
            "tile_bytes=100 is invalid: must be a positive multiple of 16 bytes, at most 1099511627776 (1024G) (environment variable ULTRACOMM_TILE_BYTES)",
        ),
        (dict(tile_bytes=True), "tile_bytes=True is invalid: expected an int"),
        (dict(num_workers=2.0), "num_workers=2.0 is invalid: expected an int"),
        (dict(deterministic=1), "deterministic=1 is invalid: expected a bool"),
        (dict(transport="rdma"), "transport='rdma' is invalid: expected one of"),
        (dict(transport=3), "expected a string"),
        (dict(timeout_s=-1), "timeout_s=-1 is invalid: must be a number of seconds in [0.1, 1e+08]"),
        (dict(chunk_bytes=48 * 1024), "is not a multiple of tile_bytes"),
        (dict(tile=1), "unknown config field(s) ['tile']"),
    ],
)
def test_replace_errors(overrides, msg):
    with pytest.raises(ConfigError) as ei:
        Config().replace(**overrides)
    assert msg in str(ei.value)


def test_describe_lists_every_variable():
    c = Config.from_env({"ULTRACOMM_TILE_BYTES": "16K"})
    text = c.describe()
    for v in VARIABLES:
        assert v.env in text
    line = next(l for l in text.splitlines() if l.startswith("ULTRACOMM_TILE_BYTES"))
    assert "16384*" in line and "32768" in line


def test_typo_warns():
    with pytest.warns(UserWarning, match="did you mean ULTRACOMM_TIMEOUT_S"):
        Config.from_env({"ULTRACOMM_TIMOUT_S": "3"})


def test_config_is_frozen():
    with pytest.raises(Exception):
        Config().tile_bytes = 16  # type: ignore[misc]


# ----------------------------------------------------------------------------- single reader

_READ = re.compile(r"os\.environ|os\.getenv|getenv\s*\(|secure_getenv\s*\(")


def test_only_env_py_reads_ultracomm_variables():
    """ULTRACOMM_* variables are read only in python/ultracomm/env.py (scripts/ and tests/
    may set them)."""
    allowed = REPO / "python" / "ultracomm" / "env.py"
    offenders = []
    for tree in ("python", "csrc", "include"):
        root = REPO / tree
        if not root.exists():
            continue
        for path in root.rglob("*"):
            if path.suffix not in {".py", ".cpp", ".cu", ".h", ".cuh", ".hpp", ".cc"} or path == allowed:
                continue
            try:
                text = path.read_text(errors="replace")
            except OSError:
                continue
            for n, line in enumerate(text.splitlines(), 1):
                if "ULTRACOMM_" in line and _READ.search(line):
                    offenders.append(f"{path.relative_to(REPO)}:{n}: {line.strip()}")
    assert not offenders, (
        "ULTRACOMM_* environment variables must be read only in python/ultracomm/env.py "
        "(add a Config field and pass the value down instead):\n" + "\n".join(offenders)
    )
