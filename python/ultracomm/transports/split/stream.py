"""The GPU ``split`` transport's bridge as data: one rank's crossings of one op
(:mod:`.bridge_program`) compiled into a flat list of stream operations that a side stream
executes in order, beside the persistent ``tma`` kernel, without the host.

Records (plain, epoch-free: cache them per (schedule, op); the epoch is applied at enqueue)::

    WAIT_GE(ref)               stall the stream until the uint64 at ref >= epoch
    SEND(peer, ref, nbytes)    send bytes [ref, ref + nbytes) to peer (NCCL send; loopback: one
                               cudaMemcpyAsync paired with the peer's RECV)
    RECV(peer, ref, nbytes)    receive nbytes from peer into ref
    WRITE(ref)                 store epoch at ref (after everything before it on the stream)

A :class:`Ref` is ``(shadow, off)``: byte ``off`` of this rank's own window (``shadow == OWN``)
or of this rank's shadow of rank ``shadow`` (the stand-in the kernel addresses instead of a
rank in another memory domain, :mod:`.shadow`).  What moves mirrors :mod:`.bridge` (the CPU
bridge) word for word, and every flag is one the kernel's interpreter (``interp.h``) already
reads or writes:

* header, per peer and direction: the sender waits for its own ``ready[op] >= epoch`` (its
  kernel's join) and sends its own ``digest[op]`` word, then its ``ready[op]`` word; the receiver
  receives them into its shadow of the sender's ``digest[op]``, then ``ready[op]`` (two
  stream-ordered messages: a kernel that sees the epoch sees the digest).  So a peer on another
  plan is caught by the kernel's own ``check_peer_plan`` on the shadow (``PlanError``, and
  ``rank r rejected its plan`` for a rejection: the rejecting rank's stream sends the rejection
  its kernel published); a peer at an older epoch leaves the shadow below ours and the kernel's
  wait times out naming it.  No extra device-side compare is needed.
* multicast send: WAIT_GE(shadow-of-dst ``arrival[slot][chunk]``) (the kernel copied the chunk
  into the shadow), SEND the chunk from the shadow; recv: RECV into the real slot, WRITE own
  ``arrival[slot][chunk]``.
* reduce send: WAIT_GE(own ``grad_ready[slot][chunk]``), SEND from the real grad slot, WRITE own
  ``consumed[slot][chunk]`` (the bytes left: what the parent's kernel would have raised); recv:
  RECV into the shadow of the source's grad slot, WRITE the shadow's ``grad_ready``.

Order (why one side stream per rank cannot deadlock).  Every message has a global rank-free
key ``(chunk, level, slot, src, dst, part)`` (headers: chunk = level = slot = -1, part 0 the
digest, 1 the ready word; :meth:`.bridge_program.Crossing.key` otherwise), the same on both of
its ends.  Each rank's stream holds its sends AND receives in that one order, a send preceded
by its WAIT_GE and followed by its sender-side WRITE, a receive followed by its WRITE.  Model
the cross mover as a rendezvous (a SEND completes only once the matching RECV is at the head
of the peer's stream; NCCL may buffer small sends, never more than that).  Take the smallest
unfinished message m = (k, src, dst).  Everything before m on src's and dst's streams is
smaller, hence finished (WRITEs have no precondition).  m's WAIT_GE waits for a flag the
interpreter raises for key k's (chunk, level), which depends only on flags of strictly smaller
(chunk, level) -- the interpreter's own task order (tasks sorted by (chunk, level), each waits
only on smaller ones) -- and on messages of strictly smaller keys (their WRITEs are done); a
header's WAIT_GE waits for the kernel's join, which waits for nothing.  So the WAIT passes,
both ends are at m, and m completes: by induction every message does.  A rank whose sends
all preceded its receives (a natural-looking order) deadlocks at once on a pair that exchanges
headers both ways: the simulation in ``tests/split_stream_sim.py`` checks both.

:func:`loopback_sequence` merges every rank's messages of a one-process loopback domain into
one list in the same global order (a SEND and its RECV become one copy), for one side stream.
"""

from __future__ import annotations

import dataclasses
from typing import Optional, Sequence

from ...records import Op
from .bridge_program import BridgeProgram, Crossing
from ...errors import InputError

__all__ = [
    "OWN",
    "Ref",
    "StreamOp",
    "Message",
    "WAIT_GE",
    "SEND",
    "RECV",
    "WRITE",
    "COPY",
    "messages",
    "rank_stream",
    "loopback_sequence",
    "stream_program",
]

