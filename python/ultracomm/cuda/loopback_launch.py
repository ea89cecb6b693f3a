"""One launch for all ranks of a one-GPU loopback domain (``cuda_local`` windows).

On one GPU the ranks' CTAs must run in ONE launch: launched one rank at a time on a stream,
rank 0's kernel would wait for flags of rank 1, whose kernel is queued behind it.  So a
loopback rank's ``transport.run`` only deposits its launch arguments here; the rank that
completes an operation's set (the ``world``-th to call, in any order) launches every rank at
once.  Nothing blocks: one thread may drive all ranks (``for ctx in ctxs: ctx.weight_sync(...)``,
the operations are collective-free with stream-ordered transports) or each rank its own
thread.

Rules the last rank checks before launching (an error there names what differs):

* operations pair up by call order: each rank's n-th call belongs to the n-th launch, so every
  rank must call the same operations in the same order (as for any collective);
* every rank enqueues on the same CUDA stream: the launch goes on it, and a rank that used
  another stream would not be ordered after its own operation.

The domain's launch sets live in ``window.shared`` (the loopback domain's dict), one per
window set, found with :func:`launches_for`.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from ..errors import InputError, UltracommError

__all__ = ["Deposit", "LoopbackLaunches", "launches_for"]


@dataclass(frozen=True)
class Deposit:
    """One rank's share of one launch: what ``launch`` needs from that rank (``item``), its
    operation (``op``, compared across ranks), its epoch and the stream it enqueued on."""

    rank: int
    op: Any
    epoch: int
    stream: int
    item: Any = None


class LoopbackLaunches:
    """Pairs the loopback ranks' n-th deposits and launches each complete set once."""

    def __init__(self, world: int):
        if world < 1:
            raise InputError(f"ultracomm: a loopback domain needs world >= 1, got {world}")
        self.world = world
        self._lock = threading.Lock()
        self._calls = [0] * world  # deposits made by each rank
        self._open: dict[int, dict[int, Deposit]] = {}  # launch number -> rank -> deposit

    def pending(self) -> dict[int, list[int]]:
        """Launch number -> ranks that deposited and wait for the others (diagnostics)."""
        with self._lock:
            return {n: sorted(d) for n, d in self._open.items()}

    def deposit(self, d: Deposit, launch: Callable[[Sequence[Deposit]], None]) -> bool:
        """Add rank ``d.rank``'s share; the rank completing the set calls ``launch(deposits in rank
        order)`` (outside the lock) and gets ``True``; the others get ``False`` at once."""
        if not 0 <= d.rank < self.world:
            raise InputError(f"ultracomm: rank {d.rank} is out of range for a loopback domain of {self.world}")
        with self._lock:
            n = self._calls[d.rank]
            self._calls[d.rank] += 1
            got = self._open.setdefault(n, {})
            got[d.rank] = d
            if len(got) < self.world:
                return False
            del self._open[n]
        deps = [got[r] for r in range(self.world)]
        ops = {repr(x.op) for x in deps}
        if len(ops) > 1:
            detail = "; ".join(f"rank {x.rank}: {x.op!r}" for x in deps)
            raise UltracommError(
                f"ultracomm: loopback launch {n}: ranks called different operations ({detail}); "
                "every rank must call the same operations in the same order"
            )
        streams = {x.stream for x in deps}
        if len(streams) > 1:
            detail = "; ".join(f"rank {x.rank}: 0x{x.stream:x}" for x in deps)
            raise UltracommError(
                f"ultracomm: loopback launch {n}: ranks enqueued on different CUDA streams "
                f"({detail}); one launch runs every loopback rank, so all must use one stream"
            )
        launch(deps)
        return True


_LOCK = threading.Lock()


def launches_for(window: Any, name: str = "ultracomm.loopback_launches") -> LoopbackLaunches:
    """The launch sets of ``window``'s loopback domain and window set (created by the first rank
    to ask; every rank of one Context gets the same object); ``name`` keeps one user's sets apart
    from another's on the same window."""
    shared = getattr(window, "shared", None)
    if shared is None or not getattr(window, "loopback", False):
        raise InputError(f"ultracomm: window {getattr(window, 'provider', window)!r} is not a loopback window")
    key = (name, tuple(window.peer_bases))
    with _LOCK:
        obj = shared.get(key)
        if obj is None:
            obj = shared[key] = LoopbackLaunches(window.world)
    return obj
