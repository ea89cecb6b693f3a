"""Differential test of ReplicaManager: the same model trained with replication and without
(a planner that places no replica: every token stays on its home expert), over the schedules,
parameter forms, checkpointing modes, dtypes and load shapes users run.  Every master gradient
(home and replicated experts, every rank, every layer) is compared, and two replicated runs
must be bit-identical.

Tolerance: with fp32 gradients (fp32 weights, or bf16 weights with an fp32 ``main_grad``
filled by ``ultracomm.moe.linear``) replication only re-associates fp32 additions: each
element is a sum over the tokens of its expert, split into the home part and the replicas'
parts reduced in fp32 -- a few ulps of the largest partial sum, far below ``1e-5`` of the
tensor's largest gradient.  Where the gradient itself is bf16 (bf16 weights, no
``main_grad``: autograd accumulates ``.grad`` in bf16 on both sides) the two runs round
different partial sums to bf16, so they may differ by a few bf16 ulps: ``4 * 2**-8``.

Found by this test's cases before the fix (relative error 1.0, i.e. all-zero grads): per-expert
parameters without ``main_grad`` (reduced grads aliased a buffer that is zeroed) and the
pipeline order F0 F1 B1 B0.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import moe_harness as mh
from ultracomm.errors import UltracommError
from ultracomm.planners.base import build_result

LAYERS = 2


def no_replication(load, domain, slots_per_rank):
    """The baseline: no replica anywhere, every token on its home expert."""
    load = np.asarray(load, np.int64)
    empty = np.full((domain.world, slots_per_rank), -1, np.int32)
    return build_result(load, domain, empty, np.zeros(empty.shape, np.int64))


def tolerance(dtype, main_grad: bool) -> float:
    return 1e-5 if dtype == torch.float32 or main_grad else 4 * 2.0**-8


def worst(a, b) -> tuple[float, str]:
    """Largest error relative to each tensor's largest gradient, and where."""
    out = (0.0, "")
    for r, (ga, gb) in enumerate(zip(a, b)):
        for layer, (la, lb) in enumerate(zip(ga[0], gb[0])):
            for m, (x, y) in enumerate(zip(la, lb)):
                x, y = x.double(), y.double()
                scale = x.abs().max().item()
                err = (x - y).abs().max().item() / scale if scale else (y.abs().max().item() and float("inf"))
                if err > out[0]:
                    out = (err, f"rank {r} layer {layer} member {m}")
    return out


def bit_identical(a, b) -> bool:
    return all(torch.equal(x, y) for ga, gb in zip(a, b) for la, lb in zip(ga[0], gb[0]) for x, y in zip(la, lb))


def check(world: int, epr: int, slots: int, schedule: str, repeat: bool = True, **kw) -> None:
    base = mh.train(world, epr, slots, LAYERS, schedule, planner=no_replication, **kw)
    got = mh.train(world, epr, slots, LAYERS, schedule, **kw)
    # the replicated run really replicated: some step moved the hot experts' tokens
    assert any(after < before for _, imb in got for before, after in imb), "no step balanced anything"
    hot = [g.abs().max().item() > 0 for gr, _ in base[:1] for layer in gr for g in layer]
    assert all(hot), "rank 0's hot experts got no gradient in the baseline: the case tests nothing there"
    err, where = worst(base, got)
    assert err <= tolerance(kw.get("dtype", torch.float32), kw.get("main_grad", False)), (
        f"{schedule}: {where} differs from no replication by {err:.3g} of its largest gradient"
    )
    if repeat:
        assert bit_identical(got, mh.train(world, epr, slots, LAYERS, schedule, **kw)), "reruns differ"


SCHEDULES = {
    "one micro-batch": "F0 B0",
    "accumulation": "F0 B0 F1 B1",
    "1f1b": "F0 F1 B0 F2 B1 B2",
    "reverse": "F0 F1 B1 B0",
    "interleaved": "F0 F1 F2 B0 B2 B1",
}


@pytest.mark.parametrize("schedule", list(SCHEDULES.values()), ids=list(SCHEDULES))
@pytest.mark.parametrize("form", mh.FORMS)
def test_schedules_and_parameter_forms(schedule, form):
    check(4, 2, 2, schedule, form=form)


@pytest.mark.parametrize("schedule", ["F0 B0", "F0 F1 B1 B0", "F0 F1 F2 B0 B2 B1"])
@pytest.mark.parametrize("checkpoint", ["reentrant", "non_reentrant"])
def test_activation_checkpointing(schedule, checkpoint):
    check(4, 2, 2, schedule, checkpoint=checkpoint, form="list")


@pytest.mark.parametrize("form", mh.FORMS)
@pytest.mark.parametrize("schedule", ["F0 B0 F1 B1", "F0 F1 B1 B0"])
def test_main_grad(form, schedule):
    check(4, 2, 2, schedule, form=form, main_grad=True)


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
@pytest.mark.parametrize("schedule", ["F0 B0", "F0 F1 B1 B0"])
def test_bf16(main_grad, schedule):
    check(4, 2, 2, schedule, dtype=torch.bfloat16, main_grad=main_grad, form="list")


