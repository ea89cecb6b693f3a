"""``Context``: owns the replica buffers, the window and the in-flight micro-batch slots.

One Context per EP group.  Per MoE layer and micro-batch::

    vid = ctx.begin(layer)               # a micro-batch slot id (PP keeps several in flight)
    ctx.weight_sync(vid, plan)           # forward: home experts -> replica slots
    ...  forward compute reads ctx.replica_weights ...
    ctx.restore(vid)                     # backward, before Dgrad: re-multicast the same plan
    ...  backward writes replica weight grads into ctx.replica_grads ...
    ctx.grad_reduce(vid)                 # master grads += replicas' grads, deterministic

Every collective operation must be called by all ranks of the group in the same order.
"""
from __future__ import annotations

import collections
import dataclasses
import logging
import threading
from typing import Any, Sequence

import torch

from . import _core
from .comm import as_comm, check_same
from .env import Config
from .errors import RegistrationError, UltracommError
from .layout import ExpertLayout
from .plan import ReplicaPlan
from .records import Op
from .schedule import Schedule, build_schedule
from .transports import resolve_transport
from .transports.host import Masters, master_pointers
from .windows import open_window, resolve_provider
from .work import OrderedRunner, Work

log = logging.getLogger("ultracomm")

_SCHEDULE_CACHE = 64  # distinct plans whose schedules are kept


@dataclasses.dataclass
class _MicroBatch:
    layer: int
    plan: ReplicaPlan | None = None
    schedule: Schedule | None = None
    my_slots: list[int] | None = None        # this rank's row of plan.slot_src
    local_index_of: list[int] | None = None  # plan.local_index_of, as a list for the executor


