"""The Megatron MoE ECHO adapter against a stand-in of ECHO's MoE layer: per layer the
global token counts go to ``gen_offloading_plan``, its ``expert_offloading_map`` to the
dispatcher's ``preprocess``, and fc1's and fc2's per-expert weights (Megatron's
``weight0..N``, with ``main_grad`` and ``grad_added_to_main_grad`` as Megatron's DDP sets
them) to ``expert_dispatch``; a grouped GEMM (every weight touched, also with zero tokens)
computes the home and spare experts.  Ranks are threads; tokens reach the rank that
computes them through a shared dict.

Interfaces: NVIDIA/Megatron-LM PR #2368, ``megatron/core/transformer/moe/offloading_planner.py``
(``gen_offloading_plan``) and the expert-weight dispatcher (``preprocess(map) -> metadata``,
``expert_dispatch(metadata, *weights) -> list[Tensor]``)."""
from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain
from ultracomm.integrations.megatron_echo import EchoExpertDispatcher, close_dispatchers, gen_offloading_plan
from ultracomm.moe import linear

WORLD, M, S, LAYERS = 4, 2, 1, 2  # ECHO's approx_bin_packing default: one spare slot per EP rank
E = WORLD * M
H, I = mh.H, mh.I


def grouped_gemm(x, w1, w2):
    """One expert of a grouped GEMM: runs (and so produces a weight gradient) even for 0 rows."""
    return mh.expert_fn(x, w1, w2, linear)


def run(main_grad: bool = True, layers: int = LAYERS):
    domain = LoopbackDomain(WORLD)

    def body(group):
        r = group.rank
        config = SimpleNamespace(pipeline_model_parallel_size=1, virtual_pipeline_model_parallel_size=None)
        params, dispatchers = [], []
        for layer in range(layers):  # every layer's dispatcher is built with the model
            ws = [mh.master_weights(r * M + j) for j in range(M)]
            fc1 = [torch.nn.Parameter(w[0].clone()) for w in ws]  # TEGroupedLinear weight0..N
            fc2 = [torch.nn.Parameter(w[1].clone()) for w in ws]
            if main_grad:
                for p in fc1 + fc2:
                    p.main_grad = torch.zeros(p.shape)
                    p.grad_added_to_main_grad = False  # as DistributedDataParallel initialises it
            params.append((fc1, fc2))
            dispatchers.append(EchoExpertDispatcher(config, group, E, WORLD * S, timeout_s=20))
        total = torch.zeros(())
        for layer in range(layers):
            x, rmap, probs, up = mh.batch(r, layer, 0, E)
            counts = torch.stack([torch.as_tensor(c) for c in group.all_gather_object(rmap.sum(0), op="test", what="token counts")])
            rerouting_map, rerouted_probs, offloading_map = gen_offloading_plan(
                rmap, probs, counts, r, WORLD, S)
            assert rerouting_map.shape == (x.shape[0], E + WORLD * S) and offloading_map.shape == (E, WORLD * S)
            meta = dispatchers[layer].preprocess(offloading_map)
            spare_fc1 = dispatchers[layer].expert_dispatch(meta, *params[layer][0])
            spare_fc2 = dispatchers[layer].expert_dispatch(meta, *params[layer][1])
            assert len(spare_fc1) == S and spare_fc1[0].shape == (I, H) and spare_fc2[0].shape == (H, I)
            domain.shared[(layer, r)] = (x, rerouting_map, rerouted_probs.detach(), up)
            group.barrier()
            for local in range(M + S):  # Megatron's column order: per rank its homes, then its spares
                col = r * (M + S) + local
                if local < M:
                    w1, w2 = params[layer][0][local], params[layer][1][local]
                else:
                    w1, w2 = spare_fc1[local - M], spare_fc2[local - M]
                for s in range(WORLD):
                    xs, cmap, cprobs, us = domain.shared[(layer, s)]
                    t = cmap[:, col].nonzero().squeeze(1)
                    y = grouped_gemm(xs[t], w1, w2) * cprobs[t, col, None]
                    total = total + (y * us[t]).sum()
            group.barrier()
        total.backward()
        grads = [[torch.stack([p.main_grad if main_grad else p.grad for p in params[layer][m]]) for m in range(2)]
                 for layer in range(layers)]
        flags = [p.grad_added_to_main_grad for fc in params for ps in fc for p in ps] if main_grad else []
        close_dispatchers(group)
        return grads, flags

    return domain.run(body, timeout=240)


@pytest.mark.parametrize("main_grad", [True, False], ids=["main_grad", "grad"])
def test_echo_adapter_grads_match_no_replication(main_grad):
    results = run(main_grad)
    mh.check_grads([grads for grads, _ in results], WORLD, M, LAYERS)
    assert all(all(flags) for _, flags in results)  # the dispatcher added into main_grad and said so, as ECHO does


def test_dispatcher_rejects_bad_maps():
    def body(group):
        d = EchoExpertDispatcher(SimpleNamespace(), group, 4, 2)
        try:
            with pytest.raises(ValueError, match="bool"):
                d.preprocess(torch.zeros(4, 2))
            with pytest.raises(ValueError, match=r"shape \[4, 2\]"):
                d.preprocess(torch.zeros(4, 3, dtype=torch.bool))
            two = torch.zeros(4, 2, dtype=torch.bool)
            two[0, 1] = two[1, 1] = True
            with pytest.raises(ValueError, match="holds one expert"):
                d.preprocess(two)
        finally:
            close_dispatchers(group)

    LoopbackDomain(2).run(body)
