"""Per-rank expert loads, gathered from every rank of the group."""
from __future__ import annotations

import numpy as np
import torch

from ..comm import Comm

__all__ = ["gather_loads"]


def gather_loads(comm: Comm, counts: torch.Tensor, op: str = "step") -> np.ndarray:
    """int64 ``[world, E]``: every rank's ``counts`` (tokens it routes to each expert).

    One ``[E]`` copy to the host (the planners run on the CPU), then the group's bounded
    exchange: a stalled or dead peer raises ``UltracommTimeout`` naming it after
    ``ULTRACOMM_TIMEOUT_S`` instead of hanging.
    """
    mine = counts.detach().to("cpu", torch.int64).numpy()
    return np.stack(comm.all_gather_object(mine, op=op, what="expert loads")).astype(np.int64)
