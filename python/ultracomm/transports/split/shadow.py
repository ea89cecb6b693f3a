"""Shadow windows: local stand-ins for the windows of ranks in other memory domains.

The interpreter addresses a peer as ``peer_base + window offset``.  For a peer it cannot reach
(another host), the ``split`` transport hands it the base of a *shadow*: an anonymous private
mapping with the window's layout, in this process.  The interpreter writes into it (multicast
chunks for that peer, ``consumed`` flags) and reads from it (reduce sources, the peer's
``ready``/``digest`` words) exactly as it would the peer's real window; the bridge
(:mod:`.bridge`) fills and drains it with messages.

Memory.  A shadow reserves the window's size in address space only (``MAP_NORESERVE``): a
page costs memory once touched.  What is touched in one op is the chunks that cross to or
from that peer (weights for multicast, grads for reduce) plus the flag pages.  They stay for
the next op of the same plan (:meth:`Shadows.settle`): handing them back after every op made
each op fault every page in again, zero-filled, while gloo wrote a crossing into it -- 2-3 ms
per op on 2 MiB crossings, as long as the message itself (perf/README.md section 6b).  Once an
op runs another plan, the pages its predecessor's plan touched are handed back
(``MADV_DONTNEED``: they read as zeros again).  So between ops a shadow holds its flag pages
(``8 x (2 + 2 x ops + slots x (weight chunks + 2 x grad chunks))`` bytes, page-rounded) and
at most the bytes that crossed under the last plan, as the ``p2p`` transport keeps its receive
buffers per program.  Epoch flags survive a release; the slot bytes need not (each op writes
every crossing chunk before it is read).
"""

from __future__ import annotations

import mmap
from typing import Sequence

import torch

__all__ = ["Shadows"]

_FLAGS = getattr(mmap, "MAP_NORESERVE", 0)


class Shadows:
    """One shadow per rank in another domain than ``rank``'s (``domain_of[r]``), each of ``nbytes``."""

    def __init__(self, rank: int, domain_of: Sequence[int], nbytes: int, data_end: int):
        self.rank = rank
        self.nbytes = nbytes
        self._data_end = data_end  # slot bytes: [0, data_end) of the layout (flags follow)
        self._maps: dict[int, mmap.mmap] = {}
        self._resident: dict[int, int] = {}  # peer -> the plan whose op last touched its shadow's pages
        self.views: dict[int, torch.Tensor] = {}
        for r, d in enumerate(domain_of):
            if d != domain_of[rank]:
                m = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | _FLAGS, prot=mmap.PROT_READ | mmap.PROT_WRITE)
                self._maps[r] = m
                self.views[r] = torch.frombuffer(m, dtype=torch.uint8)

    def bases(self, window_bases: Sequence[int]) -> list[int]:
        """The pointer table the interpreter gets: real windows in this domain, shadows elsewhere."""
        return [int(self.views[r].data_ptr()) if r in self.views else int(b) for r, b in enumerate(window_bases)]

    def base(self, peer: int) -> int:
        return int(self.views[peer].data_ptr())

    def settle(self, peers: Sequence[int], plan: int) -> None:
        """An op of ``plan`` (a schedule digest) over ``peers``' shadows finished: keep their pages
        for the next op of that plan; hand back the pages of every shadow last used by another plan."""
        stale = [r for r, p in self._resident.items() if p != plan]
        self.release(stale)
        for r in stale:
            del self._resident[r]
        for r in peers:
            self._resident[r] = plan

    def release(self, peers: Sequence[int]) -> None:
        """Hand back the slot pages of ``peers``' shadows (flags stay)."""
        page = mmap.PAGESIZE
        end = self._data_end // page * page
        if end and hasattr(mmap, "MADV_DONTNEED"):
            for r in peers:
                self._maps[r].madvise(mmap.MADV_DONTNEED, 0, end)

    def close(self) -> None:
        self.views = {}
        for m in self._maps.values():
            try:
                m.close()
            except BufferError:  # a tensor over it is still alive: the mapping goes with it
                pass
        self._maps = {}