OWN = -1  # Ref.shadow of this rank's own window
WAIT_GE, SEND, RECV, WRITE, COPY = "wait_ge", "send", "recv", "write", "copy"
_HEADER = (-1, -1, -1)


@dataclasses.dataclass(frozen=True)
class Ref:
    """Byte ``off`` of this rank's own window (``shadow == OWN``) or of its shadow of rank ``shadow``."""

    shadow: int
    off: int


@dataclasses.dataclass(frozen=True)
class StreamOp:
    """One stream operation (module docstring).  ``peer``/``nbytes``: SEND/RECV's peer and bytes
    (-1/0 for flags); ``key``: the global order key of the message (a flag's: the message it
    guards or publishes); ``what``: how an error names it.  Loopback sequences only: ``rank`` is
    the rank whose spaces ``ref`` is relative to, and COPY moves ``nbytes`` from ``src`` (relative
    to rank ``peer``'s spaces) to ``ref``."""

    kind: str
    ref: Ref
    peer: int = -1
    nbytes: int = 0
    key: tuple = ()
    what: str = ""
    rank: int = -1  # loopback sequence: the rank whose spaces ``ref`` is relative to
    src: Optional[Ref] = None  # COPY: the source (relative to ``peer``'s spaces)


@dataclasses.dataclass(frozen=True)
class Message:
    """One message ``src -> dst``: ``src_ref`` relative to src's spaces, ``dst_ref`` to dst's;
    ``wait`` (src's precondition) and ``src_write`` / ``dst_write`` (flags raised after it)."""

    key: tuple
    src: int
    dst: int
    src_ref: Ref
    dst_ref: Ref
    nbytes: int
    wait: Optional[Ref]
    src_write: Optional[Ref]
    dst_write: Optional[Ref]
    what: str


def _slot(wl: dict, mc: bool, slot: int) -> int:
    return wl["weights_off"] + wl["weight_stride"] * slot if mc else wl["grads_off"] + wl["grad_stride"] * slot


def _flag(wl: dict, kind: str, slot: int, chunk: int) -> int:
    per = wl["weight_chunks"] if kind == "arrival" else wl["grad_chunks"]
    return wl[f"{kind}_off"] + 8 * (slot * per + chunk)


def _crossing_message(wl: dict, mc: bool, x: Crossing) -> Message:
    lo, n = _slot(wl, mc, x.slot) + x.lo, x.hi - x.lo
    name = f"expert {x.expert} chunk {x.chunk} (bytes [{x.lo}, {x.hi}) of slot {x.slot})"
    key = (*x.key(), x.src, x.dst, 0)
    if mc:  # sender: its shadow of dst; receiver: its real slot
        return Message(
            key,
            x.src,
            x.dst,
            Ref(x.dst, lo),
            Ref(OWN, lo),
            n,
            wait=Ref(x.dst, _flag(wl, "arrival", x.slot, x.chunk)),
            src_write=None,
            dst_write=Ref(OWN, _flag(wl, "arrival", x.slot, x.chunk)),
            what=f"multicast {name} rank {x.src} -> rank {x.dst}",
        )
    return Message(
        key,
        x.src,
        x.dst,
        Ref(OWN, lo),
        Ref(x.src, lo),
        n,
        wait=Ref(OWN, _flag(wl, "grad_ready", x.slot, x.chunk)),
        src_write=Ref(OWN, _flag(wl, "consumed", x.slot, x.chunk)),
        dst_write=Ref(x.src, _flag(wl, "grad_ready", x.slot, x.chunk)),
        what=f"reduce {name} rank {x.src} -> rank {x.dst}",
    )


def _header_messages(wl: dict, op: Op, src: int, dst: int) -> list[Message]:
    digest, ready = wl["digest_off"] + 8 * int(op), wl["ready_off"] + 8 * int(op)
    return [
        Message(
            (*_HEADER, src, dst, 0),
            src,
            dst,
            Ref(OWN, digest),
            Ref(src, digest),
            8,
            wait=Ref(OWN, ready),
            src_write=None,
            dst_write=None,
            what=f"header (digest) rank {src} -> rank {dst}",
        ),
        Message(
            (*_HEADER, src, dst, 1),
            src,
            dst,
            Ref(OWN, ready),
            Ref(src, ready),
            8,
            wait=None,
            src_write=None,
            dst_write=None,
            what=f"header (ready) rank {src} -> rank {dst}",
        ),
    ]


