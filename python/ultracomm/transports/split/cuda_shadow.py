"""Device shadows for the GPU ``split`` transport: the stand-ins the persistent kernel addresses
instead of ranks in other memory domains (the device twin of :mod:`.shadow`).

The kernel addresses a peer as ``base + window offset`` anywhere in the window's layout, so a
shadow spans the whole window.  Chosen here: one zeroed full-size allocation
(``torch.zeros(total_bytes, uint8)`` on the window's device) per peer in another domain,
made the first time an op of this rank crosses to or from that peer (an op's peers are its
:class:`~.bridge_program.BridgeProgram`'s ``peers``), kept for the transport's life (flags are
epochs and never reset).  Memory: ``total_bytes x (peers in other domains this rank ever
exchanged with)`` -- e.g. with 8 slots of 64 MiB weights + 128 MiB fp32 grads, 1.5 GiB per peer.

Not chosen (yet): reserving the window's range with the CUDA VMM API (``cuMemAddressReserve``)
and mapping physical granules only where crossings land plus the flag area, which would cut
that to the crossing bytes.  ``cuda/driver.py`` has no VMM bindings; their structs
(``CUmemAllocationProp``, ``CUmemAccessDesc``) through ctypes could only be checked on a
device, and a wrong layout there fails at run time, not in CI.  The pointer table holds
:data:`NO_SHADOW` for a peer without a shadow: the kernel only touches ranks of its own tasks
and its slots' parents, all of which are bridge-program peers, so it is never dereferenced;
it is not null (the plan validation refuses null bases) but lies in the first pages, which
nothing maps, so a bug there faults instead of writing into someone's memory.
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
from ...errors import InputError

__all__ = ["DeviceShadows", "NO_SHADOW"]

NO_SHADOW = 0x1000  # non-null, 8-byte aligned, never mapped (see the module docstring)


class DeviceShadows:
    """Rank ``rank``'s shadows of ranks outside its domain (``domain_of[r]``), on ``device``."""

    def __init__(
        self,
        rank: int,
        domain_of: Sequence[int],
        nbytes: int,
        device: Any,
        alloc=lambda n, dev: torch.zeros(n, dtype=torch.uint8, device=dev),
    ):
        self.rank, self.domain_of, self.nbytes, self.device = rank, tuple(domain_of), int(nbytes), device
        self._alloc = alloc
        self.views: dict[int, torch.Tensor] = {}

    def ensure(self, peers: Iterable[int]) -> bool:
        """Allocate the shadows of ``peers`` that have none yet; True if any was made."""
        made = False
        for q in peers:
            if self.domain_of[q] == self.domain_of[self.rank]:
                raise InputError(
                    f"ultracomm split: rank {q} shares rank {self.rank}'s memory domain; it gets no "
                    "shadow (the bridge program and the domains disagree)"
                )
            if q not in self.views:
                self.views[q] = self._alloc(self.nbytes, self.device)
                made = True
        return made

    def bytes_held(self) -> int:
        return self.nbytes * len(self.views)

    def bases(self, window_bases: Sequence[int]) -> list[int]:
        """The kernel's pointer table: real windows in this domain, shadows (or NO_SHADOW) elsewhere."""
        me = self.domain_of[self.rank]
        return [
            int(b) if self.domain_of[r] == me else (int(self.views[r].data_ptr()) if r in self.views else NO_SHADOW)
            for r, b in enumerate(window_bases)
        ]

    def tensor(self, peer: int) -> torch.Tensor:
        return self.views[peer]

    def close(self) -> None:
        self.views = {}
