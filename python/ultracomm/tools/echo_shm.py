"""Megatron MoE ECHO's all-to-all pattern executed over host shared memory: the CPU bench's
like-for-like baseline for ultracomm's host executor.

ECHO distributes replica weights with one ``all_to_all_single``: each home ``index_select``s
one row per replica it must send into a contiguous send buffer, the collective exchanges the
buffers, every rank ends up with its replicas' rows.  Here the same three steps run over the
same kind of POSIX shared-memory window ultracomm's host transport uses, so a measured ratio
between the two isolates the algorithm (staging copy + bulk-synchronous exchange vs chunked
direct / relay copies), not the transport:

1. **stage**: ``index_select`` this rank's outgoing rows (grouped by destination rank, in slot
   order) into its own window;
2. **barrier** (a counter per rank in its window, spun on by the others);
3. **exchange**: every rank copies the rows addressed to it straight out of each home's
   window into its replica slots (``index_copy_``);
4. **barrier**: the staging areas may be reused, the operation is complete everywhere.

The gradient reverse stages the replicas' grads (grouped by home), barriers, and each home
``index_add_``s the rows from every peer's window into its master grads in rank order
(deterministic), then barriers.

The barrier's flag is written after the staged rows with plain stores; x86-64's store order
(TSO) makes the rows visible before the flag.  Other CPUs would need fences: :class:`EchoShm`
refuses to run there rather than race.
"""

from __future__ import annotations

import ctypes
import os
import platform
import time

import torch

from ..comm import Comm
from ..errors import UltracommError, UltracommTimeout

_FLAG_BYTES = 64  # one cache line for this rank's barrier counter


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


