"""The message program of the ``p2p`` transport: a schedule's tree edges as point-to-point
messages, grouped in *waves* that every rank derives alike.

One message carries one member segment of one chunk over one tree edge (the bytes the host
executor's ``copy``/``reduce`` of that segment would touch; member padding never moves).

Waves.  Chunk ``c`` crosses edge ``parent -> x`` of the multicast tree in wave
``c + depth(x) - 1``: a relay at depth ``d`` receives chunk ``c`` in wave ``c + d - 1`` and
forwards it in wave ``c + d``, so relaying costs one wave per level, not one expert.  In the
reduce tree, node ``x`` sends its chunk ``c`` (a leaf's gradient, a relay's partial) to its
parent in wave ``c + height(x)``, and the reduce task of node ``z`` for chunk ``c`` runs at
the start of wave ``c + height(z)``, after its children's chunk ``c`` arrived in earlier waves.
Every dependency points to an earlier wave, and every rank posts its waves in increasing
order with each pair's messages in one order (wave, slot, chunk, offset), so NCCL (which
matches a pair's messages in posting order) and gloo (tag = the message's index in that
order) pair the same messages, and no wait can form a cycle.

The sender's side comes from its own task list (``Schedule.tasks``); the receiver's side from
the global tree (``Schedule.tree``), because a rank's schedule holds only its own task lists.
:func:`build_program` checks that its tasks agree with the tree, so a mismatch is a clear
error here, not a hang.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Sequence

import numpy as np

from ...host_memory import page_aligned_empty
from ...records import MASTER, Op
from ..segments import member_segments
from ...errors import InputError

__all__ = ["Message", "Program", "build_program", "multicast_depths", "reduce_heights", "cached_program"]


@dataclasses.dataclass(frozen=True)
class Message:
    """One member segment of one chunk over one tree edge.

    ``slot``: the receiver's slot (multicast) or the sender's slot (reduce); ``lo``/``hi``:
    the byte range in slot layout; ``tag``: index of the message in its (src, dst) pair's
    order (filled by :func:`build_program`)."""

    wave: int
    src: int
    dst: int
    slot: int
    chunk: int
    member: int
    lo: int
    hi: int
    expert: int
    tag: int = -1

    def order(self) -> tuple:
        return (self.wave, self.slot, self.chunk, self.lo)


@dataclasses.dataclass(frozen=True)
class SendItem:
    """Send ``msg`` from ``self`` (``slot == MASTER``: the master copy of ``msg.expert``)."""

    msg: Message
    self_slot: int


@dataclasses.dataclass(frozen=True)
class ReduceItem:
    """Reduce task ``task`` (list index) for one segment: ``self = self + sources`` in order."""

    task: int
    expert: int
    chunk: int
    member: int
    lo: int
    hi: int
    self_slot: int  # MASTER or the relay's own slot
    sources: tuple[Message, ...]  # the received messages, in summation order


@dataclasses.dataclass
class Wave:
    reduces: list[ReduceItem] = dataclasses.field(default_factory=list)
    sends: list[SendItem] = dataclasses.field(default_factory=list)
    recvs: list[Message] = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class Program:
    """One rank's messages of one operation, by wave (``waves[w]``: reduce first, then post the
    wave's sends and receives as one batch)."""

    op: Op
    rank: int
    waves: list[Wave]
    #: multicast: the receive messages a relay's send of (slot, chunk) waits for
    forward_deps: dict[tuple[int, int], list[Message]]
    #: reduce: a receive buffer per message, made on first use and kept with the program
    buffers: dict[Message, Any] = dataclasses.field(default_factory=dict)
    #: the program bound to buffers (:mod:`.bound`), per (master addresses, local index map)
    bindings: dict[tuple, Any] = dataclasses.field(default_factory=dict)

    def buffer(self, msg: Message, device: Any) -> Any:
        """The receive buffer of ``msg`` (uint8, ``msg.hi - msg.lo`` bytes, page-aligned on the
        CPU: :mod:`ultracomm.host_memory`), reused by every operation that runs this program
        (one operation at a time per transport)."""
        buf = self.buffers.get(msg)
        if buf is None:
            buf = self.buffers[msg] = page_aligned_empty(msg.hi - msg.lo, device)
        return buf

    @property
    def num_messages(self) -> int:
        return sum(len(w.sends) + len(w.recvs) for w in self.waves)

    @property
    def bytes_sent(self) -> int:
        """Bytes of this rank's outgoing messages."""
        return sum(x.msg.hi - x.msg.lo for w in self.waves for x in w.sends)


