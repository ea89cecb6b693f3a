"""The device plans (uploaded task lists) a GPU transport keeps, least recently used first out
-- except those a CUDA graph captured.

A captured kernel launch keeps the plan's device pointer: freeing that plan (an eviction after
``capacity`` newer plans) would make every later replay of the graph read freed memory.  So a
plan used while the caller's stream is capturing is pinned: it stays until the transport closes
(the graph's lifetime is the user's; a Context outliving its graphs is the safe order).  Pinned
plans do not count against ``capacity``'s eviction, they only stop being evicted.
"""
from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Any, Callable, Hashable

__all__ = ["DevicePlanCache"]

log = logging.getLogger("ultracomm")


def _capturing() -> bool:
    import torch

    return bool(torch.cuda.is_available() and torch.cuda.is_current_stream_capturing())


class DevicePlanCache:
    """``get(key, make)``: the plan under ``key``, made by ``make()`` when missing.

    Args:
        capacity: unpinned plans kept (the least recently used beyond it are freed).
        capturing: whether the caller's stream is capturing a CUDA graph now (tests inject it).
    """

    def __init__(self, capacity: int, capturing: Callable[[], bool] = _capturing):
        if capacity < 1:
            raise ValueError(f"ultracomm: plan cache capacity must be >= 1, got {capacity}")
        self.capacity = int(capacity)
        self._capturing = capturing
        self._plans: "OrderedDict[Hashable, Any]" = OrderedDict()
        self.pinned: set = set()

    def __len__(self) -> int:
        return len(self._plans)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._plans

    def get(self, key: Hashable, make: Callable[[], Any]) -> Any:
        plan = self._plans.get(key)
        if plan is None:
            plan = self._plans[key] = make()
        else:
            self._plans.move_to_end(key)
        if key not in self.pinned and self._capturing():
            self.pinned.add(key)
            log.debug("ultracomm: device plan %r pinned: a CUDA graph captured it", key)
        self._evict()
        return plan

    def _evict(self) -> None:
        over = len(self._plans) - len(self.pinned) - self.capacity
        if over <= 0:
            return
        for key in [k for k in self._plans if k not in self.pinned][:over]:
            del self._plans[key]  # frees device memory (cudaFree synchronises the device)

    def clear(self) -> None:
        """Free every plan (the transport is closing; the caller synchronised the device)."""
        self._plans.clear()
        self.pinned.clear()
