"""What every GPU window provider does the same way: check it can work here, zero, barrier.

Setup steps that can fail on one rank go through ``comm.agree`` (bounded; every rank raises,
naming the failed rank), so no rank waits for one that stopped.  Before ``create`` returns,
the window is zeroed (flags hold epochs: 0 = nothing published yet), the zeroing has
finished on the device, and a barrier has passed: no peer can publish epoch 1 into a window
that is still being cleared.
"""

from __future__ import annotations

from typing import Any

import torch

from ..comm import Comm
from ..cuda.support import require
from ..errors import InputError


def check_usable(cls: Any, comm: Comm) -> None:
    """Before anything collective: a GPU here (``NotAvailableError`` naming what is missing), and a
    group of the kind the provider needs (``ValueError`` naming the provider to use instead)."""
    require(f"the {cls.provider} window", need_module=False)
    why = cls.unavailable_reason(comm)
    if why:
        raise InputError(f"ultracomm: {why}")


def zero_and_barrier(comm: Comm, local: torch.Tensor, op: str) -> None:
    """Clear this rank's window, wait until the device has done it, then meet every peer."""
    local.zero_()
    torch.cuda.synchronize(local.device)
    comm.barrier(op=op, what="window zeroed on every rank")