def cached_program(
    cache: dict, schedule, op: Op, world: int, build: Callable[[np.ndarray, np.ndarray], Any], limit: int = 128
) -> Any:
    """``cache``'s entry for (``schedule``, ``op``), made by ``build(slot_src [world, slots], home_of [E])``
    (the plan's arrays, int64) when missing; the cache is emptied when it reaches ``limit`` entries."""
    key = (schedule.digest, int(op))
    prog = cache.get(key)
    if prog is None:
        if len(cache) >= limit:
            cache.clear()
        inp = schedule.inputs()
        prog = cache[key] = build(
            np.asarray(inp["slot_src"], dtype=np.int64).reshape(world, -1), np.asarray(inp["home_of"], dtype=np.int64)
        )
    return prog


def _chunk_range(chunk: int, chunk_bytes: int, slot_bytes: int) -> tuple[int, int]:
    off = chunk * chunk_bytes
    return off, min(chunk_bytes, slot_bytes - off)


def multicast_depths(schedule) -> np.ndarray:
    """``int [world, slots]``: depth of each replica in the multicast tree (1 = fed by the
    master), 0 for empty slots."""
    return np.asarray(schedule.tree(Op.MULTICAST)[2])


def reduce_heights(schedule, slot_src: np.ndarray, home_of: np.ndarray) -> tuple[np.ndarray, dict[int, int]]:
    """Heights in the reduce tree: ``int [world, slots]`` (0 = leaf) and ``{expert: height of
    its master}`` for experts with replicas.  A node's height is 1 + its highest child's."""
    pr, ps, depth = (np.asarray(a) for a in schedule.tree(Op.REDUCE))
    world, slots = pr.shape
    height = np.zeros((world, slots), dtype=np.int64)
    master: dict[int, int] = {}
    nodes = [(int(depth[r, s]), r, s) for r in range(world) for s in range(slots) if int(slot_src[r, s]) >= 0]
    for _, r, s in sorted(nodes, reverse=True):  # deepest first: children are final before parents
        h = int(height[r, s]) + 1
        p, q = int(pr[r, s]), int(ps[r, s])
        if q == MASTER:
            e = int(slot_src[r, s])
            master[e] = max(master.get(e, 0), h)
        else:
            height[p, q] = max(int(height[p, q]), h)
    return height, master


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise InputError(
            f"ultracomm p2p: the schedule's tasks and trees disagree: {what}; rebuild the schedule "
            "with this build of ultracomm"
        )