class EchoShm:
    """ECHO's staged all-to-all and its reverse over a host_shm window (one per rank).

    Args:
        plan: the ReplicaPlan (identical on every rank).
        comm: the group (``ultracomm.comm.as_comm(None)`` for the default process group).
        n: elements per expert row (weights and grads alike).
        weight_dtype, grad_dtype: dtypes of the rows moved by :meth:`weights` / :meth:`grads`.
        timeout_s: how long a barrier may wait for a peer before raising ``TimeoutError``.
    """

    def __init__(
        self, plan, comm: Comm, n: int, weight_dtype: torch.dtype, grad_dtype: torch.dtype, timeout_s: float = 100.0
    ):
        if platform.machine().lower() not in ("x86_64", "amd64"):
            raise UltracommError(f"EchoShm relies on x86-64 store ordering; this CPU is {platform.machine()}")
        from ..windows.host_shm import HostShmWindow

        self.rank, self.world, self.n = comm.rank, comm.world, int(n)
        self.wdtype, self.gdtype, self.timeout_s = weight_dtype, grad_dtype, float(timeout_s)
        src = plan.slot_src.tolist()
        home = plan.home_of.tolist()
        local = plan.local_index_of.tolist()
        W = self.world
        # rows[h][d]: local rows home h sends to rank d, in d's slot order; slots[d][h]: d's slots they fill
        rows = [[[local[e] for e in src[d] if e >= 0 and home[e] == h] for d in range(W)] for h in range(W)]
        slots = [[[s for s, e in enumerate(src[d]) if e >= 0 and home[e] == h] for h in range(W)] for d in range(W)]
        r = self.rank
        self.send_index = torch.tensor([i for d in range(W) for i in rows[r][d]], dtype=torch.long)
        # where my rows sit in home h's staging area: after the rows h sends to ranks < me
        self.recv = [
            (h, sum(len(x) for x in rows[h][:r]), torch.tensor(slots[r][h], dtype=torch.long))
            for h in range(W)
            if slots[r][h]
        ]
        # reverse: I stage my replicas' grads grouped by home; home h reads my block for it
        self.grad_index = torch.tensor([s for h in range(W) for s in slots[r][h]], dtype=torch.long)
        self.grad_from = [
            (d, sum(len(x) for x in slots[d][:r]), torch.tensor(rows[r][d], dtype=torch.long))
            for d in range(W)
            if rows[r][d]
        ]
        most = max(
            max(
                sum(len(x) for x in rows[h]) * _itemsize(weight_dtype),
                sum(len(x) for x in slots[h]) * _itemsize(grad_dtype),
            )
            for h in range(W)
        )
        self.window = HostShmWindow.create(comm, _FLAG_BYTES + max(most * self.n, 16))
        self._views = [self._peer_bytes(p) for p in range(W)]
        self._epoch = 0
        self._flags = [v[:8].view(torch.int64) for v in self._views]
        self._flags[r].zero_()
        comm.barrier()

    def _peer_bytes(self, p: int) -> torch.Tensor:
        """``uint8`` tensor over rank ``p``'s window (its mapping in this process)."""
        if p == self.rank:
            return self.window.local
        buf = (ctypes.c_uint8 * self.window.nbytes).from_address(self.window.peer_bases[p])
        return torch.frombuffer(buf, dtype=torch.uint8)

    def _stage(self, p: int, dtype: torch.dtype) -> torch.Tensor:
        """Rank ``p``'s staging area as ``[rows, n]`` of ``dtype``."""
        body = self._views[p][_FLAG_BYTES:]
        rows = body.numel() // (_itemsize(dtype) * self.n)
        return body[: rows * _itemsize(dtype) * self.n].view(dtype).view(rows, self.n)

    def barrier(self, what: str) -> None:
        """Raise my counter, wait until every peer's reaches it (``TimeoutError`` naming the
        rank, the step and the peers still missing after ``timeout_s``)."""
        self._epoch += 1
        e = self._epoch
        self._flags[self.rank].fill_(e)
        deadline = time.monotonic() + self.timeout_s
        waiting = [p for p in range(self.world) if p != self.rank]
        yields, sleep_s = 0, 2e-6
        while waiting:
            waiting = [p for p in waiting if int(self._flags[p]) < e]
            if not waiting:
                break
            if time.monotonic() > deadline:
                raise UltracommTimeout(
                    f"ultracomm EchoShm rank {self.rank}: {what} barrier {e} still waits for "
                    f"ranks {waiting} after {self.timeout_s:g} s"
                )
            # the host executor's flag-wait policy: 32 yields, then sleeps doubling from 2 us to 200 us
            if yields < 32:
                yields += 1
                os.sched_yield()
            else:
                time.sleep(sleep_s)
                sleep_s = min(sleep_s * 2, 200e-6)

    def _run(self, what: str, src: torch.Tensor, index: torch.Tensor, dtype: torch.dtype, pulls, apply) -> None:
        """Stage ``src[index]`` into my window, barrier, ``apply(idx, rows)`` for each ``(peer,
        offset, idx)`` of ``pulls`` with the peer's staged rows, barrier."""
        k = index.numel()
        if k:
            torch.index_select(src, 0, index, out=self._stage(self.rank, dtype)[:k])
        self.barrier(f"{what} stage")
        for p, off, idx in pulls:
            apply(idx, self._stage(p, dtype)[off : off + idx.numel()])
        self.barrier(f"{what} exchange")

    def weights(self, master: torch.Tensor, slots: torch.Tensor) -> None:
        """``master [epr, n]`` (home rows) -> ``slots [S, n]`` (this rank's replicas)."""
        self._run(
            "weights",
            master,
            self.send_index,
            self.wdtype,
            self.recv,
            lambda idx, rows: slots.index_copy_(0, idx, rows),
        )

    def grads(self, slot_grads: torch.Tensor, master_grad: torch.Tensor) -> None:
        """Replica grads ``slot_grads [S, n]`` -> added into ``master_grad [epr, n]`` at their
        homes, peers in rank order."""
        self._run(
            "grads",
            slot_grads,
            self.grad_index,
            self.gdtype,
            self.grad_from,
            lambda idx, rows: master_grad.index_add_(0, idx, rows),
        )

    def close(self) -> None:
        self._views, self._flags = [], []
        self.window.close()
