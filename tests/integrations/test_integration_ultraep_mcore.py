"""The UltraEP adapter driven the way Megatron-LM's UltraEP integration drives ``ultra_ep.Manager``.

Upstream read (not copied): Victarry/Megatron-LM,
``megatron/core/transformer/moe/ultraep_manager.py`` at 68659e1e35ce95e1c898c70afd7df86053d7eef8
(``UltraEPManager``).  What it does with the runtime, and what is held here:

* it builds ``Manager`` with keyword arguments only -- ``group=``, ``num_layers=``,
  ``num_local_master_experts=``, ``num_local_redundant_experts=``, ``expert_fc1_numel=`` (``2*H*F``),
  ``expert_fc2_numel=`` (``H*F``), ``is_train=True``, ``explicitly_destroy=False``,
  ``max_microbatches=`` (in-flight micro-batches x 3: activation checkpointing may forward a layer
  again before its slot retires), ``weight_data_dtype=config.params_dtype``, ``grad_dtype=fp32``;
* it reads ``local_replica_{fc1,fc2}_{weight,grad}_buffer`` right after construction;
* layer ids are Megatron's one-based layer numbers, ``1..num_layers`` (the last one included);
* ``construct_local_master_ptr_pool(layer_id=, fc1_weights=, fc2_weights=, fc1_grads=, fc2_grads=)``;
* ``allocate_microbatch_slot(layer_number)``, ``update_placement(vid, routing_map)``,
  ``reroute(vid, probs, routing_map) -> (probs, routing_map)``, ``weight_sync(vid, async_finish=)`` and
  ``grad_reduce(vid, async_finish=)``, whose results have ``current_stream_wait()``.

UltraEP v1.0.0 (Dots-Infra/UltraEP 94cab099) is still the newest release; this pins the
caller's side of the interface.
"""

from __future__ import annotations

import torch

from ultracomm import LoopbackDomain
from ultracomm.integrations import ultraep as ultra_ep

WORLD, NUM_EXPERTS, REDUNDANT, LAYERS = 2, 4, 1, 3
HIDDEN, FFN = 4, 2
FC1, FC2 = 2 * HIDDEN * FFN, HIDDEN * FFN
PP_IN_FLIGHT = 1


def _weights(rank: int, layer: int, j: int) -> tuple[torch.Tensor, torch.Tensor]:
    base = 100.0 * layer + 10.0 * (rank * (NUM_EXPERTS // WORLD) + j)
    return torch.arange(FC1, dtype=torch.float32) + base, -(torch.arange(FC2, dtype=torch.float32) + base)


def test_mcore_ultraep_manager_call_pattern():
    def body(group):
        rank, masters = group.rank, NUM_EXPERTS // WORLD
        runtime = ultra_ep.Manager(
            group=group,
            num_layers=LAYERS,
            num_local_master_experts=masters,
            num_local_redundant_experts=REDUNDANT,
            expert_fc1_numel=FC1,
            expert_fc2_numel=FC2,
            is_train=True,
            explicitly_destroy=False,
            max_microbatches=max(1, PP_IN_FLIGHT) * 3,
            weight_data_dtype=torch.float32,  # config.params_dtype
            grad_dtype=torch.float32,
            timeout_s=20,
        )
        buffers = (
            runtime.local_replica_fc1_weight_buffer,
            runtime.local_replica_fc2_weight_buffer,
            runtime.local_replica_fc1_grad_buffer,
            runtime.local_replica_fc2_grad_buffer,
        )
        assert [tuple(b.shape) for b in buffers] == [(REDUNDANT, FC1), (REDUNDANT, FC2)] * 2
        assert all(b.dtype == torch.float32 for b in buffers)

        for layer_number in range(1, LAYERS + 1):  # one-based, the last layer included
            fc1, fc2 = zip(*(_weights(rank, layer_number, j) for j in range(masters)))
            runtime.construct_local_master_ptr_pool(
                layer_id=layer_number,
                fc1_weights=list(fc1),
                fc2_weights=list(fc2),
                fc1_grads=[torch.zeros(FC1) for _ in range(masters)],
                fc2_grads=[torch.zeros(FC2) for _ in range(masters)],
            )

        seen = []
        for layer_number in range(1, LAYERS + 1):
            vid = runtime.allocate_microbatch_slot(layer_number)
            routing_map = torch.zeros(8, NUM_EXPERTS, dtype=torch.bool)
            routing_map[:, 0] = True  # expert 0 (rank 0's) is hot on every rank
            routing_map[::2, NUM_EXPERTS - 1] = True
            probs = routing_map.float() * 0.5
            runtime.update_placement(vid, routing_map)
            runtime.weight_sync(vid, async_finish=True).current_stream_wait()
            new_probs, new_map = runtime.reroute(vid, probs, routing_map)
            assert new_map.shape == (8, WORLD * (masters + REDUNDANT)) and new_map.dtype == torch.bool
            assert int(new_map.sum()) == int(routing_map.sum())
            assert torch.equal(new_probs.sum(1), probs.sum(1))
            p2l = runtime.physical_to_logical_map[vid]
            for slot in range(REDUNDANT):  # each filled replica slot holds its expert's weights
                expert = int(p2l[rank * (masters + REDUNDANT) + masters + slot])
                if expert >= 0:
                    home, j = divmod(expert, masters)
                    w1, w2 = _weights(home, layer_number, j)
                    assert torch.equal(runtime.local_replica_fc1_weight_buffer[slot], w1)
                    assert torch.equal(runtime.local_replica_fc2_weight_buffer[slot], w2)
                    seen.append(expert)
            runtime.grad_reduce(vid, async_finish=True).current_stream_wait()
        return seen

    seen = LoopbackDomain(WORLD).run(body, timeout=60)
    assert any(0 in s for s in seen)  # the hot expert got a replica somewhere
