"""``ULTRACOMM_PLAN_CHECK=window`` on the host transport (its default, ``auto``, since issue 32): no
plan agreement per ``weight_sync``.
Each rank publishes its schedule digest beside its ready flag; the executor raises
``PlanMismatchError`` naming both digests when a peer runs another plan, and a rank whose plan
is invalid publishes a rejection, so its peers fail at once instead of after the timeout."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

from ultracomm import Context, LoopbackDomain, ReplicaPlan
from ultracomm.errors import ConfigError, PeerError, PlanError, UltracommError
from ultracomm.records import Op
from ultracomm.transports.host import op_digest

from test_context import make_layout, masters_for

TIMEOUT_S = 60.0  # what a peer would wait without the window check; every failure here must come far sooner
FAST_S = 10.0
LAYOUT = make_layout(4, 4)
SWAP = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)  # each rank holds the other's expert


def run(plans, plan_check="window", **kw):
    """Per rank: (weight_sync's error or None, seconds it took, op digest of the rank's own plan, its
    replica slots afterwards, the exchanges weight_sync made, the error of a later restore or None)."""

    def body(group):
        with Context(group, LAYOUT, 1, 1, num_layers=1, plan_check=plan_check, timeout_s=TIMEOUT_S, **kw) as ctx:
            ctx.register_masters(0, *masters_for(LAYOUT, ctx.rank, 1))
            assert ctx.window_plan_check == (plan_check in ("window", "auto"))  # auto: the host has window flags
            vid = ctx.begin(0)
            plan = plans[group.rank]
            try:
                mine = op_digest(ctx.schedule_for(plan, plan.digest()).digest, Op.MULTICAST)
            except Exception:  # noqa: BLE001 - an invalid plan has no schedule
                mine = None
            gathered = []
            real = ctx.comm.all_gather_object
            ctx.comm.all_gather_object = lambda *a, **k: gathered.append(k.get("what")) or real(*a, **k)
            t0 = time.monotonic()
            try:
                ctx.weight_sync(vid, plan)
                error = None
            except Exception as e:  # noqa: BLE001 - returned for the test to check
                error = e
            elapsed = time.monotonic() - t0
            later = None
            try:  # once what was queued ran (a rejection is published in call order), is the Context usable?
                ctx.synchronize()
                ctx.restore(vid)
            except Exception as e:  # noqa: BLE001 - returned for the test to check
                later = e
            return error, elapsed, mine, [t.clone() for t in ctx.replica_weights], gathered, later

    return LoopbackDomain(2).run(body, timeout=4 * TIMEOUT_S)


def test_ranks_on_different_plans_raise_plan_mismatch_naming_both_digests_at_once():
    other = ReplicaPlan.make(np.array([[1], [-1]], np.int32), experts_per_rank=1)  # rank 1 keeps no replica
    res = run([SWAP, other])
    digests = [r[2] for r in res]
    assert digests[0] != digests[1]
    for r, (error, elapsed, mine, replicas, gathered, later) in enumerate(res):
        peer = 1 - r
        assert isinstance(error, PlanError), (r, error)
        assert type(error).__name__ == "PlanMismatchError"
        assert str(error).startswith(
            f"ultracomm: rank {r} weight_sync (multicast) epoch 1: rank {peer} runs a different plan for this "
            f"operation (schedule digest 0x{digests[peer]:016x} in its window, 0x{digests[r]:016x} here; seen "
        ), error
        assert elapsed < FAST_S, elapsed
        assert all(not t.any() for t in replicas), f"rank {r}: bytes moved despite the mismatch"
        assert gathered == []  # no plan agreement
        assert isinstance(later, UltracommError) and "failed earlier" in str(later)


def test_a_rank_rejecting_its_plan_fails_its_peer_at_once():
    wrong = ReplicaPlan.make(np.array([[1, -1], [0, -1]], np.int32), experts_per_rank=1)  # 2 slots per rank
    res = run([SWAP, wrong])
    (e0, t0, _, replicas0, gathered0, later0), (e1, _, _, _, _, later1) = res
    assert isinstance(e1, ValueError) and "2 slots per rank" in str(e1)  # rank 1's own error
    assert isinstance(e0, PlanError) and str(e0).startswith(
        "ultracomm: rank 0 weight_sync (multicast) epoch 1: rank 1 rejected its plan for this operation"
    ), e0
    assert t0 < FAST_S, t0
    assert all(not t.any() for t in replicas0) and gathered0 == []
    assert isinstance(later1, UltracommError) and "this rank rejected its plan" in str(later1)


def test_same_plan_moves_the_replicas_without_a_collective():
    res = run([SWAP, SWAP])
    for r, (error, _, _, replicas, gathered, later) in enumerate(res):
        assert error is None and later is None
        assert gathered == []
        want = masters_for(LAYOUT, 1 - r, 1)[0]
        for m, t in enumerate(replicas):
            assert torch.equal(t[0], want[m][0])


def test_window_is_the_host_default_and_needs_window_flags():
    res = run([SWAP, SWAP], plan_check="auto")  # issue 32: no store collective per weight_sync
    assert all(r[0] is None and r[4] == [] for r in res)
    res = run([SWAP, SWAP], plan_check="agree")
    assert all(r[0] is None and r[4] == ["plan agreement"] for r in res)
    for transport, kw in (("p2p", {}), ("split", dict(window="local", domain="a,b"))):  # auto: agree, no flags

        def check(group):
            with Context(group, LAYOUT, 1, 1, num_layers=1, transport=transport, timeout_s=TIMEOUT_S, **kw) as ctx:
                return ctx.window_plan_check

        assert LoopbackDomain(2).run(check) == [False, False], transport

    def body(group):
        Context(group, LAYOUT, 1, 1, num_layers=1, transport="p2p", plan_check="window", timeout_s=TIMEOUT_S)

    with pytest.raises((ConfigError, PeerError), match="plan_check='window' .* transport 'p2p' has none"):
        LoopbackDomain(2).run(body)
