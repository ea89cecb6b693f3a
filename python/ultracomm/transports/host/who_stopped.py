"""Which ranks stopped first, from the ready flags a timed-out rank can read in its window.

The executor's timeout names the rank this rank waited for.  In a relay tree that rank may be
alive and waiting in turn for the one that stopped (issue 23: 16 of 69 survivors named a live
rank).  Every rank raises ``ready[op]`` to the operation's epoch when it starts an operation,
and epochs count every operation of a Context, so a rank's latest epoch over both ops says how
far it got: the ranks behind this operation's epoch never started it, and the one furthest
behind stopped first.  A rank stalled *inside* the operation has its ready flag at the epoch
like every live rank: the window cannot tell it apart, and the note says nothing then.

Only windows this process maps can be read (host_shm, local; in the split transport the ranks of
this rank's memory domain): the p2p transport's private windows and other domains' shadows
are not the peers' flags.
"""

from __future__ import annotations

import ctypes
from typing import Optional, Sequence

from ...blame import awaited_ranks
from ...records import Op


def latest_epochs(bases: Sequence[int], readable: Sequence[bool], ready_off: int) -> dict[int, int]:
    """Rank -> the latest epoch it started (max of its ready flags), for the readable ranks."""
    out = {}
    for r, (base, ok) in enumerate(zip(bases, readable)):
        if ok and base:
            out[r] = max(
                ctypes.c_uint64.from_address(base + ready_off + 8 * int(op)).value for op in (Op.MULTICAST, Op.REDUCE)
            )
    return out


def stopped_note(message: str, epoch: int, rank: int, latest: dict[int, int]) -> Optional[str]:
    """The sentence to add to a timeout ``message`` of ``rank`` at ``epoch``, or None when the
    window knows nothing the message does not say already."""
    behind = sorted((e, r) for r, e in latest.items() if r != rank and e < epoch)
    if not behind:
        return None
    found = awaited_ranks(message)
    awaited = found[0] if found else None
    if [r for _, r in behind] == [awaited] and "has not started this operation" in message:
        return None
    first_epoch, first = behind[0]
    listed = ", ".join(f"rank {r} at epoch {e}" for e, r in behind)
    started = (
        f"rank {awaited} started this operation and likely waits in turn; "
        if awaited is not None and latest.get(awaited, -1) >= epoch
        else ""
    )
    return (
        f"{started}by their ready flags, {len(behind)} rank(s) have not started this operation ({listed}): "
        f"rank {first} stopped first (latest epoch {first_epoch}) and is likely the stalled or dead rank"
    )
