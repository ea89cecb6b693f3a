"""1000 Contexts created, used and then closed -- or dropped without close() -- leave nothing:
file descriptors, threads and /dev/shm mappings return to where they were, RSS stays flat."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
import torch

from ultracomm import ClosedError, Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan

from conftest import live_threads

CYCLES = 1000
RSS_BOUND = 16 << 20  # bytes of growth tolerated over CYCLES (allocator noise; a leaked window is 12 KiB)


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _shm_mappings() -> int:
    with open("/proc/self/maps") as f:
        return sum("/dev/shm/ultracomm-" in line for line in f)


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="needs /proc")
@pytest.mark.parametrize("close", [True, False], ids=["closed", "dropped"])
def test_contexts_leave_nothing_behind(close):
    layout = ExpertLayout((Member("w", (8, 8), torch.float32),))
    group = LoopbackDomain(1).group(0)
    plan = ReplicaPlan.make(np.full((1, 1), -1, np.int32), experts_per_rank=1)

    def cycle() -> None:
        ctx = Context(group, layout, 1, 1, num_layers=1, window="host_shm", timeout_s=30)
        ctx.register_masters(0, [torch.zeros(1, 8, 8)], [torch.zeros(1, 8, 8)])
        vid = ctx.begin(0)
        ctx.weight_sync(vid, plan)  # an operation ran: the runner thread held its closure
        ctx.grad_reduce(vid)
        assert _shm_mappings() >= 1
        if close:
            ctx.close()

    for _ in range(20):  # warm caches and the allocator
        cycle()
    before = (_fds(), live_threads(), _shm_mappings(), _rss())
    for _ in range(CYCLES):
        cycle()
    # a dropped Context's finaliser may run on its own runner thread (the thread dropped the last
    # reference with the operation's closure): there it asks the thread to stop and cannot join it,
    # so the thread ends just after.  Wait for that end (a thread that never stops still counts)
    for t in threading.enumerate():
        if t.name.startswith("ultracomm-rank") and t is not threading.current_thread():
            t.join(timeout=10)
    after = (_fds(), live_threads(), _shm_mappings(), _rss())
    assert after[:3] == before[:3] == (before[0], before[1], 0), (before, after)
    assert after[3] - before[3] <= RSS_BOUND, (before, after)


def test_use_after_close_is_a_clear_error():
    layout = ExpertLayout((Member("w", (8, 8), torch.float32),))
    ctx = Context(LoopbackDomain(1).group(0), layout, 1, 1, num_layers=1)
    ctx.register_masters(0, [torch.zeros(1, 8, 8)], [torch.zeros(1, 8, 8)])
    vid = ctx.begin(0)
    ctx.close()
    ctx.close()  # idempotent
    assert ctx.closed
    plan = ReplicaPlan.make(np.full((1, 1), -1, np.int32), experts_per_rank=1)
    for call in (
        lambda: ctx.begin(0),
        lambda: ctx.weight_sync(vid, plan),
        lambda: ctx.restore(vid),
        lambda: ctx.grad_reduce(vid),
        lambda: ctx.end(vid),
        ctx.synchronize,
        lambda: ctx.register_masters(0, [torch.zeros(1, 8, 8)], None),
    ):
        with pytest.raises(ClosedError, match="this Context is closed"):
            call()


def test_the_thread_count_does_not_depend_on_when_it_is_taken():
    """The heartbeat thread ends within HEARTBEAT_S of the last host window's close: a plain
    threading.active_count() right after a close (the leak checks' "before") and one taken after
    a wait (a slow join, a preempted main thread on a loaded machine) differed by that thread --
    2 then 1 here -- and the leak checks read it as a thread gone or leaked.  live_threads() waits
    for it first."""
    import time

    ctx = Context(LoopbackDomain(1).group(0), ExpertLayout((Member("w", (8, 8), torch.float32),)), 1, 1, num_layers=1)
    ctx.close()
    now = live_threads()
    time.sleep(0.3)
    assert live_threads() == now
