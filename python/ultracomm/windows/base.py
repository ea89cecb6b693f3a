"""The window interface shared by every provider."""

from __future__ import annotations

import abc

import torch

from ..comm import Comm


class Window(abc.ABC):
    """One rank's view of a symmetric window.

    Attributes:
        rank, world: this rank and the group size.
        nbytes: bytes per rank (identical on every rank).
        local: ``uint8 [nbytes]`` tensor over this rank's own window.
        peer_bases: ``world`` addresses: rank ``r``'s window as addressed from this process.
        device: where the window lives (``local.device``): the CPU, or the CUDA device whose
            kernels may dereference ``peer_bases``.
    """

    provider: str
    rank: int
    world: int
    nbytes: int
    local: torch.Tensor
    peer_bases: list[int]

    @classmethod
    @abc.abstractmethod
    def create(cls, comm: Comm, nbytes: int, op: str = "window setup") -> "Window":
        """Collectively create this rank's window of ``nbytes`` and reach every peer's.

        Every step that can fail on one rank must be a ``comm.agree`` (bounded; every rank
        raises, naming the failed rank), so that no rank waits for one that stopped.
        ``op`` names the caller's operation in errors (e.g. ``"Context setup"``).
        """

    @property
    def device(self) -> torch.device:
        return self.local.device

    @abc.abstractmethod
    def close(self) -> None:
        """Release this rank's mappings (collective-free; idempotent)."""

    def __enter__(self) -> "Window":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