@pytest.mark.parametrize("schedule", ["F0 B0", "F0 F1 B1 B0"])
@pytest.mark.parametrize("checkpoint", [None, "non_reentrant"])
def test_experts_with_biases(schedule, checkpoint):
    check(4, 2, 2, schedule, bias=True, checkpoint=checkpoint, form="parameter_list")


@pytest.mark.parametrize("load", ["very hot", "uniform-ish", "zero-token rank"])
def test_load_shapes(load):
    kw = {"very hot": {"hot": 8.0}, "uniform-ish": {"hot": 1.0}, "zero-token rank": {"zero_rank": 3}}[load]
    check(4, 2, 2, "F0 F1 B1 B0", **kw)


@pytest.mark.parametrize("schedule", ["F0 B0", "F0 F1 B1 B0"])
@pytest.mark.parametrize("form", ["stacked", "list"])
def test_world_two(schedule, form):
    check(2, 2, 1, schedule, form=form)


@st.composite
def orders(draw, max_mbs: int = 3, max_in_flight: int = 2):
    """A valid order of ``n`` micro-batches: each backward after its forward, at most
    ``max_in_flight`` forwarded and not yet backwarded."""
    n = draw(st.integers(2, max_mbs))
    done, live, nxt, out = 0, [], 0, []
    while done < n:
        can_f = nxt < n and len(live) < max_in_flight
        if can_f and (not live or draw(st.booleans())):
            out.append(f"F{nxt}")
            live.append(nxt)
            nxt += 1
        else:
            mb = live.pop(draw(st.integers(0, len(live) - 1)))
            out.append(f"B{mb}")
            done += 1
    return " ".join(out)


