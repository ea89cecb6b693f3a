"""The Megatron MoE ECHO adapter against a stand-in of upstream's BalancedMoELayer: per layer
the global token counts go to ``gen_offloading_plan``, its ``expert_offloading_map`` to the
dispatcher's ``preprocess``, and fc1's and fc2's per-expert weights (Megatron's
``weight0..N``) to ``dispatch``; the rerouted map is read in Megatron's column order (per rank
its home experts, then its spares); a grouped GEMM (every weight touched, also with zero
tokens) computes the home and spare experts.  Ranks are threads; tokens reach the rank that
computes them through a shared dict.

Upstream: Victarry/Megatron-LM ``megatron/core/transformer/moe/balanced_moe_layer.py`` at
ae807d3f3473beffa83099c1b489d1a360383acb (``_install_spare_expert_weights``: ``dispatch(metadata,
*home_weights, runtime_weight_dtype=)``; ``_fold_runtime_main_grads``:
``fold_spare_gradients(metadata, *spare_grads, reference_weight_dtype=)``) and the
``expert_weight_dispatcher.py`` it imports (``_AllToAllExpertWeightDispatch``: outputs zeros
for an empty spare, the home weight for a filled one, the same rank included; backward returns
each home weight the sum of its spares' gradients).  Megatron's DDP hook: megatron-core
0.16.1 wheel, ``megatron/core/distributed/distributed_data_parallel.py``
``_make_backward_post_hook`` and ``zero_grad_buffer``."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain
from ultracomm.integrations.megatron_echo import EchoExpertDispatcher, close_dispatchers, gen_offloading_plan
from ultracomm.moe import linear

WORLD, M, S, LAYERS = 4, 2, 1, 2  # upstream's approx_bin_packing default: one spare slot per EP rank
E = WORLD * M
H, I = mh.H, mh.I


def grouped_gemm(x, w1, w2, fused: bool):
    """One expert of a grouped GEMM: runs (and so produces a weight gradient) even for 0 rows.
    ``fused``: weight grads go straight into ``main_grad`` with ``grad_added_to_main_grad`` set
    (TE's gradient-accumulation fusion, as ``ultracomm.moe.linear`` does); else plain autograd."""
    return mh.expert_fn(x, w1, w2, linear if fused else (lambda a, w: a @ w.t()))


def megatron_ddp_hook(param: torch.nn.Parameter) -> None:
    """megatron-core 0.16.1 DDP, restated: ``__init__`` sets ``grad_added_to_main_grad = False``
    (reset again only by ``zero_grad_buffer``, once per iteration); a hook on the param's grad
    accumulator adds ``.grad`` into ``main_grad`` unless ``grad_added_to_main_grad`` is set,
    then clears ``.grad``."""
    param.main_grad = torch.zeros(param.shape)
    param.grad_added_to_main_grad = False

    def hook(*unused):
        if param.grad is not None and (not param.grad_added_to_main_grad or getattr(param, "zero_out_wgrad", False)):
            param.main_grad.add_(param.grad.data)
        param.grad = None

    acc = param.expand_as(param).grad_fn.next_functions[0][0]
    acc.register_hook(hook)
    param._ddp_grad_acc = acc  # kept alive as DDP keeps self.grad_accs


def home_params(rank: int, ddp: bool) -> tuple[list, list]:
    """``rank``'s home experts' fc1 and fc2 weights as Parameters (TEGroupedLinear weight0..N),
    with Megatron's DDP hook where ``ddp``."""
    ws = [mh.master_weights(rank * M + j) for j in range(M)]
    fc1 = [torch.nn.Parameter(w[0].clone()) for w in ws]
    fc2 = [torch.nn.Parameter(w[1].clone()) for w in ws]
    if ddp:
        for p in fc1 + fc2:
            megatron_ddp_hook(p)
    return fc1, fc2


def token_counts(group, rmap: torch.Tensor) -> torch.Tensor:
    """Every rank's tokens per expert, ``[WORLD, E]`` int32 (gen_offloading_plan's counts)."""
    every = group.all_gather_object(rmap.sum(0), op="test", what="token counts")
    return torch.stack([torch.as_tensor(c) for c in every]).to(torch.int32)


def layer_output(shared: dict, mb: int, layer: int, rank: int, homes, spares, fused: bool) -> torch.Tensor:
    """The summed expert outputs of ``rank``'s columns (Megatron's order: per rank its homes, then
    its spares) over every rank's tokens; ``shared[(mb, layer, s)]``: rank ``s``'s ``(x,
    rerouting_map, rerouted_probs, up)``; ``homes`` / ``spares``: fc1's and fc2's weights."""
    out = torch.zeros(())
    for local in range(M + S):
        col = rank * (M + S) + local
        w1, w2 = (homes[0][local], homes[1][local]) if local < M else (spares[0][local - M], spares[1][local - M])
        for s in range(WORLD):
            xs, cmap, cprobs, us = shared[(mb, layer, s)]
            t = cmap[:, col].nonzero().squeeze(1)
            y = grouped_gemm(xs[t], w1, w2, fused) * cprobs[t, col, None]
            out = out + (y * us[t]).sum()
    return out


MODES = ["fused", "plain", "grad"]  # DDP + TE-style fused wgrad; DDP + autograd .grad; no DDP (.grad)


def run(mode: str = "fused", layers: int = LAYERS, schedule: str = "F0 B0", algorithm: str = "approx_bin_packing"):
    """Train ``layers`` MoE layers on ``WORLD`` ranks in ``schedule`` (forward/backward of
    micro-batches, e.g. ``F0 F1 B1 B0``); returns per rank ``([layer][member] -> [M, *shape]``
    home grads (``main_grad`` through the DDP hook, or ``.grad``), DDP flags)."""
    ddp, fused = mode != "grad", mode == "fused"
    domain = LoopbackDomain(WORLD)
    steps = schedule.split()
    in_flight = max(
        sum(1 for s in steps[: i + 1] if s[0] == "F") - sum(1 for s in steps[: i + 1] if s[0] == "B")
        for i in range(len(steps))
    )

    def body(group):
        r = group.rank
        config = SimpleNamespace(pipeline_model_parallel_size=in_flight, virtual_pipeline_model_parallel_size=None)
        params, dispatchers = [], []
        for layer in range(layers):  # every layer's dispatcher is built with the model
            params.append(home_params(r, ddp))
            dispatchers.append(EchoExpertDispatcher(config, group, E, WORLD * S, timeout_s=20))
        losses = {}
        for step in steps:
            mb = int(step[1:])
            if step[0] == "B":
                losses.pop(mb).backward()
                continue
            total = torch.zeros(())
            for layer in range(layers):
                x, rmap, probs, up = mh.batch(r, layer, mb, E)
                rerouting_map, rerouted_probs, offloading_map = gen_offloading_plan(
                    rmap,
                    probs,
                    token_counts(group, rmap),
                    ep_rank=r,
                    num_ep_ranks=WORLD,
                    num_spare_experts_per_ep_rank=S,
                    assignment_algorithm=algorithm,
                )
                meta = dispatchers[layer].preprocess(offloading_map)
                spare_fc1 = dispatchers[layer].dispatch(meta, *params[layer][0])
                spare_fc2 = dispatchers[layer].dispatch(meta, *params[layer][1])
                assert len(spare_fc1) == S and spare_fc1[0].shape == (I, H) and spare_fc2[0].shape == (H, I)
                domain.shared[(mb, layer, r)] = (x, rerouting_map, rerouted_probs.detach(), up)
                group.barrier()
                total = total + layer_output(domain.shared, mb, layer, r, params[layer], (spare_fc1, spare_fc2), fused)
                group.barrier()
            losses[mb] = total
        grads = [
            [torch.stack([p.main_grad if ddp else p.grad for p in params[layer][m]]) for m in range(2)]
            for layer in range(layers)
        ]
        flags = [p.grad_added_to_main_grad for fc in params for ps in fc for p in ps] if ddp else []
        close_dispatchers(group)
        return grads, flags

    return domain.run(body, timeout=240)


@pytest.mark.parametrize("mode", MODES)
def test_echo_adapter_grads_match_no_replication(mode):
    results = run(mode)
    mh.check_grads([grads for grads, _ in results], WORLD, M, LAYERS)
    if mode == "plain":
        assert not any(flag for _, flags in results for flag in flags)  # the adapter leaves DDP's flag alone


@pytest.mark.parametrize("mode", ["fused", "plain"])
def test_ddp_accumulates_every_micro_batch(mode):
    """Three micro-batches through Megatron's DDP hook: every home grad is the sum of all three
    (an adapter that set grad_added_to_main_grad after the first drops the home experts' own
    .grad of the second and third -- DDP resets the flag only per iteration; one that returns
    the spares' sum only through autograd loses it where the fused wgrad set the flag)."""
    results = run(mode, layers=1, schedule="F0 B0 F1 B1 F2 B2")
    mh.check_grads([grads for grads, _ in results], WORLD, M, 1, mbs=3)


@pytest.mark.parametrize("mode", ["fused", "plain"])
def test_pipeline_order_and_one_shot_greedy(mode):
    results = run(mode, layers=2, schedule="F0 F1 B1 B0", algorithm="one_shot_greedy")
    mh.check_grads([grads for grads, _ in results], WORLD, M, 2, mbs=2)


def offloading_map() -> torch.Tensor:
    """2 ranks, 2 home experts and 2 spares each.  Spare 0 (rank 0, slot 0) holds expert 0 on
    its own home rank (a local copy, allowed upstream); spare 1 (rank 0, slot 1) expert 3;
    spare 2 (rank 1, slot 0) expert 0; spare 3 empty."""
    m = torch.zeros(4, 4, dtype=torch.bool)
    m[0, 0] = m[3, 1] = m[0, 2] = True
    return m


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_dispatch_outputs_and_gradients_follow_upstream(dtype):
    """dispatch: local spare k gets the weight of the expert its column names (same rank
    included), zeros when empty, in runtime_weight_dtype; backward: each home weight gets the
    sum of its spares' gradients (summed in fp32 for bf16 weights, returned in their dtype)."""

    def body(group):
        r = group.rank
        d = EchoExpertDispatcher(SimpleNamespace(), group, 4, 4, timeout_s=20)
        try:
            weights = [
                torch.nn.Parameter(torch.full((3, 2), float(10 * (2 * r + j) + 1), dtype=dtype)) for j in range(2)
            ]
            meta = d.preprocess(offloading_map())
            assert meta.local_spare_home_indices.tolist() == ([0, 3] if r == 0 else [0, -1])
            out = d.dispatch(meta, *weights, runtime_weight_dtype=torch.float64)
            assert [t.dtype for t in out] == [torch.float64, torch.float64]
            got = [float(t.detach()[0, 0]) for t in out] + [bool(t.eq(t[0, 0]).all()) for t in out]
            # spare k's gradient: (rank + 1) * (k + 1) everywhere
            sum(((r + 1) * (k + 1) * t).sum() for k, t in enumerate(out)).backward()
            assert all(w.grad.dtype == dtype for w in weights)
            return got, [w.grad.clone() for w in weights]
        finally:
            close_dispatchers(group)

    (got0, grads0), (got1, grads1) = LoopbackDomain(2).run(body, timeout=120)
    assert got0 == [1.0, 31.0, True, True]  # expert 0 (local copy), expert 3 (from rank 1)
    assert got1 == [1.0, 0.0, True, True]  # expert 0 (from rank 0), empty
    # expert 0: rank 0's spare 0 (1 * 1) + rank 1's spare 0 (2 * 1); expert 3: rank 0's spare 1 (1 * 2)
    assert [float(g[0, 0]) for g in grads0] == [3.0, 0.0] and [float(g[0, 0]) for g in grads1] == [0.0, 2.0]
    assert all(bool(g.eq(g[0, 0]).all()) for g in grads0 + grads1)


@pytest.mark.parametrize("policy, combine", [(None, torch.float32), ("param_dtype", torch.bfloat16)])
def test_fold_spare_gradients(policy, combine):
    """Upstream's fold_spare_gradients: the local home experts' sums of the spare gradients,
    in the grad-combine dtype (``moe_balance_expert_weight_grad_combine_dtype``: fp32 for bf16
    weights by default, the weights' dtype with ``param_dtype``)."""
    config = (
        SimpleNamespace() if policy is None else SimpleNamespace(moe_balance_expert_weight_grad_combine_dtype=policy)
    )

    def body(group):
        r = group.rank
        d = EchoExpertDispatcher(config, group, 4, 4, timeout_s=20)
        try:
            weights = [torch.zeros(3, 2, dtype=torch.bfloat16) for _ in range(2)]
            meta = d.preprocess(offloading_map())
            with torch.no_grad():
                d.dispatch(meta, *weights)
            spare = [torch.full((3, 2), float((r + 1) * (k + 1)), dtype=torch.bfloat16) for k in range(2)]
            folded = d.fold_spare_gradients(meta, *spare, reference_weight_dtype=torch.bfloat16)
            return [(f.dtype, float(f[0, 0])) for f in folded]
        finally:
            close_dispatchers(group)

    got = LoopbackDomain(2).run(body, timeout=120)
    assert got == [[(combine, 3.0), (combine, 0.0)], [(combine, 0.0), (combine, 2.0)]]


def test_dispatcher_rejects_bad_input():
    def body(group):
        d = EchoExpertDispatcher(SimpleNamespace(), group, 4, 2)
        try:
            pre = "ultracomm: EchoExpertDispatcher: "
            with pytest.raises(ValueError) as e:
                d.preprocess(torch.zeros(4, 2))
            assert str(e.value) == pre + "expert_offloading_map must be a bool tensor, got torch.float32"
            with pytest.raises(ValueError) as e:
                d.preprocess(torch.zeros(4, 3, dtype=torch.bool))
            assert str(e.value) == pre + "expert_offloading_map must have shape [4, 2], got [4, 3]"
            two = torch.zeros(4, 2, dtype=torch.bool)
            two[0, 1] = two[1, 1] = True
            with pytest.raises(ValueError) as e:
                d.preprocess(two)
            assert str(e.value) == pre + (
                "spare slot 1 of expert_offloading_map holds experts [0, 1]; each spare "
                "slot holds at most one home expert"
            )
            meta = d.preprocess(torch.zeros(4, 2, dtype=torch.bool))
            with pytest.raises(ValueError) as e:
                d.dispatch(meta, torch.zeros(2))
            assert str(e.value) == pre + "expected 2 local home weights, got 1"
            with pytest.raises(ValueError) as e:
                d.fold_spare_gradients(meta, torch.zeros(2))
            assert str(e.value) == pre + (
                "fold_spare_gradients: no dispatch of [2] torch.float32 weights by this "
                "layer yet; call dispatch(metadata, *home_weights) first (or pass "
                "reference_weight_dtype)"
            )
            with pytest.raises(ValueError) as e:
                EchoExpertDispatcher(SimpleNamespace(), group, 3, 2)
            assert str(e.value) == pre + "num_home_experts must be a positive multiple of the EP size 2, got 3"
        finally:
            close_dispatchers(group)

    LoopbackDomain(2).run(body)


_REINIT = r"""
import torch.distributed as dist
from ultracomm.integrations import megatron_echo as me

def init():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

assert me._pool_of(None) is me._pool_of(None)  # before init_process_group: one pool
init()
first = me._pool_of(None)
first.members["fc1"] = object()  # its first dispatch happened
assert me._pool_of(None) is first
dist.destroy_process_group()
init()  # the default group again (torch restarts its names): a new object, a new pool
second = me._pool_of(None)
assert second is not first and not second.members, "the re-created default group found the old group's pool"
me.close_dispatchers(None)  # forgets the current default group's pool
assert me._pool_of(None) is not second
dist.destroy_process_group()
print("ok")
"""


def test_default_group_initialised_again_gets_a_new_pool():
    """ep_group=None (the default group): a training script that destroys its default group and
    initialises it again builds its dispatchers into a new pool, not the old group's -- which held
    Contexts on the destroyed group and, after its first dispatch, refused new dispatchers ("built
    after the first dispatch").  In a subprocess: the default group is process-wide state."""
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", _REINIT], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]
