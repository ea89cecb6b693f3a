"""What the trace readers (:func:`~ultracomm.profile.load_trace`, ``python -m ultracomm.tools.whatif``,
``python -m ultracomm.viewer``) accept, checked before anything large is read or allocated.

Traces come from other machines and other people: a reader must end, in bounded time and
memory, with one clear line naming the file or option and what is wrong (:class:`TraceError`).
So: only regular files are opened (a FIFO would block forever), files a trace names stay
inside its directory (no ``..``, no absolute path, no symlink leaving it), ``.npz`` members are
size-checked before they are decompressed (a bomb is refused, not inflated), JSON is checked
for shape and type, and shapes and counts are bounded before planners or arrays see them.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import stat
import zipfile
from pathlib import Path
from typing import Any, BinaryIO, Iterator

import numpy as np

from ..errors import InputError, UltracommError
from .fields import empty_arrays

__all__ = [
    "TraceError",
    "MAX_WORLD",
    "MAX_EXPERTS",
    "MAX_SLOTS",
    "MAX_INDEX_BYTES",
    "MAX_ARRAY_BYTES",
    "MAX_COUNT",
    "RECORD_ARRAYS",
    "read_regular",
    "member_path",
    "load_npz",
    "read_npy",
    "load_counts",
    "check_index",
    "check_counts",
    "bounded_int",
    "output_path",
]

MAX_WORLD = 1 << 16  #: EP ranks a trace may describe
MAX_EXPERTS = 1 << 20  #: experts per layer
MAX_SLOTS = 1 << 10  #: replica slots per rank
MAX_INDEX_BYTES = 16 << 20  #: an index.json larger than this is refused
MAX_ARRAY_BYTES = 4 << 30  #: decompressed bytes of one .npz / .npy (all members)
MAX_COUNT = 1 << 48  #: tokens in one count (the planners' bound, ultracomm.planners.base.MAX_LOAD_TOTAL)
#: arrays every records file holds (the recorder writes them all; readers index them without asking)
RECORD_ARRAYS = tuple(empty_arrays(0, 0, 0))


class TraceError(UltracommError, ValueError):
    """A trace file or option that cannot be read as given (the message says which and why)."""

    def __init__(self, *args: object) -> None:
        if args and isinstance(args[0], str) and not args[0].startswith("ultracomm"):
            args = ("ultracomm.profile: " + args[0], *args[1:])
        super().__init__(*args)


def _open_regular(path: Path, what: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    except FileNotFoundError:
        raise TraceError(f"{path}: {what} does not exist") from None
    except OSError as e:
        raise TraceError(f"{path}: cannot open {what} ({e.strerror})") from None
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):
        os.close(fd)
        raise TraceError(f"{path}: {what} is not a regular file")
    return fd


@contextlib.contextmanager
def regular_file(path: Path, what: str, limit: int) -> Iterator[BinaryIO]:
    """Regular file ``path`` open for reading, at most ``limit`` bytes (FIFOs, devices and
    directories are refused without blocking)."""
    fd = _open_regular(path, what)
    try:
        size = os.fstat(fd).st_size
        if size > limit:
            raise TraceError(f"{path}: {what} is {size} bytes, more than the {limit} this reader accepts")
        with os.fdopen(fd, "rb", closefd=False) as f:
            yield f
    finally:
        os.close(fd)


def read_regular(path: Path, what: str, limit: int) -> bytes:
    """The bytes of regular file ``path`` (see :func:`regular_file`)."""
    with regular_file(path, what, limit) as f:
        return f.read(limit + 1)


def member_path(root: Path, name: Any, what: str) -> Path:
    """``root / name`` for a file name an index lists: a relative name that stays inside
    ``root`` after symlinks are resolved."""
    if not isinstance(name, str) or not name or "\x00" in name:
        raise TraceError(f"{root}: {what} must be a file name (a non-empty string), got {name!r}")
    p = Path(name)
    if p.is_absolute() or ".." in p.parts:
        raise TraceError(
            f"{root}: {what} {name!r} leaves the trace directory (absolute or '..'); a trace's files stay inside it"
        )
    full = root / p
    try:
        inside = full.resolve(strict=False).is_relative_to(root.resolve(strict=False))
    except OSError as e:
        raise TraceError(f"{root}: cannot resolve {what} {name!r} ({e})") from None
    if not inside:
        raise TraceError(f"{root}: {what} {name!r} is a symlink that leaves the trace directory")
    return full


def load_npz(path: Path, what: str, limit: int = MAX_ARRAY_BYTES, skip: tuple = ()) -> dict[str, np.ndarray]:
    """The arrays of ``.npz`` file ``path``: members and their decompressed sizes are checked in
    the zip directory first (a decompression bomb is refused before inflating), no pickles."""
    fd = _open_regular(path, what)
    try:
        with os.fdopen(fd, "rb", closefd=False) as f:
            try:
                zf = zipfile.ZipFile(f)
            except (zipfile.BadZipFile, OSError, ValueError) as e:
                raise TraceError(f"{path}: {what} is not a readable .npz ({e})") from None
            with zf:
                infos = zf.infolist()
                total = sum(i.file_size for i in infos)
                if total > limit:
                    raise TraceError(
                        f"{path}: {what} would decompress to {total} bytes, more than the {limit} this reader accepts"
                    )
                out = {}
                for info in infos:
                    if not info.filename.endswith(".npy"):
                        raise TraceError(f"{path}: {what} holds {info.filename!r}, not a .npy array")
                    if info.filename[:-4] in skip:
                        continue
                    where = f"{path}: {what} member {info.filename!r}"
                    try:
                        with zf.open(info) as m:
                            out[info.filename[:-4]] = read_npy(m, info.file_size, where)
                    except TraceError:
                        raise
                    except (ValueError, OSError, zipfile.BadZipFile, EOFError) as e:
                        raise TraceError(f"{where} is not a valid array ({e})") from None
                return out
    finally:
        os.close(fd)


def read_npy(f: BinaryIO, size: int, where: str) -> np.ndarray:
    """The array of ``.npy`` stream ``f`` (``size`` bytes, header included; no pickles).

    numpy allocates the shape a header claims before reading the data, so a header that
    claims 10**12 elements in a small file ends in MemoryError: the claim is compared to the
    bytes that follow the header first.  Other malformed headers raise ValueError."""
    version = np.lib.format.read_magic(f)
    read_header = {(1, 0): np.lib.format.read_array_header_1_0, (2, 0): np.lib.format.read_array_header_2_0}.get(
        version
    )
    if read_header is None:  # 3.0 only differs for non-latin-1 field names, never token counts
        raise InputError(f"unsupported .npy format version {version[0]}.{version[1]}")
    shape, _, dtype = read_header(f)
    claimed, left = math.prod(shape) * dtype.itemsize, size - f.tell()
    if not dtype.hasobject and claimed > left:  # object arrays: read_array refuses the pickle below
        raise TraceError(
            f"{where} has a .npy header that claims shape {shape} {dtype} ({claimed} bytes) but only "
            f"{left} bytes follow it; the file is truncated or damaged: write it again (numpy.save)"
        )
    f.seek(0)
    return np.lib.format.read_array(f, allow_pickle=False)


def load_counts(path: Path) -> np.ndarray:
    """The routing-statistics array of a ``.npy`` (or the first array of a ``.npz``) file."""
    what = "the routing-statistics file"
    if path.suffix == ".npz":
        arrays = load_npz(path, what)
        if not arrays:
            raise TraceError(f"{path}: {what} holds no array")
        a = next(iter(arrays.values()))
    else:
        with regular_file(path, what, MAX_ARRAY_BYTES) as f:
            try:
                a = read_npy(f, os.fstat(f.fileno()).st_size, f"{path}: {what}")
            except TraceError:
                raise
            except (ValueError, OSError, EOFError) as e:
                raise TraceError(f"{path}: {what} is not a valid .npy array ({e})") from None
    return check_counts(a, f"{path}: {what}")


def check_counts(a: Any, where: str) -> np.ndarray:
    """``a`` as int64 token counts: integers, non-negative, each at most :data:`MAX_COUNT`."""
    a = np.asarray(a)
    if a.dtype.kind not in "iu":
        raise TraceError(f"{where} must hold integer token counts, got dtype {a.dtype}")
    if a.size:
        if a.dtype.kind == "i" and int(a.min()) < 0:
            raise TraceError(f"{where} holds a negative count ({int(a.min())})")
        if int(a.max()) > MAX_COUNT:
            raise TraceError(f"{where} holds a count of {int(a.max())}, more than {MAX_COUNT} (2**48)")
    return a.astype(np.int64)


def bounded_int(v: Any, name: str, lo: int, hi: int, where: str) -> int:
    """``v`` as an int in ``[lo, hi]`` (bools and non-integers refused)."""
    if isinstance(v, bool) or not isinstance(v, (int, np.integer)) or not lo <= int(v) <= hi:
        raise TraceError(f"{where}: {name} must be an integer in [{lo}, {hi}], got {v!r}")
    return int(v)


def check_index(idx: Any, where: str) -> dict:
    """The parsed ``index.json``, checked for shape, types and bounds."""
    if not isinstance(idx, dict):
        raise TraceError(f"{where} must be a JSON object, got {type(idx).__name__}")
    files = idx.get("files")
    if not isinstance(files, list) or not all(isinstance(f, dict) and "file" in f for f in files):
        raise TraceError(
            f"{where}: 'files' must be a list of {{\"file\": name, ...}} objects, got {type(files).__name__}"
        )
    world = bounded_int(idx.get("world") or 0, "'world'", 0, MAX_WORLD, where)
    E = bounded_int(idx.get("num_experts") or 0, "'num_experts'", 0, MAX_EXPERTS, where)
    if files and (world < 1 or E < 1):
        raise TraceError(f"{where}: a trace with records needs world >= 1 and num_experts >= 1, got {world} and {E}")
    if world and E % world:
        raise TraceError(f"{where}: num_experts {E} does not divide over world {world}")
    epr = bounded_int(
        idx.get("experts_per_rank") or (E // world if world else 0), "'experts_per_rank'", 0, MAX_EXPERTS, where
    )
    if world and epr * world != E:
        raise TraceError(f"{where}: experts_per_rank {epr} x world {world} != num_experts {E}")
    bounded_int(idx.get("slots_per_rank") or 0, "'slots_per_rank'", 0, MAX_SLOTS, where)
    if idx.get("detail") not in ("full", "experts"):
        raise TraceError(f'{where}: \'detail\' must be "full" or "experts", got {idx.get("detail")!r}')
    node_of = idx.get("node_of")
    if node_of and (
        not isinstance(node_of, list)
        or len(node_of) != world
        or not all(isinstance(n, int) and not isinstance(n, bool) and 0 <= n < MAX_WORLD for n in node_of)
    ):
        raise TraceError(f"{where}: 'node_of' must list one node index per rank ({world})")
    if idx.get("meta") is not None and not isinstance(idx.get("meta"), dict):
        raise TraceError(f"{where}: 'meta' must be a JSON object")
    bounded_int(idx.get("late_ops", 0), "'late_ops'", 0, 1 << 62, where)
    return idx


def parse_index(data: bytes, where: str) -> dict:
    try:
        return check_index(json.loads(data), where)
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise TraceError(f"{where} is not valid JSON ({e})") from None


def check_part(d: dict, world: int, E: int, S: int, where: str) -> None:
    """One records file's arrays agree with the index: same record count everywhere, and the
    per-record shapes of ``world`` ranks, ``E`` experts and ``S`` slots."""
    if "step" not in d:
        raise TraceError(f"{where} has no 'step' array: not an ultracomm trace file")
    missing = [k for k in RECORD_ARRAYS if k not in d]
    if missing:  # readers index every one of them; a KeyError later names no file
        names = ", ".join(map(repr, missing[:3])) + (f" and {len(missing) - 3} more" if len(missing) > 3 else "")
        raise TraceError(
            f"{where} lacks the array(s) {names} that every ultracomm records file holds; the file is "
            "damaged or not from ultracomm.profile: record or import the trace again"
        )
    n = d["step"].shape[0] if d["step"].ndim == 1 else -1
    want = {
        "expert_load": (n, E),
        "load": (n, world, E),
        "slot_src": (n, world, S),
        "home_of": (n, E),
        "rank_load_after": (n, world),
    }
    for k, v in d.items():
        if v.ndim == 0 or v.shape[0] != n:
            raise TraceError(f"{where}: array {k!r} has shape {v.shape}, expected {n} records first")
        if k in want and tuple(v.shape) != want[k]:
            raise TraceError(
                f"{where}: array {k!r} has shape {tuple(v.shape)}, but the index says {want[k]} "
                f"(world {world}, {E} experts, {S} slots)"
            )
    for k in ("expert_load", "load"):
        if k in d:
            check_counts(d[k], f"{where}: array {k!r}")


def output_path(path: Any, option: str) -> str:
    """An output file ``path``: its folder exists and it is not a folder itself."""
    p = Path(str(path))
    if p.is_dir():
        raise TraceError(f"{option} {path}: is a directory; give a file name")
    parent = p.parent if str(p.parent) else Path(".")
    if not parent.is_dir():
        raise TraceError(f"{option} {path}: the directory {parent} does not exist")
    return str(p)


def check_options(a: Any) -> None:
    """The numeric and path options the trace tools share (``argparse`` namespace ``a``; only
    the attributes it has are checked): one :class:`TraceError` naming the first bad one."""
    import math
    import re

    def need(ok: bool, text: str) -> None:
        if not ok:
            raise TraceError(text)

    if getattr(a, "ep", None) is not None:
        need(1 <= a.ep <= MAX_WORLD, f"--ep {a.ep}: EP ranks must be in [1, {MAX_WORLD}]")
    if hasattr(a, "slots"):
        need(1 <= a.slots <= MAX_SLOTS, f"--slots {a.slots}: replica slots per rank must be in [1, {MAX_SLOTS}]")
    if hasattr(a, "tflops"):
        need(
            math.isfinite(a.tflops) and 1e-3 <= a.tflops <= 1e7,
            f"--tflops {a.tflops:g}: achieved TFLOP/s must be a number in [0.001, 1e7]",
        )
    for name in ("max_records", "max_chunks"):  # 0 means all / exact
        if hasattr(a, name):
            v = getattr(a, name)
            need(0 <= v <= 1 << 40, f"--{name.replace('_', '-')} {v}: must be 0 (no limit) or a positive count")
    for name in ("max_cells", "max_detail", "max_points"):
        if hasattr(a, name):
            v = getattr(a, name)
            need(1 <= v <= 1 << 40, f"--{name.replace('_', '-')} {v}: must be a positive count")
    domain = getattr(a, "domain", None)
    m = re.fullmatch(r"(\d+)x8-rdma", domain.strip().lower()) if isinstance(domain, str) else None
    if m:
        need(
            1 <= int(m.group(1)) <= MAX_WORLD // 8,
            f"--domain {domain}: at most {MAX_WORLD // 8} nodes of 8 ({MAX_WORLD} ranks)",
        )
    for opt, name in (("--json", "json"), ("-o/--out", "out"), ("--screenshot", "screenshot")):
        if getattr(a, name, None):
            output_path(getattr(a, name), opt)