def build_program(
    op: Op,
    schedule,
    rank: int,
    tasks: np.ndarray,
    refs: np.ndarray,
    slot_src: np.ndarray,
    home_of: np.ndarray,
    chunk_bytes: int,
    slot_bytes: int,
    member_off: Sequence[int],
    member_bytes: Sequence[int],
) -> Program:
    """Rank ``rank``'s :class:`Program` of ``op`` from its task list (``tasks``/``refs``), the
    schedule's global trees and the plan (``slot_src [world, slots]``, ``home_of [E]``)."""
    op = Op(op)
    pr, ps, _ = (np.asarray(a) for a in schedule.tree(op))
    world, slots = slot_src.shape
    nchunks = -(-slot_bytes // chunk_bytes) if slot_bytes else 0
    sends: list[SendItem] = []
    recvs: list[Message] = []
    reduces: list[tuple[int, ReduceItem]] = []
    deps: dict[tuple[int, int], list[Message]] = {}

    def segs(c: int):
        off, nb = _chunk_range(c, chunk_bytes, slot_bytes)
        return member_segments(off, nb, member_off, member_bytes)

    def own_slots():  # (slot, expert, tree parent's rank) of this rank's filled slots
        for s in range(slots):
            e = int(slot_src[rank, s])
            if e >= 0:
                p = int(pr[rank, s])
                _check(
                    0 <= p < world and p != rank,
                    f"rank {rank} slot {s} (expert {e}) has {op.name.lower()} tree parent rank {p}",
                )
                yield s, e, p

    if op == Op.MULTICAST:
        depth = multicast_depths(schedule)
        for t in tasks:
            c, e, me_slot = int(t["chunk"]), int(t["expert"]), int(t["self_slot"])
            for d, s in _refs_of(t, refs):
                _check(d != rank, f"rank {rank} copies expert {e} to its own slot {s}")
                _check(
                    (int(pr[d, s]), int(ps[d, s])) == (rank, me_slot),
                    f"rank {rank} copies expert {e} to rank {d} slot {s}, whose tree parent is "
                    f"({int(pr[d, s])}, {int(ps[d, s])})",
                )
                for m, lo, hi in segs(c):
                    sends.append(SendItem(Message(c + int(depth[d, s]) - 1, rank, d, s, c, m, lo, hi, e), me_slot))
        for s, e, p in own_slots():
            for c in range(nchunks):
                for m, lo, hi in segs(c):
                    msg = Message(c + int(depth[rank, s]) - 1, p, rank, s, c, m, lo, hi, e)
                    recvs.append(msg)
                    deps.setdefault((s, c), []).append(msg)
    else:
        height, master_h = reduce_heights(schedule, slot_src, home_of)
        for s, e, p in own_slots():  # this rank's chunks go up to the slot's parent
            for c in range(nchunks):
                for m, lo, hi in segs(c):
                    sends.append(SendItem(Message(c + int(height[rank, s]), rank, p, s, c, m, lo, hi, e), s))
        for i, t in enumerate(tasks):
            c, e, me_slot = int(t["chunk"]), int(t["expert"]), int(t["self_slot"])
            h = master_h.get(e) if me_slot == MASTER else int(height[rank, me_slot])
            _check(
                h is not None and h >= 1, f"rank {rank} reduces expert {e} into slot {me_slot}, which has no children"
            )
            srcs = _refs_of(t, refs)
            for q, s in srcs:
                _check(q != rank, f"rank {rank} reduces its own slot {s} into expert {e}")
                _check(
                    (int(pr[q, s]), int(ps[q, s])) == (rank, me_slot),
                    f"rank {rank} pulls expert {e} from rank {q} slot {s}, whose tree parent is "
                    f"({int(pr[q, s])}, {int(ps[q, s])})",
                )
            for m, lo, hi in segs(c):
                got = [Message(c + int(height[q, s]), q, rank, s, c, m, lo, hi, e) for q, s in srcs]
                recvs.extend(got)
                reduces.append((c + h, ReduceItem(i, e, c, m, lo, hi, me_slot, tuple(got))))

    # tags: a message's index in its (src, dst) pair's order, the same on both ends
    tag_of: dict[Message, int] = {}
    for peer_msgs in _by_pair([x.msg for x in sends] + recvs).values():
        for k, msg in enumerate(sorted(peer_msgs, key=Message.order)):
            tag_of[msg] = k

    def tagged(msg: Message) -> Message:
        return dataclasses.replace(msg, tag=tag_of[msg])

    nwaves = 1 + max([x.msg.wave for x in sends] + [x.wave for x in recvs] + [w for w, _ in reduces], default=-1)
    waves = [Wave() for _ in range(nwaves)]
    for item in sends:
        waves[item.msg.wave].sends.append(SendItem(tagged(item.msg), item.self_slot))
    for msg in recvs:
        waves[msg.wave].recvs.append(tagged(msg))
    for w, item in reduces:
        _check(
            all(x.wave < w for x in item.sources),
            f"rank {rank} reduces expert {item.expert} chunk {item.chunk} before its sources arrive",
        )
        waves[w].reduces.append(dataclasses.replace(item, sources=tuple(tagged(x) for x in item.sources)))
    for wave in waves:
        wave.sends.sort(key=lambda x: (x.msg.dst, x.msg.order()))
        wave.recvs.sort(key=lambda x: (x.src, x.order()))
    deps = {k: [tagged(x) for x in v] for k, v in deps.items()}
    return Program(op, rank, waves, deps)


def _refs_of(task, refs: np.ndarray) -> list[tuple[int, int]]:
    """A task's ``(rank, slot)`` refs, in list order."""
    b = int(task["ref_begin"])
    return [(int(x["rank"]), int(x["slot"])) for x in refs[b : b + int(task["ref_count"])]]


def _by_pair(msgs: list[Message]) -> dict[tuple[int, int], list[Message]]:
    out: dict[tuple[int, int], list[Message]] = {}
    for m in msgs:
        out.setdefault((m.src, m.dst), []).append(m)
    return out
