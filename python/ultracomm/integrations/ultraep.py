"""UltraEP's Python interface over ultracomm: switch by changing the import.

::

    # before                                  # after
    import ultra_ep                           from ultracomm.integrations import ultraep as ultra_ep
    manager = ultra_ep.Manager(group, num_layers, num_local_master_experts,
                               num_local_redundant_experts, expert_fc1_numel, expert_fc2_numel,
                               is_train=True, max_microbatches=pp_in_flight,
                               weight_data_dtype=torch.bfloat16, grad_dtype=torch.float32)

Checked against github.com/Dots-Infra/UltraEP v1.0.0 (commit 94cab099b44f, ``ultra_ep/``
and ``csrc/``): ``__version__``, ``init_runtime``, ``EventHandle`` and ``Manager`` with its
public calls -- ``allocate_microbatch_slot``, ``construct_local_master_ptr_pool`` (FP8 weight
scales too), ``update_placement`` / ``update_placement_sparse``, ``weight_sync``, ``reroute``
(autograd) / ``reroute_sparse``, ``grad_reduce``, ``get_comm_stream``,
``set_weight_sync_plan_mode``, ``set_grad_reduce_deterministic``, the replica buffers
(``local_replica_{fc1,fc2}_{weight,grad}_buffer``, the joined ``local_replica_{weight,grad}_buffer``,
``local_replica_{fc1,fc2}_weight_scale_buffer``, ``local_replica_weight_scale_buffer_raw``)
and the placement tensors (maps, counts, quotas and both quota prefixes).

What UltraEP does and this adapter keeps: layer ids are *virtual* (``real_layer *
max_microbatches + slot``; real layers may be 1-indexed, UltraEP allocates three spare
ones); a placement lasts until the next ``update_placement`` of its layer id (``weight_sync``
and ``grad_reduce`` may run on it again); ``grad_reduce`` leaves the placed replica grad
slots zeroed (UltraEP's reduce kernels clear what they read), so hosts accumulate replica
wgrads with ``+=``; gradients are fp32.

Differences: the placement is ultracomm's planner (``quota`` by default), planned on the host,
so placement tensors live on the CPU and token splits differ from UltraEP's kernel's; events
wrap ultracomm ``Work`` handles; a ``grad_reduce`` whose replicas another layer's multicast
overwrote since its last ``weight_sync`` raises instead of reducing gradients computed on
stale weights; reductions are always in a fixed order; ``legacy_placement`` is refused.
"""

from __future__ import annotations

import functools
import weakref
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ..comm import as_comm
from ..context import Context
from ..dataplane import device_type
from ..dataplane.domains import domain_of, rank_domain
from ..env import Config
from ..errors import InputError, UltracommError
from ..layout import ExpertLayout, Member
from ..moe.loads import gather_loads
from ..moe.reroute import RerouteTable, reroute as _reroute
from ..planners import Domain, get_planner
from ..planners.base import instance_index
from ..work import Work

__all__ = ["Manager", "EventHandle", "init_runtime", "__version__"]

#: The UltraEP release this adapter matches (``ultra_ep.__version__``).
__version__ = "1.0.0"
UPSTREAM_COMMIT = "94cab099b44fffa99a82fea99e7c12d89cf65e4f"  # Dots-Infra/UltraEP v1.0.0

_SPARE_LAYERS = 3  # UltraEP allocates num_layers + 3 real layers (1-indexed layer ids)
_ALIGN = 16  # UltraEP's TMA alignment (kNumTMAAlignBytes); ultracomm's layouts use the same
_PLAN_MODES = {"direct": "off", "adaptive": "auto", "adaptiverelay": "auto", "forcerelay": "force"}


def _domain_size(domain_of_ranks: Sequence[int], rank: int) -> int:
    return sum(1 for d in domain_of_ranks if d == domain_of_ranks[rank])


