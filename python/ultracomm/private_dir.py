"""Directories ultracomm writes files into on the user's behalf (the load profile), checked as
the /dev/shm segments are: only this user may write there, and nothing is written through a
link another user planted.

A directory is *private* when it is owned by this user (effective uid) and neither group- nor
world-writable; a symbolic link on the way to it counts only if this user owns the link too.
Anyone else able to write there could plant links at the names ultracomm writes, or swap the
files after they are written.  ``make_private_dir`` creates what is missing with mode 0700 and
returns an open descriptor of the checked directory: files are then created relative to it
(``dir_fd``), so a directory renamed or replaced after the check is never written into.
"""

from __future__ import annotations

import os
import stat
from typing import Optional

from .errors import UltracommError

__all__ = [
    "PrivateDirError",
    "why_not_private",
    "why_not_a_dir",
    "make_private_dir",
    "open_private",
    "create_exclusive",
]


class PrivateDirError(UltracommError, ValueError):
    """A directory is not one this user alone can write (the message says why and what to do)."""


def why_not_private(path: str) -> Optional[str]:
    """None when the existing ``path`` is a private directory, else why not (for an error).
    ``path`` must exist; a link is followed after its own owner is checked."""
    uid = os.geteuid()
    st = os.lstat(path)
    if stat.S_ISLNK(st.st_mode):
        if st.st_uid != uid:
            return (
                f"is a symbolic link owned by uid {st.st_uid}, not by this user (uid {uid}); give a directory you own"
            )
        st = os.stat(path)
    if not stat.S_ISDIR(st.st_mode):
        return "is not a directory; give a directory (created when missing)"
    if st.st_uid != uid:
        return f"is owned by uid {st.st_uid}, not by this user (uid {uid}); give a directory you own"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return (
            f"is writable by its group or by everyone (mode {stat.S_IMODE(st.st_mode):04o}); "
            "give a directory only you can write (chmod go-w)"
        )
    return None


def why_not_a_dir(path: str) -> Optional[str]:
    """Without touching the filesystem: None when ``path`` is, or could be created as, a private
    directory; else why not.  The first existing ancestor must be a directory."""
    p = os.path.abspath(path)
    if os.path.lexists(p):
        return why_not_private(p)
    parent = os.path.dirname(p)
    while parent != os.path.dirname(parent) and not os.path.lexists(parent):
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        return f"cannot be created: {parent} is not a directory"
    return None


def make_private_dir(path: str) -> None:
    """Create ``path`` (and missing parents) with mode 0700; raise PrivateDirError unless it is
    private afterwards (it may have existed, or been created by someone else in between)."""
    p = os.path.abspath(path)
    missing = []
    while not os.path.lexists(p):
        missing.append(p)
        p = os.path.dirname(p)
    for d in reversed(missing):
        try:
            os.mkdir(d, 0o700)
        except FileExistsError:  # someone else made it first: checked below like any existing one
            pass
        except OSError as e:
            raise PrivateDirError(f"{d} cannot be created: {e.strerror}") from None
    why = why_not_private(path)
    if why:
        raise PrivateDirError(f"{path} {why}")


def open_private(path: str) -> int:
    """An O_DIRECTORY descriptor of the private directory ``path``, checked through the
    descriptor itself (what is checked is what files are created in)."""
    why = why_not_private(path)
    if why:
        raise PrivateDirError(f"{path} {why}")
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    st = os.fstat(fd)
    if st.st_uid != os.geteuid() or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        os.close(fd)
        raise PrivateDirError(f"{path} changed while it was opened; give a directory only you can write")
    return fd


def create_exclusive(dir_fd: int, name: str) -> int:
    """A new file ``name`` in ``dir_fd``, mode 0600, never through a link, never an existing file."""
    return os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600, dir_fd=dir_fd)
