"""The ``tma`` transport: runs this rank's task lists with the persistent CUDA kernel
(``ultracomm._cuda``; sm_90+: TMA bulk copies, sm_80: 16-byte vector loads/stores) on the
caller's CUDA stream.

Interface (stable; ``Context`` and the GPU tests use exactly this):

``TmaTransport(*, rank, world, window, wlayout, layout, num_workers, timeout_s, jitter_us=0,
multicast_sms=None, reduce_sms=None, experts_per_rank=None, plan_slots=0, reduce_path="hunk")``
    ``window``: a GPU window (``cuda_ipc``, ``torch_symm``, ``cuda_local`` or ``nvshmem``) whose
    ``peer_bases`` are device addresses of every rank's window as this device addresses them
    and whose ``local`` is a CUDA tensor (its device is the one the kernel runs on).
    ``multicast_sms`` / ``reduce_sms``: CTAs per launch (one per SM; ``ULTRACOMM_MULTICAST_SMS``
    / ``ULTRACOMM_REDUCE_SMS``, resolved by ``Context``); ``None`` takes
    :func:`ultracomm.cuda.sm_budget.choose_sms` of ``link_bytes_per_s`` (keyword, default 450e9).
    ``num_workers`` and ``jitter_us`` (host-executor knobs) are accepted and ignored.
    ``plan_slots``: vid slots of the plan arena (``Context``: num_layers x max_microbatches);
    with ``experts_per_rank`` the arena is allocated here (:attr:`plan_arena_bytes`), else at the
    first ``run`` (its local experts are then the first plan's).
    ``reduce_path`` (``ULTRACOMM_REDUCE_PATH``): how the kernel adds gradients, ``"hunk"`` or
    ``"tma"`` (see "Reduce paths"); ``"tma"`` on a GPU older than sm_90 raises ``ValueError``.
    Raises :class:`~ultracomm.cuda.support.NotAvailableError` naming what is missing (a CPU
    torch, no device, no ``_cuda`` in the build, no driver, a pre-sm_80 GPU).

``run(op, schedule, epoch, masters, my_slots, local_index_of, op_name, stream, slot=None) -> bool``
    Enqueues the operation on ``stream`` (a ``cudaStream_t`` as int, e.g.
    ``torch.cuda.current_stream().cuda_stream``) and returns at once: no host synchronisation,
    no allocation and no pageable copy.  The plan goes into the plan arena (:mod:`.plan_slots`):
    into vid slot ``slot`` (``Context`` passes ``vid % plan_slots``; restore and grad_reduce of
    the vid reuse what weight_sync wrote) or, for ``slot=None``, a scratch slot (pinned while a
    CUDA graph captures it); a new plan is one async copy from pinned staging on ``stream``.
    A plan beyond the arena's bounds raises ``ValueError`` before anything is enqueued.  The
    kernel publishes the schedule digest beside ``ready[op]`` (a peer on another plan raises
    ``PlanError`` on every rank touching it).  Graph replays run fresh epochs on their own (the
    kernel runs max(epoch, last + 1)) and the plan their slot holds when they run.

Reduce paths (``reduce_path``): both add, per element, the destination then every source in the
schedule's order in fp32, each add rounded once, fp16/bf16 converted in hardware and NaN sums
redone by the host's rule: bit-identical to the host executor and to each other.  ``"hunk"`` (the
default): each thread loads several 16-byte packs of the destination and of a pair of sources into
registers before the first add (NCCL's reduceCopyPacks; csrc/cuda/mover_common.cuh vec_reduce).
``"tma"``: bulk copies (``cp.async.bulk``) bring each operand's 8 KiB sub-tile into shared memory
through the kernel's ring of stages, up to six stages of four operands ahead of the adds, which
read shared memory (csrc/cuda/mover_tma.cuh reduce_staged); segments whose operands are not
16-byte congruent take the hunk path.  Separate kernels (the default ones are unchanged), sm_90+
only, no more shared memory.  Which is faster is ``perf/bench_gpu.py``'s to say (reduce rows
``tile mover tma-staged`` beside ``tile mover``).

Loopback windows (``cuda_local``: every rank a thread of one process, windows on one GPU):
    each rank's n-th ``run`` joins the n-th launch (:mod:`ultracomm.cuda.loopback_launch`: same
    operations in the same order, one stream) and the call completing the set launches all
    ranks in one grid (:mod:`.loopback`), since only one launch keeps every rank's CTAs
    co-resident.  A ``Work`` of an earlier rank completes before that launch ran; ``run``
    returns ``False`` for such a share (``True`` when the call enqueued the launch).

Resident plans (``schedule`` a :class:`~ultracomm.resident_plan.DeviceSchedule`, from
``Context.weight_sync(vid, ResidentPlan(...))``): the plan never visits the host.  ``run``
enqueues, on its ``weight_sync``, the device build of its lists into the vid's slot
(:mod:`.resident`: templates once per slot and masters, ``k_build_slot`` per rank entry) and
then the launch; ``restore`` / ``grad_reduce`` run what the slot holds.  A failed build is
raised by ``check_error``.

``reject(op, epoch, stream) -> None``
    This rank rejected its plan: publishes kRejectedDigest beside ``ready[op] = epoch`` in its
    window (stream-ordered), so peers raise ``PlanError`` instead of timing out.

``close() -> None``
    Frees the plan arena (after the device finished the queued kernels).

``check_error() -> None``
    After the stream reached a launch (event or stream synchronised): raises
    ``UltracommTimeout`` (rank, operation, expert, chunk, peer, as the host executor words it),
    ``PlanError`` (a peer runs another plan or rejected its plan) or ``UltracommError``, for
    the first failure recorded since the last call; otherwise returns.
"""

