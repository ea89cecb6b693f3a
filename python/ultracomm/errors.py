"""Exception types raised by the ultracomm Python layer.

Every error derives from :class:`UltracommError` (a ``RuntimeError``), so
``except UltracommError`` catches all of them.  Errors about bad user input also
derive from ``ValueError`` so that generic input-validation handlers keep working.

Timeouts waiting on a peer are raised by the C++ core as
``ultracomm._core.TimeoutError``; they are not defined here.
"""
from __future__ import annotations

__all__ = [
    "UltracommError",
    "PlanError",
    "LayoutError",
    "ConfigError",
    "RegistrationError",
]


class UltracommError(RuntimeError):
    """Base class of all ultracomm errors."""


class PlanError(UltracommError, ValueError):
    """A replica plan is invalid (bad shape, dtype, expert id, placement) or
    differs across ranks."""


class LayoutError(UltracommError, ValueError):
    """An expert layout (members, dtypes, alignment) is invalid."""


class ConfigError(UltracommError, ValueError):
    """An ``ULTRACOMM_*`` environment variable or per-call override is invalid."""


class RegistrationError(UltracommError, ValueError):
    """Tensors registered with a context do not match the expert layout."""
