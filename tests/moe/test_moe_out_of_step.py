"""Ranks out of step (issue 32 item 6): a rank that runs its MoE layers in another order than its
peers (rank 1: layer 1 then layer 0; the others 0 then 1) makes every rank raise
``PlanMismatchError`` naming both sides at the first step's loads' exchange, before any byte
moves -- on the host transport (load board; either plan check), on p2p (the store exchange) and on
the CPU split (a load board over loopback windows, the store exchange as between hosts).  Loopback
ranks, ReplicaManager with its defaults otherwise."""

from __future__ import annotations

import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain, PlanError, PlanMismatchError, _core
from ultracomm.moe import ReplicaManager

WORLD, EPR, K, LAYERS = 3, 2, 1, 2
E = WORLD * EPR
TAIL = "; every rank must call the same collective operations in the same order"

CASES = {  # name -> (manager options, whether the loads go through a load board)
    "host": (dict(), True),
    "host_agree": (dict(plan_check="agree"), True),
    "p2p": (dict(transport="p2p"), False),
    # loopback "local" windows map every rank, so a board; over processes on two hosts, the store
    "split": (dict(transport="split", window="local", domain="a,a,b"), True),
    "split_store": (dict(transport="split", window="local", domain="a,a,b", board=False), False),
}


def expected(rank: int, board: bool) -> str:
    """What rank ``rank`` raises: rank 1 ran layer 1 first, ranks 0 and 2 layer 0."""
    if rank == 1:
        mine, others = "step(layer 1)", "ranks [0, 2] posted step(layer 0)"
    else:
        mine, others = "step(layer 0)", "rank 1 posted step(layer 1)"
    where = " in load exchange 1" if board else " (expert loads)"
    return f"ultracomm: rank {rank} {mine} (expert loads): ranks called different operations ({others}{where}){TAIL}"


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_rank_running_its_layers_in_another_order_makes_every_rank_raise(case):
    options, board = CASES[case]

    def body(group):
        r = group.rank
        opts = dict(options)
        use_board = opts.pop("board", True)
        mgr = ReplicaManager(group, mh.layout(), EPR, K, LAYERS, timeout_s=20, **opts)
        try:
            if not use_board:
                mgr._board.close()
                mgr._board = None  # the store exchange, as between hosts
            assert (mgr._board is not None) == board
            params = mh.make_params(r, EPR, LAYERS, torch.float32, "stacked", False, False)
            for layer in range(LAYERS):
                mgr.register_layer(layer, params[layer])
            order = [1, 0] if r == 1 else [0, 1]
            before = [t.clone() for t in mgr.ctx.replica_weights]
            busy = mgr.ctx._vids.in_flight()  # micro-batch slots in flight
            errors = []
            for layer in order:
                _, rmap, probs, _ = mh.batch(r, layer, 0, E)
                try:
                    mgr.step(layer, rmap, probs)
                except Exception as e:  # noqa: BLE001 - the outcome under test
                    errors.append(e)
                    break
            moved = any(not torch.equal(a, b) for a, b in zip(before, mgr.ctx.replica_weights))
            return [(type(e), str(e)) for e in errors], moved, mgr.ctx._vids.in_flight() == busy
        finally:
            mgr.close()

    res = LoopbackDomain(WORLD).run(body, timeout=120)
    for r, (errors, moved, slots_kept) in enumerate(res):
        assert len(errors) == 1, (r, errors)
        kind, text = errors[0]
        assert kind is PlanMismatchError and issubclass(kind, PlanError), (r, kind)
        assert text == expected(r, board), (r, text)
        assert not moved, f"rank {r}: replica slots changed"
        assert slots_kept, f"rank {r}: the failed step kept its micro-batch slot"


def test_plan_mismatch_error_is_one_class_everywhere():
    import ultracomm
    from ultracomm import errors

    assert ultracomm.PlanMismatchError is errors.PlanMismatchError is _core.PlanMismatchError
    assert issubclass(PlanMismatchError, PlanError) and "PlanMismatchError" in errors.__all__
    assert "PlanMismatchError" in dir(ultracomm)
