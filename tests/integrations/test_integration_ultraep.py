"""The UltraEP adapter driven the way UltraEP's README drives ``ultra_ep.Manager``: its three
backward hooks (restore, start and join grad_reduce), ``update_placement`` ->
``weight_sync`` -> ``reroute`` per layer, per-expert master lists with ``main_grad``-style
fp32 grads, replica wgrads added (``+=``) into ``local_replica_{fc1,fc2}_grad_buffer`` and never
zeroed by the host (UltraEP's reduce does that), two training iterations.

Ranks are threads; tokens reach the rank hosting their physical expert through a shared
dict (standing in for the token dispatcher, which UltraEP leaves to the framework).
Contract tests of UltraEP's own behaviour are in test_integration_ultraep_contract.py."""

from __future__ import annotations

import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain, UltracommError
from ultracomm.integrations import ultraep as ultra_ep  # the switch: this import instead of `import ultra_ep`
from ultracomm.moe import linear

WORLD, M, R, LAYERS = 4, 2, 2, 2
E = WORLD * M
H, I = mh.H, mh.I


# --- UltraEP README's backward-only hooks (identity in the forward), as a user writes them ---
class _BackwardHook(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, manager, vid):
        ctx.manager, ctx.vid = manager, vid
        return x.view_as(x)


class RestoreReplicaWeights(_BackwardHook):
    @staticmethod
    def backward(ctx, g):
        ctx.manager.weight_sync(ctx.vid, async_finish=False)  # restore before the expert Dgrad
        return g, None, None


class StartGradReduce(_BackwardHook):
    @staticmethod
    def backward(ctx, g):
        ctx.manager.gr_event = ctx.manager.grad_reduce(ctx.vid, async_finish=True)
        return g, None, None


class JoinGradReduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, manager):
        ctx.manager = manager
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        ctx.manager.gr_event.current_stream_wait()
        return g, None


def run(restore_hook: bool = True, planner: str = "quota", iterations: int = 2):
    domain = LoopbackDomain(WORLD)

    def body(group):
        r = group.rank
        manager = ultra_ep.Manager(
            group,
            num_layers=LAYERS,
            num_local_master_experts=M,
            num_local_redundant_experts=R,
            expert_fc1_numel=I * H,
            expert_fc2_numel=H * I,
            is_train=True,
            max_microbatches=1,
            weight_data_dtype=torch.float32,
            grad_dtype=torch.float32,
            planner=planner,
            timeout_s=20,
        )
        assert manager.local_replica_fc1_weight_buffer.shape == (R, I * H)
        assert manager.local_replica_fc2_grad_buffer.shape == (R, H * I)
        # fc1 is 120 bytes: fc2 starts at the next 16-byte boundary, so no joined [R, fc1 + fc2] view
        with pytest.raises(ValueError, match=r"local_replica_weight_buffer .* expert_fc1_numel=30 is not"):
            manager.local_replica_weight_buffer
        params = {}
        for layer in range(1, LAYERS + 1):  # Megatron's layer numbers start at 1
            ws = [mh.master_weights(r * M + j) for j in range(M)]
            fc1 = [torch.nn.Parameter(w[0].clone()) for w in ws]
            fc2 = [torch.nn.Parameter(w[1].clone()) for w in ws]
            for p in fc1 + fc2:
                p.main_grad = torch.zeros(p.shape)
            manager.construct_local_master_ptr_pool(
                layer, fc1, fc2, [p.main_grad for p in fc1], [p.main_grad for p in fc2]
            )
            params[layer] = (fc1, fc2)

        def transformer_layer(hidden, layer, it):
            vid = manager.allocate_microbatch_slot(layer)
            hidden = JoinGradReduce.apply(hidden, manager)
            x, rmap, probs, up = mh.batch(r, layer - 1, it, E)
            manager.update_placement(vid, rmap)
            ws_event = manager.weight_sync(vid, async_finish=True)
            eprobs, emap = manager.reroute(vid, probs, rmap)
            ws_event.current_stream_wait()
            assert emap.shape == (x.shape[0], WORLD * (M + R)) and int(emap.sum()) == int(rmap.sum())
            hidden = StartGradReduce.apply(hidden, manager, vid)
            # "dispatch": every rank posts its tokens; each computes the physical experts it hosts
            domain.shared[(layer, it, r)] = (x, emap, eprobs.detach(), up)
            group.barrier()
            scale = hidden * 0 + 1  # exactly 1, zero gradient: the expert backward runs before `hidden`s
            out = torch.zeros(())
            for p in range(r * (M + R), (r + 1) * (M + R)):
                j = p % (M + R)
                if j < M:
                    w1, w2 = params[layer][0][j], params[layer][1][j]
                else:
                    # the replica buffers as weights whose fp32 wgrads `linear` adds (+=) into the replica
                    # grad buffers (Megatron's fused wgrad accumulation); the host never zeroes them
                    w1 = manager.local_replica_fc1_weight_buffer[j - M].view(I, H).detach().requires_grad_()
                    w2 = manager.local_replica_fc2_weight_buffer[j - M].view(H, I).detach().requires_grad_()
                    w1.main_grad = manager.local_replica_fc1_grad_buffer[j - M].view(I, H)
                    w2.main_grad = manager.local_replica_fc2_grad_buffer[j - M].view(H, I)
                for s in range(WORLD):
                    xs, es, ps, us = domain.shared[(layer, it, s)]
                    t = es[:, p].nonzero().squeeze(1)
                    if t.numel():
                        y = mh.expert_fn(xs[t] * scale, w1, w2, linear) * ps[t, p, None]
                        out = out + (y * us[t]).sum()
            if restore_hook:
                out = RestoreReplicaWeights.apply(out, manager, vid)
            return hidden + out

        for it in range(iterations):  # main_grad accumulates over the iterations, as over micro-batches
            h = torch.ones((), requires_grad=True)
            for layer in range(1, LAYERS + 1):
                h = transformer_layer(h, layer, it)
            h.backward()
            for t in (manager.local_replica_fc1_grad_buffer, manager.local_replica_fc2_grad_buffer):
                assert not t.any()  # the last grad_reduce cleared what the backward added
        grads = [
            [torch.stack([p.main_grad for p in params[layer][m]]) for m in range(2)] for layer in range(1, LAYERS + 1)
        ]
        placement = (
            manager.physical_to_logical_map.clone(),
            manager.logical_to_physical_map.clone(),
            manager.logical_replica_counts.clone(),
            manager.logical_instance_quota.clone(),
        )
        manager.explicitly_destroy = True
        manager.destroy()
        return grads, placement

    return domain.run(body, timeout=240)


