"""The CPU ``split`` transport's crossings between real buffers: no shadow copy, and the calling
thread moves what no interpreter task waits for.

The shadow protocol (:mod:`.bridge`) lets the interpreter write a multicast crossing into its
shadow of the receiver, then sends it from there: one extra copy of every crossing byte, and a
flag hand-off (interpreter -> send lane) before the message leaves.  Here (per rank and op,
:func:`build_direct_plan`):

* the interpreter gets its task list without the refs to ranks of other domains (tasks left
  with none are dropped); a crossing from the master is sent straight from the master's member
  bytes, posted before the interpreter starts (*early*); one from a relay's own slot is sent
  by the send lane once the slot's ``arrival`` flag says the chunk is there;
* a multicast crossing into a slot that no own task forwards (a leaf) is received into the
  real slot and completed by the calling thread after the interpreter returned; the slot is
  hidden from the interpreter (``my_slots`` -1: its drain does not wait for an arrival flag
  nobody would raise).  Into a relay's slot: the receive lane raises ``arrival`` (release) when
  the chunk is complete, as before;
* reduce: a leaf grad slot whose parent is in another domain is sent from the real slot at once
  (a leaf's grads are complete when the op starts) and hidden from the interpreter (no
  ``grad_ready`` to publish, no ``consumed`` to drain); a relay's partial is sent by the send
  lane after its ``grad_ready``, then ``consumed`` is raised (release); sources in other
  domains are received into the shadow of the source and the receive lane raises the shadow's
  ``grad_ready`` -- the interpreter sums them in the schedule's order, exactly as before.

Messages carry member segments (padding between members never moves): crossing tag ``t``
(:mod:`.bridge_program`, 1, 2, ... per pair) becomes tags ``t * 256 + k`` for its ``k``-th segment,
the same on both ends; tag 0 stays the header.  Layouts of more than 255 members use the shadow
protocol.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np
import torch

from ... import _core
from ...records import MASTER, REF_DTYPE, Op
from ..segments import member_segments
from .bridge import BridgeLanes, BridgeRun
from .bridge_program import BridgeProgram, Crossing
from ...errors import InputError

__all__ = ["Part", "DirectPlan", "build_direct_plan", "DirectBridge", "MAX_SEGMENTS"]

MAX_SEGMENTS = 255  # segments of one crossing: tags t * 256 + k


@dataclasses.dataclass(frozen=True)
class Part:
    """One crossing as messages: its member segments ``(m, lo, hi)`` (slot layout) and their tags;
    ``self_slot``: the sender's source (``MASTER`` or its own slot; multicast sends only)."""

    x: Crossing
    segs: tuple[tuple[int, int, int], ...]
    self_slot: int = MASTER

    def tag(self, k: int) -> int:
        return self.x.tag * 256 + k


@dataclasses.dataclass(frozen=True)
class DirectPlan:
    """What the interpreter runs (``tasks``/``refs``, own slots in ``hidden`` passed as empty) and
    the crossings by who moves them: posted at start and completed by the calling thread
    (``early_*``) or handled by the lanes (``lane_*``)."""

    tasks: np.ndarray
    refs: np.ndarray
    hidden: frozenset
    early_sends: tuple[Part, ...]
    lane_sends: tuple[Part, ...]
    early_recvs: tuple[Part, ...]
    lane_recvs: tuple[Part, ...]

    def my_slots(self, my_slots: Sequence[int]) -> list[int]:
        return [-1 if s in self.hidden else int(e) for s, e in enumerate(my_slots)]


def _keep_refs(tasks: np.ndarray, refs: np.ndarray, keep) -> tuple[np.ndarray, np.ndarray]:
    """``tasks``/``refs`` with only the refs ``keep(rank)`` accepts; tasks left without refs dropped."""
    out_t, out_r = [], []
    for t in tasks:
        b, n = int(t["ref_begin"]), int(t["ref_count"])
        kept = [x for x in refs[b : b + n] if keep(int(x["rank"]))]
        if not kept:
            continue
        row = t.copy()
        row["ref_begin"], row["ref_count"] = len(out_r), len(kept)
        out_t.append(row)
        out_r += kept
    return (
        np.array(out_t, dtype=tasks.dtype) if out_t else np.zeros(0, dtype=tasks.dtype),
        np.array(out_r, dtype=REF_DTYPE) if out_r else np.zeros(0, dtype=REF_DTYPE),
    )


