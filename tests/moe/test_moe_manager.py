"""ReplicaManager end to end on loopback ranks: planner -> weight_sync -> rerouted tokens ->
replica weights as autograd tensors -> guard/restore -> reduce, against a float64
no-replication reference (tests/moe_harness.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain, UltracommError
from ultracomm.moe import ReplicaManager, linear
from ultracomm.planners.base import build_result

WORLD, EPR, K, LAYERS = 4, 2, 2, 2
E = WORLD * EPR
TOL = mh.TOL


def fixed_planner(slot_src: np.ndarray):
    """A planner that always returns ``slot_src``, each replica taking half of its expert's tokens
    split evenly over the replicas (integer, exact)."""
    slot_src = np.asarray(slot_src, np.int32)

    def plan(load, domain, slots_per_rank):
        load = np.asarray(load, np.int64)
        total = load.sum(0)
        quota = np.zeros(slot_src.shape, np.int64)
        for e in np.unique(slot_src[slot_src >= 0]):
            where = np.argwhere(slot_src == e)
            share = total[e] // 2 // len(where)
            for r, k in where:
                quota[r, k] = share
        return build_result(load, domain, slot_src, quota)

    return plan


def params_for(rank: int, layers: int, dtype=torch.float32, main_grad: bool = False, per_expert: bool = False):
    return mh.make_params(rank, EPR, layers, dtype, "list" if per_expert else "stacked", main_grad, False)


def run(
    order: str = "plain",
    mbs: int = 1,
    checkpoint: str | None = None,
    planner="quota",
    skip_replicas_on: tuple = (),
    guard: bool = True,
    dtype=torch.float32,
    main_grad: bool = False,
    per_expert: bool = False,
    max_microbatches: int | None = None,
    hot: float = 3.0,
    lin=linear,
):
    """Per rank ``(grads[layer][member] [EPR, ...], imbalances)``; ``order``: ``plain``
    (F0 B0 F1 B1 ...) or ``interleaved`` (every forward, then the backwards in forward order)."""
    if order == "plain":
        schedule = " ".join(f"F{m} B{m}" for m in range(mbs))
    else:
        schedule = " ".join([f"F{m}" for m in range(mbs)] + [f"B{m}" for m in range(mbs)])
    return mh.train(
        WORLD,
        EPR,
        K,
        LAYERS,
        schedule,
        planner=planner,
        checkpoint=checkpoint,
        dtype=dtype,
        form="list" if per_expert else "stacked",
        main_grad=main_grad,
        hot=hot,
        lin=lin,
        guard=guard,
        skip_replicas_on=skip_replicas_on,
        max_microbatches=max_microbatches or mbs,
    )


def check_against_reference(results, mbs=1):
    mh.check_grads([grads for grads, _ in results], WORLD, EPR, LAYERS, mbs)


def bitwise_equal(a, b):
    return all(torch.equal(x, y) for ra, rb in zip(a, b) for la, lb in zip(ra[0], rb[0]) for x, y in zip(la, lb))


def test_manager_grads_match_no_replication_and_repeat_bit_identically():
    first = run()
    check_against_reference(first)
    before, after = first[0][1][0]
    assert before > 3 and after == pytest.approx(1.0, abs=0.1)  # the skewed router, then balanced
    assert bitwise_equal(first, run())


def test_interleaved_microbatches_give_the_plain_order_grads():
    plain = run("plain", mbs=2)
    check_against_reference(plain, mbs=2)
    assert bitwise_equal(plain, run("interleaved", mbs=2))


@pytest.mark.parametrize("mode", ["non_reentrant", "reentrant"])
def test_activation_recompute_resyncs_and_gives_the_same_grads(mode):
    assert bitwise_equal(run(), run(checkpoint=mode))


def test_rank_without_replica_tokens_still_reaches_every_collective():
    # replicas of the hot experts only on ranks 2 and 3; ranks 0 and 1 never touch replica weights
    slot_src = np.array([[-1, -1], [-1, -1], [0, 1], [1, 0]])
    results = run(planner=fixed_planner(slot_src), skip_replicas_on=(0, 1))
    check_against_reference(results)


def test_replica_weights_read_after_the_next_layers_step_raise():
    def body(group):
        mgr = ReplicaManager(group, mh.layout(), EPR, K, LAYERS, timeout_s=20)
        for layer, ps in enumerate(params_for(group.rank, LAYERS)):
            mgr.register_layer(layer, ps)
        steps = [mgr.step(layer, mh.batch(group.rank, layer, 0, E)[1]) for layer in range(LAYERS)]
        try:
            with pytest.raises(UltracommError, match="overwritten by layer 1"):
                steps[0].replica_weights()
        finally:
            mgr.ctx.synchronize()
            mgr.close()

    LoopbackDomain(WORLD).run(body)


def test_missing_guard_is_caught_before_stale_grads_are_reduced():
    # every rank uses its replicas in both layers; without guard() nothing restores layer 0's
    # replicas after layer 1's weight_sync, so its backward must raise instead of reducing
    slot_src = np.array([[2, 4], [4, 6], [6, 0], [0, 2]])
    with pytest.raises(UltracommError, match="stale weights"):
        run(planner=fixed_planner(slot_src), guard=False, hot=0.0)


def plain_for_replicas(x, w):
    """ultracomm.moe.linear for the masters, an ordinary matmul (autograd wgrad in the weight's
    dtype, weight saved for the Dgrad) for the replica weights."""
    return linear(x, w) if isinstance(w, torch.nn.Parameter) else x @ w.t()


def worst_relative(a, b) -> float:
    return max(
        ((x - y).abs().max() / x.abs().max()).item()
        for (ra, _), (rb, _) in zip(a, b)
        for la, lb in zip(ra, rb)
        for x, y in zip(la, lb)
    )


def test_replica_weights_work_in_ordinary_autograd_ops():
    # saved for the Dgrad by a plain matmul: writes into the window's grad slots (the staged copy
    # before each reduce) must not count as modifying them
    check_against_reference(run(lin=plain_for_replicas))


def test_bf16_weights_get_fp32_wgrads_in_main_grad():
    # Megatron-style per-expert parameters with fp32 main_grad: home and replica wgrads both go
    # through ultracomm.moe.linear's fp32 accumulation, so ultracomm and no replication agree to
    # fp32 reassociation although the weights are bf16; replica wgrads rounded to bf16 (an
    # ordinary matmul on the replica weights) are visibly worse
    none = np.full((WORLD, K), -1)
    base = run(planner=fixed_planner(none), dtype=torch.bfloat16, main_grad=True, per_expert=True)
    fused = run(dtype=torch.bfloat16, main_grad=True, per_expert=True)
    assert all(g.dtype == torch.float32 for r, _ in fused for layer in r for g in layer)
    assert worst_relative(base, fused) <= TOL
    assert (
        worst_relative(base, run(dtype=torch.bfloat16, main_grad=True, per_expert=True, lin=plain_for_replicas))
        > 100 * TOL
    )


def test_profiled_manager_records_the_loads_the_planner_saw(tmp_path):
    """With a profile, each step's record holds the gathered [world, E] loads and the
    planner's plan beside the ops' times, so `ultracomm.tools.whatif` can replay a manager run."""
    from ultracomm.profile import Profiler, load_trace

    seen: dict = {}

    def body(group):
        r = group.rank
        prof = Profiler(tmp_path / f"r{r}")
        mgr = ReplicaManager(group, mh.layout(), EPR, K, LAYERS, planner="quota", timeout_s=20, profile=prof)
        params = params_for(r, LAYERS)
        for layer in range(LAYERS):
            mgr.register_layer(layer, params[layer])
        anchor = torch.ones((), requires_grad=True)
        total = 0
        for layer in range(LAYERS):
            x, rmap, probs, _ = mh.batch(r, layer, 0, E)
            step = mgr.step(layer, rmap, probs)
            seen[(r, layer)] = (rmap.sum(0).numpy().copy(), np.asarray(step.result.plan.slot_src).copy())
            loss = mh.rank_loss(step, r, WORLD, layer, 0, params[layer], step.replica_weights(), linear)
            total = total + step.guard(loss) * anchor
        total.backward()
        mgr.close()
        prof.close()

    LoopbackDomain(WORLD).run(body, timeout=240)
    for r in range(WORLD):
        tr = load_trace(tmp_path / f"r{r}")
        assert tr["layer"].tolist() == list(range(LAYERS))
        assert tr["has_load"].all() and tr["has_plan"].all()
        for i, layer in enumerate(tr["layer"].tolist()):
            want = np.stack([seen[(q, layer)][0] for q in range(WORLD)])
            assert np.array_equal(tr.load_matrix(i), want)
            assert np.array_equal(tr["slot_src"][i], seen[(r, layer)][1])
            assert tr["time_weight_sync"][i] > 0 and tr["time_grad_reduce"][i] > 0


def test_default_planner_is_the_device_planner_with_a_logged_fallback(caplog):
    """Issue 19 item 7: the device control plane's planner is the default; beyond its capacities the manager
    plans with host ``quota`` and says so in one log line."""
    from ultracomm.moe import manager as mgr_mod
    from ultracomm.planners import get_planner

    assert get_planner("device") is mgr_mod.device_planner.plan
    import inspect

    assert inspect.signature(mgr_mod.ReplicaManager.__init__).parameters["planner"].default == "device"
    assert mgr_mod.device_planner.fits(1024, 65536, 8) and not mgr_mod.device_planner.fits(1025, 1025, 1)
    assert not mgr_mod.device_planner.fits(8, 64, 9) and not mgr_mod.device_planner.fits(8, 65537, 1)


def test_beyond_the_device_planners_capacity_the_manager_logs_and_plans_with_quota(monkeypatch, caplog):
    import logging

    from ultracomm import LoopbackDomain
    from ultracomm.moe import ReplicaManager
    from ultracomm.moe import manager as mgr_mod
    from ultracomm.planners import get_planner

    monkeypatch.setattr(mgr_mod.device_planner, "MAX_SLOTS", 1)  # as if 2 slots were beyond it

    def body(group):
        mgr = ReplicaManager(group, mh.layout(), 2, 2, 1, timeout_s=20)
        chosen = mgr.planner
        mgr.close()
        return chosen

    with caplog.at_level(logging.WARNING, logger="ultracomm"):
        chosen = LoopbackDomain(2).run(body, timeout=120)
    assert all(c is get_planner("quota") for c in chosen)
    lines = [r.getMessage() for r in caplog.records if "device planner" in r.getMessage()]
    assert (
        lines
        == [
            "ultracomm: world 2, 4 experts, 2 slots exceed the device planner's capacities; "
            "planning with the host planner 'quota'"
        ]
        * 2
    )


def test_device_planner_grads_match_no_replication_and_repeat_bit_identically():
    first = run(planner="device", mbs=2, order="interleaved")
    check_against_reference(first, mbs=2)
    before, after = first[0][1][0]
    assert before > 3 and after < 1.1  # the device planner balanced the skewed router
    assert bitwise_equal(first, run(planner="device", mbs=2, order="interleaved"))


def test_manager_refuses_a_one_gpu_loopback_domain_of_several_ranks():
    """cuda_local windows run every rank's share of an operation in one launch, enqueued by the
    last rank to call it: a manager's forward compute and backward (one autograd device thread
    for every rank) would run before the operations they read, so it refuses, naming what to use."""
    from types import SimpleNamespace

    from ultracomm.errors import ConfigError
    from ultracomm.moe import ReplicaManager

    ctx = SimpleNamespace(stream_ordered=True, window=SimpleNamespace(loopback=True), world=2)
    with pytest.raises(
        ConfigError,
        match="ReplicaManager cannot run on a one-GPU loopback domain .cuda_local "
        "windows. of more than one rank.*Use one process per GPU",
    ):
        ReplicaManager(None, None, 1, 1, 1, context=ctx)
