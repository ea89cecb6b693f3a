"""What the GPU release workers share: a bounded device synchronize after a failure, and the
failure as JSON (tests/mp/*_release_worker.py)."""

from __future__ import annotations

import threading
import time

import torch

from ultracomm.errors import PlanError, UltracommTimeout

SYNC_BOUND_S = 5.0


def device_sync() -> tuple[bool, float]:
    """torch.cuda.synchronize() in a thread, bounded: (returned, seconds)."""
    t = time.monotonic()
    th = threading.Thread(target=torch.cuda.synchronize, daemon=True)
    th.start()
    th.join(SYNC_BOUND_S)
    return not th.is_alive(), time.monotonic() - t


def describe(e) -> dict:
    return dict(
        error=None if e is None else f"{type(e).__name__}: {e}",
        timeout=isinstance(e, UltracommTimeout),
        plan_error=isinstance(e, PlanError),
    )
