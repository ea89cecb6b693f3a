"""The ``copy_engine`` transport's multicast as stream commands (the protocol of ``interp.h``
without a kernel), built on the CPU and executed by the driver on CUDA streams.

Per rank and operation, one *main* stream and one stream per destination rank:

1. join (main): write own ``digest[op]``, then ``ready[op] = epoch``;
2. every copy task in list order, per destination ``(d, s)`` on ``d``'s stream: a relay first
   waits for its own ``arrival[slot][chunk] >= epoch``; the first command towards ``d`` waits
   for ``d``'s ``ready[op] >= epoch`` (``d`` started this operation, its slots may be
   overwritten); then one copy per member segment; then ``arrival[s][chunk] = epoch`` on ``d``
   (a fenced stream write: the copies are visible before the flag);
3. drain (main, after every destination stream): wait for each own filled slot's
   ``arrival[s][c] >= epoch``.

A stream runs its commands in order, so relay waits never block a stream on work queued behind
them: task lists are sorted by (chunk, level) and a task only waits for lower (chunk, level).
Plans, digests and schedules are agreed by the Context on the CPU before ``run`` (this
transport is not stream-ordered), so no digest is compared on the device.  Commands carry
absolute addresses; values are ``EPOCH`` (this operation's epoch) or a literal.
:func:`simulate` executes the commands of every rank of a loopback domain over host memory,
which is how the CPU test suite checks them against the host executor.
"""
from __future__ import annotations

import ctypes
import dataclasses
import random
from typing import Sequence

import numpy as np

from ..records import MASTER, Op
from ..reference import member_segments

__all__ = ["Cmd", "EPOCH", "MAIN", "multicast_commands", "simulate"]

EPOCH = -1  # value placeholder: the operation's epoch
MAIN = -1   # stream key of the main stream (others: the destination rank)


@dataclasses.dataclass(frozen=True)
class Cmd:
    """``kind``: ``wait`` (``*addr >= value``), ``write`` (``*addr = value``), ``copy`` (``nbytes``
    from ``src`` to ``addr``) or ``join`` (main waits for every other stream); ``what`` names a
    wait in timeout messages."""

    kind: str
    stream: int
    addr: int = 0
    value: int = EPOCH
    src: int = 0
    nbytes: int = 0
    what: str = ""


def _slot_addr(wl: dict, base: int, slot: int) -> int:
    return base + wl["weights_off"] + wl["weight_stride"] * slot


def _flag(wl: dict, base: int, kind: str, slot: int = 0, chunk: int = 0, op: Op = Op.MULTICAST) -> int:
    if kind == "ready":
        return base + wl["ready_off"] + 8 * int(op)
    if kind == "digest":
        return base + wl["digest_off"] + 8 * int(op)
    return base + wl["arrival_off"] + 8 * (slot * wl["weight_chunks"] + chunk)


def multicast_commands(rank: int, wl: dict, bases: Sequence[int], tasks: np.ndarray, refs: np.ndarray,
                       member_off: Sequence[int], member_bytes: Sequence[int], master_ptrs: Sequence[int],
                       local_index_of: Sequence[int], my_slots: Sequence[int], digest: int) -> list[Cmd]:
    """Rank ``rank``'s commands for one multicast (``master_ptrs[i * M + m]``: member ``m`` of
    local expert ``i``; ``bases``: every rank's window as addressed here)."""
    me = bases[rank]
    nm = len(member_off)
    cmds = [Cmd("write", MAIN, _flag(wl, me, "digest"), digest, what="digest"),
            Cmd("write", MAIN, _flag(wl, me, "ready"), what="ready")]
    joined: set[int] = set()
    relay_waited: set[tuple[int, int, int]] = set()
    for t in tasks:
        c, e, self_slot = int(t["chunk"]), int(t["expert"]), int(t["self_slot"])
        off, nb = int(t["offset"]), int(t["bytes"])
        for ref in refs[int(t["ref_begin"]):int(t["ref_begin"]) + int(t["ref_count"])]:
            d, s = int(ref["rank"]), int(ref["slot"])
            if self_slot != MASTER and (d, self_slot, c) not in relay_waited:
                relay_waited.add((d, self_slot, c))
                cmds.append(Cmd("wait", d, _flag(wl, me, "arrival", self_slot, c),
                                what=f"expert {e} chunk {c} to arrive in its relay slot {self_slot}"))
            if d not in joined:
                joined.add(d)
                cmds.append(Cmd("wait", d, _flag(wl, bases[d], "ready"),
                                what=f"rank {d} to start the operation (ready flag; expert {e} chunk {c} slot {s})"))
            for m, lo, hi in member_segments(off, nb, member_off, member_bytes):
                if self_slot == MASTER:
                    src = master_ptrs[local_index_of[e] * nm + m] + lo - member_off[m]
                else:
                    src = _slot_addr(wl, me, self_slot) + lo
                cmds.append(Cmd("copy", d, _slot_addr(wl, bases[d], s) + lo, src=src, nbytes=hi - lo))
            cmds.append(Cmd("write", d, _flag(wl, bases[d], "arrival", s, c), what=f"arrival expert {e} chunk {c}"))
    cmds.append(Cmd("join", MAIN))
    for s, e in enumerate(my_slots):
        if e >= 0:
            for c in range(wl["weight_chunks"]):
                cmds.append(Cmd("wait", MAIN, _flag(wl, me, "arrival", s, c),
                                what=f"expert {e} chunk {c} to arrive in slot {s}"))
    return cmds


def simulate(programs: Sequence[Sequence[Cmd]], epoch: int, seed: int = 0, max_rounds: int = 10**6) -> None:
    """Run every rank's commands over host memory with per-stream FIFO order, picking a ready
    stream at random each step (``seed``).  Raises ``RuntimeError`` naming the stuck waits if no
    stream can make progress (a deadlock in the command order)."""
    rng = random.Random(seed)
    queues = {}
    for r, cmds in enumerate(programs):
        for cmd in cmds:
            queues.setdefault((r, cmd.stream), []).append(cmd)
    pos = {k: 0 for k in queues}

    def ready(key) -> bool:
        cmd = queues[key][pos[key]]
        if cmd.kind == "wait":
            return ctypes.c_uint64.from_address(cmd.addr).value >= (epoch if cmd.value == EPOCH else cmd.value)
        if cmd.kind == "join":
            r = key[0]
            return all(pos[k] == len(queues[k]) for k in queues if k[0] == r and k[1] != MAIN)
        return True

    for _ in range(max_rounds):
        live = [k for k in queues if pos[k] < len(queues[k])]
        if not live:
            return
        runnable = [k for k in live if ready(k)]
        if not runnable:
            stuck = [f"rank {k[0]} stream {k[1]}: {queues[k][pos[k]].kind} {queues[k][pos[k]].what}" for k in live]
            raise RuntimeError("copy_engine commands deadlock: " + "; ".join(stuck))
        key = rng.choice(runnable)
        cmd = queues[key][pos[key]]
        if cmd.kind == "copy":
            ctypes.memmove(cmd.addr, cmd.src, cmd.nbytes)
        elif cmd.kind == "write":
            ctypes.c_uint64.from_address(cmd.addr).value = epoch if cmd.value == EPOCH else cmd.value
        pos[key] += 1
    raise RuntimeError("copy_engine simulation did not finish")
