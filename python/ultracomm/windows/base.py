"""The window interface shared by every provider."""
from __future__ import annotations

import abc

import torch


class Window(abc.ABC):
    """One rank's view of a symmetric window.

    Attributes:
        rank, world: this rank and the group size.
        nbytes: bytes per rank (identical on every rank).
        local: ``uint8 [nbytes]`` tensor over this rank's own window.
        peer_bases: ``world`` addresses: rank ``r``'s window as addressed from this process.
    """

    provider: str
    rank: int
    world: int
    nbytes: int
    local: torch.Tensor
    peer_bases: list[int]

    @abc.abstractmethod
    def close(self) -> None:
        """Release this rank's mappings (collective-free; idempotent)."""

    def __enter__(self) -> "Window":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