def messages(prog: BridgeProgram, wl: dict) -> list[Message]:
    """Every message rank ``prog.rank`` sends or receives in ``prog.op``, in the global order."""
    mc = Op(prog.op) == Op.MULTICAST
    me = prog.rank
    out: list[Message] = []
    for q in prog.peers:
        out += _header_messages(wl, prog.op, me, q) + _header_messages(wl, prog.op, q, me)
    for x in prog.sends:
        if x.src != me:
            raise InputError(f"ultracomm split: rank {me}'s bridge program sends {x} of another rank")
        out.append(_crossing_message(wl, mc, x))
    for x in prog.recvs:
        if x.dst != me:
            raise InputError(f"ultracomm split: rank {me}'s bridge program receives {x} for another rank")
        out.append(_crossing_message(wl, mc, x))
    keys = [m.key for m in out]
    if len(set(keys)) != len(keys):
        raise InputError(f"ultracomm split: rank {me}'s bridge program lists a message twice")
    return sorted(out, key=lambda m: m.key)


def rank_stream(msgs: Sequence[Message], rank: int, order: str = "global") -> list[StreamOp]:
    """Rank ``rank``'s stream operations for its ``msgs`` (:func:`messages`).  ``order="global"``
    is the only deadlock-free one; ``"sends_first"`` (every send before every receive) exists so
    a test can show that the simulation catches a deadlock."""
    if order not in ("global", "sends_first"):
        raise InputError(f"ultracomm split: unknown stream order {order!r}")
    seq = list(msgs)
    if order == "sends_first":
        seq = [m for m in seq if m.src == rank] + [m for m in seq if m.src != rank]
    out: list[StreamOp] = []
    for m in seq:
        if m.src == rank:
            if m.wait is not None:
                out.append(StreamOp(WAIT_GE, m.wait, key=m.key, what=f"wait before {m.what}"))
            out.append(StreamOp(SEND, m.src_ref, m.dst, m.nbytes, m.key, m.what))
            if m.src_write is not None:
                out.append(StreamOp(WRITE, m.src_write, key=m.key, what=f"flag after {m.what}"))
        elif m.dst == rank:
            out.append(StreamOp(RECV, m.dst_ref, m.src, m.nbytes, m.key, m.what))
            if m.dst_write is not None:
                out.append(StreamOp(WRITE, m.dst_write, key=m.key, what=f"flag after {m.what}"))
        else:
            raise InputError(f"ultracomm split: {m.what} does not involve rank {rank}")
    return out


def stream_program(prog: BridgeProgram, wl: dict) -> list[StreamOp]:
    """Rank ``prog.rank``'s stream operations of ``prog`` (empty: nothing crosses)."""
    return rank_stream(messages(prog, wl), prog.rank)


def loopback_sequence(progs: Sequence[BridgeProgram], wl: dict) -> list[StreamOp]:
    """Every rank's messages of one loopback domain merged into one list in the global order, for
    one side stream: per message the sender's WAIT_GE, one COPY (``rank`` = dst, ``ref`` = the
    destination; ``peer`` = src, ``src`` = the source), then the sender's and receiver's WRITEs.
    Each message must be listed by both of its ends, alike (else ``ValueError``)."""
    by_key: dict[tuple, list[Message]] = {}
    for p in progs:
        for m in messages(p, wl):
            by_key.setdefault(m.key, []).append(m)
    out: list[StreamOp] = []
    for key in sorted(by_key):
        ms = by_key[key]
        if len(ms) != 2 or ms[0] != ms[1]:
            ends = sorted({p.rank for p in progs if any(m.key == key for m in messages(p, wl))})
            raise InputError(
                f"ultracomm split: {ms[0].what} is listed by ranks {ends} (expected both ends, alike): "
                "the ranks' bridge programs disagree"
            )
        m = ms[0]
        if m.wait is not None:
            out.append(StreamOp(WAIT_GE, m.wait, key=key, what=f"wait before {m.what}", rank=m.src))
        out.append(StreamOp(COPY, m.dst_ref, m.src, m.nbytes, key, m.what, rank=m.dst, src=m.src_ref))
        if m.src_write is not None:
            out.append(StreamOp(WRITE, m.src_write, key=key, what=f"flag after {m.what}", rank=m.src))
        if m.dst_write is not None:
            out.append(StreamOp(WRITE, m.dst_write, key=key, what=f"flag after {m.what}", rank=m.dst))
    return out
