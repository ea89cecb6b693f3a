"""Issue 37: FP8 runtime copies through a ReplicaManager.  Each step the masters are quantized
into FP8 weights and scales, which ultracomm multicasts as bytes; the replicas' fp32 wgrads
reduce into the high-precision masters through autograd.  The same loopback MoE is trained
with and without ultracomm (tests/stacks_harness.py, ``fp8=``) and every loss, gradient and
parameter compared, over the stacks of issue 32.

fp32 masters: tolerance 1e-5, as for plain weights -- the forward values are the same FP8
numbers either way, and the gradients only re-associate fp32 sums.  bf16 masters: one step
(bf16 updates would move a master across an FP8 rounding boundary on one side only), within
2^-7: the home wgrad and the replicas' fp32 sum are each rounded to bf16 before autograd adds
them, where the run without ultracomm rounds one sum.
"""

from __future__ import annotations

import pytest
import torch

from ultracomm import LoopbackDomain

import moe_harness as mh
import stacks_harness as sh


@pytest.fixture
def mx_dims(monkeypatch):
    """MXFP8 scales blocks of 32 along a row: the harness's experts at hidden 32, inner 32."""
    monkeypatch.setattr(mh, "H", 32)
    monkeypatch.setattr(mh, "I", 32)


def _both(world, epr, slots, **kw):
    return sh.train(world, epr, slots, ultracomm=False, **kw), sh.train(world, epr, slots, ultracomm=True, **kw)


@pytest.mark.parametrize("stack", sh.STACKS)
def test_fp8_row_scaled_every_stack(stack):
    sh.compare(*_both(4, 2, 2, stack=stack, fp8="row"))


@pytest.mark.parametrize("stack", ["backward", "autograd_grad", "megatron_ddp"])
def test_mxfp8_block_scaled(mx_dims, stack):
    # hidden 32: each loss term is a sum of 32x larger products, and the per-rank losses cancel
    # (|loss| ~ 2.6 of terms ~ 100): 1e-4 of the loss is ~1e-6 of its terms, fp32 re-association
    sh.compare(*_both(4, 2, 2, stack=stack, fp8="mxfp8"), tol=1e-4)


@pytest.mark.parametrize("stack", ["backward", "megatron_ddp"])
def test_fp8_bf16_masters_one_step(stack):
    sh.compare(*_both(4, 2, 2, stack=stack, fp8="row", master_dtype=torch.bfloat16, steps=1), tol=2.0**-7)


def test_fp8_twice_under_checkpointing_world_two():
    sh.compare(*_both(2, 2, 1, fp8="row", twice=True, checkpoint=True))


def _manager_rank(group, check):
    from ultracomm.moe import ReplicaManager

    lay = sh.fp8_layout("row", torch.float32)
    params = mh.make_params(group.rank, 2, 1, torch.float32, "stacked", False, False)[0]
    copies = sh.fp8_copies(params, "row")
    mgr = ReplicaManager(group, lay, 2, 1, 1, planner="quota", timeout_s=20)
    try:
        return check(mgr, params, copies)
    finally:
        mgr.close()


def test_fp8_registration_errors():
    from ultracomm.errors import RegistrationError

    def check(mgr, params, copies):
        with pytest.raises(RegistrationError, match=r"members \['fc1', 'fc2'\] are FP8 runtime copies: pass masters"):
            mgr.register_layer(0, copies)
        with pytest.raises(RegistrationError, match=r"masters\['fc2'\] is None, but 'fc2' is an FP8 runtime copy"):
            mgr.register_layer(0, copies, masters=[params[0], None, None, None])
        with pytest.raises(RegistrationError, match=r"masters\['fc1_scale'\]: member 'fc1_scale' carries no gradient"):
            mgr.register_layer(0, copies, masters=[params[0], params[0], params[1], None])
        with pytest.raises(
            RegistrationError,
            match=r"masters\['fc1'\]: expected .* in torch.float32; got "
            r"torch.bfloat16",
        ):
            mgr.register_layer(0, copies, masters=[params[0].bfloat16(), None, params[1], None])
        with pytest.raises(RegistrationError, match="one entry per member"):
            mgr.register_layer(0, copies, masters=[params[0], params[1]])
        mgr.register_layer(0, copies, masters=[params[0], None, params[1], None])

    LoopbackDomain(2).run(lambda g: _manager_rank(g, check))


def test_an_fp8_gradient_through_autograd_raises():
    """A replica's FP8 weight used by plain autograd ops (no main_grad): autograd rounds its
    gradient to float8 before ultracomm sees it -- refused, not reduced."""
    from ultracomm.errors import UltracommError
    from ultracomm.fp8 import dequantize

    def check(mgr, params, copies):
        mgr.register_layer(0, copies, masters=[params[0], None, params[1], None])
        _, rmap, probs, _ = mh.batch(mgr.rank, 0, 0, 4, hot=6.0)
        step = mgr.step(0, rmap, probs)
        q1, s1, _, _ = step.replica_weights()
        # every rank uses its slot's view (rank 1's holds expert 0 or 1; rank 0's may be empty): each
        # raises before the collective reduce, so no rank waits for another
        x = torch.randn(3, mh.H, requires_grad=True)
        loss = step.guard((x @ dequantize(q1[0], s1[0]).t()).sum())
        with pytest.raises(
            UltracommError,
            match=r"FP8 member 'fc1' got its gradient through autograd, which rounds "
            r"it to torch.float8_e4m3fn; accumulate .* into weight.main_grad",
        ):
            loss.backward()

    LoopbackDomain(2).run(lambda g: _manager_rank(g, check))