#: id(group) -> (a reference to that group, its domain size).  Keyed by id() because groups need not
#: be hashable, and checked by identity: an id is reused once its object is freed, and a size cached
#: for a dead group would make a new group's rank skip the collective its peers wait in.
_runtime_sizes: dict[int, tuple[Any, int]] = {}


def _cached_size(group: Any) -> Optional[int]:
    entry = _runtime_sizes.get(id(group))
    return entry[1] if entry is not None and entry[0]() is group else None


def _forget(key: int, ref: "weakref.ref") -> None:
    """The group cached under ``key`` was freed (weakref callback); a newer entry there stays."""
    entry = _runtime_sizes.get(key)
    if entry is not None and entry[0] is ref:
        del _runtime_sizes[key]


def _remember_size(group: Any, size: int) -> None:
    """Cache ``size`` for ``group`` (kept if one is cached already), dropped when the group is freed."""
    if _cached_size(group) is not None:
        return
    key = id(group)
    try:
        ref = weakref.ref(group, functools.partial(_forget, key))
    except TypeError:  # not weak-referenceable: hold it, so its id cannot be reused while cached
        ref = (lambda g: lambda: g)(group)
    _runtime_sizes[key] = (ref, size)


def init_runtime(group: Any) -> int:
    """UltraEP's ``init_runtime(group)``: the number of ranks that share this rank's memory
    domain (UltraEP's NVLink domain size).  Collective the first time per group (one exchange
    of domain keys, :mod:`ultracomm.dataplane.domains`); later calls return the cached size.  UltraEP
    allows one EP group per process (NVSHMEM); ultracomm has no process-wide runtime, so any
    number of groups may be used."""
    size = _cached_size(group)
    if size is None:
        comm = as_comm(group)
        cfg = Config.from_env()
        dtype = device_type(cfg.transport, cfg.window, None)
        device = torch.device("cuda", torch.cuda.current_device()) if dtype == "cuda" else None
        mine = rank_domain(cfg.domain, comm.rank, comm.world, dtype, device).key
        keys = comm.with_timeout(cfg.timeout_s).all_gather_object(mine, op="init_runtime", what="memory domains")
        size = _domain_size(domain_of(keys), comm.rank)
        _remember_size(group, size)
    return size


class EventHandle:
    """UltraEP's event wrapper: ``current_stream_wait()`` waits for the operation (an ultracomm
    ``Work``; ``None`` for a finished synchronous call).  ``extra_tensors`` are kept alive with
    the handle, as UltraEP's are (its stand-in for ``record_stream``)."""

    def __init__(self, event: Optional[Work] = None, extra_tensors: Optional[tuple] = None):
        self.event = event
        self.extra_tensors = extra_tensors

    def current_stream_wait(self) -> None:
        if self.event is not None:
            self.event.wait()

    def __enter__(self) -> "EventHandle":
        return self

    def __exit__(self, *exc: object) -> None:
        self.current_stream_wait()


class _Slot:
    """What one virtual layer id holds from its update_placement to the next."""

    def __init__(self, vid: int, result: Any, table: RerouteTable):
        self.vid, self.result, self.table = vid, result, table
        self.synced = False


class Manager:
    """UltraEP's ``Manager`` (one per EP group); see the module docstring.

    Extra keywords: ``planner`` (``quota`` default, UltraEP's algorithm), ``planner_options``,
    ``node_of`` and any ``Context`` option (``timeout_s``, ``relay_mode``, ``device``, ...).
    """

    def __init__(
        self,
        group: Any,
        num_layers: int,
        num_local_master_experts: int,
        num_local_redundant_experts: int,
        expert_fc1_numel: int,
        expert_fc2_numel: int,
        is_train: bool = True,
        explicitly_destroy: bool = False,
        max_microbatches: int = 1,
        legacy_placement: bool = False,
        weight_data_dtype: torch.dtype = torch.bfloat16,
        weight_scale_dtype: torch.dtype = torch.float32,
        expert_fc1_weight_scale_numel: int = 0,
        expert_fc2_weight_scale_numel: int = 0,
        grad_dtype: torch.dtype = torch.float32,
        *,
        planner: str = "quota",
        planner_options: dict | None = None,
        **context_options: Any,
    ):
        for name, dt in (
            ("weight_data_dtype", weight_data_dtype),
            ("weight_scale_dtype", weight_scale_dtype),
            ("grad_dtype", grad_dtype),
        ):
            if not isinstance(dt, torch.dtype):  # UltraEP's check_dtype
                raise TypeError(f"{name} must be a torch.dtype, got {type(dt).__name__}")
        if grad_dtype is not torch.float32:  # UltraEP's grad_reduce kernels read and write fp32
            raise ValueError("UltraEP currently supports only fp32 gradients")
        if legacy_placement:
            raise InputError(
                "ultracomm UltraEP adapter: legacy_placement (UltraEP's CPU placement with round-robin "
                "reroute) is not supported; choose an ultracomm planner with planner=... instead"
            )
        for name, n in (
            ("expert_fc1_weight_scale_numel", expert_fc1_weight_scale_numel),
            ("expert_fc2_weight_scale_numel", expert_fc2_weight_scale_numel),
        ):
            if isinstance(n, bool) or not isinstance(n, int) or n < 0:
                raise InputError(f"ultracomm UltraEP adapter: {name} must be an int >= 0, got {n!r}")
        self.group = group
        self.id = id(group)
        self.num_layers = num_layers
        self.num_local_master_experts = num_local_master_experts
        self.num_local_redundant_experts = num_local_redundant_experts
        self.expert_fc1_numel, self.expert_fc2_numel = expert_fc1_numel, expert_fc2_numel
        self.expert_total_numel = expert_fc1_numel + expert_fc2_numel
        self.expert_fc1_weight_scale_numel = expert_fc1_weight_scale_numel
        self.expert_fc2_weight_scale_numel = expert_fc2_weight_scale_numel
        self.expert_weight_scale_total_numel = expert_fc1_weight_scale_numel + expert_fc2_weight_scale_numel
        self.weight_data_dtype, self.weight_scale_dtype, self.grad_dtype = (
            weight_data_dtype,
            weight_scale_dtype,
            grad_dtype,
        )
        self.is_train, self.explicitly_destroy, self.legacy_placement = is_train, explicitly_destroy, False
        self.reroute_mode = "quota"
        self.grad_reduce_deterministic = True
        self.max_microbatches = max(1, max_microbatches)
        self.real_num_alloc_layers = num_layers + _SPARE_LAYERS
        self.num_alloc_layers = self.real_num_alloc_layers * self.max_microbatches
        # FP8 scales ride in the weight slot after fc2 (one multicast); members of size 0 are left out
        members = [
            Member("fc1", (expert_fc1_numel,), weight_data_dtype),
            Member("fc2", (expert_fc2_numel,), weight_data_dtype),
        ]
        scale_numels = {"fc1_scale": expert_fc1_weight_scale_numel, "fc2_scale": expert_fc2_weight_scale_numel}
        self._scale_members = [name for name, n in scale_numels.items() if n > 0]
        members += [Member(name, (scale_numels[name],), weight_scale_dtype) for name in self._scale_members]
        layout = ExpertLayout(tuple(members), grad_dtype, _ALIGN)
        self.ctx = Context(
            group,
            layout,
            num_local_master_experts,
            num_local_redundant_experts,
            self.real_num_alloc_layers,
            self.max_microbatches,
            **context_options,
        )
        self.rank, self.num_ranks = self.ctx.rank, self.ctx.world
        self.nvl_domain_size = _domain_size(self.ctx.domain_of, self.rank)
        _remember_size(group, self.nvl_domain_size)
        self.weight_sync_plan_mode = {"off": "direct", "auto": "adaptive", "force": "forcerelay"}[
            self.ctx.config.relay_mode
        ]
        M, R, W = num_local_master_experts, num_local_redundant_experts, self.num_ranks
        self.num_local_physical_experts = M + R
        self.num_global_physical_experts = (M + R) * W
        self.num_global_logical_experts = M * W
        self.domain = Domain(W, np.asarray(self.ctx.node_of, np.int64), M)
        self.planner = get_planner(planner)
        self.planner_options = dict(planner_options or {})
        self._mb_counters = [0] * self.real_num_alloc_layers
        self._slots: dict[int, _Slot] = {}
        self._scale_grads: dict[int, list[torch.Tensor]] = {}
        L, E = self.num_alloc_layers, self.num_global_logical_experts
        # UltraEP's initial placement: masters only (init_master_placement in csrc/kernels/placement.cu)
        p2l = np.full((W, M + R), -1, np.int32)
        p2l[:, :M] = np.arange(E).reshape(W, M)
        self._physical_to_logical_map = torch.from_numpy(np.tile(p2l.reshape(1, -1), (L, 1)))
        self._logical_to_physical_map = torch.full((L, E, W), -1, dtype=torch.int32)
        self._logical_to_physical_map[:, :, 0] = torch.from_numpy(self._physical(np.arange(E) // M, None, np.arange(E)))
        self._logical_replica_counts = torch.ones((L, E), dtype=torch.int32)
        self._logical_instance_quota = torch.zeros((L, E, W), dtype=torch.int32)
        self._logical_instance_quota_prefix = torch.zeros((L, E, W), dtype=torch.int32)
        self._rank_quota_prefix = torch.zeros((L, E, W), dtype=torch.int32)
        c = self.ctx
        self.device = c.window.device
        self.local_replica_fc1_weight_buffer, self.local_replica_fc2_weight_buffer = c.replica_weights[:2]
        scales = dict(zip(self._scale_members, c.replica_weights[2:]))
        empty = lambda dt: torch.empty((R, 0), dtype=dt, device=self.device)  # noqa: E731
        self.local_replica_fc1_weight_scale_buffer = scales.get("fc1_scale", empty(weight_scale_dtype))
        self.local_replica_fc2_weight_scale_buffer = scales.get("fc2_scale", empty(weight_scale_dtype))
        self.local_replica_weight_scale_buffer_raw = self._raw_scales(layout) if scales else empty(torch.uint8)
        if is_train:
            self.local_replica_fc1_grad_buffer, self.local_replica_fc2_grad_buffer = c.replica_grads[:2]
        else:
            self.local_replica_fc1_grad_buffer = self.local_replica_fc2_grad_buffer = None

    # ------------------------------------------------------------------ buffers
    def _raw_scales(self, layout: ExpertLayout) -> torch.Tensor:
        """uint8 ``[R, stride]`` over the scales of every slot, UltraEP's raw scale buffer:
        fc1's scales, fc2's at the next 16-byte boundary, ``stride`` rounded up to 16."""
        first = self.ctx.replica_weights[2]
        b1 = self.expert_fc1_weight_scale_numel * first.element_size()
        b2 = self.expert_fc2_weight_scale_numel * first.element_size()
        stride = -(-(-(-b1 // _ALIGN) * _ALIGN + b2) // _ALIGN) * _ALIGN
        return torch.empty(0, dtype=torch.uint8, device=first.device).set_(
            first.untyped_storage(),
            first.storage_offset() * first.element_size(),
            (self.num_local_redundant_experts, stride),
            (self.ctx.wlayout["weight_stride"], 1),
        )

    def _joined(self, fc1: torch.Tensor, stride: int, what: str) -> torch.Tensor:
        """``[R, fc1 + fc2]`` over the slots (UltraEP's full buffer): fc2 must directly follow fc1."""
        nbytes = self.expert_fc1_numel * fc1.element_size()
        if nbytes % _ALIGN:
            raise InputError(
                f"ultracomm UltraEP adapter: local_replica_{what}_buffer (the joined [R, fc1 + fc2] view) needs "
                f"expert_fc1_numel * {fc1.element_size()} bytes to be a multiple of {_ALIGN} (fc2 starts at the next "
                f"{_ALIGN}-byte boundary); expert_fc1_numel={self.expert_fc1_numel} is not, so use "
                f"local_replica_fc1_{what}_buffer and local_replica_fc2_{what}_buffer"
            )
        return torch.as_strided(
            fc1, (self.num_local_redundant_experts, self.expert_total_numel), (stride // fc1.element_size(), 1)
        )

    @property
    def local_replica_weight_buffer(self) -> torch.Tensor:
        """``[R, fc1 + fc2]`` weights of every replica slot (raises when fc1's size leaves a gap)."""
        return self._joined(self.ctx.replica_weights[0], self.ctx.wlayout["weight_stride"], "weight")

    @property
    def local_replica_grad_buffer(self) -> Optional[torch.Tensor]:
        """``[R, fc1 + fc2]`` fp32 grads of every replica slot (``None`` when not training)."""
        if not self.is_train:
            return None
        return self._joined(self.ctx.replica_grads[0], self.ctx.wlayout["grad_stride"], "grad")

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
        """int32 ``[num_alloc_layers, E, world]``: tokens each instance computes (all ranks')."""
        return self._logical_instance_quota

    @property
    def logical_instance_quota_prefix(self) -> torch.Tensor:
        """int32 ``[num_alloc_layers, E, world]``: inclusive prefix sums of the quotas over each
        expert's instances (0 past its instance count)."""
        return self._logical_instance_quota_prefix

    @property
    def rank_quota_prefix(self) -> torch.Tensor:
        """int32 ``[num_alloc_layers, E, world]``: inclusive prefix sums of *this rank's* tokens
        sent to each instance (its ``j``-th token of expert ``e`` goes to the first instance
        whose prefix exceeds ``j``; 0 past the instance count)."""
        return self._rank_quota_prefix

    def get_quota_tensor(self, layer_id: int) -> torch.Tensor:
        return self._logical_instance_quota[layer_id]

    def get_quota_prefix_tensor(self, layer_id: int) -> torch.Tensor:
        return self._logical_instance_quota_prefix[layer_id]

    def get_rank_quota_prefix_tensor(self, layer_id: int) -> torch.Tensor:
        return self._rank_quota_prefix[layer_id]

    # ------------------------------------------------------------------ lifecycle and settings
    def destroy(self) -> None:
        assert self.explicitly_destroy, "destroy() needs Manager(..., explicitly_destroy=True)"
        self.ctx.close()

    def get_comm_stream(self) -> torch.cuda.Stream:
        """The stream the operations run on: ultracomm's GPU transports enqueue on the caller's
        current stream, so that is the one returned.  Raises where there is no such stream."""
        if not self.ctx.stream_ordered:
            raise UltracommError(
                f"ultracomm UltraEP adapter: get_comm_stream() has no CUDA stream to return: this Manager's transport "
                f"{self.ctx.transport.name!r} is not stream-ordered (its operations run on ultracomm's own thread and "
                "are joined with EventHandle.current_stream_wait())"
            )
        return torch.cuda.current_stream(self.device)

    def set_weight_sync_plan_mode(self, plan_mode: str) -> None:
        """UltraEP's plan modes as ultracomm relay modes: ``direct`` -> ``off``, ``adaptive`` /
        ``adaptive_relay`` -> ``auto`` (relay trees where the cost model gains), ``force_relay`` ->
        ``force``.  Call it on every rank between steps (ranks must build the same schedules)."""
        normalized = plan_mode.lower().replace("_", "")
        if normalized not in _PLAN_MODES:
            raise ValueError("plan_mode must be one of: direct, adaptive_relay, force_relay")
        self.ctx.set_relay_mode(_PLAN_MODES[normalized])
        self.weight_sync_plan_mode = normalized

    def set_grad_reduce_deterministic(self, deterministic: bool) -> None:
        """Recorded only: ultracomm always reduces in the schedule's fixed order (bit-identical
        run to run), which is also a valid result of UltraEP's atomic mode."""
        self.grad_reduce_deterministic = bool(deterministic)

    def allocate_microbatch_slot(self, real_layer_id: int) -> int:
        """The next virtual layer id of ``real_layer_id`` (``real * max_microbatches + slot``;
        the slot counter wraps, as in UltraEP)."""
        if not 0 <= real_layer_id < self.real_num_alloc_layers:
            raise InputError(
                f"ultracomm: real layer {real_layer_id} is out of range 0..{self.real_num_alloc_layers - 1}"
            )
        slot = self._mb_counters[real_layer_id] % self.max_microbatches
        self._mb_counters[real_layer_id] += 1
        return real_layer_id * self.max_microbatches + slot

    def _real_layer_id(self, layer_id: int) -> int:
        return layer_id // self.max_microbatches

    def construct_local_master_ptr_pool(
        self,
        layer_id: int,
        fc1_weights: Sequence[torch.Tensor],
        fc2_weights: Sequence[torch.Tensor],
        fc1_grads: Optional[Sequence[torch.Tensor]] = None,
        fc2_grads: Optional[Sequence[torch.Tensor]] = None,
        fc1_weight_scales: Optional[Sequence[torch.Tensor]] = None,
        fc2_weight_scales: Optional[Sequence[torch.Tensor]] = None,
    ) -> None:
        """Register real layer ``layer_id``'s master experts: per-expert lists (any shapes of
        ``expert_fc{1,2}_numel`` elements, each contiguous; grads fp32; FP8 scales of
        ``expert_fc{1,2}_weight_scale_numel`` elements when those are non-zero)."""
        M = self.num_local_master_experts
        lists = [("fc1_weights", fc1_weights), ("fc2_weights", fc2_weights)]
        if self._scale_members:
            if fc1_weight_scales is None or fc2_weight_scales is None:
                raise InputError(
                    "ultracomm UltraEP adapter: weight scale tensors are required when scale numel is "
                    "non-zero (pass fc1_weight_scales and fc2_weight_scales)"
                )
            scales = {
                "fc1_scale": ("fc1_weight_scales", fc1_weight_scales),
                "fc2_scale": ("fc2_weight_scales", fc2_weight_scales),
            }
            lists += [scales[name] for name in self._scale_members]
        for name, lst in lists:
            if len(lst) != M:
                raise InputError(f"ultracomm: {name} has {len(lst)} tensors; expected num_local_master_experts={M}")
        flat = lambda ts: [t.view(-1) for t in ts]  # noqa: E731 - same storage, UltraEP's numel view
        grads = None
        if self.is_train:
            if fc1_grads is None or fc2_grads is None:
                raise InputError("ultracomm: training needs fc1_grads and fc2_grads (Manager(is_train=True))")
            grads = [flat(fc1_grads), flat(fc2_grads)]
            if self._scale_members:  # every member has a grad in a Context; the scales' stay zero
                dev = fc1_weights[0].device if M else self.device
                self._scale_grads[layer_id] = [
                    torch.zeros((M, m.numel), device=dev) for m in self.ctx.layout.members[2:]
                ]
                grads += self._scale_grads[layer_id]
        self.ctx.register_masters(layer_id, [flat(lst) for _, lst in lists], grads)

    # ------------------------------------------------------------------ per layer and micro-batch
    def update_placement(self, layer_id: int, routing_map: torch.Tensor, verify_reduced_loads: bool = False) -> None:
        """Plan the replicas of virtual layer ``layer_id`` from ``routing_map``
        (bool ``[tokens, E]``, this rank's tokens).  Collective."""
        counts = routing_map.sum(0)
        load = self._place(layer_id, counts)
        if verify_reduced_loads and not np.array_equal(load[self.rank], counts.cpu().numpy()):
            raise AssertionError("ultracomm: the gathered loads do not hold this rank's routing counts")

    def update_placement_sparse(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """``update_placement`` from int64 ``[tokens, top_k]`` logical expert ids (ids outside
        ``[0, E)``, e.g. -1 padding, are not counted).  Collective."""
        E = self.num_global_logical_experts
        ids = self._check_topk(topk_ids, "update_placement_sparse").reshape(-1)
        ids = ids[(ids >= 0) & (ids < E)]
        self._place(layer_id, torch.bincount(ids, minlength=E))

    def _place(self, layer_id: int, counts: torch.Tensor) -> np.ndarray:
        real = self._real_layer_id(layer_id)
        old = self._slots.pop(layer_id, None)
        if old is not None:  # the layer id is reused: its last micro-batch is done
            self.ctx.end(old.vid)
        load = gather_loads(self.ctx.comm, counts, op="update_placement")
        result = self.planner(load, self.domain, self.num_local_redundant_experts, **self.planner_options)
        table = RerouteTable.from_result(result, self.rank, "physical")
        self._slots[layer_id] = _Slot(self.ctx.begin(real), result, table)
        self._record_placement(layer_id, result, table)
        return load

    def _physical(self, rank: np.ndarray, slot: np.ndarray | None, expert: np.ndarray) -> np.ndarray:
        M, R = self.num_local_master_experts, self.num_local_redundant_experts
        return rank * (M + R) + (expert % M if slot is None else M + slot)

    def _record_placement(self, layer_id: int, result: Any, table: RerouteTable) -> None:
        M, R, W = self.num_local_master_experts, self.num_local_redundant_experts, self.num_ranks
        E = self.num_global_logical_experts
        slot_src = np.asarray(result.slot_src)
        p2l = np.full((W, M + R), -1, np.int32)
        p2l[:, :M] = np.arange(E).reshape(W, M)
        p2l[:, M:] = slot_src
        self._physical_to_logical_map[layer_id] = torch.from_numpy(p2l.reshape(-1))
        inst_rank, slot_inst = instance_index(slot_src, result.domain)
        l2p = np.full((E, W), -1, np.int32)
        experts = np.arange(E)
        l2p[:, 0] = self._physical(experts // M, None, experts)
        filled = slot_src >= 0
        rr, kk = np.nonzero(filled)
        l2p[slot_src[filled], slot_inst[filled]] = self._physical(rr, kk, slot_src[filled])
        counts = (inst_rank >= 0).sum(1)
        inside = np.arange(W)[None, :] < counts[:, None]  # UltraEP leaves 0 past each expert's instances
        n = min(result.quota.shape[1], W)
        quota = np.zeros((E, W), np.int64)
        quota[:, :n] = result.quota[:, :n]
        mine = np.zeros((E, W), np.int64)
        mine[:, :n] = table.bounds.numpy()[:, :n]
        self._logical_to_physical_map[layer_id] = torch.from_numpy(l2p)
        self._logical_instance_quota[layer_id] = torch.from_numpy(quota.astype(np.int32))
        self._logical_instance_quota_prefix[layer_id] = torch.from_numpy(
            (np.cumsum(quota, 1) * inside).astype(np.int32)
        )
        self._rank_quota_prefix[layer_id] = torch.from_numpy((mine * inside).astype(np.int32))
        self._logical_replica_counts[layer_id] = torch.from_numpy(counts.astype(np.int32))

    def _slot(self, layer_id: int, what: str) -> _Slot:
        slot = self._slots.get(layer_id)
        if slot is None:
            raise InputError(
                f"ultracomm: {what}({layer_id}): no placement for this layer id; call "
                f"update_placement({layer_id}, routing_map) first"
            )
        return slot

    def weight_sync(
        self, layer_id: int, previous_event: Optional[EventHandle] = None, async_finish: bool = False
    ) -> EventHandle:
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

    def reroute(
        self, layer_id: int, probs: torch.Tensor, routing_map: torch.Tensor, backend: str = "cuda"
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``(expanded_probs, expanded_routing_map)`` ``[T, world * (M + R)]``: this rank's
        tokens sent to the instances by ``rank_quota_prefix`` (differentiable in ``probs``).
        Runs where the tensors are; ``backend`` must be ``"cuda"``, as in UltraEP v1.0.0."""
        if backend != "cuda":
            raise ValueError("Only backend='cuda' is supported; CPU reroute has been removed")
        slot = self._slot(layer_id, "reroute")
        emap, eprobs = _reroute(routing_map, probs, slot.table)
        return eprobs, emap

    def reroute_sparse(self, layer_id: int, topk_ids: torch.Tensor) -> None:
        """Rewrite int64 ``[tokens, top_k]`` logical ids into physical ids, in place: this rank's
        ``j``-th entry of expert ``e`` (row-major order) goes to instance ``i``, the first with
        ``rank_quota_prefix[layer_id, e, i] > j`` (the last instance past the end).  Ids outside
        ``[0, E)`` stay.  UltraEP numbers the entries in atomic order; the counts per instance agree."""
        self._check_topk(topk_ids, "reroute_sparse")
        if not topk_ids.is_contiguous():
            raise InputError("ultracomm: reroute_sparse rewrites topk_ids in place; pass a contiguous tensor")
        self._slot(layer_id, "reroute_sparse")
        E, dev = self.num_global_logical_experts, topk_ids.device
        flat = topk_ids.view(-1)
        pos = ((flat >= 0) & (flat < E)).nonzero().squeeze(1)
        if pos.numel() == 0:
            return
        ids = flat[pos]
        order = torch.sort(ids, stable=True).indices  # row-major within each expert
        sorted_ids = ids[order]
        first = torch.searchsorted(sorted_ids, sorted_ids)  # start of each expert's run
        ordinal = torch.empty_like(ids)
        ordinal[order] = torch.arange(ids.numel(), device=dev) - first
        counts = self._logical_replica_counts[layer_id].to(dev, torch.int64)[ids]
        prefix = self._rank_quota_prefix[layer_id].to(dev, torch.int64)[ids]  # [n, W]
        inside = torch.arange(prefix.shape[1], device=dev)[None, :] < counts[:, None]
        inst = ((ordinal[:, None] >= prefix) & inside).sum(1)
        inst = torch.minimum(inst, counts - 1)
        phys = self._logical_to_physical_map[layer_id].to(dev, torch.int64)[ids, inst]
        flat[pos] = phys

    def _check_topk(self, topk_ids: torch.Tensor, what: str) -> torch.Tensor:
        if not isinstance(topk_ids, torch.Tensor) or topk_ids.dtype != torch.int64 or topk_ids.dim() != 2:
            got = (
                f"{topk_ids.dtype} {list(topk_ids.shape)}"
                if isinstance(topk_ids, torch.Tensor)
                else type(topk_ids).__name__
            )
            raise InputError(f"ultracomm: {what}: topk_ids must be an int64 [tokens, top_k] tensor, got {got}")
        return topk_ids

    def grad_reduce(
        self, layer_id: int, previous_event: Optional[EventHandle] = None, async_finish: bool = False
    ) -> EventHandle:
        """Add the replicas' gradients (``local_replica_*_grad_buffer``) into the masters' grads,
        deterministically, then zero this rank's placed replica grad slots (UltraEP's reduce
        leaves them zero, so the next backward's ``+=`` starts clean).  The placement stays
        until the next ``update_placement`` of ``layer_id``."""
        slot = self._slot(layer_id, "grad_reduce")
        if previous_event is not None:
            previous_event.current_stream_wait()
        work = self.ctx.grad_reduce(slot.vid, async_op=async_finish, release=False, zero_replica_grads=True)
        return EventHandle(work)
