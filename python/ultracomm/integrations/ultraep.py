"""UltraEP's Python interface over ultracomm: switch by changing the import.

::

    # before                                  # after
    import ultra_ep                           from ultracomm.integrations import ultraep as ultra_ep
    manager = ultra_ep.Manager(group, num_layers, num_local_master_experts,
                               num_local_redundant_experts, expert_fc1_numel, expert_fc2_numel,
                               is_train=True, max_microbatches=pp_in_flight,
                               weight_data_dtype=torch.bfloat16, grad_dtype=torch.float32)

Method names, arguments and buffer shapes follow ``ultra_ep/manager.py`` of
github.com/Dots-Infra/UltraEP (v1.0.0): ``allocate_microbatch_slot``,
``construct_local_master_ptr_pool``, ``update_placement``, ``weight_sync`` (the first call
per slot multicasts, later calls restore), ``reroute`` (autograd), ``grad_reduce``,
``local_replica_{fc1,fc2}_{weight,grad}_buffer`` and the placement tensors.  Layer ids are
*virtual* (``real_layer * max_microbatches + slot``); real layers may be 1-indexed (three
spare layers, as UltraEP allocates).  Differences: placement tensors live on the host
(ultracomm's planners run on the CPU), events wrap ultracomm ``Work`` handles, FP8 weight
scales and ``legacy_placement`` are not supported, and a ``grad_reduce`` whose replicas were
overwritten by another layer since its last ``weight_sync`` raises instead of reducing
gradients computed on stale weights.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..context import Context
from ..layout import ExpertLayout, Member
from ..moe.loads import gather_loads
from ..moe.reroute import RerouteTable, reroute as _reroute
from ..planners import Domain, get_planner
from ..planners.base import instance_index
from ..work import Work

__all__ = ["Manager", "EventHandle"]

_SPARE_LAYERS = 3  # UltraEP allocates num_layers + 3 real layers (1-indexed layer ids)


class EventHandle:
    """UltraEP's event wrapper: ``current_stream_wait()`` waits for the operation."""

    def __init__(self, work: Optional[Work] = None):
        self.event = work

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.wait()

    def __enter__(self) -> "EventHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait()


class _Slot:
    """What one virtual layer id holds between update_placement and grad_reduce."""

    def __init__(self, vid: int, result: Any, synced: bool = False):
        self.vid, self.result, self.synced = vid, result, synced
        self.tables: dict[int, RerouteTable] = {}


