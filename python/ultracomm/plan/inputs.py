"""What a plan's constructors and converters accept: integer tensors, ndarrays or nested lists,
converted to int64 numpy arrays, with a :class:`~ultracomm.errors.PlanError` naming the input
when a value is not an integer or does not fit in int32."""

from __future__ import annotations

from typing import Any, Sequence, Union

import numpy as np
import torch

from ..errors import PlanError

ArrayLike = Union[torch.Tensor, np.ndarray, Sequence[Any]]

_INT32_MIN, _INT32_MAX = -(2**31), 2**31 - 1


def _to_numpy(x: ArrayLike, name: str, *, allow_bool: bool = False) -> np.ndarray:
    """Convert a tensor / ndarray / nested list to an int64 numpy array.

    Floats, complex and (unless ``allow_bool``) bools are rejected with a PlanError
    naming ``name``.  Empty lists are accepted as integer.
    """
    if isinstance(x, torch.Tensor):
        t = x.detach()
        if t.device.type == "meta":
            raise PlanError(f"{name} is a meta tensor (it holds no values); pass it on the CPU or a GPU")
        if t.dtype == torch.bool:
            if not allow_bool:
                raise PlanError(
                    f"{name} must hold integer expert ids, got a torch.bool tensor; convert it with .to(torch.int32)"
                )
            return t.cpu().numpy().astype(np.int64)
        if t.is_floating_point() or t.is_complex():
            raise PlanError(
                f"{name} must hold integers, got dtype {t.dtype}; expert ids are integers "
                "(-1 marks an empty slot): convert with .to(torch.int32) if the values are whole"
            )
        return _as_int64(t.cpu().numpy(), name)
    arr = np.asarray(x)
    if arr.size == 0 and not isinstance(x, np.ndarray):
        arr = arr.astype(np.int64)
    if arr.dtype == np.bool_:
        if not allow_bool:
            raise PlanError(f"{name} must hold integer expert ids, got booleans; convert to int32")
        return arr.astype(np.int64)
    if arr.dtype.kind in "fO" and not isinstance(x, np.ndarray) and _all_python_ints(x):
        raise PlanError(f"{name} has values outside the int32 range")  # numpy fell back to float/object
    if arr.dtype.kind not in "iu":
        raise PlanError(
            f"{name} must hold integers, got dtype {arr.dtype}; expert ids are integers (-1 marks an empty slot)"
        )
    return _as_int64(arr, name)


def _all_python_ints(x: Any) -> bool:
    """``x`` is a (nested) sequence of Python ints (bools excluded)."""
    items = np.asarray(x, dtype=object).ravel()
    return bool(items.size) and all(isinstance(v, (int, np.integer)) and not isinstance(v, bool) for v in items)


def _as_int64(arr: np.ndarray, name: str) -> np.ndarray:
    """``arr`` as int64; unsigned values that int64 cannot hold (e.g. uint64 2^64-1, which a
    plain cast turns into -1, an empty slot) are rejected instead of wrapped."""
    if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT32_MAX:
        raise PlanError(f"{name} has values outside the int32 range (largest {int(arr.max())})")
    return arr.astype(np.int64)


def _check_int32_range(a: np.ndarray, name: str) -> None:
    if a.size and (a.min() < _INT32_MIN or a.max() > _INT32_MAX):
        raise PlanError(f"{name} has values outside the int32 range")
