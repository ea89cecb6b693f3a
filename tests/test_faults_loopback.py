"""Bounded control-plane collectives and setup agreement, with ranks as threads (loopback).

A rank that stalls, skips a collective, calls a different one or fails a setup step makes
every other rank raise within the timeout, naming it.  The multi-process versions (SIGKILL,
SIGSTOP) are in test_faults_mp.py.
"""

from __future__ import annotations

import os
import sys
import threading
import time

import numpy as np
import pytest

import ultracomm
from ultracomm import (
    Context,
    LoopbackDomain,
    PeerError,
    PlanMismatchError,
    ReplicaPlan,
    UltracommError,
    UltracommTimeout,
)
from ultracomm.comm import as_comm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import leftover_segments, shm_segments  # noqa: E402
from test_context import make_layout, masters_for  # noqa: E402

TIMEOUT = 0.5
MARGIN = 2.0  # scheduling slack on a loaded 2-core machine


def test_timeout_is_an_ultracomm_error_and_a_timeout_error():
    assert issubclass(UltracommTimeout, TimeoutError) and issubclass(UltracommTimeout, UltracommError)
    assert issubclass(ultracomm._core.TimeoutError, UltracommTimeout)  # executor timeouts are the same type


def test_survivors_raise_within_timeout_and_late_rank_raises_too():
    gave_up = threading.Barrier(2)
    both_gave_up = threading.Event()
    elapsed = {}

    def body(group):
        comm = as_comm(group, TIMEOUT)
        if group.rank == 2:  # stalled: arrives only after both others have given up
            both_gave_up.wait(30)
            with pytest.raises(
                UltracommTimeout,
                match=r"rank 2 Context setup \(configuration\): ranks \[0, 1\] had "
                r"already timed out waiting for this rank",
            ):
                comm.all_gather_object(2, op="Context setup", what="configuration")
            return True
        t0 = time.monotonic()
        with pytest.raises(
            UltracommTimeout,
            match=rf"rank {group.rank} Context setup \(configuration\) timed out "
            r"after 0.5 s: ranks \[2\] did not arrive",
        ):
            comm.all_gather_object(group.rank, op="Context setup", what="configuration")
        elapsed[group.rank] = time.monotonic() - t0
        if gave_up.wait() == 0:
            both_gave_up.set()
        return True

    assert LoopbackDomain(3).run(body, timeout=60) == [True] * 3
    for r in (0, 1):
        assert TIMEOUT * 0.9 <= elapsed[r] <= TIMEOUT + MARGIN, elapsed


def test_ranks_in_different_collectives_raise_at_once():
    def body(group):
        comm = as_comm(group, 30.0)  # no rank should need to wait for it
        t0 = time.monotonic()
        op = ("weight_sync", "plan agreement") if group.rank else ("Context setup", "configuration")
        others = (
            r"ranks \[1, 2\] posted weight_sync \(plan agreement\)"
            if group.rank == 0
            else r"rank 0 posted Context setup \(configuration\)"
        )
        with pytest.raises(
            PlanMismatchError,
            match=rf"rank {group.rank} {op[0]} \({op[1]}\): ranks called different "
            rf"operations \({others}\); every rank must call the same",
        ):
            comm.all_gather_object(None, op=op[0], what=op[1])
        return time.monotonic() - t0

    assert max(LoopbackDomain(3).run(body, timeout=60)) < 5.0


def test_exchanges_stay_in_step_and_old_keys_are_removed():
    domain = LoopbackDomain(2)

    def body(group):
        comm = as_comm(group, 30.0)
        out = [comm.all_gather_object((group.rank, i), op="t", what=str(i)) for i in range(50)]
        return out

    res = domain.run(body)
    assert res[0] == res[1] == [[(0, i), (1, i)] for i in range(50)]
    assert len(domain.board.items) <= 2 * 2  # at most the last two exchanges' keys per rank


def test_agree_fails_every_rank_naming_the_failed_one():
    def body(group):
        comm = as_comm(group, 30.0)

        def step():
            if group.rank == 1:
                raise OSError(36, "File name too long")
            return group.rank

        if group.rank == 1:
            with pytest.raises(OSError, match="File name too long"):
                comm.agree(step, op="Context setup", what="host_shm mapping")
        else:
            with pytest.raises(
                PeerError,
                match=r"rank \d Context setup \(host_shm mapping\): ranks \[1\] failed: "
                r"rank 1: OSError: \[Errno 36\] File name too long",
            ):
                comm.agree(step, op="Context setup", what="host_shm mapping")
        return comm.agree(lambda: group.rank * 10, op="t", what="after")  # the group is still usable

    assert LoopbackDomain(3).run(body) == [[0, 10, 20]] * 3


