"""A synchronous operation with nothing queued runs on the caller's thread (no hand-off to the
Context's runner thread, perf/README.md section 6b); anything else keeps the one call order."""

from __future__ import annotations

import threading

import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.work import OrderedRunner


def test_claim_inline_runs_on_the_caller_only_when_idle():
    r = OrderedRunner("t-runner")
    try:
        seen: list[str] = []
        run = r.claim_inline()
        assert run is not None
        # submitted after the claim: waits for the inline callable, then runs on the runner thread
        late = r.submit("late", lambda: seen.append(f"late:{threading.current_thread().name}"))
        assert r.claim_inline() is None  # something is claimed and queued: no second inline turn
        run(lambda: seen.append(f"inline:{threading.current_thread().name}"))
        late.wait(10)
        assert seen == [f"inline:{threading.current_thread().name}", "late:t-runner"]
        # a queued (blocked) callable makes the caller submit instead
        release = threading.Event()
        busy = r.submit("busy", lambda: release.wait(10))
        assert r.claim_inline() is None
        release.set()
        busy.wait(10)
        run = r.claim_inline()  # idle again
        assert run is not None
        with pytest.raises(ZeroDivisionError):
            run(lambda: 1 / 0)
        assert r.claim_inline() is not None  # the failed turn was given back
    finally:
        r.close()


def test_claim_inline_from_the_runner_thread_is_refused():
    r = OrderedRunner("t-runner2")
    try:
        got = []
        r.submit("x", lambda: got.append(r.claim_inline())).wait(10)
        assert got == [None]
    finally:
        r.close()


def test_sync_ops_run_on_the_callers_thread_and_async_ones_keep_the_order():
    layout = ExpertLayout((Member("w", (64,), torch.float32),))
    epr, slots, world = 2, 1, 2
    src = torch.tensor([[2], [0]], dtype=torch.int32)  # each rank holds one expert of the other
    plan = ReplicaPlan.make(src, experts_per_rank=epr)

    def body(group):
        ctx = Context(group, layout, epr, slots, num_layers=1, transport="host")
        threads = []
        real = ctx.transport.run

        def spy(*a, **k):
            threads.append(threading.current_thread().name)
            return real(*a, **k)

        ctx.transport.run = spy
        w = torch.arange(epr * 64, dtype=torch.float32).reshape(epr, 64) + 1000 * group.rank
        ctx.register_masters(0, [w], [torch.zeros_like(w)])
        vid = ctx.begin(0)
        ctx.weight_sync(vid, plan)  # sync, idle: caller's thread
        work = ctx.restore(vid, async_op=True)  # async: runner thread
        ctx.restore(vid)  # sync after an async one still queued or not: in order
        work.wait()
        got = ctx.replica_weights[0][0].clone()
        ctx.end(vid)
        ctx.close()
        return threads, got

    res = LoopbackDomain(world).run(body, timeout=60)
    for r, (threads, got) in enumerate(res):
        me = f"loopback-rank{r}"
        assert threads[0] == me and threads[1] == f"ultracomm-rank{r}", threads
        assert threads[2] in (me, f"ultracomm-rank{r}")
        e = int(src[r, 0])
        want = torch.arange(64, dtype=torch.float32) + (e % epr) * 64 + 1000 * (e // epr)
        assert torch.equal(got, want)
