"""``host_shm`` windows: POSIX shared memory (``/dev/shm``) mapped by every rank of a group.

Lifecycle, so that nothing is left in ``/dev/shm``: each rank creates its segment, the
names are exchanged over the group, every rank maps every peer's segment, and after a
barrier each rank unlinks its own name.  From then on the memory lives only in the
mappings and disappears with the last process, however it exits.  A crash in the short
window before the unlink leaves a segment whose name carries the dead pid; the next
``create`` on the machine removes such leftovers.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import re
import time
import uuid

import torch

from ..comm import Comm
from .base import Window

SHM_DIR = "/dev/shm"
_PREFIX = "ultracomm-"
_NAME = re.compile(r"^ultracomm-(\d+)-[0-9a-f]+-r\d+$")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


STALE_AFTER_S = 600.0  # a live segment is unlinked seconds after creation; older ones are leftovers


def sweep_stale_segments(shm_dir: str = SHM_DIR, min_age_s: float = STALE_AFTER_S) -> list[str]:
    """Unlink ultracomm segments whose creating process is gone; return their names.

    A pid is only meaningful in its own pid namespace (containers may share /dev/shm), so a
    segment must also be older than ``min_age_s``: a live job unlinks its names within
    seconds of creating them, so an old named segment is a leftover either way.
    """
    removed = []
    try:
        names = os.listdir(shm_dir)
    except FileNotFoundError:
        return removed
    now = time.time()
    for name in names:
        m = _NAME.match(name)
        if not m:
            continue
        try:
            age = now - os.stat(os.path.join(shm_dir, name)).st_mtime
        except FileNotFoundError:
            continue
        if age >= min_age_s and not _pid_alive(int(m.group(1))):
            try:
                os.unlink(os.path.join(shm_dir, name))
                removed.append(name)
            except FileNotFoundError:
                pass
    return removed


def _map(path: str, nbytes: int, create: bool) -> mmap.mmap:
    flags = os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0)
    fd = os.open(path, flags, 0o600)
    try:
        if create:
            os.ftruncate(fd, nbytes)
            try:  # reserve the pages now: tmpfs over-commits, and a full /dev/shm would SIGBUS later
                os.posix_fallocate(fd, 0, nbytes)
            except OSError as e:
                raise RuntimeError(
                    f"ultracomm: cannot reserve {nbytes} bytes in {SHM_DIR} for the host_shm window ({e}); "
                    f"free space there or enlarge it (containers: --shm-size)") from e
        elif os.fstat(fd).st_size != nbytes:
            raise ValueError(
                f"ultracomm: shared-memory segment {path} has {os.fstat(fd).st_size} bytes, expected {nbytes}: "
                "ranks disagree on the window size (different layouts or slots_per_rank?)"
            )
        return mmap.mmap(fd, nbytes, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        os.close(fd)


class HostShmWindow(Window):
    provider = "host_shm"

    def __init__(self, rank: int, world: int, nbytes: int, maps: list[mmap.mmap], views: list[torch.Tensor]):
        self.rank, self.world, self.nbytes = rank, world, nbytes
        self._maps = maps
        self._views = views
        self.local = views[rank]
        self.peer_bases = [v.data_ptr() for v in views]

    @classmethod
    def create(cls, comm: Comm, nbytes: int) -> "HostShmWindow":
        if not os.path.isdir(SHM_DIR):
            raise RuntimeError(f"ultracomm: host_shm needs {SHM_DIR} (POSIX shared memory); it is missing here")
        sweep_stale_segments()
        name = f"{_PREFIX}{os.getpid()}-{uuid.uuid4().hex[:12]}-r{comm.rank}"
        path = os.path.join(SHM_DIR, name)
        error: Exception | None = None
        try:
            own = _map(path, nbytes, create=True)
        except (OSError, RuntimeError) as e:
            error = e
        try:
            # collective even when this rank failed, so that no peer waits for it
            names = comm.all_gather_object(None if error else name)
            if error is not None:
                raise error
            failed = [r for r, n in enumerate(names) if n is None]
            if failed:
                raise RuntimeError(f"ultracomm: ranks {failed} could not create their host_shm window")
            maps = [own if r == comm.rank else _map(os.path.join(SHM_DIR, n), nbytes, create=False)
                    for r, n in enumerate(names)]
            comm.barrier()  # every peer has mapped our segment: the name is no longer needed
        finally:
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
        views = [torch.frombuffer(m, dtype=torch.uint8) for m in maps]
        return cls(comm.rank, comm.world, nbytes, maps, views)

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
