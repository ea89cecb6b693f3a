"""The ``copy_engine`` transport's multicast as stream commands (the protocol of ``interp.h``
without a kernel), built on the CPU and executed by the driver on CUDA streams.

Per rank and operation: the caller's stream (``MAIN``), one internal stream per destination
rank and one ``DRAIN`` stream.  In submission order (the list :func:`multicast_commands`
returns):

1. MAIN: ``digest[op] = D`` (this op's digest, first), ``ready[op] = epoch`` (release: a peer
   that sees the epoch sees the digest), ``started = epoch`` (a host word: the watchdog's clock
   starts), then ``fork`` (an event recorded on the caller's stream);
2. per destination ``d``, on ``d``'s stream, which first waits for the fork (``forked``), every
   copy task in list order: a relay first waits for its own ``arrival[slot][chunk] >= epoch``;
   the first command towards ``d`` waits for ``d``'s ``ready[op] >= epoch`` and then for ``d``'s
   ``digest[op] == D`` (an *equality* wait: a destination on another plan, or one that
   rejected its plan, never satisfies it, so nothing is ever copied into it); then one copy per
   member segment; then ``arrival[s][chunk] = epoch`` on ``d`` (a fenced stream write: the copies
   are visible before the flag); last ``done[d] = epoch`` (a host word);
3. DRAIN (forked too): wait for each own filled slot's ``arrival[s][c] >= epoch``, then
   ``done[DRAIN] = epoch``;
4. MAIN joins: wait for every ``done[k] >= epoch``.  These host words, and the ``abort`` word,
   are the ones the watchdog (:mod:`.watchdog`) writes to release a stuck operation.

No wait whose only releaser is a peer (issue 35): on the device the internal streams do not run
these waits as ``cuStreamWaitValue64`` (which only the peer's write could release).
:func:`gate_commands` folds each internal stream's run of waits and the copies and flag writes
they guard into one ``gate`` command, run as the gate kernel (``csrc/cuda/ce_gate.cuh``, one CTA):
it spins on the waits or on this rank's ``abort`` word (a host word the watchdog sets on a
failure), and does its copies and writes only when the waits passed and no abort was seen, so a
released gate moves nothing into a peer and the stream drains at once.  Joins and ``done``
writes stay stream memory operations on host words: the watchdog releases the joins itself.

Why the equality wait is sound: a rank publishes its digest before its ready flag (fenced
writes in one stream), and cannot leave an epoch before every sender's arrival write, which
follows the sender's equality wait; so a sender that saw ``ready >= epoch`` reads the digest of
that epoch.  If the destination is on another plan it may leave the epoch (it expects nothing
from us); a later epoch of it with our very plan would then satisfy the wait and receive our
bytes of that plan, but it cannot finish that epoch without our arrival flag at its epoch,
which we never write: it fails too.  Nothing is silently corrupted.

Why the order cannot deadlock: task lists are sorted by (chunk, level) and a task only waits
for lower (chunk, level); ready flags are all written before any fork.  Commands are submitted
in that order (loopback: :func:`submission_order` merges every rank's), drains and joins last,
so even streams that share a hardware queue never hold work that a queued wait depends on.

Commands carry absolute addresses; values are ``EPOCH`` (this operation's epoch) or a literal.
:func:`simulate` executes every rank's commands of a loopback domain over host memory.
"""

from __future__ import annotations

import ctypes
import dataclasses
import random
from typing import Callable, Optional, Sequence

import numpy as np

from ...records import MASTER, Op
from ..segments import member_segments
from ...errors import UltracommError

__all__ = [
    "Cmd",
    "EPOCH",
    "MAIN",
    "DRAIN",
    "host_words",
    "word_addr",
    "abort_addr",
    "multicast_commands",
    "gate_commands",
    "submission_order",
    "simulate",
    "geq",
]

EPOCH = -1  # value placeholder: the operation's epoch
MAIN = -1  # stream key of the caller's stream (others: the destination rank, or DRAIN)
DRAIN = -2  # stream key of the stream that waits for this rank's own arrivals

# FlagKind (include/ultracomm/records/error_record.h) of a wait, for the watchdog's error records
FLAG_NONE, FLAG_READY, FLAG_ARRIVAL = 0, 1, 2


def host_words(world: int) -> int:
    """uint64 host words per rank: ``started``, ``done[DRAIN]``, ``done[0..world-1]``, ``abort``."""
    return 3 + world