def build_direct_plan(
    prog: BridgeProgram,
    schedule: Any,
    tasks: np.ndarray,
    refs: np.ndarray,
    domain_of: Sequence[int],
    member_off: Sequence[int],
    member_bytes: Sequence[int],
) -> DirectPlan:
    """Rank ``prog.rank``'s :class:`DirectPlan` of ``prog.op`` (see the module docstring)."""
    op, rank = prog.op, prog.rank
    if len(member_off) > MAX_SEGMENTS:
        raise InputError(f"ultracomm split: {len(member_off)} members; direct crossings take at most {MAX_SEGMENTS}")
    me = domain_of[rank]
    relay_slots = {int(t["self_slot"]) for t in tasks if int(t["self_slot"]) != MASTER}

    def part(x: Crossing, self_slot: int = MASTER) -> Part:
        return Part(x, tuple(member_segments(x.lo, x.hi - x.lo, member_off, member_bytes)), self_slot)

    es, ls, er, lr = [], [], [], []
    hidden = set()
    if op == Op.MULTICAST:
        _, ps, _ = (np.asarray(a) for a in schedule.tree(op))
        itasks, irefs = _keep_refs(tasks, refs, lambda r: domain_of[r] == me)
        for x in prog.sends:
            src = int(ps[x.dst, x.slot])
            (es if src == MASTER else ls).append(part(x, src))
        for x in prog.recvs:
            if x.slot in relay_slots:
                lr.append(part(x))
            else:
                er.append(part(x))
                hidden.add(x.slot)
    else:
        itasks, irefs = tasks, refs
        for x in prog.sends:
            if x.slot in relay_slots:
                ls.append(part(x))
            else:
                es.append(part(x))
                hidden.add(x.slot)
        lr = [part(x) for x in prog.recvs]
    return DirectPlan(itasks, irefs, frozenset(hidden), tuple(es), tuple(ls), tuple(er), tuple(lr))


