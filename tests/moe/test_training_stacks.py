"""Issue 32: the replicas' gradients reach the masters through autograd, so every way a
training stack takes its gradients sees them.  The same loopback MoE is trained for several
optimizer steps with ultracomm and with no ultracomm at all (tests/stacks_harness.py), and
every step's loss, every gradient the stack reads (None where the run without ultracomm has
None) and the parameters after the last step are compared, at world 2 and 4.

Tolerance 1e-5 of each tensor's largest value: fp32 gradients, which replication only
re-associates (tests/moe/test_moe_differential.py says why that bounds them); AdamW's update
divides by the root of its second moment, which keeps relative differences relative.

Before the fix (the replicas' sums added into ``.grad``/``main_grad`` after the backward):
``autograd_grad`` and ``hook_step`` missed every replica contribution, ``late_main_grad`` /
``rebound_main_grad`` wrote ``.grad`` (or the old tensor) instead of the ``main_grad`` the
optimizer reads, AdamW decayed masters no token reached (``.grad`` zeros instead of None),
and frozen experts crashed in ``_build``.
"""

from __future__ import annotations

import pytest

import stacks_harness as sh


# the main_grad stacks with Megatron's per-expert parameters (weight0..N): a stacked parameter's
# per-expert rows are views, which carry no main_grad, so its home wgrads go to .grad there
CASES = [(s, f) for s in sh.STACKS for f in ("stacked", "list") if f == "list" or s not in sh.MAIN_GRAD_STACKS]


@pytest.mark.parametrize("stack,form", CASES)
def test_every_stack_sees_the_replicas_gradients(stack, form):
    kw = dict(stack=stack, form=form)
    sh.compare(sh.train(4, 2, 2, ultracomm=False, **kw), sh.train(4, 2, 2, ultracomm=True, **kw))


@pytest.mark.parametrize("stack", ["backward", "autograd_grad", "hook_step", "rebound_main_grad"])
def test_world_two(stack):
    kw = dict(stack=stack, form="list")
    sh.compare(sh.train(2, 2, 1, ultracomm=False, **kw), sh.train(2, 2, 1, ultracomm=True, **kw))


@pytest.mark.parametrize("stack", ["backward", "autograd_grad", "hook_step"])
def test_adamw_leaves_none_where_no_token_reached(stack):
    """Experts 5..7 never get a token: per-expert masters keep ``.grad`` None, so AdamW neither
    decays nor moves them -- as without ultracomm (a zero grad would decay them)."""
    kw = dict(stack=stack, form="list", cold=(5, 6, 7), optimizer="adamw")
    base = sh.train(4, 2, 2, ultracomm=False, **kw)
    got = sh.train(4, 2, 2, ultracomm=True, **kw)
    nones = [i for i, g in enumerate(base[2]["grads"][0]) if g is None]
    assert nones, "rank 2 has a master no token reached: the case tests something"
    sh.compare(base, got)


@pytest.mark.parametrize("world", [2, 4])
def test_frozen_experts_get_replicas_and_no_reduction(world):
    """LoRA / router-only fine-tuning: every expert frozen; what trains is an input scale whose
    gradient runs through the experts' Dgrad, on replicas restored in the backward."""
    kw = dict(frozen=True, optimizer="sgd")
    slots = 2 if world == 4 else 1
    sh.compare(sh.train(world, 2, slots, ultracomm=False, **kw), sh.train(world, 2, slots, ultracomm=True, **kw))


@pytest.mark.parametrize("checkpoint", [False, True], ids=["plain", "non_reentrant"])
def test_a_module_applied_twice_per_block(checkpoint):
    """The same MoE layer twice in a block (two steps of one layer in flight), under
    non-reentrant checkpointing: each recompute is matched to its own forward's step."""
    kw = dict(form="list", twice=True, checkpoint=checkpoint)
    sh.compare(sh.train(4, 2, 2, ultracomm=False, **kw), sh.train(4, 2, 2, ultracomm=True, **kw))


@pytest.mark.parametrize("evaluate", ["plain", "scope"])
def test_an_evaluation_forward_between_forward_and_backward(evaluate):
    """An evaluation forward with grad enabled, its output dropped at once, between F0 and B0
    (world 4, one micro-batch in flight): its steps leave the training step alone -- dropped by
    themselves when their graph dies (no garbage collector needed: it is disabled here), or
    taken inside ``mgr.evaluating()`` as steps that expect no backward."""
    import gc

    kw = dict(form="list", evaluate=evaluate)
    base = sh.train(4, 2, 2, ultracomm=False, **kw)
    gc.disable()
    try:
        got = sh.train(4, 2, 2, ultracomm=True, **kw)
    finally:
        gc.enable()
    sh.compare(base, got)