class Manager:
    """UltraEP's ``Manager`` (one per EP group); see the module docstring.

    Extra keywords: ``planner`` (``quota`` default, UltraEP's algorithm), ``planner_options``,
    ``node_of`` and any ``Context`` option (``timeout_s``, ``relay_mode``, ...).
    """

    def __init__(self, group: Any, num_layers: int, num_local_master_experts: int,
                 num_local_redundant_experts: int, expert_fc1_numel: int, expert_fc2_numel: int,
                 is_train: bool = True, explicitly_destroy: bool = False, max_microbatches: int = 1,
                 legacy_placement: bool = False, weight_data_dtype: torch.dtype = torch.bfloat16,
                 weight_scale_dtype: torch.dtype = torch.float32, expert_fc1_weight_scale_numel: int = 0,
                 expert_fc2_weight_scale_numel: int = 0, grad_dtype: torch.dtype = torch.float32, *,
                 planner: str = "quota", planner_options: dict | None = None, **context_options: Any):
        if legacy_placement:
            raise ValueError("ultracomm UltraEP adapter: legacy_placement (round-robin reroute) is not supported; "
                             "choose an ultracomm planner with planner=... instead")
        if expert_fc1_weight_scale_numel or expert_fc2_weight_scale_numel:
            raise NotImplementedError("ultracomm UltraEP adapter: FP8 weight scales are not supported yet; pass "
                                      "expert_fc{1,2}_weight_scale_numel=0 (bf16/fp16/fp32 experts)")
        self.group = group
        self.num_layers = num_layers
        self.num_local_master_experts = num_local_master_experts
        self.num_local_redundant_experts = num_local_redundant_experts
        self.expert_fc1_numel, self.expert_fc2_numel = expert_fc1_numel, expert_fc2_numel
        self.expert_total_numel = expert_fc1_numel + expert_fc2_numel
        self.weight_data_dtype, self.weight_scale_dtype, self.grad_dtype = weight_data_dtype, weight_scale_dtype, grad_dtype
        self.is_train, self.explicitly_destroy = is_train, explicitly_destroy
        self.max_microbatches = max(1, max_microbatches)
        self.real_num_alloc_layers = num_layers + _SPARE_LAYERS
        self.num_alloc_layers = self.real_num_alloc_layers * self.max_microbatches
        layout = ExpertLayout((Member("fc1", (expert_fc1_numel,), weight_data_dtype),
                               Member("fc2", (expert_fc2_numel,), weight_data_dtype)), grad_dtype)
        self.ctx = Context(group, layout, num_local_master_experts, num_local_redundant_experts,
                           self.real_num_alloc_layers, self.max_microbatches, **context_options)
        self.rank, self.num_ranks = self.ctx.rank, self.ctx.world
        M, R, W = num_local_master_experts, num_local_redundant_experts, self.num_ranks
        self.num_local_physical_experts = M + R
        self.num_global_physical_experts = (M + R) * W
        self.num_global_logical_experts = M * W
        self.domain = Domain(W, np.asarray(self.ctx.node_of, np.int64), M)
        self.planner = get_planner(planner)
        self.planner_options = dict(planner_options or {})
        self._mb_counters = [0] * self.real_num_alloc_layers
        self._slots: dict[int, _Slot] = {}
        self._masters_set: set[int] = set()
        L, E, P = self.num_alloc_layers, self.num_global_logical_experts, self.num_global_physical_experts
        self._physical_to_logical_map = torch.full((L, P), -1, dtype=torch.int32)
        self._logical_to_physical_map = torch.full((L, E, W), -1, dtype=torch.int32)
        self._logical_replica_counts = torch.zeros((L, E), dtype=torch.int32)
        self._logical_instance_quota = torch.zeros((L, E, W), dtype=torch.int32)
        c = self.ctx
        self.local_replica_fc1_weight_buffer, self.local_replica_fc2_weight_buffer = c.replica_weights
        self.local_replica_weight_buffer = self._joined(c.replica_weights, layout.weight_offsets, c.wlayout["weight_stride"])
        if is_train:
            self.local_replica_fc1_grad_buffer, self.local_replica_fc2_grad_buffer = c.replica_grads
            self.local_replica_grad_buffer = self._joined(c.replica_grads, layout.grad_offsets, c.wlayout["grad_stride"])
        else:
            self.local_replica_fc1_grad_buffer = self.local_replica_fc2_grad_buffer = None
            self.local_replica_grad_buffer = None

    def _joined(self, views: Sequence[torch.Tensor], offsets: Sequence[int], stride: int) -> torch.Tensor | None:
        """``[R, fc1 + fc2]`` over the slots (UltraEP's full buffer) when fc2 directly follows fc1."""
        fc1 = views[0]
        if offsets[1] != self.expert_fc1_numel * fc1.element_size():
            return None  # padding between the members: no such view (use the fc1/fc2 buffers)
        return torch.as_strided(fc1, (self.num_local_redundant_experts, self.expert_total_numel),
                                (stride // fc1.element_size(), 1))

    # ------------------------------------------------------------------ placement tensors
    @property
    def physical_to_logical_map(self) -> torch.Tensor:
        """int32 ``[num_alloc_layers, world * (M + R)]`` (-1: empty slot)."""
        return self._physical_to_logical_map

    @property
    def logical_to_physical_map(self) -> torch.Tensor:
        """int32 ``[num_alloc_layers, E, world]``: physical id of each instance, master first (-1 pad)."""
        return self._logical_to_physical_map

    @property
    def logical_replica_counts(self) -> torch.Tensor:
        """int32 ``[num_alloc_layers, E]``: instances per expert (master included)."""
        return self._logical_replica_counts

    @property
    def logical_instance_quota(self) -> torch.Tensor:
        """int32 ``[num_alloc_layers, E, world]``: tokens each instance computes."""
        return self._logical_instance_quota

    def get_quota_tensor(self, layer_id: int) -> torch.Tensor:
        return self._logical_instance_quota[layer_id]

    # ------------------------------------------------------------------ lifecycle
    def destroy(self) -> None:
        assert self.explicitly_destroy, "destroy() needs Manager(..., explicitly_destroy=True)"
        self.ctx.close()

    def allocate_microbatch_slot(self, real_layer_id: int) -> int:
        """The next virtual layer id of ``real_layer_id`` (``real * max_microbatches + slot``;
        the slot counter wraps, as in UltraEP)."""
        if not 0 <= real_layer_id < self.real_num_alloc_layers:
            raise ValueError(f"ultracomm: real layer {real_layer_id} is out of range 0..{self.real_num_alloc_layers - 1}")
        slot = self._mb_counters[real_layer_id] % self.max_microbatches
        self._mb_counters[real_layer_id] += 1
        return real_layer_id * self.max_microbatches + slot

    def _real_layer_id(self, layer_id: int) -> int:
        return layer_id // self.max_microbatches

    def construct_local_master_ptr_pool(self, layer_id: int, fc1_weights: Sequence[torch.Tensor],
                                        fc2_weights: Sequence[torch.Tensor],
                                        fc1_grads: Optional[Sequence[torch.Tensor]] = None,
                                        fc2_grads: Optional[Sequence[torch.Tensor]] = None,
                                        fc1_weight_scales: Any = None, fc2_weight_scales: Any = None) -> None:
        """Register real layer ``layer_id``'s master experts: per-expert lists (any shapes of
        ``expert_fc{1,2}_numel`` elements, each contiguous; grads in ``grad_dtype``)."""
        if fc1_weight_scales is not None or fc2_weight_scales is not None:
            raise NotImplementedError("ultracomm UltraEP adapter: FP8 weight scales are not supported yet")
        M = self.num_local_master_experts
        for name, lst in (("fc1_weights", fc1_weights), ("fc2_weights", fc2_weights)):
            if len(lst) != M:
                raise ValueError(f"ultracomm: {name} has {len(lst)} tensors; expected num_local_master_experts={M}")
        flat = lambda ts: [t.view(-1) for t in ts]  # noqa: E731 - same storage, UltraEP's numel view
        grads = None
        if self.is_train:
            if fc1_grads is None or fc2_grads is None:
                raise ValueError("ultracomm: training needs fc1_grads and fc2_grads (Manager(is_train=True))")
            grads = [flat(fc1_grads), flat(fc2_grads)]
        self.ctx.register_masters(layer_id, [flat(fc1_weights), flat(fc2_weights)], grads)
        self._masters_set.add(layer_id)

    # ------------------------------------------------------------------ per layer and micro-batch
    def update_placement(self, layer_id: int, routing_map: torch.Tensor, verify_reduced_loads: bool = False) -> None:
        """Plan the replicas of virtual layer ``layer_id`` from ``routing_map``
        (bool ``[tokens, E]``, this rank's tokens).  Collective."""
        real = self._real_layer_id(layer_id)
        old = self._slots.pop(layer_id, None)
        if old is not None and old.vid is not None:  # the slot is reused: its last micro-batch is done
            self.ctx.end(old.vid)
        load = gather_loads(self.ctx.comm, routing_map.sum(0), op="update_placement")
        if verify_reduced_loads and not np.array_equal(load[self.rank], routing_map.sum(0).cpu().numpy()):
            raise AssertionError("ultracomm: the gathered loads do not hold this rank's routing counts")
        result = self.planner(load, self.domain, self.num_local_redundant_experts, **self.planner_options)
        self._slots[layer_id] = _Slot(self.ctx.begin(real), result)
        self._record_placement(layer_id, result)

    def _physical(self, rank: np.ndarray, slot: np.ndarray | None, expert: np.ndarray) -> np.ndarray:
        M, R = self.num_local_master_experts, self.num_local_redundant_experts
        return rank * (M + R) + (expert % M if slot is None else M + slot)

    def _record_placement(self, layer_id: int, result: Any) -> None:
        M, R, W = self.num_local_master_experts, self.num_local_redundant_experts, self.num_ranks
        E = self.num_global_logical_experts
        slot_src = np.asarray(result.slot_src)
        p2l = np.full((W, M + R), -1, np.int32)
        p2l[:, :M] = np.arange(E).reshape(W, M)
        p2l[:, M:] = slot_src
        self._physical_to_logical_map[layer_id] = torch.from_numpy(p2l.reshape(-1))
        inst_rank, slot_inst = instance_index(slot_src, result.domain)
        l2p = np.full((E, W), -1, np.int32)
        quota = np.zeros((E, W), np.int32)
        experts = np.arange(E)
        l2p[:, 0] = self._physical(experts // M, None, experts)
        filled = slot_src >= 0
        rr, kk = np.nonzero(filled)
        l2p[slot_src[filled], slot_inst[filled]] = self._physical(rr, kk, slot_src[filled])
        n = min(result.quota.shape[1], W)
        quota[:, :n] = result.quota[:, :n]
        self._logical_to_physical_map[layer_id] = torch.from_numpy(l2p)
        self._logical_instance_quota[layer_id] = torch.from_numpy(quota)
        self._logical_replica_counts[layer_id] = torch.from_numpy((inst_rank >= 0).sum(1).astype(np.int32))

    def _slot(self, layer_id: int, what: str) -> _Slot:
        slot = self._slots.get(layer_id)
        if slot is None or slot.vid is None:
            raise ValueError(f"ultracomm: {what}({layer_id}): no placement for this layer id; call "
                             f"update_placement({layer_id}, routing_map) first")
        return slot

    def weight_sync(self, layer_id: int, previous_event: Optional[EventHandle] = None,
                    async_finish: bool = False) -> EventHandle:
        """Copy the masters into the replicas of ``layer_id``'s placement: the first call
        after ``update_placement`` multicasts, later calls restore (UltraEP's backward hook)."""
        slot = self._slot(layer_id, "weight_sync")
        if previous_event is not None:
            previous_event.current_stream_wait()
        if not slot.synced:
            work = self.ctx.weight_sync(slot.vid, slot.result.plan, async_op=async_finish)
            slot.synced = True
        else:
            work = self.ctx.restore(slot.vid, async_op=async_finish)
        return EventHandle(work)

    def reroute(self, layer_id: int, probs: torch.Tensor, routing_map: torch.Tensor,
                backend: str = "cuda") -> tuple[torch.Tensor, torch.Tensor]:
        """``(expanded_probs, expanded_routing_map)`` ``[T, world * (M + R)]``: this rank's
        tokens sent to the instances by the planner's quotas (differentiable in ``probs``).
        ``backend`` is accepted for compatibility (any device works)."""
        slot = self._slot(layer_id, "reroute")
        table = slot.tables.get(self.rank)
        if table is None:
            table = slot.tables[self.rank] = RerouteTable.from_result(slot.result, self.rank, "physical")
        emap, eprobs = _reroute(routing_map, probs, table)
        return eprobs, emap

    def grad_reduce(self, layer_id: int, previous_event: Optional[EventHandle] = None,
                    async_finish: bool = False) -> EventHandle:
        """Add the replicas' gradients (``local_replica_*_grad_buffer``) into the masters'
        grads, deterministically; releases ``layer_id``'s placement."""
        slot = self._slot(layer_id, "grad_reduce")
        if previous_event is not None:
            previous_event.current_stream_wait()
        work = self.ctx.grad_reduce(slot.vid, async_op=async_finish)
        slot.vid = None
        return EventHandle(work)
