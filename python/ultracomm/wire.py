"""Strict byte format of the values ranks exchange through the process group's store.

The store is reachable by any local process that can connect to torchrun's port, so what
comes back from it is parsed, never unpickled: a value is a small tree of ``None``, ``bool``,
``int`` (int64 or uint64 range), ``float``, ``str``, ``bytes``, ``list``, ``tuple``, ``dict``
with ``str`` keys, numpy arrays of plain numeric dtypes, and the dataclasses registered in
:data:`DATACLASSES` (by name, field by field; :func:`register`).  Anything else cannot be encoded (a clear
``TypeError`` on the sending rank); anything malformed, truncated, too deep or too large
cannot be decoded (:class:`WireError` naming what is wrong).

Layout: ``b"UCW1"`` then one item.  An item is a one-byte tag and its payload, little endian:

====  ===============================================================
tag   payload
====  ===============================================================
N     (None)
T F   (True / False)
i     int64
q     uint64 (ints from 2**63 to 2**64 - 1: digests)
d     float64
s b   u32 length, then UTF-8 text / raw bytes
l t   u32 count, then the items (list / tuple)
m     u32 count, then key (an ``s`` item) and value, alternately
a     dtype code (u8), ndim (u8), shape (u64 each), then the raw C-order bytes
c     class name (an ``s`` item), then its fields as an ``m`` item
====  ===============================================================
"""

from __future__ import annotations

import dataclasses
import struct
from typing import Any

import numpy as np
from .errors import InputError, InputTypeError

__all__ = ["encode", "decode", "register", "WireError", "DATACLASSES", "MAX_BYTES", "MAX_DEPTH"]

MAGIC = b"UCW1"
MAX_BYTES = 1 << 30  #: largest message decoded (1 GiB)
MAX_DEPTH = 32  #: deepest nesting decoded
_DTYPES = (
    "bool",
    "int8",
    "uint8",
    "int16",
    "uint16",
    "int32",
    "uint32",
    "int64",
    "uint64",
    "float16",
    "float32",
    "float64",
)


class WireError(ValueError):
    """A store value that is not a well-formed ultracomm message."""


#: classes that may travel (name -> class); each module that defines one registers it at import
#: (:func:`register`: ``ultracomm.dataplane.domains`` registers ``RankDomain``)
DATACLASSES: dict[str, type] = {}


def register(cls: type) -> type:
    """Let dataclass ``cls`` travel by its name (field by field); returns ``cls`` (a decorator too).
    The module defining it calls this at import, so this low module names no class above it."""
    if not (isinstance(cls, type) and dataclasses.is_dataclass(cls)):
        raise InputTypeError(f"ultracomm wire: only dataclasses can be registered, got {cls!r}")
    prior = DATACLASSES.get(cls.__name__)
    if prior is not None and (prior.__module__, prior.__qualname__) != (cls.__module__, cls.__qualname__):
        raise InputError(
            f"ultracomm wire: another class named {cls.__name__} is registered "
            f"({prior.__module__}.{prior.__qualname__})"
        )
    DATACLASSES[cls.__name__] = cls  # the same class again: its module was reloaded
    return cls


# ------------------------------------------------------------------ encode
def encode(value: Any) -> bytes:
    """``value`` as bytes (see the module docstring); ``TypeError`` for what cannot travel."""
    out = [MAGIC]
    _enc(value, out, 0)
    return b"".join(out)


def _u32(n: int) -> bytes:
    if n >= 1 << 32:
        raise InputTypeError(f"ultracomm wire: {n} items or bytes is too many for one message")
    return struct.pack("<I", n)


def _enc(v: Any, out: list, depth: int) -> None:
    if depth > MAX_DEPTH:
        raise InputTypeError(f"ultracomm wire: nesting deeper than {MAX_DEPTH}")
    if v is None:
        out.append(b"N")
    elif isinstance(v, (bool, np.bool_)):
        out.append(b"T" if v else b"F")
    elif isinstance(v, (int, np.integer)):
        v = int(v)
        if -(1 << 63) <= v < (1 << 63):
            out.append(b"i" + struct.pack("<q", v))
        elif (1 << 63) <= v < (1 << 64):
            out.append(b"q" + struct.pack("<Q", v))
        else:
            raise InputTypeError(f"ultracomm wire: int {v} is outside the int64/uint64 range")
    elif isinstance(v, (float, np.floating)):
        out.append(b"d" + struct.pack("<d", float(v)))
    elif isinstance(v, str):
        data = v.encode("utf-8")
        out.append(b"s" + _u32(len(data)) + data)
    elif isinstance(v, (bytes, bytearray, memoryview)):
        data = bytes(v)
        out.append(b"b" + _u32(len(data)) + data)
    elif isinstance(v, np.ndarray):
        name = v.dtype.name
        if name not in _DTYPES or v.ndim > 8:
            raise InputTypeError(f"ultracomm wire: numpy array of dtype {name} with {v.ndim} dims cannot travel")
        out.append(
            b"a"
            + bytes([_DTYPES.index(name), v.ndim])
            + struct.pack(f"<{v.ndim}Q", *v.shape)
            + np.ascontiguousarray(v).astype(v.dtype.newbyteorder("<"), copy=False).tobytes()
        )
    elif isinstance(v, (list, tuple)):
        out.append((b"l" if isinstance(v, list) else b"t") + _u32(len(v)))
        for x in v:
            _enc(x, out, depth + 1)
    elif isinstance(v, dict):
        out.append(b"m" + _u32(len(v)))
        for k, x in v.items():
            if not isinstance(k, str):
                raise InputTypeError(f"ultracomm wire: dict key {k!r} is not a str")
            _enc(k, out, depth + 1)
            _enc(x, out, depth + 1)
    elif dataclasses.is_dataclass(v) and DATACLASSES.get(type(v).__name__) is type(v):
        out.append(b"c")
        _enc(type(v).__name__, out, depth + 1)
        _enc({f.name: getattr(v, f.name) for f in dataclasses.fields(v)}, out, depth + 1)
    else:
        raise InputTypeError(
            f"ultracomm wire: a {type(v).__name__} cannot travel between ranks (allowed: None, bool, "
            "int, float, str, bytes, list, tuple, dict, numpy arrays, registered dataclasses)"
        )


