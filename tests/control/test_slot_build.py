"""The device step's build into a plan-arena slot (include/ultracomm/impl/slot_build.h), host build
``_core.build_into_views`` -- the code ``k_build_slot`` runs on the GPU: on every rank of random
plans (with and without nodes, depth limits and chunk sizes) both views get exactly the portable
builder's task and ref bytes, this rank's plan row as ``my_slots``, its slots' parents in that
op's tree as ``slot_parent``, the counts and the digest; a build that cannot fit its views
writes no task and the rejected digest (peers raise PlanError instead of waiting)."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ultracomm import _core

from test_schedule_portable import random_problem

REJECTED = (1 << 64) - 1  # kRejectedDigest (include/ultracomm/records/error_record.h)
K_BAD_SHAPE, K_OVERFLOW = 1, 5  # psched::Status


def _caps(plan, wb, gb, chunk):
    """The plan arena's bounds for these sizes (transports/tma/plan_slots.arena_bounds)."""
    W, S = plan.slot_src.shape
    epr = -(-len(plan.home_of) // W)
    chunks = [max(1, -(-b // chunk)) for b in (wb, gb)]
    return [(epr + S) * c for c in chunks], [W * S, W * S]


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    world=st.integers(2, 48),
    slots=st.integers(1, 4),
    epr=st.integers(1, 3),
    nodes=st.sampled_from([0, 2, 4]),
    chunk=st.sampled_from([16, 64, 4096]),
    max_depth=st.sampled_from([1, 2, 8]),
)
def test_views_hold_the_portable_builders_lists_on_every_rank(seed, world, slots, epr, nodes, chunk, max_depth):
    plan, node_of, wb, gb = random_problem(seed, world, slots, epr, nodes)
    tcap, rcap = _caps(plan, wb, gb, chunk)
    digests = set()
    for r in range(world):
        args = (plan.slot_src, plan.home_of, node_of, wb, gb, chunk, r, max_depth, 64)
        got = _core.build_into_views(*args, tcap, rcap)
        want = _core.build_schedule_portable(*args)
        assert got["status"] == 0
        for op in ("multicast", "reduce"):
            g, w = got[op], want[op]
            assert g["tasks"].tobytes() == w["tasks"].tobytes(), (r, op)
            assert g["refs"].tobytes() == w["refs"].tobytes(), (r, op)
            assert (g["num_tasks"], g["num_refs"]) == (len(w["tasks"]), len(w["refs"]))
            assert g["my_slots"] == plan.slot_src[r].tolist()
            assert g["slot_parent"] == w["parent_rank"][r].tolist()
            assert g["digest"] == want["digest"]
        digests.add(got["digest"])
    assert len(digests) == 1  # every rank publishes the same digest


def _small():
    slot_src = np.array([[5, 9], [1, 13], [2, -1], [5, 6]], np.int32)
    home_of = (np.arange(16) // 4).astype(np.int32)
    return slot_src, home_of


def assert_rejected(got, refs=True):
    """Both views of a rejected build: no task (and, with ``refs``, no ref), the rejected digest,
    and every slot cleared (-1: the rank's drain waits on nothing)."""
    for op in ("multicast", "reduce"):
        v = got[op]
        assert (v["num_tasks"], v["digest"]) == (0, REJECTED)
        if refs:
            assert v["num_refs"] == 0
        assert v["my_slots"] == [-1, -1] and v["slot_parent"] == [-1, -1]


def test_overflow_writes_no_task_and_the_rejected_digest():
    slot_src, home_of = _small()
    got = _core.build_into_views(slot_src, home_of, None, 4096, 8192, 1024, 0, 8, 64, [1, 1000], [100, 100])
    assert got["status"] == K_OVERFLOW
    assert_rejected(got)


def test_a_template_of_another_rank_is_not_written():
    """The views were set up for rank 1, the problem is rank 0's: no list is built, the views'
    slots are cleared (the 7s the test filled them with become -1: the rank's drain then waits on
    nothing) and the digest says rejected."""
    slot_src, home_of = _small()
    got = _core.build_into_views(
        slot_src, home_of, None, 4096, 8192, 1024, 0, 8, 64, [100, 100], [100, 100], view_rank=1
    )
    assert got["status"] == K_BAD_SHAPE
    assert_rejected(got, refs=False)


@pytest.mark.parametrize("upstream", [6, 7], ids=["exchange-failed", "planner-failed"])
def test_failed_inputs_are_not_built_from(upstream):
    """The loads' exchange timed out, or the planner refused the loads: the build rejects with
    that status instead of building lists from partial or stale inputs."""
    slot_src, home_of = _small()
    got = _core.build_into_views(
        slot_src, home_of, None, 4096, 8192, 1024, 0, 8, 64, [100, 100], [100, 100], upstream=upstream
    )
    assert got["status"] == upstream
    assert_rejected(got)


def test_bad_caps_raise():
    slot_src, home_of = _small()
    with pytest.raises(ValueError, match="task_cap and ref_cap must be two counts"):
        _core.build_into_views(slot_src, home_of, None, 4096, 8192, 1024, 0, 8, 64, [100], [100, 100])