def abort_addr(base: int, world: int) -> int:
    """Address of the ``abort`` word (non-zero: every gate of this rank releases and skips)."""
    return base + 8 * (2 + world)


def word_addr(base: int, key: Optional[int]) -> int:
    """Address of ``started`` (``key=None``) or of ``done[key]`` in the host words at ``base``."""
    if key is None:
        return base
    return base + 8 * (1 if key == DRAIN else 2 + key)


@dataclasses.dataclass(frozen=True)
class Cmd:
    """``kind``: ``wait`` (``*addr >= value``), ``wait_eq`` (``*addr == value``), ``write``
    (``*addr = value``), ``copy`` (``nbytes`` from ``src`` to ``addr``), ``fork`` (record the fork
    event on MAIN) or ``forked`` (this stream waits for the fork event).  ``phase`` and ``order``
    place it in a loopback domain's merged submission (``(chunk, level)`` of its task); the
    other fields describe a wait for error records (``peer``: the rank expected to raise it)."""

    kind: str
    stream: int
    addr: int = 0
    value: int = EPOCH
    src: int = 0
    nbytes: int = 0
    what: str = ""
    phase: int = 1
    order: tuple = ()
    flag: int = FLAG_NONE
    task: int = -1
    expert: int = -1
    chunk: int = -1
    slot: int = -1
    peer: int = -1
    parts: tuple = ()  # a ``gate``: its waits, then the copies and writes they guard


def slot_addr(wl: dict, base: int, slot: int) -> int:
    return base + wl["weights_off"] + wl["weight_stride"] * slot


def flag_addr(wl: dict, base: int, kind: str, slot: int = 0, chunk: int = 0, op: Op = Op.MULTICAST) -> int:
    if kind == "ready":
        return base + wl["ready_off"] + 8 * int(op)
    if kind == "digest":
        return base + wl["digest_off"] + 8 * int(op)
    return base + wl["arrival_off"] + 8 * (slot * wl["weight_chunks"] + chunk)


def multicast_commands(
    rank: int,
    wl: dict,
    bases: Sequence[int],
    tasks: np.ndarray,
    refs: np.ndarray,
    member_off: Sequence[int],
    member_bytes: Sequence[int],
    master_ptrs: Sequence[int],
    local_index_of: Sequence[int],
    my_slots: Sequence[int],
    digest: int,
    words: int,
    slot_parent: Optional[Sequence[int]] = None,
) -> list[Cmd]:
    """Rank ``rank``'s commands for one multicast, in submission order (``master_ptrs[i * M + m]``:
    member ``m`` of local expert ``i``; ``bases``: every rank's window as addressed here;
    ``words``: this rank's host words (:func:`host_words`); ``slot_parent[s]``: the rank that
    fills own slot ``s``, named in errors)."""
    me = bases[rank]
    nm = len(member_off)
    parent = list(slot_parent) if slot_parent is not None else [-1] * len(my_slots)
    cmds = [
        Cmd("write", MAIN, flag_addr(wl, me, "digest"), digest, what="digest", phase=0),
        Cmd("write", MAIN, flag_addr(wl, me, "ready"), what="ready", phase=0),
        Cmd("write", MAIN, word_addr(words, None), what="started", phase=0),
        Cmd("fork", MAIN, phase=0),
    ]
    streams: list[int] = []
    relay_waited: set[tuple[int, int, int]] = set()
    for ti, t in enumerate(tasks):
        c, e, self_slot = int(t["chunk"]), int(t["expert"]), int(t["self_slot"])
        off, nb, order = int(t["offset"]), int(t["bytes"]), (c, int(t["level"]))
        at = dict(order=order, task=ti, expert=e, chunk=c)
        for ref in refs[int(t["ref_begin"]) : int(t["ref_begin"]) + int(t["ref_count"])]:
            d, s = int(ref["rank"]), int(ref["slot"])
            if d not in streams:
                streams.append(d)
                cmds.append(Cmd("forked", d, **at))
                cmds.append(
                    Cmd(
                        "wait",
                        d,
                        flag_addr(wl, bases[d], "ready"),
                        flag=FLAG_READY,
                        slot=s,
                        peer=d,
                        what=f"rank {d} to start the operation (ready flag; expert {e} chunk {c} slot {s})",
                        **at,
                    )
                )
                cmds.append(
                    Cmd(
                        "wait_eq",
                        d,
                        flag_addr(wl, bases[d], "digest"),
                        digest,
                        flag=FLAG_READY,
                        slot=s,
                        peer=d,
                        what=f"rank {d} to run this plan (digest; expert {e} chunk {c} slot {s})",
                        **at,
                    )
                )
            if self_slot != MASTER and (d, self_slot, c) not in relay_waited:
                relay_waited.add((d, self_slot, c))
                cmds.append(
                    Cmd(
                        "wait",
                        d,
                        flag_addr(wl, me, "arrival", self_slot, c),
                        flag=FLAG_ARRIVAL,
                        slot=self_slot,
                        peer=parent[self_slot],
                        what=f"expert {e} chunk {c} to arrive in its relay slot {self_slot}",
                        **at,
                    )
                )
            for m, lo, hi in member_segments(off, nb, member_off, member_bytes):
                if self_slot == MASTER:
                    src = master_ptrs[local_index_of[e] * nm + m] + lo - member_off[m]
                else:
                    src = slot_addr(wl, me, self_slot) + lo
                cmds.append(Cmd("copy", d, slot_addr(wl, bases[d], s) + lo, src=src, nbytes=hi - lo, **at))
            cmds.append(
                Cmd("write", d, flag_addr(wl, bases[d], "arrival", s, c), what=f"arrival expert {e} chunk {c}", **at)
            )
    for d in streams:
        cmds.append(Cmd("write", d, word_addr(words, d), what=f"done[{d}]", phase=2))
    filled = [(s, e) for s, e in enumerate(my_slots) if e >= 0]
    if filled:
        streams.append(DRAIN)
        cmds.append(Cmd("forked", DRAIN, phase=2))
        for s, e in filled:
            for c in range(wl["weight_chunks"]):
                cmds.append(
                    Cmd(
                        "wait",
                        DRAIN,
                        flag_addr(wl, me, "arrival", s, c),
                        flag=FLAG_ARRIVAL,
                        expert=e,
                        chunk=c,
                        slot=s,
                        peer=parent[s],
                        phase=2,
                        what=f"expert {e} chunk {c} to arrive in slot {s}",
                    )
                )
        cmds.append(Cmd("write", DRAIN, word_addr(words, DRAIN), what="done[drain]", phase=2))
    cmds += [Cmd("wait", MAIN, word_addr(words, k), what=f"join: stream {k} done", phase=3) for k in streams]
    return cmds