class Context:
    """Replica buffers, window and operations of one expert-parallel group.

    Args:
        group: ``torch.distributed`` process group (``None``: the default group) or a
            ``LoopbackGroup`` (ranks as threads of one process).
        layout: the members of one expert (:class:`ExpertLayout`).
        experts_per_rank: master experts on each rank; expert ``e``'s home is
            ``e // experts_per_rank`` unless a plan says otherwise.
        slots_per_rank: replica slots on each rank (weights and grads).
        num_layers: MoE layers that will register masters.
        max_microbatches: micro-batches in flight at once (pipeline parallelism).
        transport: ``auto`` or a built transport (default from ``ULTRACOMM_TRANSPORT``).
        window: window provider (default from ``ULTRACOMM_WINDOW``).
        node_of: node index of each rank (``[world]``); ``None``: one node.
        config: an :class:`ultracomm.env.Config`; keyword ``overrides`` replace its fields.
    """

    def __init__(
        self,
        group: Any,
        layout: ExpertLayout,
        experts_per_rank: int,
        slots_per_rank: int,
        num_layers: int,
        max_microbatches: int = 1,
        *,
        transport: str | None = None,
        window: str | None = None,
        node_of: Sequence[int] | None = None,
        config: Config | None = None,
        **overrides: Any,
    ):
        if not isinstance(layout, ExpertLayout):
            raise TypeError(f"ultracomm: layout must be an ExpertLayout, got {type(layout).__name__}")
        for name, v, lo in (("experts_per_rank", experts_per_rank, 1), ("slots_per_rank", slots_per_rank, 0),
                            ("num_layers", num_layers, 1), ("max_microbatches", max_microbatches, 1)):
            if not isinstance(v, int) or v < lo:
                raise ValueError(f"ultracomm: {name} must be an int >= {lo}, got {v!r}")
        cfg = config or Config.from_env()
        if transport is not None:
            overrides["transport"] = transport
        if window is not None:
            overrides["window"] = window
        self.config = cfg.replace(**overrides) if overrides else cfg
        if not self.config.deterministic:
            # every transport built so far reduces in the schedule's fixed order; there is no
            # faster non-deterministic path to switch to, so say so instead of ignoring it
            log.warning("ultracomm: ULTRACOMM_DETERMINISTIC=0 has no effect: reductions are always ordered")
        log.setLevel(self.config.log_level.upper())
        self.comm = as_comm(group)
        self.rank, self.world = self.comm.rank, self.comm.world
        self.layout = layout
        self.experts_per_rank = experts_per_rank
        self.num_experts = experts_per_rank * self.world
        self.slots_per_rank = slots_per_rank
        self.num_layers = num_layers
        self.max_microbatches = max_microbatches
        self.node_of = [0] * self.world if node_of is None else [int(n) for n in node_of]
        if len(self.node_of) != self.world or min(self.node_of) < 0:
            raise ValueError(f"ultracomm: node_of must list a node index >= 0 for each of the {self.world} ranks")

        transport_cls = resolve_transport(self.config.transport)
        provider = resolve_provider(self.config.window, self.comm)
        if provider not in transport_cls.window_providers:
            raise ValueError(f"ultracomm: transport {transport_cls.name!r} cannot use window {provider!r}; "
                             f"use one of {transport_cls.window_providers}")
        check_same(self.comm, "Context configuration", (
            repr(layout), experts_per_rank, slots_per_rank, num_layers, max_microbatches, self.node_of,
            self.config.chunk_bytes, self.config.relay_mode, self.config.max_depth, self.config.intra_bw,
            self.config.inter_bw, transport_cls.name, provider))

        self.wlayout = _core.window_layout(slots_per_rank, layout.weight_bytes, layout.grad_bytes,
                                           self.config.chunk_bytes)
        self.window = open_window(provider, self.comm, self.wlayout["total_bytes"])
        self.transport = transport_cls(
            rank=self.rank, world=self.world, window=self.window, wlayout=self.wlayout, layout=layout,
            num_workers=self.config.num_workers, timeout_s=self.config.timeout_s, jitter_us=self.config.jitter_us)

        self.replica_weights = self._slot_views(self.wlayout["weights_off"], self.wlayout["weight_stride"],
                                                layout.weight_offsets, [m.dtype for m in layout.members])
        self.replica_grads = self._slot_views(self.wlayout["grads_off"], self.wlayout["grad_stride"],
                                              layout.grad_offsets, [layout.grad_dtype] * len(layout.members))
        self._masters: list[Masters | None] = [None] * num_layers
        self._vids: list[_MicroBatch | None] = [None] * max_microbatches
        self._schedules: collections.OrderedDict[bytes, Schedule] = collections.OrderedDict()
        self._epoch = 0
        self._lock = threading.Lock()
        self._broken: BaseException | None = None
        self._runner = OrderedRunner(f"ultracomm-rank{self.rank}")

    # ------------------------------------------------------------------ buffers
    def _slot_views(self, region_off: int, stride: int, member_offs: Sequence[int],
                    dtypes: Sequence[torch.dtype]) -> tuple[torch.Tensor, ...]:
        """``[slots_per_rank, *member.shape]`` views of member ``m`` in every slot of a region."""
        views = []
        for member, off, dt in zip(self.layout.members, member_offs, dtypes):
            esz = torch.empty((), dtype=dt).element_size()
            inner = [1] * len(member.shape)
            for i in range(len(member.shape) - 2, -1, -1):
                inner[i] = inner[i + 1] * member.shape[i + 1]
            flat = self.window.local.view(dt)  # window sizes and offsets are 256/16-byte aligned
            views.append(torch.as_strided(flat, (self.slots_per_rank, *member.shape), (stride // esz, *inner),
                                          (region_off + off) // esz))
        return tuple(views)

    def register_masters(self, layer: int, weights: Sequence[torch.Tensor], grads: Sequence[torch.Tensor]) -> None:
        """Register layer ``layer``'s master experts on this rank.

        Args:
            weights: one tensor per layout member, ``[experts_per_rank, *member.shape]``,
                ``member.dtype``, contiguous.
            grads: the same shapes in ``layout.grad_dtype`` (e.g. Megatron's ``main_grad``);
                ``grad_reduce`` adds the replicas' gradients into them.
        The tensors must stay alive (and at the same address) while the Context uses them.
        """
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise RegistrationError(f"ultracomm: layer {layer!r} is out of range 0..{self.num_layers - 1}")
        self.layout.check_tensors(weights, grads, self.experts_per_rank)
        if any(t.device.type != "cpu" for t in (*weights, *grads)) and self.transport.name == "host":
            raise RegistrationError("ultracomm: the host transport needs CPU tensors; move them with .cpu() "
                                    "or use a GPU transport")
        weights, grads = tuple(weights), tuple(grads)
        self._masters[layer] = Masters(weights, grads, master_pointers(weights, self.experts_per_rank),
                                       master_pointers(grads, self.experts_per_rank))

    # ------------------------------------------------------------------ micro-batch slots
    def begin(self, layer: int) -> int:
        """Take a free micro-batch slot id for ``layer``; released by ``grad_reduce`` or ``end``."""
        if not isinstance(layer, int) or not 0 <= layer < self.num_layers:
            raise ValueError(f"ultracomm: layer {layer!r} is out of range 0..{self.num_layers - 1}")
        if self._masters[layer] is None:
            raise RegistrationError(f"ultracomm: layer {layer} has no masters; call register_masters({layer}, ...) first")
        for vid, mb in enumerate(self._vids):
            if mb is None:
                self._vids[vid] = _MicroBatch(layer)
                return vid
        raise UltracommError(
            f"ultracomm: all {self.max_microbatches} micro-batch slots are in flight; call grad_reduce(vid) or "
            "end(vid) for finished micro-batches, or create the Context with a larger max_microbatches")

    def end(self, vid: int) -> None:
        """Release ``vid`` without reducing (inference, or a micro-batch that is dropped)."""
        self._get(vid)
        self._vids[vid] = None

    def _get(self, vid: int, need_plan: bool = False) -> _MicroBatch:
        if not isinstance(vid, int) or not 0 <= vid < self.max_microbatches or self._vids[vid] is None:
            raise ValueError(f"ultracomm: vid {vid!r} is not in flight; get one from begin(layer)")
        mb = self._vids[vid]
        if need_plan and mb.schedule is None:
            raise UltracommError(f"ultracomm: vid {vid} has no plan yet; call weight_sync(vid, plan) first")
        return mb

    # ------------------------------------------------------------------ operations
    def schedule_for(self, plan: ReplicaPlan, key: bytes | None = None) -> Schedule:
        """The (cached) schedule of ``plan`` with this Context's configuration (this rank's lists).
        ``key``: ``plan.digest()`` if the caller has it already."""
        key = plan.digest() if key is None else key
        sched = self._schedules.get(key)
        if sched is None:
            c = self.config
            sched = build_schedule(plan, self.layout.weight_bytes, self.layout.grad_bytes, node_of=self.node_of,
                                   chunk_bytes=c.chunk_bytes, relay_mode=c.relay_mode, max_depth=c.max_depth,
                                   intra_bw=c.intra_bw, inter_bw=c.inter_bw, rank=self.rank)
            self._schedules[key] = sched
            if log.isEnabledFor(logging.DEBUG):
                st = sched.stats()
                log.debug("rank %d: schedule %016x built: multicast depth %d max egress %d B (lower bound %d B); "
                          "reduce depth %d max ingress %d B (lower bound %d B)", self.rank, sched.digest,
                          st["multicast"]["depth"], st["multicast"]["max_egress"],
                          st["multicast"]["lower_bound_bytes"], st["reduce"]["depth"], st["reduce"]["max_ingress"],
                          st["reduce"]["lower_bound_bytes"])
            if len(self._schedules) > _SCHEDULE_CACHE:
                self._schedules.popitem(last=False)
        else:
            self._schedules.move_to_end(key)
        return sched

    def _prepare_plan(self, plan: ReplicaPlan) -> Schedule:
        """Validate ``plan`` here, build its schedule, then agree with every rank (collective).

        Every rank raises when any rank's plan is invalid or the plans or schedules differ,
        so no rank is left waiting in a later collective or flag.
        """
        local_error: BaseException | None = None
        mine = None
        try:
            if not isinstance(plan, ReplicaPlan):
                raise TypeError(f"ultracomm: plan must be a ReplicaPlan, got {type(plan).__name__}; "
                                "build one with ReplicaPlan.make(...) or a converter")
            if (plan.world, plan.slots_per_rank, plan.num_experts) != (self.world, self.slots_per_rank,
                                                                       self.num_experts):
                raise ValueError(
                    f"ultracomm: plan is for world {plan.world}, {plan.slots_per_rank} slots per rank, "
                    f"{plan.num_experts} experts; this Context has world {self.world}, {self.slots_per_rank} "
                    f"slots per rank, {self.num_experts} experts")
            plan.validate(experts_per_rank=self.experts_per_rank)
            key = plan.digest()
            sched = self.schedule_for(plan, key)
            mine = (key.hex(), sched.digest)
        except (TypeError, ValueError) as e:
            local_error = e
        views = self.comm.all_gather_object(
            (None if local_error is None else f"{type(local_error).__name__}: {local_error}", mine))
        if local_error is not None:
            raise local_error
        failed = [r for r, (err, _) in enumerate(views) if err is not None]
        if failed:
            raise ValueError(f"ultracomm: ranks {failed} rejected their plan ({views[failed[0]][0]}); every rank "
                             "must pass the same valid plan")
        for what, i in (("plan", 0), ("schedule", 1)):
            groups: dict = {}
            for r, (_, m) in enumerate(views):
                groups.setdefault(m[i], []).append(r)
            if len(groups) > 1:
                detail = "; ".join(f"ranks {rs}" for rs in groups.values())
                hint = ("every rank must pass the same plan" if what == "plan" else
                        "ranks built different schedules from one plan: their configurations differ")
                raise ValueError(f"ultracomm: {what} differs across ranks ({detail}); {hint}")
        return sched

    def _submit(self, name: str, op: Op, mb: _MicroBatch, async_op: bool) -> Work | None:
        if self._broken is not None:
            raise UltracommError(f"ultracomm: this Context failed earlier ({self._broken}); create a new Context")
        masters = self._masters[mb.layer]
        sched = mb.schedule
        my_slots, local_index_of = mb.my_slots, mb.local_index_of

        def body() -> None:
            if self._broken is not None:  # queued before an earlier operation failed: never start it
                raise UltracommError(f"ultracomm: {name} (epoch {epoch}) not started: an earlier operation of "
                                     f"this Context failed ({self._broken}); create a new Context")
            try:
                self.transport.run(op, sched, epoch, masters, my_slots, local_index_of, name)
            except BaseException as e:
                self._broken = e
                raise

        with self._lock:  # epochs are taken and queued in one order, whatever thread calls
            self._epoch += 1
            epoch = self._epoch
            work = self._runner.submit(f"{name} (rank {self.rank}, epoch {epoch})", body)
        log.debug("rank %d: %s vid-layer %d epoch %d submitted", self.rank, name, mb.layer, epoch)
        if async_op:
            return work
        work.wait()
        return None

    def weight_sync(self, vid: int, plan: ReplicaPlan, async_op: bool = False) -> Work | None:
        """Multicast the home experts of ``vid``'s layer into the replica slots ``plan`` names.

        On return (or ``work.wait()``), ``replica_weights[m][s]`` on rank ``r`` holds member
        ``m`` of expert ``plan.slot_src[r, s]``.  Collective: every rank passes the same plan.
        """
        mb = self._get(vid)
        sched = self._prepare_plan(plan)
        mb.plan, mb.schedule = plan, sched
        mb.my_slots, mb.local_index_of = plan.slot_src[self.rank].tolist(), plan.local_index_of.tolist()
        return self._submit("weight_sync", Op.MULTICAST, mb, async_op)

    def restore(self, vid: int, async_op: bool = False) -> Work | None:
        """Re-multicast ``vid``'s plan (the slots were reused by other layers since its forward)."""
        mb = self._get(vid, need_plan=True)
        return self._submit("restore", Op.MULTICAST, mb, async_op)

    def grad_reduce(self, vid: int, async_op: bool = False) -> Work | None:
        """Add every replica's gradient (``replica_grads``) into its home expert's master grad.

        Deterministic: for each element, fp32 ``acc = master``, then the sources in the order
        the schedule lists them (relays pre-reduce their subtree first), cast back to the
        grad dtype.  Releases ``vid``.

        A relay's ``replica_grads`` slot is overwritten with its partial sum (its own grad
        plus its children's), so replica grads are consumed by this call; with
        ``async_op=True`` write ``replica_grads`` again only after ``work.wait()``.
        """
        mb = self._get(vid, need_plan=True)
        work = self._submit("grad_reduce", Op.REDUCE, mb, async_op)
        self._vids[vid] = None
        return work

    def replicas(self, vid: int) -> list[int]:
        """Expert held by each of this rank's replica slots under ``vid``'s plan (-1 = empty)."""
        return self._get(vid, need_plan=True).plan.slot_src[self.rank].tolist()

    def synchronize(self) -> None:
        """Wait for every operation submitted so far on this rank."""
        self._runner.submit("synchronize", lambda: None).wait()

    def close(self) -> None:
        """Finish queued operations and release the window (not collective)."""
        runner, self._runner = self._runner, None
        if runner is not None:
            runner.close()
            self.window.close()

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass
