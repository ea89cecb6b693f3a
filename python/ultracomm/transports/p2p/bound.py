"""A message program bound to buffers: what the ``p2p`` transport posts per wave, resolved once.

Resolving a message's tensor (a slice of the window, of a master member, a receive buffer) and
its summation views costs a few microseconds each in Python; on a transport whose baseline is
one ``batch_isend_irecv`` per operation (perf/README.md section 6b) that was a visible part of
a small operation.  So the slices are made once per (program, masters, local index map) and
kept; an operation then only posts and waits.  Receive buffers are the program's own (one
operation at a time per transport), so a binding's tensors stay valid for its program's life.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Optional

import torch

from ...records import MASTER, Op
from .waves import Message, Program

__all__ = ["Bound", "BoundWave", "bind"]


def _typed_view(t: torch.Tensor, dtype: torch.dtype) -> Optional[torch.Tensor]:
    """``t`` (uint8) viewed as ``dtype``, or None where a view is impossible (misaligned): such a
    segment is summed by :func:`~ultracomm.transports.segments.ordered_sum` at run time."""
    try:
        return t.view(dtype)
    except RuntimeError:
        return None


@dataclasses.dataclass
class BoundReduce:
    """One reduce item: ``dst`` (uint8 bytes), ``sources`` (message ids, summation order) and,
    where every view exists and ``dst`` is fp32 in place, the typed views to ``add_`` directly."""

    dst: torch.Tensor
    sources: list[int]
    bufs: list[torch.Tensor]  # the sources' receive buffers (uint8), in order
    fast: Optional[tuple[torch.Tensor, list[torch.Tensor]]]  # (dst as fp32, sources as dtype)


@dataclasses.dataclass
class BoundWave:
    reduces: list[BoundReduce]
    deps: list[int]  # multicast: received message ids a relay's sends wait for
    ops: list[tuple[str, torch.Tensor, int, int]]  # (kind, tensor, peer, tag), sends first
    ids: list[int]  # message id of each op


@dataclasses.dataclass
class Bound:
    """A :class:`~.waves.Program` with every tensor resolved; ``messages[i]`` is message ``i``."""

    waves: list[BoundWave]
    messages: list[Message]


def bind(
    prog: Program,
    op: Op,
    source: Callable[[int, int, int, int, int], torch.Tensor],
    slot_bytes: Callable[[int, int, int], torch.Tensor],
    device: Any,
    dtype: torch.dtype,
) -> Bound:
    """Bind ``prog``: ``source(expert, self_slot, member, lo, hi)`` gives a send's bytes (or a
    reduce's destination), ``slot_bytes(slot, lo, hi)`` a multicast receive's target."""
    ids: dict[Message, int] = {}
    messages: list[Message] = []

    def mid(m: Message) -> int:
        i = ids.get(m)
        if i is None:
            i = ids[m] = len(messages)
            messages.append(m)
        return i

    mc = op == Op.MULTICAST
    waves: list[BoundWave] = []
    for wave in prog.waves:
        reduces = []
        for item in wave.reduces:
            dst = source(item.expert, item.self_slot, item.member, item.lo, item.hi)
            bufs = [prog.buffer(m, device) for m in item.sources]
            d = _typed_view(dst, dtype)
            srcs = [_typed_view(b, dtype) for b in bufs]
            fast = None
            if (
                dtype == torch.float32
                and d is not None
                and d.data_ptr() == dst.data_ptr()
                and all(s is not None for s in srcs)
            ):
                fast = (d, srcs)
            reduces.append(BoundReduce(dst, [mid(m) for m in item.sources], bufs, fast))
        deps: list[int] = []
        if mc:
            for item in wave.sends:
                if item.self_slot != MASTER:
                    deps += [mid(d) for d in prog.forward_deps[(item.self_slot, item.msg.chunk)]]
        ops, oids = [], []
        for item in wave.sends:
            m = item.msg
            ops.append(("send", source(m.expert, item.self_slot, m.member, m.lo, m.hi), m.dst, m.tag))
            oids.append(mid(m))
        for m in wave.recvs:
            buf = slot_bytes(m.slot, m.lo, m.hi) if mc else prog.buffer(m, device)
            ops.append(("recv", buf, m.src, m.tag))
            oids.append(mid(m))
        waves.append(BoundWave(reduces, list(dict.fromkeys(deps)), ops, oids))
    return Bound(waves, messages)