from __future__ import annotations

import logging
import weakref
from typing import Any, Callable, Sequence

import numpy as np

from ...cuda.support import cuda_runtime, raise_record, record_epoch
from ...env import REDUCE_PATHS
from ...cuda.loopback_launch import Deposit, launches_for
from ...records import REF_DTYPE, TASK_DTYPE, Op
from ..device_schedule import DeviceSchedule
from ...cuda.sm_budget import choose_sms
from ..base import GRAD_DTYPE_CODE, Masters, Transport
from .plan_slots import PlanSlots, arena_bounds, arena_bytes
from .loopback import runner_for
from .resident import ResidentSlots, Share
from ...errors import InputError

__all__ = ["TmaTransport"]

log = logging.getLogger("ultracomm")


class TmaTransport(Transport):
    """Persistent-kernel executor over GPU windows (see the module docstring)."""

    name = "tma"
    window_providers = ("cuda_ipc", "torch_symm", "cuda_local", "nvshmem")
    stream_ordered = True
    options = frozenset(
        {"num_workers", "jitter_us", "multicast_sms", "reduce_sms", "experts_per_rank", "plan_slots", "reduce_path"}
    )
    takes_slot = True
    window_flags = True
    #: takes resident plans (DeviceSchedule): builds their lists on the GPU
    build_on_device = True

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        window,
        wlayout: dict,
        layout,
        num_workers: int,
        timeout_s: float,
        jitter_us: int = 0,
        multicast_sms: int | None = None,
        reduce_sms: int | None = None,
        link_bytes_per_s: float = 450e9,
        experts_per_rank: int | None = None,
        plan_slots: int = 0,
        reduce_path: str = "hunk",
    ):
        if reduce_path not in REDUCE_PATHS:
            raise InputError(f"ultracomm: reduce_path must be one of {', '.join(REDUCE_PATHS)}, got {reduce_path!r}")
        local = window.local
        if getattr(local, "device", None) is None or local.device.type != "cuda":
            raise InputError(
                f"ultracomm: the tma transport needs a GPU window, got {window.provider!r} on "
                f"{getattr(local, 'device', 'host')}"
            )
        import torch

        self.device = local.device.index if local.device.index is not None else torch.cuda.current_device()
        self._cuda = cuda_runtime(self.device)
        self.rank, self.world = rank, world
        self.window, self.wlayout, self.layout = window, dict(wlayout), layout
        self.timeout_s = float(timeout_s)
        if plan_slots < 0:
            raise InputError(f"ultracomm: plan_slots must be >= 0, got {plan_slots}")
        self.plan_slots = int(plan_slots)
        self._arena_shape = None
        if experts_per_rank is not None:
            loopback = bool(getattr(window, "loopback", False))
            self._arena_shape = dict(
                nranks=world if loopback else 1,
                world=world,
                experts_per_rank=int(experts_per_rank),
                members=len(layout.members),
                wlayout=dict(wlayout),
            )
        #: device bytes of this rank's plan arena (as many again in pinned host memory); a loopback
        #: domain's ranks share one arena of that size
        self.plan_arena_bytes = (
            arena_bytes(self._cuda, self.plan_slots, **self._arena_shape) if self._arena_shape is not None else 0
        )
        # a loopback window (cuda_local): one launch runs every rank (loopback.py)
        self._loopback = (
            runner_for(window, self._cuda, self.device, self.timeout_s, self.plan_slots)
            if getattr(window, "loopback", False)
            else None
        )
        self.runner = self._loopback.runner if self._loopback is not None else self._cuda.Runner(self.device)
        if reduce_path == "tma" and self.runner.mover != "tma":
            raise InputError(
                f"ultracomm: reduce_path='tma' (ULTRACOMM_REDUCE_PATH) stages gradients through shared memory with "
                f"bulk copies, which need sm_90 or newer; device {self.device} runs the {self.runner.mover} mover "
                "(sm_80): use reduce_path='hunk'"
            )
        #: how the kernel adds gradients: "hunk" (registers) or "tma" (TMA-staged), module doc
        self.reduce_path = reduce_path
        sms = self.runner.sm_count
        # the Context passes both (env / profile); alone: the measured per-CTA fallback
        self.multicast_sms = (
            int(multicast_sms) if multicast_sms is not None else choose_sms("multicast", 0, link_bytes_per_s, sms).sms
        )
        self.reduce_sms = (
            int(reduce_sms) if reduce_sms is not None else choose_sms("reduce", 0, link_bytes_per_s, sms).sms
        )
        for what, v in (("multicast_sms", self.multicast_sms), ("reduce_sms", self.reduce_sms)):
            if v < 1:
                raise InputError(f"ultracomm: {what} must be >= 1, got {v}")
        log.debug(
            "ultracomm tma: rank %d device %d (%s mover, %d SMs): multicast_sms=%d reduce_sms=%d reduce_path=%s",
            rank,
            self.device,
            self.runner.mover,
            sms,
            self.multicast_sms,
            self.reduce_sms,
            reduce_path,
        )
        self._grad_code = GRAD_DTYPE_CODE[layout.grad_dtype]
        self._bases = [int(b) for b in window.peer_bases]
        self._members = {
            Op.MULTICAST: (list(layout.weight_offsets), list(layout.weight_sizes)),
            Op.REDUCE: (list(layout.grad_offsets), list(layout.grad_sizes)),
        }
        self._slots = PlanSlots(self.plan_slots)
        self._resident = ResidentSlots(self._slots)
        self._templates: dict = {}  # (id(masters), id(local_index_of)) -> resident plans' templates
        self._arena = None
        if self._loopback is None and self._arena_shape is not None:
            self._arena = self._make_arena(self._arena_shape)
        elif self._loopback is not None and self._arena_shape is not None:
            self._loopback.ensure_arena(self._arena_shape)
        self._names: dict[int, str | None] = {}

    def loopback_arena(self, masters: Masters, local_index_of: Sequence[int]) -> Any:
        """The loopback domain's launcher, its plan arena allocated (sized for these masters when
        the transport was made without an arena shape); every loopback launch path calls it."""
        if self._arena_shape is None:
            self._loopback.ensure_arena(self._shape_of(masters, local_index_of))
        return self._loopback

    def _make_arena(self, shape: dict) -> object:
        return self._cuda.PlanArena(self.device, self._slots.num_slots, **arena_bounds(**shape))

    def _shape_of(self, masters: Masters, local_index_of: Sequence[int]) -> dict:
        """The arena's shape when the constructor was not told experts_per_rank: the first plan's."""
        n_local = sum(1 for i in local_index_of if i >= 0)
        return dict(
            nranks=self.world if self._loopback is not None else 1,
            world=self.world,
            experts_per_rank=max(n_local, 1),
            members=len(self.layout.members),
            wlayout=dict(self.wlayout),
        )

    def _rank_args(
        self, op: Op, schedule, masters: Masters, my_slots: Sequence[int], local_index_of: Sequence[int]
    ) -> tuple[tuple, "Callable[[], dict]"]:
        """(cache key, builder of this rank's DevicePlan arguments) of one operation."""
        ptrs = masters.weight_ptrs if op == Op.MULTICAST else masters.grad_ptrs
        key = (schedule.digest, int(op), tuple(ptrs), tuple(my_slots), tuple(local_index_of), tuple(self._bases))

        def make() -> dict:
            member_off, member_bytes = self._members[op]
            L = self.wlayout
            return dict(
                op=int(op),
                rank=self.rank,
                world=self.world,
                slots=L["slots"],
                weight_slot_bytes=L["weight_slot_bytes"],
                grad_slot_bytes=L["grad_slot_bytes"],
                chunk_bytes=L["chunk_bytes"],
                window_bases=self._bases,
                member_off=member_off,
                member_bytes=member_bytes,
                master_ptrs=list(ptrs),
                local_index_of=list(local_index_of),
                grad_dtype=self._grad_code,
                my_slots=list(my_slots),
                tasks=schedule.tasks(op, self.rank),
                refs=schedule.refs(op, self.rank),
                timeout_s=self.timeout_s,
                slot_parent=schedule.tree(op)[0][self.rank].tolist(),
                digest=schedule.digest,
            )

        return key, make

    def _share(self, sched: DeviceSchedule, masters: Masters, local_index_of: Sequence[int]) -> Share:
        """This rank's entry of a resident plan's launch (resident.py).  The templates and their
        keys depend only on the masters and local_index_of: made once per pair (E-long lists)."""
        key = (id(masters), id(local_index_of))
        got = self._templates.get(key)
        if got is None or got[0]() is not masters or got[1] is not local_index_of:
            # held weakly: masters registered anew must not keep the old tensors alive
            for k in [k for k, v in self._templates.items() if v[0]() is None]:
                del self._templates[k]
            got = self._templates[key] = (
                weakref.ref(masters),
                local_index_of,
                *self._template_fns(masters, local_index_of),
            )
        return Share(sched.token, got[2], got[3], sched.build_args())

    def _template_fns(self, masters: Masters, local_index_of: Sequence[int]) -> tuple:
        lio = [int(i) for i in local_index_of]
        S = int(self.wlayout["slots"])
        # registered without grads: no reduction can run (Context refuses it); the weights'
        # pointers stand in so the reduce template is well-formed, and the key tells them apart
        ptrs = {
            int(Op.MULTICAST): list(masters.weight_ptrs),
            int(Op.REDUCE): list(masters.grad_ptrs if masters.grad_ptrs is not None else masters.weight_ptrs),
        }
        keys = {op: (op, masters.grad_ptrs is None, tuple(p), tuple(lio), tuple(self._bases)) for op, p in ptrs.items()}

        def template(op: int) -> dict:
            member_off, member_bytes = self._members[Op(op)]
            L = self.wlayout
            return dict(
                op=op,
                rank=self.rank,
                world=self.world,
                slots=S,
                weight_slot_bytes=L["weight_slot_bytes"],
                grad_slot_bytes=L["grad_slot_bytes"],
                chunk_bytes=L["chunk_bytes"],
                window_bases=self._bases,
                member_off=member_off,
                member_bytes=member_bytes,
                master_ptrs=ptrs[op],
                local_index_of=lio,
                grad_dtype=self._grad_code,
                my_slots=[-1] * S,
                tasks=np.zeros(0, TASK_DTYPE),
                refs=np.zeros(0, REF_DTYPE),
                timeout_s=self.timeout_s,
                slot_parent=[-1] * S,
                digest=1,
            )

        return template, keys.__getitem__

    def run(
        self,
        op: Op,
        schedule,
        epoch: int,
        masters: Masters,
        my_slots: Sequence[int],
        local_index_of: Sequence[int],
        op_name: str | None,
        stream: int,
        slot: int | None = None,
    ) -> bool:
        """Enqueue ``op`` of ``schedule`` for this rank at ``epoch`` on ``stream`` (see module doc)."""
        op = Op(int(op))
        ctas = self.multicast_sms if op == Op.MULTICAST else self.reduce_sms
        if isinstance(schedule, DeviceSchedule):
            return self._run_resident(op, schedule, epoch, masters, local_index_of, op_name, stream, slot, ctas)
        key, make = self._rank_args(op, schedule, masters, my_slots, local_index_of)
        if self._loopback is not None:  # the rank completing the set launches every rank
            lb = self.loopback_arena(masters, local_index_of)
            return launches_for(self.window).deposit(
                Deposit(self.rank, int(op), int(epoch), int(stream), (key, make, ctas, op_name, slot)),
                lambda deps: lb.launch(deps, self.rank, self.reduce_path),
            )
        if self._arena is None:
            self._arena = self._make_arena(self._shape_of(masters, local_index_of))
        where, upload = self._slots.place(int(op), key, slot)
        self.runner.launch_slot(
            self._arena,
            where,
            int(op),
            [make()] if upload else None,
            int(epoch),
            ctas,
            int(stream),
            False,
            reduce_path=self.reduce_path,
        )
        self._slots.written(where, int(op), key)
        if len(self._names) > 1024:
            self._names.clear()
        self._names[int(epoch)] = op_name
        return True

    def _run_resident(
        self,
        op: Op,
        sched: DeviceSchedule,
        epoch: int,
        masters: Masters,
        local_index_of: Sequence[int],
        op_name: str | None,
        stream: int,
        slot: int | None,
        ctas: int,
    ) -> bool:
        share = self._share(sched, masters, local_index_of)
        if self._loopback is not None:
            lb = self.loopback_arena(masters, local_index_of)
            return launches_for(self.window).deposit(
                Deposit(
                    self.rank,
                    int(op),
                    int(epoch),
                    int(stream),
                    (("resident", share.token), None, ctas, op_name, slot, share),
                ),
                lambda deps: lb.launch(deps, self.rank, self.reduce_path),
            )
        if self._arena is None:
            self._arena = self._make_arena(self._shape_of(masters, local_index_of))
        self._resident.launch(
            self.runner, self._arena, slot, int(op), [share], int(epoch), ctas, int(stream), self.reduce_path
        )
        if len(self._names) > 1024:
            self._names.clear()
        self._names[int(epoch)] = op_name
        return True

    def reject(self, op: Op, epoch: int, stream: int) -> None:
        """This rank rejected its plan for ``op`` at ``epoch``: publish it in its window
        (stream-ordered), so peers raise ``PlanError`` "rank r rejected its plan" at once."""
        if self._loopback is not None:
            self._loopback.reject(self.rank, int(op), int(epoch), self.wlayout, self._bases[self.rank], int(stream))
            return
        L = self.wlayout
        self._cuda.publish_rejection(
            int(op),
            int(epoch),
            self._bases[self.rank],
            L["slots"],
            L["weight_slot_bytes"],
            L["grad_slot_bytes"],
            L["chunk_bytes"],
            int(stream),
        )

    def close(self) -> None:
        """Free this rank's plan arena (the caller synchronised the device first)."""
        self._arena = None

    def check_error(self) -> None:
        """Raise the first failure recorded since the last call (see module doc)."""
        if self._loopback is not None:
            self._loopback.check_error(self.rank)
            return
        # a failed device build first: the kernel's digest mismatches and rejections follow from it
        if self._arena is not None:
            self._arena.retire()  # the stream reached the launches: their copies are done
        failure = self._resident.take_failure(self._arena, self.rank) if self._arena is not None else None
        rec = self.runner.take_error()
        if failure is not None:
            raise failure
        if rec is not None:
            raise_record(rec, self._names.get(record_epoch(rec)), self.timeout_s)
