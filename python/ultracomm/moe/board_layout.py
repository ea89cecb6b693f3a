"""The load board: its byte layout and exchange protocol, one description for both boards
(:class:`~ultracomm.moe.loads.LoadBoard` in host memory, :class:`~ultracomm.moe.loads_gpu.GpuLoadBoard`
in GPU windows, whose kernel ``csrc/cuda/k_loads.cu`` gets these offsets; ``csrc/cuda/load_exchange.h``
repeats this text beside the pointer math).

Every rank owns one board (a small symmetric window); a peer's address is its base + offset.
Per board, ``entries x world`` records of ``record_bytes`` (a multiple of 64)::

    record(n, q) = ((n % entries) * world + q) * record_bytes
      +0  uint64 flag   the exchange number whose counts the record holds
      +8  int32 [E]     sender q's expert token counts

Exchange ``n`` (1, 2, ... on every rank in the same order): sender ``q`` writes its counts into
``record(n, q)`` of EVERY rank's board, then stores ``flag = n`` with release semantics there;
each rank waits until its own ``record(n, q).flag >= n`` for every ``q`` (bounded by
``ULTRACOMM_TIMEOUT_S``), then reads the counts.  Writers push, readers poll their own memory
(on GPUs the polling stays local, the writes cross NVLink once).  With two entries a record is
rewritten (exchange ``n + 2``) only after its reader posted ``n + 1``, i.e. finished reading
``n``.  Flags only grow, never reset.
"""
from __future__ import annotations

from dataclasses import dataclass

__all__ = ["BoardLayout", "ENTRIES", "MAX_COUNT"]

ENTRIES = 2
MAX_COUNT = 2**31 - 1  # counts are int32: tokens one rank routes to one expert in one step


@dataclass(frozen=True)
class BoardLayout:
    world: int
    num_experts: int
    entries: int = ENTRIES

    def __post_init__(self) -> None:
        if self.world < 1 or self.num_experts < 1 or self.entries < 2:
            raise ValueError(f"ultracomm: a load board needs world >= 1, num_experts >= 1 and entries >= 2, got "
                             f"{self.world}, {self.num_experts}, {self.entries}")

    @property
    def record_bytes(self) -> int:
        return -(-(8 + 4 * self.num_experts) // 64) * 64

    @property
    def total_bytes(self) -> int:
        """Bytes of one rank's board."""
        return self.entries * self.world * self.record_bytes

    def record(self, n: int, sender: int) -> int:
        """Offset of sender's record (its flag) for exchange ``n`` in any rank's board."""
        return ((n % self.entries) * self.world + sender) * self.record_bytes

    def counts(self, n: int, sender: int) -> int:
        """Offset of sender's int32 counts for exchange ``n``."""
        return self.record(n, sender) + 8