class DirectBridge(BridgeRun):
    """:class:`~.bridge.BridgeRun` over a :class:`DirectPlan`: the same headers, lanes and failure
    handling; messages between real buffers.  ``members``: the master tensors of the op (weights
    or grads), ``local_index_of``: local expert index per global expert, ``member_off``: member
    offsets in the slot layout.  After the interpreter returned, the calling thread runs
    :meth:`finish_early`."""

    def __init__(
        self, *args: Any, plan: DirectPlan, members: tuple, local_index_of: Sequence[int], member_off: Sequence[int]
    ):
        super().__init__(*args)
        self.plan, self.members, self.local_index_of, self.member_off = plan, members, local_index_of, member_off
        self._early_sent: list[tuple[Part, list]] = []
        self._early_recv: list[tuple[Part, list]] = []
        self._lane_recv: list[tuple[Part, list]] = []

    # ------------------------------------------------------------------ buffers
    def _own(self, slot: int, lo: int, hi: int) -> torch.Tensor:
        base = self._slot_off(slot)
        return self.local[base + lo : base + hi]

    def _source(self, p: Part, m: int, lo: int, hi: int) -> torch.Tensor:
        """Multicast: the master's member bytes or the relay's own slot; reduce: own grad slot."""
        if not self.mc or p.self_slot != MASTER:
            return self._own(p.x.slot if not self.mc else p.self_slot, lo, hi)
        t = self.members[m]
        li, off = self.local_index_of[p.x.expert], self.member_off[m]
        if isinstance(t, torch.Tensor):
            flat = t.reshape(-1).view(torch.uint8)
            per = flat.numel() // t.shape[0]
            return flat[li * per + lo - off : li * per + hi - off]
        return t[li].reshape(-1).view(torch.uint8)[lo - off : hi - off]

    def _target(self, p: Part, lo: int, hi: int) -> torch.Tensor:
        if self.mc:  # the real slot
            return self._own(p.x.slot, lo, hi)
        base = self._slot_off(p.x.slot)  # the shadow of the source
        return self.shadows.views[p.x.src][base + lo : base + hi]

    def _what(self, p: Part, send: bool) -> str:
        x = p.x
        if self.mc:
            return (
                f"send {self._chunk(x)} rank {x.dst}'s slot {x.slot}) to rank {x.dst}"
                if send
                else f"receive {self._chunk(x)} its slot {x.slot}) from rank {x.src}"
            )
        return (
            f"send {self._chunk(x)} its grad slot {x.slot}) to rank {x.dst}"
            if send
            else f"receive {self._chunk(x)} rank {x.src}'s grad slot {x.slot}) from rank {x.src}"
        )

    def _post_part(self, kind: str, p: Part) -> list:
        send = kind == "send"
        peer, what = (p.x.dst if send else p.x.src), self._what(p, send)
        return [
            self._post(kind, self._source(p, m, lo, hi) if send else self._target(p, lo, hi), peer, p.tag(k), what)
            for k, (m, lo, hi) in enumerate(p.segs)
        ]

    def _complete_part(self, p: Part, works: list, send: bool) -> None:
        what = self._what(p, send)
        for w in works:
            self._complete(w, what, p.x.dst if send else p.x.src)

    # ------------------------------------------------------------------ posting (calling thread)
    def _post_early(self, header_peers: tuple[int, ...]) -> None:
        """Headers as :class:`BridgeRun`; then every receive and the early sends."""
        saved, self.prog = self.prog, dataclasses.replace(self.prog, recvs=())
        try:
            super()._post_early(header_peers)  # headers (and the shadow words of peers without one)
        finally:
            self.prog = saved
        self._lane_recv = [(p, self._post_part("recv", p)) for p in self.plan.lane_recvs]
        self._early_recv = [(p, self._post_part("recv", p)) for p in self.plan.early_recvs]
        self._early_sent = [(p, self._post_part("send", p)) for p in self.plan.early_sends]
        self._posted = [None] * len(self._lane_recv)  # the receive lane has work (BridgeRun.start)

    # ------------------------------------------------------------------ lanes
    def _send(self) -> None:
        for p in self.plan.lane_sends:
            x = p.x
            if self.mc:  # a relay forwards its own chunk once it is there
                flag = self.own_base + self._flag_off("arrival", p.self_slot, x.chunk)
                waited = f"its own chunk {x.chunk} of expert {x.expert} in its slot {p.self_slot} (to forward to rank {x.dst})"
            else:  # a relay's partial, complete once its grad_ready is raised
                flag = self.own_base + self._flag_off("grad_ready", x.slot, x.chunk)
                waited = f"its own grad_ready of {self._chunk(x)} its grad slot {x.slot}) for rank {x.dst}"
            if not self._wait_flag(flag, waited):
                return
            self._complete_part(p, self._post_part("send", p), True)
            if not self.mc:  # the bytes left the slot: what the parent's consumed flag says
                _core.store_release(self.own_base + self._flag_off("consumed", x.slot, x.chunk), self.epoch)
        for q, work in self._hsend:
            self._complete(work, f"send its header to rank {q}", q)

    def _recv(self) -> None:
        if not self._recv_headers():
            return
        for p, works in self._lane_recv:
            if self.stopped():
                return
            self._complete_part(p, works, False)
            self._landed(p.x)

    def start(self, lanes: Optional[BridgeLanes] = None) -> None:
        self.prog = dataclasses.replace(self.prog, sends=tuple(p.x for p in self.plan.lane_sends))
        super().start(lanes)

    # ------------------------------------------------------------------ calling thread, after the interpreter
    def finish_early(self) -> None:
        """Complete the early messages: the receives into hidden slots (then their ``arrival``
        flags, as a writer would raise them) and the sends from masters / leaf grad slots (reduce:
        then ``consumed``)."""
        for p, works in self._early_recv:
            self._complete_part(p, works, False)
            _core.store_release(self.own_base + self._flag_off("arrival", p.x.slot, p.x.chunk), self.epoch)
        for p, works in self._early_sent:
            self._complete_part(p, works, True)
            if not self.mc:
                _core.store_release(self.own_base + self._flag_off("consumed", p.x.slot, p.x.chunk), self.epoch)
