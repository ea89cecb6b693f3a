"""What the ``split`` transport's bridge moves: the chunks that cross memory domains, in order.

A schedule's tree edges between ranks of one domain run on the window (the host executor);
an edge between domains is a *crossing*: every chunk of the slot at its end travels as one
message (the chunk's byte range of the slot, member padding included).  Per rank and op:

* multicast: ``sends`` -- each own copy task's destinations in another domain (the sender's
  interpreter writes them into its shadow of that rank); ``recvs`` -- each own slot whose tree
  parent is in another domain (received into the rank's real slot);
* reduce: ``sends`` -- each own slot whose tree parent is in another domain (read from the
  real grad slot once its ``grad_ready`` is raised); ``recvs`` -- each own reduce task's
  sources in another domain (received into the shadow of the source).

Order.  The interpreter claims tasks sorted by (chunk, level) and a task only waits for flags
raised by tasks of a smaller (chunk, level) (multicast level: the sender's depth; reduce
level: the node's height).  A crossing carries the key of the task that produces it -- (c,
depth - 1) for chunk c into a slot at depth d; (c, height) for a reduce source -- and the
bridge handles its sends and its receives each in key order, so a blocked bridge only ever
waits for something of a smaller key, as the interpreter itself does: no cycle.  Messages of a
(src, dst) pair are tagged 1, 2, ... in the pair's key order (tag 0 is the op's header: epoch
and digest), computed alike on both ends.  The sender's side comes from its own task list, the
receiver's from the global tree; they are checked against each other (a mismatch is a clear
error, not a hang).
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from ...records import MASTER, Op
from ..p2p.waves import multicast_depths, reduce_heights
from ...errors import InputError

__all__ = ["Crossing", "BridgeProgram", "build_bridge_program"]

HEADER_TAG = 0


@dataclasses.dataclass(frozen=True)
class Crossing:
    """Chunk ``chunk`` of slot ``slot`` over the tree edge ``src -> dst`` (``slot``: the receiver's
    slot for multicast, the sender's for reduce); ``lo``/``hi``: its byte range in the slot."""

    chunk: int
    level: int
    src: int
    dst: int
    slot: int
    expert: int
    lo: int
    hi: int
    tag: int = -1

    def key(self) -> tuple:
        return (self.chunk, self.level, self.slot)


@dataclasses.dataclass(frozen=True)
class BridgeProgram:
    """One rank's crossings of one op: ``peers`` (ranks in other domains it exchanges with, each
    sent and received one header), ``sends`` and ``recvs`` in the order the bridge handles them."""

    op: Op
    rank: int
    peers: tuple[int, ...]
    sends: tuple[Crossing, ...]
    recvs: tuple[Crossing, ...]

    @property
    def bytes_sent(self) -> int:
        return sum(x.hi - x.lo for x in self.sends)

    @property
    def bytes_received(self) -> int:
        return sum(x.hi - x.lo for x in self.recvs)


def _check(ok: bool, what: str) -> None:
    if not ok:
        raise InputError(
            f"ultracomm split: the schedule's tasks and trees disagree: {what}; rebuild the schedule "
            "with this build of ultracomm"
        )


def _refs(task, refs: np.ndarray) -> list[tuple[int, int]]:
    b = int(task["ref_begin"])
    return [(int(x["rank"]), int(x["slot"])) for x in refs[b : b + int(task["ref_count"])]]


def build_bridge_program(
    op: Op,
    schedule,
    rank: int,
    tasks: np.ndarray,
    refs: np.ndarray,
    slot_src: np.ndarray,
    home_of: np.ndarray,
    domain_of: Sequence[int],
    chunk_bytes: int,
    slot_bytes: int,
) -> BridgeProgram:
    """Rank ``rank``'s :class:`BridgeProgram` of ``op`` from its task list (``tasks``/``refs``), the
    schedule's global trees, the plan (``slot_src [world, slots]``, ``home_of [E]``) and the ranks'
    domains (``domain_of[r]``)."""
    op = Op(op)
    dom = np.asarray(domain_of, dtype=np.int64)
    pr, ps, _ = (np.asarray(a) for a in schedule.tree(op))
    world, slots = slot_src.shape
    _check(len(dom) == world, f"{len(dom)} domains for {world} ranks")
    nchunks = -(-slot_bytes // chunk_bytes) if slot_bytes else 0
    me = int(dom[rank])

    def chunk_range(c: int) -> tuple[int, int]:
        return c * chunk_bytes, min((c + 1) * chunk_bytes, slot_bytes)

    def crossing(c: int, level: int, src: int, dst: int, slot: int, expert: int) -> Crossing:
        return Crossing(c, level, src, dst, slot, expert, *chunk_range(c))

    def own_cross_slots():  # (slot, expert, parent) of own filled slots whose parent is elsewhere
        for s in range(slots):
            e = int(slot_src[rank, s])
            if e < 0:
                continue
            p = int(pr[rank, s])
            _check(0 <= p < world and p != rank, f"rank {rank} slot {s} (expert {e}) has tree parent rank {p}")
            if int(dom[p]) != me:
                yield s, e, p

    sends: list[Crossing] = []
    recvs: list[Crossing] = []
    if op == Op.MULTICAST:
        depth = multicast_depths(schedule)
        for t in tasks:
            c, e, self_slot = int(t["chunk"]), int(t["expert"]), int(t["self_slot"])
            for d, s in _refs(t, refs):
                if int(dom[d]) == me:
                    continue
                _check(
                    (int(pr[d, s]), int(ps[d, s])) == (rank, self_slot),
                    f"rank {rank} copies expert {e} to rank {d} slot {s}, whose tree parent is "
                    f"({int(pr[d, s])}, {int(ps[d, s])})",
                )
                sends.append(crossing(c, int(depth[d, s]) - 1, rank, d, s, e))
        for s, e, p in own_cross_slots():
            recvs += [crossing(c, int(depth[rank, s]) - 1, p, rank, s, e) for c in range(nchunks)]
    else:
        height, _ = reduce_heights(schedule, slot_src, home_of)
        for s, e, p in own_cross_slots():
            sends += [crossing(c, int(height[rank, s]), rank, p, s, e) for c in range(nchunks)]
        for t in tasks:
            c, e, self_slot = int(t["chunk"]), int(t["expert"]), int(t["self_slot"])
            for q, s in _refs(t, refs):
                if int(dom[q]) == me:
                    continue
                _check(
                    (int(pr[q, s]), int(ps[q, s])) == (rank, self_slot),
                    f"rank {rank} pulls expert {e} from rank {q} slot {s}, whose tree parent is "
                    f"({int(pr[q, s])}, {int(ps[q, s])})",
                )
                _check(
                    self_slot == MASTER or int(slot_src[rank, self_slot]) == e,
                    f"rank {rank} reduces expert {e} into its slot {self_slot}",
                )
                recvs.append(crossing(c, int(height[q, s]), q, rank, s, e))

    tag: dict[Crossing, int] = {}
    pairs: dict[tuple[int, int], list[Crossing]] = {}
    for x in sends + recvs:
        pairs.setdefault((x.src, x.dst), []).append(x)
    for msgs in pairs.values():
        for i, x in enumerate(sorted(msgs, key=Crossing.key)):
            tag[x] = HEADER_TAG + 1 + i
    sends = sorted((dataclasses.replace(x, tag=tag[x]) for x in sends), key=lambda x: (*x.key(), x.dst))
    recvs = sorted((dataclasses.replace(x, tag=tag[x]) for x in recvs), key=lambda x: (*x.key(), x.src))
    peers = tuple(sorted({x.dst for x in sends} | {x.src for x in recvs}))
    return BridgeProgram(op, rank, peers, tuple(sends), tuple(recvs))
