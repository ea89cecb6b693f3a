"""lb_prefetch's loopback domain (LBDomain: several experts per rank, several members) and the fill and
#wrong of its slots."""

from __future__ import annotations

from typing import TYPE_CHECKING, Callable

import numpy as np

from .constants import SENTINEL

if TYPE_CHECKING:
    from .gpu import Gpu


def lb_fill(torch, slot: Callable, mapping: np.ndarray, members: int, value: int) -> None:
    """Every slot ``slot(rank, column, member)`` of every rank (filled or empty), every member, to the
    byte ``value``."""
    W, S = mapping.shape
    for r in range(W):
        for c in range(S):
            for m in range(members):
                slot(r, c, m).view(torch.uint8).fill_(value)


def lb_wrong(torch, slot: Callable, masters: list, mapping: np.ndarray, epr: int) -> int:
    """Bytes of the slots ``slot(rank, column, member)`` that differ from the expert ``mapping`` names
    there (``masters[home][member][local]``), or, for an empty slot (-1), from SENTINEL."""
    wrong = 0
    W, S = mapping.shape
    for r in range(W):
        for c in range(S):
            e = int(mapping[r, c])
            for m in range(len(masters[0])):
                got = slot(r, c, m).view(torch.uint8)
                if e < 0:
                    wrong += int((got != SENTINEL).sum())
                else:
                    wrong += int((got != masters[e // epr][m][e % epr].view(torch.uint8)).sum())
    return wrong


class LBDomain:
    """The lb_prefetch shape on a one-GPU loopback domain, as Loopback but with several experts per
    rank and several members: ``masters[r][m]`` (``[experts_per_rank, n]`` of member m's dtype) are
    rank r's home experts; ``windows[r]`` (``_core.window_layout`` of ``slots`` slots of the layout's
    weight bytes) hold its replica slots; the multicast of ``mapping`` (``[world, slots]``) runs the
    schedule ultracomm builds (``build_schedule``, relay off by default) on ``CudaLoopback`` (every
    rank in one persistent launch; ``setup_cuda``) -- the data plane the deepep_lb adapter and a
    Context use.  ``rank_args(r)`` are rank r's arguments of ``CudaLoopback.plan`` and, identically,
    of the host executor's ``_core.run_host`` (how the CPU test checks them)."""

    def __init__(
        self,
        torch,
        dev,
        layout,
        masters: list,
        mapping: np.ndarray,
        experts_per_rank: int,
        *,
        chunk_bytes: int = 1 << 20,
        relay_mode: str = "off",
    ):
        import ultracomm as uc
        from ultracomm import _core
        from ultracomm.records import Op
        from ultracomm.schedule import build_schedule

        self.torch, self.layout, self.masters, self.epr = torch, layout, masters, experts_per_rank
        self.mapping = np.asarray(mapping, np.int32)
        self.world, self.slots = self.mapping.shape
        self.op = Op.MULTICAST
        self.plan = uc.ReplicaPlan.make(self.mapping, experts_per_rank=experts_per_rank)
        self.sched = build_schedule(
            self.plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=chunk_bytes, relay_mode=relay_mode
        )
        self.wl = _core.window_layout(self.slots, layout.weight_bytes, layout.grad_bytes, chunk_bytes)
        self.windows = [torch.zeros(self.wl["total_bytes"], dtype=torch.uint8, device=dev) for _ in range(self.world)]
        self.lb, self.dplan, self.ctas, self.capped, self.epoch = None, None, 0, False, 0

    def rank_args(self, r: int) -> dict:
        """Rank r's per-rank arguments: masters as ``[local expert * M + member]`` addresses."""
        M = len(self.layout.members)
        return dict(
            member_off=list(self.layout.weight_offsets),
            member_bytes=list(self.layout.weight_sizes),
            master_ptrs=[self.masters[r][m][i].data_ptr() for i in range(self.epr) for m in range(M)],
            local_index_of=[int(x) for x in self.plan.local_index_of.tolist()],
            my_slots=[int(x) for x in self.plan.slot_src[r].tolist()],
            tasks=self.sched.tasks(self.op, r),
            refs=self.sched.refs(self.op, r),
            slot_parent=[int(x) for x in self.sched.tree(self.op)[0][r]],
            digest=self.sched.digest,
        )

    def slot(self, r: int, s: int, m: int):
        """Member m of rank r's slot s (a view of its window, in the member's dtype)."""
        off = self.wl["weights_off"] + s * self.wl["weight_stride"] + self.layout.weight_offsets[m]
        return self.windows[r][off : off + self.layout.weight_sizes[m]].view(self.layout.members[m].dtype)

    def copy_pairs(self) -> list:
        """(destination slot, source master row) of every filled slot and member: DeepEP's direct pushes."""
        out = []
        for r in range(self.world):
            for c in range(self.slots):
                e = int(self.mapping[r, c])
                if e >= 0:
                    out += [
                        (self.slot(r, c, m), self.masters[e // self.epr][m][e % self.epr])
                        for m in range(len(self.layout.members))
                    ]
        return out

    def setup_cuda(self, gpu: "Gpu", timeout_s: float = 10.0) -> None:
        """CudaLoopback over the windows and the multicast's plan (validated and uploaded once);
        CTAs per rank with tasks as Loopback (what a Context would use, capped so the whole grid --
        one CTA for each rank without a task -- fits at once)."""
        from ultracomm.cuda.loopback import CudaLoopback
        from ultracomm.cuda.sm_budget import choices_for_device
        from ultracomm.env import Config

        mc, _ = choices_for_device(0, 0, Config().intra_bw, gpu.info["sms"], gpu.info["name"])
        self.lb = CudaLoopback(self.world, self.wl, self.windows, timeout_s=timeout_s)
        a = [self.rank_args(r) for r in range(self.world)]
        self.dplan = self.lb.plan(
            self.op,
            tasks=[x["tasks"] for x in a],
            refs=[x["refs"] for x in a],
            member_off=a[0]["member_off"],
            member_bytes=a[0]["member_bytes"],
            master_ptrs=[x["master_ptrs"] for x in a],
            local_index_of=[x["local_index_of"] for x in a],
            my_slots=[x["my_slots"] for x in a],
            grad_dtype=self.layout.grad_dtype,
            slot_parent=[x["slot_parent"] for x in a],
            digest=a[0]["digest"],
        )
        cap = max(1, self.lb.max_ctas_per_rank(self.dplan))  # the whole grid co-resident
        self.ctas, self.capped = min(mc.sms, cap), mc.sms > cap
        self.idle = sum(1 for x in a if not len(x["tasks"]))

    def cta_note(self) -> str:
        """What the launch runs: "N CTAs/rank", or "N CTAs per rank with tasks, 1 per idle rank"
        (runner.h launch_ctas), and the co-residency cap when it lowered N."""
        note = (
            f"{self.ctas} CTAs per rank with tasks, 1 per idle rank ({self.idle})"
            if self.idle
            else f"{self.ctas} CTAs/rank"
        )
        return note + (" (co-residency cap)" if self.capped else "")

    def run(self) -> None:
        self.epoch += 1
        self.lb.launch(self.dplan, self.epoch, ctas_per_rank=self.ctas, op_name="weight_sync")

    def check(self) -> None:
        if self.lb is not None:
            self.lb.check_error()

    def close(self) -> None:
        self.dplan, self.lb, self.windows = None, None, []