def gate_commands(cmds: Sequence[Cmd], words: int, nwords: int) -> list[Cmd]:
    """``cmds`` with each internal stream's run of waits and the copies and writes after them
    (up to its next wait) folded into one ``gate`` command (``parts``), placed where its first
    part was.  MAIN, ``fork``/``forked`` and writes of the host words (``words``, ``nwords``
    words: ``done``) stay as they are.  See the module docstring."""
    out: list = []
    open_at: dict[int, int] = {}  # stream -> index in out of its open gate
    parts: dict[int, list] = {}

    def flush(stream: int) -> None:
        i = open_at.pop(stream, None)
        if i is not None:
            ps = parts.pop(stream)
            out[i] = dataclasses.replace(
                ps[0],
                kind="gate",
                addr=0,
                value=EPOCH,
                src=0,
                nbytes=0,
                what=f"gate: {ps[0].what or ps[0].kind}",
                parts=tuple(ps),
            )

    for c in cmds:
        host = c.kind == "write" and words <= c.addr < words + 8 * nwords
        if c.stream == MAIN or c.kind in ("fork", "forked", "gate") or host:
            flush(c.stream)
            out.append(c)
            continue
        if c.kind in ("wait", "wait_eq") and any(p.kind not in ("wait", "wait_eq") for p in parts.get(c.stream, ())):
            flush(c.stream)
        if c.stream not in open_at:
            open_at[c.stream] = len(out)
            parts[c.stream] = []
            out.append(None)
        parts[c.stream].append(c)
    for stream in list(open_at):
        flush(stream)
    return out


def gate_passes(cmd: Cmd, epoch: int) -> bool:
    """Whether every wait of gate ``cmd`` holds (host memory)."""
    for p in cmd.parts:
        want = epoch if p.value == EPOCH else p.value
        v = _u64(p.addr).value
        if (p.kind == "wait" and not geq(v, want)) or (p.kind == "wait_eq" and v != want):
            return False
    return True