@pytest.mark.parametrize("window", ["local", "host_shm"])
def test_context_setup_with_a_missing_rank_times_out(window):
    before = shm_segments()

    def body(group):
        if group.rank == 1:
            return None  # never creates its Context
        t0 = time.monotonic()
        with pytest.raises(
            UltracommTimeout,
            match=r"rank 0 Context setup \(configuration\) timed out after 0.5 s: "
            r"ranks \[1\] did not arrive",
        ):
            Context(group, make_layout(4, 4), 1, 1, num_layers=1, window=window, timeout_s=TIMEOUT)
        return time.monotonic() - t0

    elapsed = LoopbackDomain(2).run(body, timeout=60)[0]
    assert elapsed <= TIMEOUT + MARGIN
    assert not leftover_segments(before, {os.getpid()})


def test_one_rank_failing_setup_fails_every_rank():
    before = shm_segments()

    def body(group):
        kw = {"chunk_bytes": 8} if group.rank == 2 else {}  # invalid on rank 2 only
        if group.rank == 2:
            with pytest.raises(ultracomm.ConfigError, match="chunk_bytes=8 is invalid"):
                Context(group, make_layout(4, 4), 1, 1, num_layers=1, window="host_shm", timeout_s=30, **kw)
        else:
            with pytest.raises(
                PeerError,
                match=r"Context setup \(configuration\): ranks \[2\] failed: rank 2: "
                r"ConfigError: ultracomm: chunk_bytes=8 is invalid",
            ):
                Context(group, make_layout(4, 4), 1, 1, num_layers=1, window="host_shm", timeout_s=30, **kw)
        return True

    assert LoopbackDomain(3).run(body, timeout=60) == [True] * 3
    assert not leftover_segments(before, {os.getpid()})


def test_mapping_failure_after_the_name_exchange_fails_every_rank(monkeypatch):
    from ultracomm.windows import host_shm

    real_map = host_shm._map

    def failing(path, nbytes, create):
        if not create and threading.current_thread().name == "loopback-rank0":
            raise OSError(36, "File name too long (simulated)")
        return real_map(path, nbytes, create)

    monkeypatch.setattr(host_shm, "_map", failing)
    before = shm_segments()

    def body(group):
        t0 = time.monotonic()
        err = PeerError if group.rank else OSError
        with pytest.raises(err, match="File name too long"):
            Context(group, make_layout(4, 4), 1, 1, num_layers=1, window="host_shm", timeout_s=30)
        return time.monotonic() - t0

    assert max(LoopbackDomain(3).run(body, timeout=60)) < 10  # at once, not after the 30 s timeout
    assert not leftover_segments(before, {os.getpid()})


def test_plan_agreement_with_a_rank_that_skips_weight_sync():
    plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)

    def body(group):  # the agreement (the host transport's default is the window check)
        with Context(group, make_layout(4, 4), 1, 1, num_layers=1, timeout_s=TIMEOUT, plan_check="agree") as ctx:
            ctx.register_masters(0, *masters_for(make_layout(4, 4), ctx.rank, 1))
            vid = ctx.begin(0)
            if group.rank == 1:
                return True  # skips weight_sync
            t0 = time.monotonic()
            with pytest.raises(
                UltracommTimeout,
                match=r"rank 0 weight_sync \(plan agreement\) timed out after 0.5 s: "
                r"ranks \[1\] did not arrive",
            ):
                ctx.weight_sync(vid, plan)
            assert time.monotonic() - t0 <= TIMEOUT + MARGIN
            with pytest.raises(UltracommError, match="failed earlier"):  # out of step: the Context is done
                ctx.weight_sync(vid, plan)
        return True

    assert LoopbackDomain(2).run(body, timeout=60) == [True, True]


def test_close_with_a_stalled_peer_returns_within_the_timeout():
    plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)

    def body(group):
        ctx = Context(group, make_layout(4, 4), 1, 1, num_layers=1, max_microbatches=3, timeout_s=TIMEOUT)
        ctx.register_masters(0, *masters_for(make_layout(4, 4), ctx.rank, 1))
        vids = [ctx.begin(0) for _ in range(3)]
        if group.rank == 1:  # agrees on three plans, then never runs them
            for _ in vids:
                ctx._prepare_plan(plan)
            return True
        works = [ctx.weight_sync(v, plan, async_op=True) for v in vids]
        t0 = time.monotonic()
        ctx.close()  # waits for the queue: the first op times out, the others never start
        assert time.monotonic() - t0 <= TIMEOUT + MARGIN
        with pytest.raises(UltracommTimeout, match="rank 1"):
            works[0].wait()
        for w in works[1:]:
            with pytest.raises(UltracommError, match="not started: an earlier operation"):
                w.wait()
        return True

    assert LoopbackDomain(2).run(body, timeout=60) == [True, True]
