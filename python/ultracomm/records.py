"""numpy views of the C++ task records in ``include/ultracomm/records/task.h``.

``TASK_DTYPE`` matches ``ultracomm::Task`` byte for byte (48 bytes), ``REF_DTYPE`` matches
``ultracomm::Ref``.  Schedules hand their task lists out as arrays of these dtypes and the
host executor takes them back without copying.
"""

from __future__ import annotations

import enum

import numpy as np

REF_DTYPE = np.dtype([("rank", "<i4"), ("slot", "<i4")])

TASK_DTYPE = np.dtype(
    [
        ("kind", "u1"),
        ("reserved0", "u1"),
        ("level", "<u2"),
        ("expert", "<i4"),
        ("chunk", "<i4"),
        ("ref_begin", "<i4"),
        ("ref_count", "<i4"),
        ("reserved1", "<i4"),
        ("offset", "<u8"),
        ("bytes", "<u8"),
        ("self_rank", "<i4"),
        ("self_slot", "<i4"),
    ]
)
assert TASK_DTYPE.itemsize == 48 and REF_DTYPE.itemsize == 8

MASTER = -1  # slot index meaning "the home's master copy" (kMaster)


class Op(enum.IntEnum):
    MULTICAST = 0
    REDUCE = 1


class TaskKind(enum.IntEnum):
    COPY = 1
    REDUCE = 2


class RelayMode(enum.IntEnum):
    AUTO = 0
    OFF = 1
    FORCE = 2
