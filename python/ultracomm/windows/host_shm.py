"""``host_shm`` windows: POSIX shared memory (``/dev/shm``) mapped by every rank of a group.

Lifecycle, so that nothing is left in ``/dev/shm``: the ranks exchange the names they will
use, each creates its segment, every rank maps every peer's segment, and once all have
(or any step failed on any rank) every rank unlinks every name.  From then on the memory
lives only in the mappings and disappears with the last process, however it exits.  Each
step is a bounded agreement: a rank that fails or stalls makes every rank raise within the
timeout.  Only a rank killed between creating its segment and the end of setup, when no
surviving rank learnt its name, leaves a segment behind; its name carries the dead pid,
and a later ``create`` on the machine removes it once it is older than
``STALE_AFTER_S`` (600 s; pids mean nothing across pid namespaces, so age decides).  Until
then ``rm /dev/shm/ultracomm-<pid>-*`` removes it by hand.

``reach`` (optional, one bool per rank) limits the mapping to the ranks of this rank's memory
domain (the ``split`` transport): a rank on another host has a segment this one cannot open.
Unreached ranks get ``peer_bases[r] == 0``; their segments are never opened here.

Peer names are accepted only in the form this module generates, and only regular files
are mapped: a name such as ``../../some/file`` is rejected before anything is opened.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import re
import stat
import time
import uuid

import torch

from ..comm import Comm
from ..errors import InputError, PeerError, UltracommError
from .base import Window

SHM_DIR = "/dev/shm"
_PREFIX = "ultracomm-"
_NAME = re.compile(r"^ultracomm-([0-9]{1,10})-([0-9a-f]{12})-r([0-9]{1,7})$")
_PID_MAX = 2**31 - 1


def segment_name(rank: int) -> str:
    """A fresh segment name for ``rank``: ``ultracomm-<pid>-<12 hex>-r<rank>``."""
    return f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-r{rank}"


def check_segment_name(name: object, rank: int) -> str:
    """``name`` if it is a segment name this module generates for ``rank``; else ValueError."""
    m = _NAME.match(name) if isinstance(name, str) else None
    if m is None or int(m.group(3)) != rank:
        raise InputError(
            f"ultracomm: rank {rank} sent host_shm segment name {name!r}, which is not one ultracomm "
            f"generates for rank {rank} (ultracomm-<pid>-<12 hex digits>-r{rank}); refusing to open it"
        )
    return name


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OverflowError, ValueError):
        return True  # another user's process, or not a pid at all: not ours to judge
    return True


STALE_AFTER_S = 600.0  # a live segment is unlinked seconds after creation; older ones are leftovers


def sweep_stale_segments(shm_dir: str = SHM_DIR, min_age_s: float = STALE_AFTER_S) -> list[str]:
    """Unlink ultracomm segments whose creating process is gone; return their names.

    A pid is only meaningful in its own pid namespace (containers may share /dev/shm), so a
    segment must also be older than ``min_age_s``: a live job unlinks its names within
    seconds of creating them, so an old named segment is a leftover either way.

    Never raises: anything it cannot parse, stat or remove (directories, links, another
    user's files, names with absurd pids) is skipped, since anyone can write to /dev/shm.
    """
    removed: list[str] = []
    try:
        names = os.listdir(shm_dir)
    except OSError:
        return removed
    now = time.time()
    uid = os.getuid()
    for name in names:
        m = _NAME.match(name)
        if not m or int(m.group(1)) > _PID_MAX:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISREG(st.st_mode) or st.st_uid != uid:
            continue
        if now - st.st_mtime >= min_age_s and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(path)
                removed.append(name)
            except OSError:
                pass
    return removed


def _map(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | os.O_NOFOLLOW | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)  # create: FileExistsError for an entry that is not ours
    done = False
    try:
        if create:
            os.ftruncate(fd, nbytes)
            try:  # reserve the pages now: tmpfs over-commits, and a full /dev/shm would SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise UltracommError(
                    f"ultracomm: cannot reserve {nbytes} bytes in {SHM_DIR} for the host_shm window ({e}); "
                    f"free space there or enlarge it (containers: --shm-size)"
                ) from e
        else:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode):
                raise InputError(f"ultracomm: {path} is not a regular file; refusing to map it")
            if st.st_size != nbytes:
                raise InputError(
                    f"ultracomm: shared-memory segment {path} has {st.st_size} bytes, expected {nbytes}: "
                    "ranks disagree on the window size (different layouts or slots_per_rank?)"
                )
        m = mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        done = True
        return m
    finally:
        os.close(fd)
        if create and not done:  # this call created the file (O_EXCL): remove what it could not finish
            with contextlib.suppress(OSError):
                os.unlink(path)


def _unlink_own_user(names: list[str]) -> None:
    """Unlink those of ``names`` that are regular files of this user (never another user's)."""
    uid = os.getuid()
    for n in names:
        path = os.path.join(SHM_DIR, n)
        with contextlib.suppress(OSError):
            st = os.lstat(path)
            if stat.S_ISREG(st.st_mode) and st.st_uid == uid:
                os.unlink(path)


def _unlink_all(names: list[str]) -> None:
    for n in names:
        with contextlib.suppress(OSError):
            os.unlink(os.path.join(SHM_DIR, n))


class HostShmWindow(Window):
    provider = "host_shm"

    def __init__(self, rank: int, world: int, nbytes: int, maps: list[mmap.mmap], views: list[torch.Tensor | None]):
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self._maps = maps
        self._views = views
        self.local = views[rank]
        self.peer_bases = [0 if v is None else v.data_ptr() for v in views]

    @classmethod
    def create(
        cls, comm: Comm, nbytes: int, op: str = "window setup", reach: list[bool] | None = None
    ) -> "HostShmWindow":
        def choose_name() -> str:
            if not os.path.isdir(SHM_DIR):
                raise UltracommError(f"ultracomm: host_shm needs {SHM_DIR} (POSIX shared memory); it is missing here")
            sweep_stale_segments()
            return segment_name(comm.rank)

        names = comm.agree(choose_name, op=op, what="host_shm name exchange")
        # never unlinked: a name whose owner found it taken (a collision: someone else's file).  If
        # the creation step failed (a rank died in it) the peers' names are unlinked where they
        # are regular files of this user, so a dead rank's segment does not stay behind
        valid = [n for r, n in enumerate(names) if _is_name_for(n, r)]
        created: list[str] | None = None
        taken_names: set[str] = set()
        own: mmap.mmap | None = None
        maps: list[mmap.mmap | None] = []
        try:

            def create_own() -> str | None:
                nonlocal own
                for r, n in enumerate(names):  # every rank checks every name before anything is opened
                    check_segment_name(n, r)
                try:
                    own = _map(os.path.join(SHM_DIR, names[comm.rank]), nbytes, create=True)
                except FileExistsError:
                    taken_names.add(names[comm.rank])
                    return "exists"  # not ours: never unlinked
                return None

            statuses = comm.agree(create_own, op=op, what="host_shm segment creation")
            created = [n for r, n in enumerate(names) if statuses[r] is None and _is_name_for(n, r)]
            taken = [r for r, st in enumerate(statuses) if st is not None]
            if taken:
                raise UltracommError(
                    f"ultracomm: host_shm segment names of ranks {taken} already exist in {SHM_DIR} "
                    f"({', '.join(names[r] for r in taken)}): another process holds them; they were left alone. "
                    "Retry (names are random), and check what else writes to /dev/shm"
                )

            def map_peers() -> None:
                for r, n in enumerate(names):
                    if r == comm.rank:
                        maps.append(own)
                    elif reach is None or reach[r]:
                        try:
                            maps.append(_map(os.path.join(SHM_DIR, n), nbytes, create=False))
                        except FileNotFoundError:  # its owner removed it: it gave up this setup before us
                            raise PeerError(
                                f"ultracomm: {op}: rank {comm.rank} could not map rank {r}'s host_shm segment "
                                f"{os.path.join(SHM_DIR, n)}: it no longer exists, so rank {r} gave up this setup "
                                "(timed out or failed) and removed it; this rank was likely stopped meanwhile. "
                                "Create the Context again on every rank"
                            ) from None
                    else:
                        maps.append(None)

            comm.agree(map_peers, op=op, what="host_shm mapping")
        except BaseException:
            for m in {id(m): m for m in [*maps, own] if m is not None}.values():
                with contextlib.suppress(BufferError):
                    m.close()
            raise
        finally:
            # every rank has mapped every segment, or setup failed: no name is needed any more
            if created is not None:
                _unlink_all(created)
            else:
                _unlink_own_user([n for n in valid if n not in taken_names])
        views = [None if m is None else torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        return cls(comm.rank, comm.world, nbytes, [m for m in maps if m is not None], views)

    def close(self) -> None:
        # Tensors from torch.frombuffer pin the mmap's buffer; drop them first.
        self.local = torch.empty(0, dtype=torch.uint8)
        self._views = []
        self.peer_bases = []
        for m in self._maps:
            # BufferError: a user still holds a view; the mapping goes when it does
            with contextlib.suppress(BufferError):
                m.close()
        self._maps = []


def _is_name_for(name: object, rank: int) -> bool:
    try:
        check_segment_name(name, rank)
        return True
    except ValueError:
        return False


__all__ = ["HostShmWindow", "SHM_DIR", "STALE_AFTER_S", "check_segment_name", "segment_name", "sweep_stale_segments"]