@settings(max_examples=8, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
@given(schedule=orders(), form=st.sampled_from(mh.FORMS), checkpoint=st.sampled_from([None, "non_reentrant"]))
def test_generated_orders(schedule, form, checkpoint):
    check(2, 2, 1, schedule, repeat=False, form=form, checkpoint=checkpoint, max_microbatches=2)


def all_of_expert_0_to_replicas(load, domain, slots_per_rank):
    """Expert 0's replicas on ranks 1 and 2 take every one of its tokens: its home rank
    computes none of them (a planner may do this when the home rank holds two hot experts)."""
    load = np.asarray(load, np.int64)
    slot_src = np.full((domain.world, slots_per_rank), -1, np.int32)
    slot_src[1, 0] = slot_src[2, 0] = 0
    total = int(load.sum(0)[0])
    quota = np.zeros(slot_src.shape, np.int64)
    quota[1, 0], quota[2, 0] = total // 2, total - total // 2
    return build_result(load, domain, slot_src, quota)


@pytest.mark.parametrize("schedule", ["F0 B0", "F0 B0 F1 B1", "F0 F1 B1 B0"])
@pytest.mark.parametrize("form", mh.FORMS)
def test_an_expert_whose_home_computes_no_token(schedule, form):
    # its .grad is None until the reduced replica grads are folded in: the case that read back
    # all zeros (the folded grad aliased the fp32 buffer that is zeroed after folding)
    base = mh.train(4, 2, 2, LAYERS, schedule, planner=no_replication, form=form)
    got = mh.train(4, 2, 2, LAYERS, schedule, planner=all_of_expert_0_to_replicas, form=form)
    err, where = worst(base, got)
    assert err <= 1e-5, f"{where} differs from no replication by {err:.3g} of its largest gradient"


INPUT_PASS = {
    "one micro-batch": ("F0 I0 B0", "F0 B0"),
    "three in flight": ("F0 F1 F2 I0 I1 I2 B0 B1 B2", "F0 F1 F2 B0 B1 B2"),
}
INPUT_PASS_KW = {
    "grad": dict(form="list"),
    "main_grad": dict(form="list", main_grad=True),
    "non_reentrant": dict(form="stacked", checkpoint="non_reentrant"),
}


@pytest.mark.parametrize("schedules", list(INPUT_PASS.values()), ids=list(INPUT_PASS))
@pytest.mark.parametrize("kw", list(INPUT_PASS_KW.values()), ids=list(INPUT_PASS_KW))
def test_an_input_gradient_pass_before_the_weight_pass(schedules, kw):
    """``I<mb>``: ``autograd.grad(loss, [input], retain_graph=True)`` through the experts before
    the micro-batch's ``loss.backward()`` (zero-bubble schedules' B before W; an adversarial or
    gradient-penalty input grad).  The masters' gradients are those of the same run without the
    input pass, bit for bit, and match no replication.  Before the fix: the replicas' fused wgrads
    were added into the staging in both passes (replica contributions doubled, 0.86 of the
    largest gradient), a master's ``main_grad`` likewise; three micro-batches' input passes took
    staging sets that their weight passes then shared (a replica sum carried into the next
    micro-batch); and a non-reentrant recompute in the input pass planned a new step ('already
    has 3 steps whose backward has not run')."""
    schedule, plain = schedules
    base = mh.train(4, 2, 2, LAYERS, schedule, planner=no_replication, **kw)
    got = mh.train(4, 2, 2, LAYERS, schedule, **kw)
    assert any(after < before for _, imb in got for before, after in imb), "no step balanced anything"
    err, where = worst(base, got)
    assert err <= 1e-5, f"{schedule}: {where} differs from no replication by {err:.3g} of its largest gradient"
    assert bit_identical(got, mh.train(4, 2, 2, LAYERS, plain, **kw)), "the input pass changed the masters' grads"


@pytest.mark.parametrize("main_grad", [False, True], ids=["grad", "main_grad"])
def test_backward_with_inputs_naming_some_masters(main_grad):
    """``loss.backward(inputs=fc1's masters)``: fc1's gradients are those of a full backward bit
    for bit, fc2 gets nothing (its ``main_grad`` stays zero), and both match no replication.
    Before the fix the replicas' sums of fc2 were added into its ``main_grad`` all the same (the
    forward's needs_input_grad, not the pass's)."""
    kw = dict(form="list", main_grad=main_grad)
    base = mh.train(4, 2, 2, LAYERS, "F0 B0", planner=no_replication, backward_members=(0,), **kw)
    got = mh.train(4, 2, 2, LAYERS, "F0 B0", backward_members=(0,), **kw)
    full = mh.train(4, 2, 2, LAYERS, "F0 B0", **kw)
    err, where = worst(
        [([layer[:1] for layer in g], i) for g, i in base], [([layer[:1] for layer in g], i) for g, i in got]
    )
    assert err <= 1e-5, f"{where} differs from no replication by {err:.3g} of its largest gradient"
    for (g, _), (f, _) in zip(got, full):
        for layer, flayer in zip(g, f):
            assert torch.equal(layer[0], flayer[0]), "fc1's grads differ from a full backward's"
            assert not layer[1].any(), "fc2, which the backward did not name, got a gradient"


PIPELINING = {
    "one micro-batch": ("F0 I0 B0", "F0 B0"),
    "zero bubble, three in flight": ("F0 F1 I0 F2 I1 B0 I2 B1 B2", "F0 F1 F2 B0 B1 B2"),
}


@pytest.mark.parametrize("schedules", list(PIPELINING.values()), ids=list(PIPELINING))
@pytest.mark.parametrize("kw", [dict(form="list"), dict(form="stacked"), dict(form="list", main_grad=True)])
def test_torch_pipelining_split_backward(schedules, kw):
    """torch.distributed.pipelining's split backward, its own functions: ``I`` is
    ``stage_backward_input`` (input grad, the grads at the weights' intermediates saved), ``B`` is
    ``stage_backward_weight`` (one ``autograd.grad`` per parameter group: a call per layer here,
    each reduces its layer), torch's groups merged where they share a parameter (torch's
    get_param_groups can leave one in two groups: the next test); ``main_grad`` under Megatron's
    DDP flag.  The masters' gradients match no replication and are bit-identical to a plain
    ``loss.backward()``.  ``hot=1``: every master gets a token on every rank -- a master that none
    reached gets None from the replica node (the None-not-zeros contract of
    test_training_stacks.py), and torch's ``autograd.grad`` per group raises 'appears to not have
    been used in the graph' for it, where plain torch leaves it out of every group."""
    schedule, plain = schedules
    kw = dict(kw, hot=1.0)
    base = mh.train(4, 2, 2, LAYERS, schedule, planner=no_replication, pipelining="merged", **kw)
    got = mh.train(4, 2, 2, LAYERS, schedule, pipelining="merged", **kw)
    assert any(after < before for _, imb in got for before, after in imb), "no step balanced anything"
    err, where = worst(base, got)
    assert err <= 1e-5, f"{schedule}: {where} differs from no replication by {err:.3g} of its largest gradient"
    assert bit_identical(got, mh.train(4, 2, 2, LAYERS, plain, **kw)), "the split backward changed the grads"


def test_torch_pipelining_parameter_in_two_groups_raises():
    """A weight pass that reaches a layer's masters twice (torch's get_param_groups leaves a
    parameter in the group it was first put in when it merges that group into another: each
    master of an ultracomm layer shares the layer's replica node, so this happens on ranks
    chosen by set order; made every rank's here) raises an UltracommError that names the cause
    and the way out, after the layer's reduce (so no rank waits in it).  Before: 'a step supports
    one backward pass (no retain_graph re-runs)', naming neither."""
    with pytest.raises(UltracommError, match="get_param_groups leaving a parameter in two groups") as e:
        mh.train(4, 2, 2, LAYERS, "F0 I0 B0", pipelining="duplicated", form="list", hot=1.0)
    assert "layer 0 step" in str(e.value) and "merge the groups that share a parameter" in str(e.value)
