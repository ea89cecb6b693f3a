"""ReplicaManager under misuse: bad inputs are refused before a micro-batch slot is taken,
a forward without a backward can be dropped (by hand or by freeing its graph), a manager
dropped without close() leaves no thread, fd or mapping behind, and out-of-range ranks are
errors rather than another rank's routing."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest
import torch

import moe_harness as mh
from conftest import live_threads
from ultracomm import InputError, LoopbackDomain, RegistrationError, UltracommError
from ultracomm.moe import ReplicaManager, linear
from ultracomm.planners.base import build_result

WORLD, EPR, K = 2, 2, 1
E = WORLD * EPR


def manager(group, max_microbatches: int = 1, **kw) -> tuple[ReplicaManager, list]:
    mgr = ReplicaManager(group, mh.layout(), EPR, K, 1, max_microbatches=max_microbatches, timeout_s=20, **kw)
    params = mh.make_params(group.rank, EPR, 1, torch.float32, "stacked", False, False)
    mgr.register_layer(0, params[0])
    return mgr, params


def forward(mgr, params, group, mb: int = 0):
    """One micro-batch's loss of layer 0 (a graph through the step's replica weights)."""
    _, rmap, probs, _ = mh.batch(group.rank, 0, mb, E)
    step = mgr.step(0, rmap, probs)
    loss = mh.rank_loss(step, group.rank, WORLD, 0, mb, params[0], step.replica_weights(), linear)
    return step.guard(loss)


@pytest.mark.parametrize(
    "probs, message",
    [
        (
            lambda p: p[:, :3],
            "probs must be a floating-point [tokens, 4] tensor shaped like routing_map [24, 4] (or None), "
            "got torch.float32 [24, 3] on cpu",
        ),
        (
            lambda p: (p > 0).int(),
            "probs must be a floating-point [tokens, 4] tensor shaped like routing_map [24, 4] (or "
            "None), got torch.int32 [24, 4] on cpu",
        ),
        (
            lambda p: p.tolist(),
            "probs must be a floating-point [tokens, 4] tensor shaped like routing_map [24, 4] (or None), got list",
        ),
    ],
)
def test_bad_probs_are_refused_before_the_layer_slot_is_taken(probs, message):
    def body(group):
        mgr, params = manager(group)
        _, rmap, good, _ = mh.batch(group.rank, 0, 0, E)
        with pytest.raises(ValueError) as err:
            mgr.step(0, rmap, probs(good))
        assert str(err.value) == "ultracomm: " + message
        forward(mgr, params, group).backward()  # the layer's one slot is still free
        mgr.close()

    LoopbackDomain(WORLD).run(body)


def test_bad_routing_map_is_refused():
    def body(group):
        mgr, params = manager(group)
        with pytest.raises(
            ValueError,
            match=r"^ultracomm: routing_map must be a bool \[tokens, 4\] tensor, got "
            r"torch.int64 \[3, 4\] on cpu$",
        ):
            mgr.step(0, torch.zeros(3, 4, dtype=torch.long))
        # a routing map without data (meta) was summed anyway: NotImplementedError from torch
        with pytest.raises(InputError, match=r"^ultracomm: routing_map is on meta; pass it on the CPU or a CUDA"):
            mgr.step(0, torch.zeros(3, 4, dtype=torch.bool, device="meta"))
        forward(mgr, params, group).backward()  # the layer's one slot is still free
        mgr.close()

    LoopbackDomain(WORLD).run(body)


@pytest.mark.parametrize(
    "params, message",
    [
        (None, " takes params as a list with one entry per layout member ['fc1', 'fc2'], got NoneType"),
        (5, " takes params as a list with one entry per layout member ['fc1', 'fc2'], got int"),
        (lambda p: p[0], " takes params as a list with one entry per layout member ['fc1', 'fc2'], got Parameter"),
        (lambda p: [p[0], 3], ": params[1] (fc2) must be a tensor or a list of per-expert tensors, got int"),
        (
            lambda p: [p[0], [p[1][0], "w"]],
            ": params[1] (fc2) must be a tensor or a list of per-expert tensors, got list",
        ),
    ],
)
def test_register_layer_refuses_what_is_not_tensors(params, message):
    """Before: None / an int / a lone tensor went into list() or zip() and raised TypeError, or (a lone
    stacked tensor) were taken apart along its expert dimension."""

    def body(group):
        mgr = ReplicaManager(group, mh.layout(), EPR, K, 1, timeout_s=20)
        good = mh.make_params(group.rank, EPR, 1, torch.float32, "stacked", False, False)[0]
        with pytest.raises(RegistrationError) as err:
            mgr.register_layer(0, params(good) if callable(params) else params)
        assert str(err.value) == "ultracomm: register_layer" + message
        mgr.register_layer(0, good)  # nothing was registered
        mgr.close()

    LoopbackDomain(WORLD).run(body)


def test_register_layer_refuses_a_bool_layer_before_anything_is_allocated():
    """register_layer(True, ...) passed the manager's check (bool is an int) as layer 1, allocated the
    gradient staging, and only the Context refused it; step(True) is refused up front (fbe590e)."""

    def body(group):
        mgr = ReplicaManager(group, mh.layout(), EPR, K, 2, timeout_s=20)
        good = mh.make_params(group.rank, EPR, 1, torch.float32, "stacked", False, False)[0]
        with pytest.raises(RegistrationError, match=r"^ultracomm: layer True is out of range 0\.\.1 \(num_layers=2\)$"):
            mgr.register_layer(True, good)
        assert mgr.grads is None and mgr.layers == [None, None]
        mgr.close()

    LoopbackDomain(WORLD).run(body)


def test_step_names_an_out_of_range_layer_and_an_unregistered_one():
    def body(group):
        mgr = ReplicaManager(group, mh.layout(), EPR, K, 2, timeout_s=20)
        _, rmap, probs, _ = mh.batch(group.rank, 0, 0, E)
        with pytest.raises(RegistrationError, match=r"^ultracomm: layer 5 is out of range 0\.\.1 \(num_layers=2\)$"):
            mgr.step(5, rmap, probs)
        with pytest.raises(
            RegistrationError, match=r"^ultracomm: layer 1 is not registered; call register_layer first$"
        ):
            mgr.step(1, rmap, probs)
        mgr.close()

    LoopbackDomain(WORLD).run(body)


def test_a_step_whose_weight_sync_is_refused_frees_its_slot():
    calls = []

    def bad_then_good(load, domain, slots_per_rank):
        load = np.asarray(load, np.int64)
        slot_src = np.full((domain.world, slots_per_rank), -1, np.int32)
        calls.append(1)
        if len(calls) <= WORLD:  # the first step on each rank: a replica of a non-existent expert
            slot_src[1, 0] = 99
        return build_result(load, domain, slot_src, np.zeros(slot_src.shape, np.int64))

    def body(group):
        mgr, params = manager(group, planner=bad_then_good)
        with pytest.raises(Exception, match="99"):
            forward(mgr, params, group)
        forward(mgr, params, group).backward()
        mgr.close()

    LoopbackDomain(WORLD).run(body)


def test_abandon_drops_a_forward_without_backward():
    def body(group):
        mgr, params = manager(group)
        kept = forward(mgr, params, group)  # an eval forward with grad enabled; the graph is kept
        with pytest.raises(UltracommError) as err:
            forward(mgr, params, group, mb=1)
        assert str(err.value) == (
            "ultracomm: layer 0 already has 1 steps whose backward has not run; run their backward, call "
            "ReplicaManager.abandon() to drop them (a skipped step), take evaluation forwards inside `with "
            "manager.evaluating():`, or create the manager with a larger max_microbatches"
        )
        assert mgr.abandon() == [0]
        with pytest.raises(UltracommError, match=r"^ultracomm: layer 0 step \(vid 0\) was abandoned "):
            kept.backward()
        forward(mgr, params, group, mb=1).backward()
        mgr.close()

    LoopbackDomain(WORLD).run(body)


def test_evaluating_leaves_the_step_in_flight_alone():
    """abandon() would drop the training micro-batch too; inside evaluating() the evaluation
    steps expect no backward, take the manager's spare slot and free it at once, and the
    training step's backward restores its own replicas (the evaluation overwrote the slots)."""

    def body(group):
        mgr, params = manager(group)
        loss = forward(mgr, params, group)
        with mgr.evaluating():
            for mb in (1, 2):  # twice: the spare slot is free again after each
                out = forward(mgr, params, group, mb=mb)
                assert out.grad_fn is not None  # grad enabled: only the masters' graph is cut
        assert len(mgr._live) == 1  # only the training step is in flight
        loss.backward()
        mgr.close()
        return [p.grad for p in params[0]]

    got = LoopbackDomain(WORLD).run(body)

    def plain(group):
        mgr, params = manager(group)
        forward(mgr, params, group).backward()
        mgr.close()
        return [p.grad for p in params[0]]

    want = LoopbackDomain(WORLD).run(plain)
    assert all((a is None and b is None) or torch.equal(a, b) for g, w in zip(got, want) for a, b in zip(g, w))


