"""ReplicaManager's load exchange through a host-memory window (issue 19 item 1, host
executor): no store or torch.distributed call per step after setup, the same plans and grads
as the store exchange, and a rank that never posts is named within the timeout."""

from __future__ import annotations

import time

import numpy as np
import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain, UltracommTimeout
from ultracomm.moe import ReplicaManager, linear
from ultracomm.moe import loads as loads_mod

WORLD, EPR, K, LAYERS = 4, 2, 2, 2
E = WORLD * EPR


def train(board: bool, counted: list | None = None):
    def body(group):
        r = group.rank
        mgr = ReplicaManager(group, mh.layout(), EPR, K, LAYERS, max_microbatches=2, timeout_s=20, plan_check="window")
        if not board:
            mgr._board = None  # the store exchange, for comparison
        calls = [0]
        inner = group.all_gather_object

        def counting(obj, **kw):
            calls[0] += 1
            return inner(obj, **kw)

        group.all_gather_object = counting  # every collective of the group goes through here
        params = mh.make_params(r, EPR, LAYERS, torch.float32, "stacked", False, False)
        for layer in range(LAYERS):
            mgr.register_layer(layer, params[layer])
        slots = []
        losses = {}
        for kind, mb in mh.parse_schedule("F0 F1 B1 B0"):
            if kind == "B":
                losses.pop(mb).backward()
                continue
            total, anchor = 0, torch.ones((), requires_grad=True)
            for layer in range(LAYERS):
                _, rmap, probs, _ = mh.batch(r, layer, mb, E)
                step = mgr.step(layer, rmap, probs)
                slots.append(np.asarray(step.result.slot_src).copy())
                loss = mh.rank_loss(step, r, WORLD, layer, mb, params[layer], step.replica_weights(), linear)
                total = total + step.guard(loss) * anchor
            losses[mb] = total
        n = calls[0]
        out = mh.master_grads(params, False)
        mgr.close()
        if counted is not None:
            counted.append(n)
        return out, slots

    return LoopbackDomain(WORLD).run(body, timeout=240)


def test_steps_exchange_loads_without_collectives_and_match_the_store_exchange():
    counted: list = []
    got = train(True, counted)
    assert counted == [0] * WORLD  # no store / group collective after setup: loads, plans, ops
    want = train(False)
    for (ga, sa), (gb, sb) in zip(got, want):
        assert all(np.array_equal(x, y) for x, y in zip(sa, sb))
        assert all(torch.equal(x, y) for la, lb in zip(ga, gb) for x, y in zip(la, lb))
    mh.check_grads([g for g, _ in got], WORLD, EPR, LAYERS, mbs=2)


def test_a_rank_that_never_posts_its_loads_is_named():
    def body(group):
        mgr = ReplicaManager(group, mh.layout(), EPR, K, LAYERS, timeout_s=1.0, plan_check="window")
        for layer, ps in enumerate(mh.make_params(group.rank, EPR, LAYERS, torch.float32, "stacked", False, False)):
            mgr.register_layer(layer, ps)
        try:
            if group.rank == 3:  # rank 3 skips its step
                return None
            t0 = time.monotonic()
            with torch.no_grad(), pytest.raises(UltracommTimeout) as err:
                mgr.step(0, mh.batch(group.rank, 0, 0, E)[1])
            return str(err.value), time.monotonic() - t0
        finally:
            mgr._board = None  # the board's peers may be gone; the Context closes alone
            mgr.ctx.close()

    res = LoopbackDomain(WORLD).run(body, timeout=60)
    for r in range(3):
        msg, elapsed = res[r]
        # rank 3 skipped its step and closed its Context: its heartbeat word says it left (ultracomm.blame),
        # so it is named as the rank that did not post, and not called stopped
        assert msg.startswith(
            f"ultracomm: rank {r} step(layer 0, no grad) (expert loads) timed out after 1 s: ranks "
            "[3] did not post their loads (timeout ULTRACOMM_TIMEOUT_S=1); by evidence, stopped: "
            "ranks []"
        ), msg
        assert "closed their Context: ranks [3] (rank 3 after epoch 0)" in msg, msg
        assert msg.endswith("every rank must call step() for the same layers in the same order"), msg
        assert 1.0 <= elapsed < 10


def test_windows_other_ranks_cannot_read_fall_back_to_the_store(monkeypatch):
    class W:
        provider, peer_bases = "private", [1, 1]
        local = torch.zeros(1)

    class C:
        window = W()

    assert loads_mod.LoadBoard.for_context(C()) is None