def submission_order(programs: Sequence[Sequence[Cmd]]) -> list[tuple[int, Cmd]]:
    """Every rank's commands as ``(rank, cmd)`` in one submission order for a one-process
    loopback domain: all prefixes, then every rank's copy tasks merged by (chunk, level), then
    drains, then joins.  Each rank's own order is kept (it must already be sorted so)."""
    items = []
    for r, cmds in enumerate(programs):
        keys = [(c.phase, c.order) for c in cmds]
        if any(a > b for a, b in zip(keys, keys[1:])):
            raise UltracommError(f"ultracomm: rank {r}'s copy_engine commands are not in (chunk, level) order")
        items += [((k, r, i), r, c) for i, (k, c) in enumerate(zip(keys, cmds))]
    items.sort(key=lambda x: x[0])
    return [(r, c) for _, r, c in items]


def geq(value: int, want: int) -> bool:
    """``cuStreamWaitValue64``'s GEQ test: ``(int64_t)(value - want) >= 0`` (cyclic)."""
    return ((value - want) & 0xFFFFFFFFFFFFFFFF) < (1 << 63)


def _u64(addr: int) -> ctypes.c_uint64:
    return ctypes.c_uint64.from_address(addr)


def simulate(
    programs: Sequence[Sequence[Cmd]],
    epoch: int,
    seed: int = 0,
    on_stall: Optional[Callable[[list], bool]] = None,
    max_rounds: int = 10**6,
    aborts: Optional[Sequence[int]] = None,
    skipped: Optional[list] = None,
) -> list:
    """Run every rank's commands over host memory with per-stream FIFO order, picking a ready
    stream at random each step (``seed``).  When no stream can move: without ``on_stall``,
    ``RuntimeError`` naming the stuck waits (a deadlock in the command order); with it,
    ``on_stall([(rank, stream, cmd), ...])`` may change memory (a watchdog) and returns whether
    to look again (``False``: stop).  Returns the ``(rank, stream, cmd)`` left blocked (``[]``:
    every stream finished).  ``gate`` commands run as the gate kernel does: ready once their
    waits hold or rank ``r``'s abort word (``aborts[r]``, an address) is non-zero; with the
    abort word set they skip their copies and writes (appended to ``skipped`` as ``(rank, cmd)``)."""
    rng = random.Random(seed)
    queues: dict[tuple[int, int], list[Cmd]] = {}
    for r, cmds in enumerate(programs):
        for cmd in cmds:
            queues.setdefault((r, cmd.stream), []).append(cmd)
    pos = {k: 0 for k in queues}
    forked: set[int] = set()

    def value(cmd: Cmd) -> int:
        return epoch if cmd.value == EPOCH else cmd.value

    def ready(key) -> bool:
        cmd = queues[key][pos[key]]
        if cmd.kind == "wait":
            return geq(_u64(cmd.addr).value, value(cmd))
        if cmd.kind == "wait_eq":
            return _u64(cmd.addr).value == value(cmd)
        if cmd.kind == "forked":
            return key[0] in forked
        if cmd.kind == "gate":
            return aborted(key[0]) or gate_passes(cmd, epoch)
        return True

    def aborted(rank: int) -> bool:
        return bool(aborts is not None and aborts[rank] and _u64(aborts[rank]).value)

    for _ in range(max_rounds):
        live = [k for k in queues if pos[k] < len(queues[k])]
        if not live:
            return []
        runnable = [k for k in live if ready(k)]
        if not runnable:
            stuck = [(k[0], k[1], queues[k][pos[k]]) for k in live]
            if on_stall is None:
                raise UltracommError(
                    "copy_engine commands deadlock: "
                    + "; ".join(f"rank {r} stream {s}: {c.kind} {c.what}" for r, s, c in stuck)
                )
            if on_stall(stuck):
                continue
            return stuck
        key = rng.choice(runnable)
        cmd = queues[key][pos[key]]
        if cmd.kind == "copy":
            ctypes.memmove(cmd.addr, cmd.src, cmd.nbytes)
        elif cmd.kind == "write":
            _u64(cmd.addr).value = value(cmd)
        elif cmd.kind == "fork":
            forked.add(key[0])
        elif cmd.kind == "gate":
            if aborted(key[0]):
                if skipped is not None:
                    skipped.append((key[0], cmd))
            else:
                for p in cmd.parts:
                    if p.kind == "copy":
                        ctypes.memmove(p.addr, p.src, p.nbytes)
                    elif p.kind == "write":
                        _u64(p.addr).value = value(p)
        pos[key] += 1
    raise UltracommError("copy_engine simulation did not finish")
