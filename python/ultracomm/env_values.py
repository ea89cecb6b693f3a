"""Text values of the configuration (``ULTRACOMM_*`` variables and ``Config`` fields): sizes,
bandwidths, booleans, numbers, choices and memory-domain declarations.  Pure parsers; which
variable is read, and how, is :mod:`ultracomm.env`'s."""

from __future__ import annotations

import re
from typing import Callable

__all__ = ["parse_size", "parse_bandwidth", "parse_bool", "parse_domain", "domain_keys", "MAX_DOMAIN_KEYS"]


_SIZE_RE = re.compile(r"^(\d+)\s*(?:([kmg])(?:i?b)?)?$", re.IGNORECASE)
_BW_RE = re.compile(r"^([0-9]*\.?[0-9]+(?:e[+-]?\d+)?)\s*([kmgt])?(?:b(?:/s)?)?$", re.IGNORECASE)
_DOMAIN_KEY_RE = re.compile(r"^[A-Za-z0-9._:/@+-]{1,128}$")
MAX_DOMAIN_KEYS = 1 << 16
_BOOL = {"1": True, "true": True, "yes": True, "on": True, "0": False, "false": False, "no": False, "off": False}


class _Bad(ValueError):
    """Internal: a value failed to parse/validate; the message says what is accepted."""


def parse_size(text: str) -> int:
    """``"32768"``, ``"32K"``, ``"1M"``, ``"1GiB"`` -> bytes (binary suffixes)."""
    m = _SIZE_RE.match(text.strip())
    if not m:
        raise _Bad("expected an integer byte count, optionally with suffix K, M or G (KiB/MiB/GiB), e.g. 256K")
    mult = {None: 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30}[m.group(2) and m.group(2).lower()]
    return int(m.group(1)) * mult


def parse_bandwidth(text: str) -> float:
    """``"370e9"``, ``"370G"``, ``"50GB/s"`` -> bytes/s (decimal suffixes)."""
    m = _BW_RE.match(text.strip())
    if not m:
        raise _Bad("expected bytes/s as a number (e.g. 370e9) or with suffix K, M, G or T (10^3..10^12, e.g. 370G)")
    mult = {None: 1.0, "k": 1e3, "m": 1e6, "g": 1e9, "t": 1e12}[m.group(2) and m.group(2).lower()]
    return float(m.group(1)) * mult


def parse_bool(text: str) -> bool:
    """``1/0, true/false, yes/no, on/off`` (case-insensitive) -> bool."""
    v = _BOOL.get(text.strip().lower())
    if v is None:
        raise _Bad("expected one of 1, 0, true, false, yes, no, on, off")
    return v


def _parse_int(text: str) -> int:
    try:
        return int(text.strip(), 10)
    except ValueError:
        raise _Bad("expected an integer") from None


def _parse_sms(text: str) -> int:
    return 0 if text.strip().lower() == "auto" else _parse_int(text)


def _parse_float(text: str) -> float:
    try:
        return float(text.strip())
    except ValueError:
        raise _Bad("expected a number, e.g. 30 or 2.5") from None


def parse_domain(text: str) -> str:
    """``"node0"`` or ``"a,a,b,b"`` -> the declaration with blanks around keys removed."""
    keys = [k.strip() for k in text.split(",")]
    if len(keys) > MAX_DOMAIN_KEYS:
        raise _Bad(f"expected at most {MAX_DOMAIN_KEYS} comma-separated keys")
    bad = [k for k in keys if not _DOMAIN_KEY_RE.match(k)]
    if bad:
        raise _Bad(
            f"key {bad[0]!r} is not 1 to 128 characters from A-Z a-z 0-9 . _ : / @ + -; expected a key "
            "(e.g. node0) or one key per rank separated by commas (e.g. a,a,b,b)"
        )
    return ",".join(keys)


def domain_keys(declared: str) -> list[str]:
    """The keys of a (parsed) ``domain`` declaration: one key, or one per rank; ``[]`` if empty."""
    return declared.split(",") if declared else []


def _choice(options: tuple[str, ...]) -> Callable[[str], str]:
    def parse(text: str) -> str:
        v = text.strip().lower()
        if v not in options:
            raise _Bad(f"expected one of {', '.join(options)}")
        return v

    return parse