def test_ultraep_readme_hooks_give_no_replication_grads():
    results = run()
    mh.check_grads([grads for grads, _ in results], WORLD, M, LAYERS, mbs=2)
    for grads, placement in results:
        p2l, l2p, counts, quota = placement
        vid = 1  # layer 1, micro-batch slot 0 (max_microbatches=1)
        assert p2l[vid].view(WORLD, M + R)[:, :M].tolist() == [[2 * w, 2 * w + 1] for w in range(WORLD)]
        for e in range(E):  # instances: master first, then each replica's physical id
            n = int(counts[vid, e])
            phys = l2p[vid, e, :n].tolist()
            assert phys[0] == (e // M) * (M + R) + e % M
            assert all(int(p2l[vid, p]) == e for p in phys[1:])
        assert int(counts[vid].sum()) > E  # the hot experts got replicas
        assert torch.equal(results[0][1][3], quota)  # every rank planned the same


def test_forgotten_restore_hook_raises_in_grad_reduce():
    # without RestoreReplicaWeights, layer 1's backward runs on layer 2's replicas: the
    # adapter's grad_reduce must refuse to reduce those gradients
    with pytest.raises(UltracommError, match=r"layer 2's multicast overwrote the replica slots"):
        run(restore_hook=False, iterations=1)


def test_joined_replica_buffers_alias_the_member_buffers():
    def body(group):
        m = ultra_ep.Manager(
            group, 2, 2, 3, expert_fc1_numel=64, expert_fc2_numel=40, weight_data_dtype=torch.bfloat16, timeout_s=20
        )
        try:
            full, grads = m.local_replica_weight_buffer, m.local_replica_grad_buffer
            assert full.shape == (3, 104) and full.dtype == torch.bfloat16 and grads.dtype == torch.float32
            for k in range(3):
                m.local_replica_fc1_weight_buffer[k].fill_(k + 1)
                m.local_replica_fc2_weight_buffer[k].fill_(-(k + 1))
                m.local_replica_fc2_grad_buffer[k].fill_(k + 0.5)
            for k in range(3):
                assert full[k, :64].eq(k + 1).all() and full[k, 64:].eq(-(k + 1)).all()
                assert grads[k, 64:].eq(k + 0.5).all()
        finally:
            m.ctx.close()

    LoopbackDomain(2).run(body)
