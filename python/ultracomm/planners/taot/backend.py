"""Which implementation runs TAOT's loops: the compiled core (``ultracomm._core.taot_matching`` /
``taot_auction`` / ``taot_consolidate`` / ``taot_run``, csrc/planners/taot*.cpp) when it has them,
else the numpy reference; ``backend="cpp"`` / ``"numpy"`` chooses explicitly.  Both give
bit-identical plans."""

from __future__ import annotations
from ...errors import InputError, UltracommError

try:  # compiled loops (csrc/planners/taot.cpp); numpy reference otherwise
    from ... import _core as _core_mod

    _HAVE_CPP = all(hasattr(_core_mod, f) for f in ("taot_auction", "taot_matching", "taot_run"))
except ImportError:  # pragma: no cover - core not built
    _core_mod = None
    _HAVE_CPP = False


def _use_cpp(backend: str | None) -> bool:
    if backend is None or backend == "auto":
        return _HAVE_CPP
    if backend == "cpp":
        if not _HAVE_CPP:
            raise UltracommError("ultracomm._core has no TAOT loops; rebuild the core")
        return True
    if backend == "numpy":
        return False
    raise InputError(f"backend must be 'auto', 'cpp' or 'numpy', got {backend!r}")
