"""What this process can do on a GPU, and the one error for "asked for a GPU feature it lacks".

Importing ultracomm never needs a GPU or the ``_cuda`` module; the GPU windows and the
``tma`` transport call :func:`require` when they are asked for, so the error names what is
missing (a CPU build of torch, no visible device, ``_cuda`` not built) and what to do.
"""

from __future__ import annotations

import functools
import importlib
import struct
from types import ModuleType
from typing import Optional

import torch

from ..errors import InputError, UltracommError

__all__ = [
    "NotAvailableError",
    "torch_cuda_reason",
    "cuda_module",
    "cuda_module_reason",
    "require",
    "resolve_device",
    "cuda_runtime",
    "raise_record",
    "record_epoch",
    "make_error_record",
]


class NotAvailableError(UltracommError, ValueError):
    """A GPU transport or window was asked for where it cannot work (the text says why).
    A ``ValueError`` too: the configuration asks for something this machine cannot give."""


def torch_cuda_reason() -> Optional[str]:
    """Why torch cannot use a CUDA device here, or ``None`` when it can."""
    if torch.version.cuda is None:
        return f"torch {torch.__version__} is a CPU build (torch.version.cuda is None); install a CUDA build of torch"
    if not torch.cuda.is_available():
        return "no CUDA device is visible (torch.cuda.is_available() is False; check CUDA_VISIBLE_DEVICES)"
    return None


@functools.lru_cache(maxsize=1)
def _import_cuda() -> tuple[Optional[ModuleType], Optional[str]]:
    try:
        mod = importlib.import_module("ultracomm._cuda")
    except ImportError as e:
        return None, (
            f"ultracomm._cuda is not built or does not load ({e}); rebuild with nvcc on PATH "
            "(ULTRACOMM_BUILD_CUDA=ON pip install --no-build-isolation -e . or "
            "python scripts/build_inplace.py)"
        )
    if hasattr(mod, "set_programmatic_launch"):  # ULTRACOMM_PDL (env.py "Process-wide fields")
        from ..env import process_field

        mod.set_programmatic_launch(bool(process_field("pdl")))
    return mod, None


def cuda_module() -> Optional[ModuleType]:
    """``ultracomm._cuda`` when it is built and loads, else ``None``."""
    return _import_cuda()[0]


def cuda_module_reason() -> Optional[str]:
    """Why ``ultracomm._cuda`` cannot be used, or ``None``."""
    return _import_cuda()[1]


def require(what: str, need_module: bool = True) -> None:
    """Raise :class:`NotAvailableError` ``"<what> is not available: <reasons>"`` unless torch sees a
    CUDA device (and, with ``need_module``, ``ultracomm._cuda`` loads)."""
    reasons = [r for r in (torch_cuda_reason(), cuda_module_reason() if need_module else None) if r]
    if reasons:
        raise NotAvailableError(f"ultracomm: {what} is not available: {'; '.join(reasons)}")


def resolve_device(device: "torch.device | str | int | None") -> torch.device:
    """``None``/``"cuda"`` -> the current CUDA device; ``"cuda:N"``/``N`` -> that one (checked)."""
    if device is None:
        device = "cuda"
    dev = torch.device(device) if not isinstance(device, int) else torch.device("cuda", device)
    if dev.type != "cuda":
        raise InputError(f"ultracomm: expected a CUDA device, got {dev}")
    if dev.index is None:
        dev = torch.device("cuda", torch.cuda.current_device())
    if not 0 <= dev.index < torch.cuda.device_count():
        raise InputError(f"ultracomm: device {dev} does not exist here ({torch.cuda.device_count()} visible)")
    return dev


def cuda_runtime(device: int, what: str = "the tma transport") -> ModuleType:
    """``ultracomm._cuda`` when it can run on CUDA device ``device`` (built, torch sees a GPU,
    driver present, sm_80 or newer); else :class:`NotAvailableError` naming what is missing."""
    require(what)
    mod = cuda_module()
    ok, why = mod.available(int(device))
    if not ok:
        raise NotAvailableError(f"ultracomm: {what} is not available: {why}")
    return mod


# ErrorRecord (include/ultracomm/records/error_record.h, 72 bytes, as _cuda's Runner.take_error returns
# it): code, rank, op, flag_kind, task, expert, chunk, slot, peer, epoch, observed, expected,
# peer_ready.
_RECORD = struct.Struct("<IiB3xIqiiiiQQQQ")
_TIMEOUT, _DIGEST_MISMATCH, _REJECTED = 1, 2, 3
_NOT_READ = 0xFFFFFFFFFFFFFFFF


def make_error_record(
    code: int,
    rank: int,
    op: int,
    epoch: int,
    *,
    flag_kind: int = 0,
    task: int = -1,
    expert: int = -1,
    chunk: int = -1,
    slot: int = -1,
    peer: int = -1,
    observed: int = _NOT_READ,
    expected: int = _NOT_READ,
    peer_ready: int = _NOT_READ,
) -> bytes:
    """A raw ErrorRecord (what a kernel writes), e.g. for a failure the host side detects."""
    return _RECORD.pack(
        code, rank, op, flag_kind, task, expert, chunk, slot, peer, epoch, observed, expected, peer_ready
    )


def record_epoch(record: bytes) -> int:
    """The epoch of a raw ErrorRecord (the launch that failed)."""
    return struct.unpack_from("<Q", record, 40)[0]


def raise_record(record: bytes, op_name: Optional[str], timeout_s: float) -> None:
    """Raise what the host executor raises for this raw ErrorRecord: ``UltracommTimeout`` for a
    timeout, ``PlanError`` when a peer runs another plan or rejected its plan (both through
    ``_core.raise_error_record``, the host executor's own text), :class:`UltracommError` else."""
    from .. import _core

    code = struct.unpack_from("<I", record, 0)[0]
    if code in (_TIMEOUT, _DIGEST_MISMATCH, _REJECTED):
        _core.raise_error_record(record, op_name, float(timeout_s))
    raise UltracommError(_core.format_error(record, op_name, float(timeout_s)))
