"""The GPU transports' device-plan cache (issue 19: a captured CUDA graph keeps a plan's device
pointer, and the cache freed that plan after 64 newer ones -- a replay then ran freed memory)."""
from __future__ import annotations

import pytest

from ultracomm.transports.device_plan_cache import DevicePlanCache


class Plan:
    live: set = set()

    def __init__(self, key):
        self.key = key
        Plan.live.add(key)

    def __del__(self):
        Plan.live.discard(self.key)


def test_least_recently_used_plans_are_freed_beyond_capacity():
    Plan.live.clear()
    c = DevicePlanCache(3, capturing=lambda: False)
    for k in "abcd":
        c.get(k, lambda k=k: Plan(k))
    assert Plan.live == set("bcd") and len(c) == 3
    first = c.get("b", lambda: Plan("B"))  # a hit: no new plan, b is now the most recent
    assert first.key == "b"
    del first
    c.get("e", lambda: Plan("e"))
    assert Plan.live == set("bde")


def test_plans_a_graph_captured_are_never_freed():
    Plan.live.clear()
    capturing = [False]
    c = DevicePlanCache(2, capturing=lambda: capturing[0])
    c.get("warm", lambda: Plan("warm"))  # run once before capture (the first use allocates)
    capturing[0] = True
    c.get("warm", lambda: Plan("never"))  # the capture reuses it: pinned from now on
    capturing[0] = False
    for i in range(100):  # 100 newer plans afterwards (a step's worth of layers x micro-batches)
        c.get(i, lambda i=i: Plan(i))
    assert "warm" in Plan.live and "warm" in c and c.pinned == {"warm"}
    assert Plan.live == {"warm", 98, 99}  # the unpinned ones still rotate within capacity
    c.clear()
    assert Plan.live == set() and not c.pinned


def test_capacity_must_be_positive():
    with pytest.raises(ValueError, match="^ultracomm: plan cache capacity must be >= 1, got 0$"):
        DevicePlanCache(0)
