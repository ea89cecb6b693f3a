"""One-GPU loopback domains on the CUDA executor: every rank's window lives on one device and
ONE launch of the persistent kernel runs all ranks (all CTAs co-resident: the launch is
cooperative and refused if they cannot all be resident), so a spinning rank can never starve a
rank that was not scheduled.  The grid: ``ctas_per_rank`` CTAs for each rank with at least one
task in the plan, ONE for each rank without (it only joins and drains; tasks are claimed
dynamically, so more CTAs would only spin) -- ``CudaLoopback.launch_ctas`` lists them.  An
operation with tasks on one rank (a pushed multicast, a pulled reduce) can so give that rank
nearly every co-resident CTA (``max_ctas_per_rank``), as a rank owning a whole GPU would have.
This is the test vehicle of the ``gpu`` tests and the GPU microbenchmarks.

Data in, data out, as the host executor: ``windows[r]`` is rank r's window (a uint8 CUDA
tensor of ``wlayout["total_bytes"]``, laid out by ``_core.window_layout``), the per-rank
arguments are ``_core.run_host``'s, so the same inputs through ``_core.run_host`` (one thread
per rank on CPU copies) must give the same bytes, flags included::

    lb = CudaLoopback(world, wlayout, windows, timeout_s=10)
    plan = lb.plan(Op.MULTICAST, tasks=[...], refs=[...], member_off=..., member_bytes=...,
                   master_ptrs=[...], local_index_of=[...], my_slots=[...])
    lb.launch(plan, epoch=1, ctas_per_rank=4)          # enqueue on the current stream
    torch.cuda.synchronize(); lb.check_error()          # raises UltracommTimeout & co.

``plan`` validates (ValueError, nothing written) and uploads once; ``launch`` only enqueues
(capturable in a CUDA graph: replays run fresh epochs, see csrc/cuda/persistent_args.h).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

from .support import cuda_runtime, raise_record, record_epoch
from ..records import Op
from ..errors import InputError

__all__ = ["CudaLoopback", "GRAD_DTYPE_CODE", "run"]

GRAD_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def _dtype_code(d: Any) -> int:
    return GRAD_DTYPE_CODE[d] if isinstance(d, torch.dtype) else int(d)


class CudaLoopback:
    """All ranks of a loopback domain on one CUDA device.

    Args:
        world: ranks (<= ``_cuda.MAX_LOOPBACK_RANKS``).
        wlayout: ``_core.window_layout(...)`` dict shared by every rank.
        windows: ``world`` uint8 CUDA tensors (one device), each >= ``wlayout["total_bytes"]``,
            zeroed before the first operation.
        timeout_s: per wait, as the host executor's (``float("inf")`` never times out).
    """

    def __init__(self, world: int, wlayout: dict, windows: Sequence[torch.Tensor], *, timeout_s: float = 10.0):
        if len(windows) != world:
            raise InputError(f"ultracomm: {len(windows)} windows for world {world}")
        dev = windows[0].device
        for r, w in enumerate(windows):
            if w.device != dev or w.device.type != "cuda" or w.dtype != torch.uint8 or not w.is_contiguous():
                raise InputError(f"ultracomm: window {r} must be a contiguous uint8 tensor on {dev} (a CUDA device)")
            if w.numel() < wlayout["total_bytes"]:
                raise InputError(
                    f"ultracomm: window {r} has {w.numel()} bytes, the layout needs {wlayout['total_bytes']}"
                )
        self.world, self.wlayout, self.windows = world, dict(wlayout), list(windows)
        self.device = dev.index if dev.index is not None else torch.cuda.current_device()
        self.timeout_s = float(timeout_s)
        self._cuda = cuda_runtime(self.device, "the CUDA loopback executor")
        self.runner = self._cuda.Runner(self.device)
        self._names: dict[int, str | None] = {}

    @property
    def bases(self) -> list[int]:
        return [w.data_ptr() for w in self.windows]

    def plan(
        self,
        op: Op | int,
        *,
        tasks: Sequence,
        refs: Sequence,
        member_off: Sequence[int],
        member_bytes: Sequence[int],
        master_ptrs: Sequence[Sequence[int]],
        local_index_of: Sequence[Sequence[int]],
        my_slots: Sequence[Sequence[int]],
        grad_dtype: Any = 0,
        slot_parent: Sequence[Sequence[int]] | None = None,
        digest: int = 0,
        withhold: Sequence[int] = (),
    ):
        """Validate and upload one operation for every rank (per-rank sequences of length world):
        ``tasks[r]`` / ``refs[r]`` TASK_DTYPE / REF_DTYPE arrays, ``master_ptrs[r]`` device
        addresses of rank r's masters (``[local expert * M + member]``), ``local_index_of[r]``,
        ``my_slots[r]``.  ``withhold``: ranks whose task list is dropped (they join and drain but
        move nothing: tests of the timeout path).  Returns a ``_cuda.DevicePlan``."""
        L = self.wlayout
        ranks = []
        for r in range(self.world):
            held = r in withhold
            ranks.append(
                dict(
                    op=int(op),
                    rank=r,
                    world=self.world,
                    slots=L["slots"],
                    weight_slot_bytes=L["weight_slot_bytes"],
                    grad_slot_bytes=L["grad_slot_bytes"],
                    chunk_bytes=L["chunk_bytes"],
                    window_bases=self.bases,
                    member_off=list(member_off),
                    member_bytes=list(member_bytes),
                    master_ptrs=list(master_ptrs[r]),
                    local_index_of=list(local_index_of[r]),
                    grad_dtype=_dtype_code(grad_dtype),
                    my_slots=list(my_slots[r]),
                    tasks=tasks[r][:0] if held else tasks[r],
                    refs=refs[r],
                    timeout_s=self.timeout_s,
                    slot_parent=None if slot_parent is None else list(slot_parent[r]),
                    digest=int(digest),
                )
            )
        return self._cuda.DevicePlan(ranks, self.device)

    def launch_ctas(self, plan, ctas_per_rank: int) -> list[int]:
        """The CTAs ``launch(plan, ..., ctas_per_rank=...)`` gives each rank, in rank order:
        ``ctas_per_rank`` where the plan has a task, 1 where it has none (``_cuda.Runner.launch_ctas``,
        the rule the launch itself applies); the grid is their sum."""
        return list(self.runner.launch_ctas(plan, int(ctas_per_rank)))

    def max_ctas_per_rank(self, plan) -> int:
        """The largest ``ctas_per_rank`` whose launch of ``plan`` is co-resident on this device
        (its whole grid, ``sum(launch_ctas(plan, c))``, within ``runner.max_coresident`` of the
        plan's grad dtype); 0 when not even one CTA a rank fits."""
        return int(self.runner.max_ctas_per_rank(plan, int(self.runner.max_coresident(plan.grad_dtype))))

    def launch(
        self,
        plan,
        epoch: int,
        *,
        ctas_per_rank: int = 4,
        stream: int | None = None,
        force_vector: bool = False,
        op_name: str | None = None,
        reduce_path: str = "hunk",
    ) -> None:
        """Enqueue ``plan`` at ``epoch`` on ``stream`` (default: the device's current stream).
        ``ctas_per_rank``: the CTAs of each rank with at least one task in ``plan``; a rank with
        none gets one (``launch_ctas``); ValueError if the whole grid cannot be co-resident.
        ``force_vector`` moves every byte through the vector path also on sm_90+ (benchmarks);
        ``reduce_path``: ``"hunk"`` (register hunks) or ``"tma"`` (TMA-staged, sm_90+; see
        :mod:`ultracomm.transports.tma`)."""
        if stream is None:
            stream = torch.cuda.current_stream(self.device).cuda_stream
        self.runner.launch(
            plan, int(epoch), int(ctas_per_rank), int(stream), bool(force_vector), reduce_path=str(reduce_path)
        )
        if len(self._names) > 256:
            self._names.clear()
        self._names[int(epoch)] = op_name

    def check_error(self) -> None:
        """Raise the failure a finished launch recorded (``UltracommTimeout`` naming rank,
        operation, expert, chunk and peer, as the host executor words it), if any."""
        rec = self.runner.take_error()
        if rec is not None:
            raise_record(rec, self._names.get(record_epoch(rec)), self.timeout_s)

    def run(
        self,
        plan,
        epoch: int,
        *,
        ctas_per_rank: int = 4,
        force_vector: bool = False,
        op_name: str | None = None,
        reduce_path: str = "hunk",
    ) -> None:
        """Launch on the current stream, wait for it, raise a recorded failure."""
        self.launch(
            plan,
            epoch,
            ctas_per_rank=ctas_per_rank,
            force_vector=force_vector,
            op_name=op_name,
            reduce_path=reduce_path,
        )
        torch.cuda.current_stream(self.device).synchronize()
        self.check_error()


def run(
    op: Op | int,
    schedule,
    epoch: int,
    windows: Sequence[torch.Tensor],
    wlayout: dict,
    *,
    member_off: Sequence[int],
    member_bytes: Sequence[int],
    master_ptrs: Sequence[Sequence[int]],
    local_index_of: Sequence[Sequence[int]],
    my_slots: Sequence[Sequence[int]],
    grad_dtype: Any = 0,
    ctas_per_rank: int = 4,
    timeout_s: float = 10.0,
) -> None:
    """One operation of ``schedule`` (a ``Schedule`` built for all ranks) over one-GPU loopback
    windows, synchronously: plan, launch, wait, raise a recorded failure."""
    world = len(windows)
    lb = CudaLoopback(world, wlayout, windows, timeout_s=timeout_s)
    plan = lb.plan(
        op,
        tasks=[schedule.tasks(op, r) for r in range(world)],
        refs=[schedule.refs(op, r) for r in range(world)],
        member_off=member_off,
        member_bytes=member_bytes,
        master_ptrs=master_ptrs,
        local_index_of=local_index_of,
        my_slots=my_slots,
        grad_dtype=grad_dtype,
        slot_parent=[p.tolist() for p in schedule.tree(op)[0]],
        digest=schedule.digest,
    )
    lb.run(plan, epoch, ctas_per_rank=ctas_per_rank)