# ------------------------------------------------------------------ decode
class _Reader:
    def __init__(self, data: bytes):
        self.data, self.pos = data, 0

    def take(self, n: int, what: str) -> bytes:
        if n < 0 or self.pos + n > len(self.data):
            raise WireError(
                f"ultracomm wire: truncated message: {what} needs {n} bytes at offset {self.pos}, "
                f"{len(self.data) - self.pos} left"
            )
        b = self.data[self.pos : self.pos + n]
        self.pos += n
        return b

    def u32(self, what: str) -> int:
        return struct.unpack("<I", self.take(4, what))[0]


def decode(data: bytes) -> Any:
    """The value ``data`` encodes; :class:`WireError` for anything else (a pickle, garbage,
    a truncated or oversized message, trailing bytes)."""
    if not isinstance(data, (bytes, bytearray)):
        raise WireError(f"ultracomm wire: expected bytes, got {type(data).__name__}")
    if len(data) > MAX_BYTES:
        raise WireError(f"ultracomm wire: message of {len(data)} bytes is larger than {MAX_BYTES}")
    if bytes(data[:4]) != MAGIC:
        raise WireError(
            f"ultracomm wire: not an ultracomm message (starts with {bytes(data[:4])!r}, expected "
            f"{MAGIC!r}); something else wrote this store key"
        )
    r = _Reader(bytes(data))
    r.pos = 4
    v = _dec(r, 0)
    if r.pos != len(r.data):
        raise WireError(f"ultracomm wire: {len(r.data) - r.pos} trailing bytes after the value")
    return v


def _dec(r: _Reader, depth: int) -> Any:
    if depth > MAX_DEPTH:
        raise WireError(f"ultracomm wire: nesting deeper than {MAX_DEPTH}")
    tag = r.take(1, "a tag")
    if tag == b"N":
        return None
    if tag in (b"T", b"F"):
        return tag == b"T"
    if tag == b"i":
        return struct.unpack("<q", r.take(8, "an int64"))[0]
    if tag == b"q":
        return struct.unpack("<Q", r.take(8, "a uint64"))[0]
    if tag == b"d":
        return struct.unpack("<d", r.take(8, "a float64"))[0]
    if tag == b"s":
        try:
            return r.take(r.u32("a str length"), "a str").decode("utf-8")
        except UnicodeDecodeError as e:
            raise WireError(f"ultracomm wire: a str that is not UTF-8 ({e})") from None
    if tag == b"b":
        return r.take(r.u32("a bytes length"), "bytes")
    if tag in (b"l", b"t"):
        n = r.u32("a count")
        if n > len(r.data) - r.pos:  # every item takes at least one byte
            raise WireError(f"ultracomm wire: a sequence of {n} items in {len(r.data) - r.pos} bytes")
        items = [_dec(r, depth + 1) for _ in range(n)]
        return items if tag == b"l" else tuple(items)
    if tag == b"m":
        n = r.u32("a count")
        if 2 * n > len(r.data) - r.pos:
            raise WireError(f"ultracomm wire: a dict of {n} entries in {len(r.data) - r.pos} bytes")
        out = {}
        for _ in range(n):
            k = _dec(r, depth + 1)
            if not isinstance(k, str):
                raise WireError(f"ultracomm wire: a dict key that is a {type(k).__name__}, not a str")
            out[k] = _dec(r, depth + 1)
        return out
    if tag == b"a":
        code, ndim = r.take(2, "an array header")
        if code >= len(_DTYPES) or ndim > 8:
            raise WireError(f"ultracomm wire: array dtype code {code} / {ndim} dims are not valid")
        shape = struct.unpack(f"<{ndim}Q", r.take(8 * ndim, "an array shape"))
        dtype = np.dtype(_DTYPES[code]).newbyteorder("<")
        count = 1
        for s in shape:
            count *= s
        nbytes = count * dtype.itemsize
        return np.frombuffer(r.take(nbytes, "array data"), dtype=dtype).reshape(shape).astype(dtype.newbyteorder("="))
    if tag == b"c":
        name = _dec(r, depth + 1)
        cls = DATACLASSES.get(name) if isinstance(name, str) else None
        if cls is None:
            raise WireError(f"ultracomm wire: class {name!r} may not travel (registered: {sorted(DATACLASSES)})")
        fields = _dec(r, depth + 1)
        want = {f.name for f in dataclasses.fields(cls)}
        if not isinstance(fields, dict) or set(fields) != want:
            raise WireError(
                f"ultracomm wire: {name} needs fields {sorted(want)}, got "
                f"{sorted(fields) if isinstance(fields, dict) else type(fields).__name__}"
            )
        return cls(**fields)
    raise WireError(f"ultracomm wire: unknown tag {tag!r} at offset {r.pos - 1}")
