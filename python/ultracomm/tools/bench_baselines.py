"""The host benchmark's baselines and timing (``python -m ultracomm.tools.bench``): torch.distributed
all-to-all and point-to-point over the same bytes, and the timed loop every method runs in."""

from __future__ import annotations

import time
from typing import Callable

import torch
import torch.distributed as dist

__all__ = ["TorchBaselines", "times"]


def times(
    fn: Callable[[], None],
    iters: int,
    warmup: int,
    setup: Callable[[], None] | None = None,
    check: Callable[[], int] | None = None,
) -> tuple[list[float], int]:
    """Slowest rank's time of ``fn()`` per iteration, and the wrong elements summed over every
    iteration (``setup()`` before and ``check()`` after each run, both untimed)."""
    out, wrong = [], 0
    for i in range(warmup + iters):
        if setup is not None:
            setup()
        dist.barrier()
        t0 = time.perf_counter()
        fn()
        dt = torch.tensor([time.perf_counter() - t0], dtype=torch.float64)
        dist.all_reduce(dt, op=dist.ReduceOp.MAX)
        if check is not None:
            wrong += check()
        if i >= warmup:
            out.append(float(dt))
    return out, wrong


# ------------------------------------------------------------------------------ baselines
class TorchBaselines:
    """ECHO-style all-to-all and P2P weight distribution / gradient return over torch.distributed."""

    def __init__(self, plan, rank: int, epr: int, n: int):
        self.plan, self.rank, self.world, self.epr, self.n = plan, rank, plan.world, epr, n
        src = plan.slot_src.tolist()
        home = plan.home_of.tolist()
        local = plan.local_index_of.tolist()
        # rows this rank sends to each destination, in destination slot order
        self.send_rows = [[local[e] for e in src[d] if e >= 0 and home[e] == rank] for d in range(self.world)]
        # (source rank, slot) of each row this rank receives, grouped by source rank in slot order
        self.recv_slots = [[s for s, e in enumerate(src[rank]) if e >= 0 and home[e] == h] for h in range(self.world)]
        self.send_index = torch.tensor([i for rows in self.send_rows for i in rows], dtype=torch.long)
        self.recv_index = torch.tensor([s for ss in self.recv_slots for s in ss], dtype=torch.long)
        self.send_splits = [len(r) * n for r in self.send_rows]
        self.recv_splits = [len(s) * n for s in self.recv_slots]

    def a2a_weights(self, master: torch.Tensor, slots: torch.Tensor) -> None:
        """``master [epr, n]`` (bf16) -> ``slots [S, n]`` through one all_to_all_single (bytes)."""
        send = master.index_select(0, self.send_index).view(torch.uint8).reshape(-1)
        recv = torch.empty(sum(self.recv_splits) * master.element_size(), dtype=torch.uint8)
        es = master.element_size()
        dist.all_to_all_single(recv, send, [x * es for x in self.recv_splits], [x * es for x in self.send_splits])
        if self.recv_index.numel():
            slots.index_copy_(0, self.recv_index, recv.view(master.dtype).view(-1, self.n))

    def a2a_grads(self, slot_grads: torch.Tensor, master_grad: torch.Tensor) -> None:
        """Reverse: replica grads back to their homes, ``index_add_`` into ``master_grad [epr, n]``."""
        send = slot_grads.index_select(0, self.recv_index).reshape(-1)
        recv = torch.empty(sum(self.send_splits), dtype=slot_grads.dtype)
        dist.all_to_all_single(recv, send, self.send_splits, self.recv_splits)
        if self.send_index.numel():
            master_grad.index_add_(0, self.send_index, recv.view(-1, self.n))

    def p2p_weights(self, master: torch.Tensor, slots: torch.Tensor) -> None:
        ops = []
        for d, rows in enumerate(self.send_rows):
            for i in rows:
                if d != self.rank:
                    ops.append(dist.P2POp(dist.isend, master[i].view(torch.uint8), d))
        for h, ss in enumerate(self.recv_slots):
            for s in ss:
                ops.append(dist.P2POp(dist.irecv, slots[s].view(torch.uint8), h))
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()

    def p2p_grads(self, slot_grads: torch.Tensor, master_grad: torch.Tensor, scratch: list[torch.Tensor]) -> None:
        ops, adds = [], []
        for h, ss in enumerate(self.recv_slots):
            for s in ss:
                ops.append(dist.P2POp(dist.isend, slot_grads[s], h))
        k = 0
        for d, rows in enumerate(self.send_rows):
            for i in rows:
                ops.append(dist.P2POp(dist.irecv, scratch[k], d))
                adds.append((i, k))
                k += 1
        if ops:
            for w in dist.batch_isend_irecv(ops):
                w.wait()
        for i, k in adds:  # rank order: deterministic
            master_grad[i].add_(scratch[k])
