"""A timed-out rank names the rank that stopped first when its window shows it (issue 23 item 9):
in a relay tree 2 -> 0 -> 1, rank 1 waits for rank 0, which is alive and waits in turn for rank
2, which never started the operation.  Rank 1's error names rank 0 (what it waited for) and then
rank 2, from the ready flags of the shared window."""

from __future__ import annotations

import os
import sys
import threading

import numpy as np
import pytest

from ultracomm import Context, LoopbackDomain, ReplicaPlan, UltracommTimeout, build_schedule
from ultracomm.transports.host.who_stopped import stopped_note

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from test_context import make_layout, masters_for  # noqa: E402

PLAN = ReplicaPlan.make(np.array([[2], [2], [-1]], np.int32), experts_per_rank=1)
KW = dict(
    num_layers=1,
    max_microbatches=2,
    num_workers=1,
    window="local",
    transport="host",
    relay_mode="force",
    max_depth=2,
    plan_check="window",
    timeout_s=0.5,
    chunk_bytes=1024,
    tile_bytes=1024,
)


def test_relay_tree_is_2_0_1():
    sched = build_schedule(PLAN, 4096, 4096, relay_mode="force", max_depth=2, chunk_bytes=1024)
    assert sched.tree("multicast")[0][:, 0].tolist() == [2, 0, -1]


def test_timeout_names_the_rank_that_never_started():
    layout = make_layout(64, 32)
    others_done = threading.Barrier(3)
    errors = {}

    def body(group):
        with Context(group, layout, 1, 1, **KW) as ctx:
            ctx.register_masters(0, *masters_for(layout, ctx.rank, 1))
            ctx.weight_sync(ctx.begin(0), PLAN)  # every rank once: epoch 1
            if ctx.rank != 2:  # rank 2 stops publishing: it never starts epoch 2
                with pytest.raises(UltracommTimeout) as ei:
                    ctx.weight_sync(ctx.begin(0), PLAN)
                errors[ctx.rank] = str(ei.value)
            others_done.wait(60)
        return True

    assert LoopbackDomain(3).run(body, timeout=120) == [True] * 3
    chunk = "expert 2 chunk 0 into slot 0"
    # blame by evidence (issue 35, ultracomm.blame): rank 2's thread is alive (its heartbeat is fresh) but
    # behind: named as such, never as stopped; rank 0 waits in turn and says so in its own record
    assert errors[1].startswith(
        f"ultracomm: rank 1 weight_sync (multicast) epoch 2 timed out after 0.5 s waiting for rank 0 to deliver "
        f"{chunk} (arrival flag); by evidence, stopped: ranks []"
    ), errors[1]
    assert (
        "rank 2 has not started this operation (ready flag at epoch 1): it waits elsewhere, or stopped calling"
        in errors[1]
    ), errors[1]
    assert "stalled or dead" not in errors[1], errors[1]
    # rank 0 waited for rank 2 itself: the executor's fact stays, its guess goes
    assert (
        "rank 2 has not started this operation (its ready flag is at epoch 1); by evidence, stopped: ranks []"
        in errors[0]
    ), errors[0]


def test_note_orders_ranks_by_how_far_they_got():
    msg = "ultracomm: rank 0 grad_reduce (reduce) epoch 9 timed out after 1 s waiting for rank 1's grad"
    assert stopped_note(msg, 9, 0, {0: 9, 1: 9, 2: 8, 3: 5, 4: 9}) == (
        "rank 1 started this operation and likely waits in turn; by their ready flags, 2 rank(s) have not started "
        "this operation (rank 3 at epoch 5, rank 2 at epoch 8): rank 3 stopped first (latest epoch 5) and is "
        "likely the stalled or dead rank"
    )
    assert stopped_note(msg, 9, 0, {0: 9, 1: 9, 2: 10}) is None  # every rank started: nothing known