def test_a_step_whose_graph_is_freed_is_dropped_by_itself():
    def body(group):
        mgr, params = manager(group)
        forward(mgr, params, group)  # the loss is dropped at once: its graph and step die
        forward(mgr, params, group, mb=1).backward()
        forward(mgr, params, group, mb=2)
        forward(mgr, params, group, mb=3).backward()
        mgr.close()

    LoopbackDomain(WORLD).run(body)


def resources() -> tuple[int, int, int]:
    with open("/proc/self/maps") as f:
        maps = sum(1 for _ in f)
    return live_threads(), len(os.listdir("/proc/self/fd")), maps


def test_managers_dropped_without_close_after_a_forward_leave_nothing_behind():
    domain = LoopbackDomain(WORLD)

    def cycles(n):
        def body(group):
            for _ in range(n):
                mgr, params = manager(group)
                forward(mgr, params, group)  # forward only; neither backward nor close()
                del mgr, params

        domain.run(body)
        gc.collect()

    cycles(3)  # warm-up: pools, lazily created threads
    before = resources()
    cycles(100)
    after = resources()
    assert after[0] <= before[0] and after[1] <= before[1], f"threads/fds {before[:2]} -> {after[:2]}"
    # per leaked Context: a mapping per peer segment; allow allocator noise of a few maps
    assert after[2] - before[2] < 20, f"mappings {before[2]} -> {after[2]}"


@pytest.mark.parametrize("source", [-1, 2, 99, True])
def test_rerouted_refuses_ranks_out_of_range(source):
    def body(group):
        mgr, _ = manager(group)
        _, rmap, probs, _ = mh.batch(group.rank, 0, 0, E)
        with torch.no_grad():
            step = mgr.step(0, rmap, probs)
        with pytest.raises(ValueError) as err:
            step.rerouted(source=source)
        assert str(err.value) == (
            f"ultracomm: rerouted(source={source!r}): source must be a rank in 0..1 (default: this rank)"
        )
        mgr.close()

    LoopbackDomain(WORLD).run(body)
