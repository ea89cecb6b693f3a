"""The ``p2p`` transport: a schedule's trees executed with ``torch.distributed`` point-to-point.

The path for replicas that no window reaches (across RDMA links, outside any shared-memory
domain): NCCL on GPUs, gloo on the CPU (so the test suite runs it everywhere).  It runs the
same schedules as the host executor and produces the same bytes:

* multicast: every copy task's member segments go to its destinations with
  ``batch_isend_irecv``; a relay forwards chunk ``c`` once it has received it;
* reduce: the puller receives its sources' chunks and accumulates in fp32, self first, then
  the sources in the task's order, rounding once into the grad dtype
  (:func:`ultracomm.tools.reference.ordered_sum`, the reference's order); a relay's partial
  overwrites its own grad slot, as the host executor's does.

Buffers are the Context's replica pool (a ``private`` window: no peer mapping).  The waves of
:mod:`ultracomm.transports.p2p.waves` order the messages; up to ``INFLIGHT_WAVES`` waves are
posted before the oldest must complete, so several chunks of one edge are in flight.  Each
wait is bounded by the Context's timeout (``ULTRACOMM_TIMEOUT_S``, passed to ``Work.wait``):
a dead or stalled peer raises :class:`~ultracomm.errors.UltracommTimeout` naming this rank,
the operation, the peer, the expert and the chunk.  On NCCL, ``Work.wait`` does not block the
host; there the process group's own timeout (its watchdog) bounds the wait, and ``run``
synchronises the device before it returns.

The transport uses the Context's process group for its messages: on NCCL, do not run other
operations on that group from another thread while an ultracomm operation is in flight.  On a
``LoopbackGroup`` (ranks as threads) the messages go through in-process mailboxes
(:mod:`ultracomm.transports.p2p.messengers`).
"""

from __future__ import annotations

import datetime
import time
from typing import Any, NoReturn, Sequence

import torch

from ..costs import costs_for_backend
from ...records import MASTER, Op
from ..segments import ordered_sum
from ..base import Masters, Transport
from ...errors import UltracommTimeout
from .messengers import PostError, messenger_for, peer_failure
from .bound import Bound, BoundWave, bind
from .waves import Message, Program, build_program, cached_program

__all__ = ["P2PTransport", "INFLIGHT_WAVES"]

#: waves posted before the oldest one must complete (chunks in flight per tree edge)
INFLIGHT_WAVES = 4
_CACHE = 128  # (schedule, op) programs kept


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class P2PTransport(Transport):
    """Executor over ``torch.distributed`` point-to-point messages (gloo on the CPU, NCCL on GPUs).

    Args (given by the Context): ``comm`` (a ``TorchComm``: the process group), ``rank``,
    ``world``, ``window`` (a ``private`` pool), ``wlayout``, ``layout``, ``timeout_s``.
    """

    name = "p2p"
    window_providers = ("private",)
    options = frozenset({"comm"})
    names_by_evidence = True
    #: how errors name the transport (the split transport's messages route says so)
    label = "p2p"

    def __init__(self, *, comm: Any, rank: int, world: int, window, wlayout: dict, layout, timeout_s: float):
        self.rank, self.world = rank, world
        self.window, self.wlayout, self.layout = window, wlayout, layout
        self.timeout_s = float(timeout_s)
        self.device = window.local.device
        self.messenger = messenger_for(comm, world, self.device)
        #: the alpha-beta costs the Context builds this transport's schedules with (chunk, tree)
        self.message_costs = costs_for_backend(getattr(self.messenger, "backend", "gloo"))
        self._members = {
            Op.MULTICAST: (list(layout.weight_offsets), list(layout.weight_sizes)),
            Op.REDUCE: (list(layout.grad_offsets), list(layout.grad_sizes)),
        }
        self._programs: dict[tuple[int, int], Program] = {}
        #: per op, the last (schedule, masters, local index map) run and its binding, compared by identity
        self._last: dict[Op, tuple] = {}
        #: the Context's :class:`ultracomm.blame.Witness` (set by the Context), or None
        self.witness = None

    # ------------------------------------------------------------------ program and buffers
    def program(self, op: Op, schedule) -> Program:
        """This rank's (cached) message program of ``op`` for ``schedule``."""
        mo, mb = self._members[op]
        slot_bytes = self.wlayout["weight_slot_bytes" if op == Op.MULTICAST else "grad_slot_bytes"]
        return cached_program(
            self._programs,
            schedule,
            op,
            self.world,
            lambda slot_src, home_of: build_program(
                op,
                schedule,
                self.rank,
                schedule.tasks(op, self.rank),
                schedule.refs(op, self.rank),
                slot_src,
                home_of,
                schedule.chunk_bytes,
                slot_bytes,
                mo,
                mb,
            ),
            _CACHE,
        )

    def _slot_bytes(self, op: Op, slot: int, lo: int, hi: int) -> torch.Tensor:
        if op == Op.MULTICAST:
            base = self.wlayout["weights_off"] + self.wlayout["weight_stride"] * slot
        else:
            base = self.wlayout["grads_off"] + self.wlayout["grad_stride"] * slot
        return self.window.local[base + lo : base + hi]

    def _master_bytes(self, members: tuple, li: int, m: int, member_off: int, lo: int, hi: int) -> torch.Tensor:
        t = members[m]
        if isinstance(t, torch.Tensor):
            flat = _flat_bytes(t)
            per = flat.numel() // t.shape[0]
            return flat[li * per + lo - member_off : li * per + hi - member_off]
        return _flat_bytes(t[li])[lo - member_off : hi - member_off]

    # ------------------------------------------------------------------ run
    def bound(self, op: Op, prog: Program, masters: Masters, local_index_of: Sequence[int]) -> Bound:
        """``prog`` bound to this op's buffers (:mod:`.bound`), kept with the program per masters
        (their addresses) and local index map: an operation that repeats a plan resolves nothing."""
        key = (masters.weight_ptrs if op == Op.MULTICAST else masters.grad_ptrs, tuple(local_index_of))
        cache = prog.bindings
        b = cache.get(key)
        if b is None:
            if len(cache) >= 4:
                cache.clear()
            members = masters.weights if op == Op.MULTICAST else masters.grads
            member_off = self._members[op][0]
            lio = list(local_index_of)

            def source(expert: int, self_slot: int, m: int, lo: int, hi: int) -> torch.Tensor:
                if self_slot == MASTER:
                    return self._master_bytes(members, lio[expert], m, member_off[m], lo, hi)
                return self._slot_bytes(op, self_slot, lo, hi)

            b = cache[key] = bind(
                prog,
                op,
                source,
                lambda slot, lo, hi: self._slot_bytes(op, slot, lo, hi),
                self.device,
                self.layout.grad_dtype,
            )
        return b

    def run(
        self,
        op: Op,
        schedule,
        epoch: int,
        masters: Masters,
        my_slots: Sequence[int],
        local_index_of: Sequence[int],
        op_name: str | None = None,
    ) -> None:
        """Run ``op`` of ``schedule`` for this rank at ``epoch``; blocks until this rank's messages
        are done.  ``op_name`` (``weight_sync``, ``restore``, ``grad_reduce``) names the operation
        in errors."""
        op = Op(op)
        last = self._last.get(op)
        if last is not None and last[0] is schedule and last[1] is masters and last[2] is local_index_of:
            b = last[3]  # the same operation as last time (restore, a repeated grad_reduce): nothing to look up
        else:
            b = self.bound(op, self.program(op, schedule), masters, local_index_of)
            self._last[op] = (schedule, masters, local_index_of, b)
        run = _Run(self, op, b, op_name or op.name.lower(), epoch)
        try:
            if self.device.type == "cuda":
                with torch.cuda.device(self.device):  # NCCL posts on the current device's streams
                    run.execute()
            else:
                run.execute()
        except UltracommTimeout as e:
            raise with_evidence(e, self.witness, epoch, run.op_name, run.started) from None


def with_evidence(e: BaseException, witness, epoch: int, op_name: str, since: float | None = None) -> BaseException:
    """``e`` (a message that did not complete: ``peer_failure``'s error, with ``peer`` and
    ``closed``) with the evidence of who stopped (:mod:`ultracomm.blame`) added; ``e`` itself
    where there is no witness or it has its evidence already."""
    peer = getattr(e, "peer", None)
    if witness is None or peer is None or "by evidence" in str(e):
        return e
    why = witness.explain(
        epoch,
        f"{op_name} message with rank {peer} failed",
        [peer, *getattr(e, "also_awaited", ())],
        [peer] if getattr(e, "closed", False) else [],
        since=since,
    )
    out = UltracommTimeout(f"{e}; {why}")
    out.peer, out.closed = peer, getattr(e, "closed", False)
    return out


class _Run:
    """One operation's progress: the Work of each posted message (by message id) and the waves
    in flight."""

    def __init__(self, t: P2PTransport, op: Op, bound: Bound, op_name: str, epoch: int):
        self.t, self.op, self.b = t, op, bound
        self.op_name, self.epoch = op_name, epoch
        self.works: list[Any] = [None] * len(bound.messages)  # a coalesced batch: the batch's one Work
        self.done: set[int] = set()  # ids of Works that completed
        self.in_flight: list[list[int]] = []
        self.timeout = datetime.timedelta(seconds=t.timeout_s)
        self.started = time.monotonic()

    @property
    def where(self) -> str:
        return f"rank {self.t.rank} {self.op_name} (epoch {self.epoch}, transport {self.t.label})"

    def wait(self, i: int) -> None:
        work = self.works[i]
        if id(work) in self.done:
            return
        try:
            work.wait(self.timeout)
        except Exception as e:  # gloo: timeout or a closed connection (a dead peer)
            msg = self.b.messages[i]
            self.fail(msg, msg.dst == self.t.rank, e)
        self.done.add(id(work))

    def fail(self, msg: Message, incoming: bool, cause: BaseException, posting: bool = False) -> NoReturn:
        err = peer_failure(
            self.where, self.describe(msg, incoming), msg.src if incoming else msg.dst, self.t.timeout_s, cause, posting
        )
        err.also_awaited = self.unfinished_peers()
        raise err from None

    def unfinished_peers(self) -> list[int]:
        """The peers of this operation's posted messages that have not completed: what this rank
        awaited besides the message that failed (for the evidence of who stopped)."""
        me, out = self.t.rank, set()
        for ids in self.in_flight:
            for i in ids:
                w = self.works[i]
                if w is None or id(w) in self.done:
                    continue
                try:
                    finished = bool(w.is_completed())
                except Exception:  # noqa: BLE001 - a failed Work has not completed
                    finished = False
                if not finished:
                    m = self.b.messages[i]
                    out.add(m.src if m.dst == me else m.dst)
        return sorted(out - {me})

    def describe(self, msg: Message, incoming: bool) -> str:
        """What a wait was for: the peer, the expert, the chunk and the bytes."""
        what = f"expert {msg.expert} chunk {msg.chunk} (bytes [{msg.lo}, {msg.hi}) of"
        if self.op == Op.MULTICAST:
            return (
                f"receive {what} its slot {msg.slot}) from rank {msg.src}"
                if incoming
                else f"send {what} rank {msg.dst}'s slot {msg.slot}) to rank {msg.dst}"
            )
        return (
            f"receive {what} rank {msg.src}'s grad slot {msg.slot}) from rank {msg.src}"
            if incoming
            else f"send {what} its grad slot {msg.slot}) to rank {msg.dst}"
        )

    def post(self, wave: BoundWave) -> None:
        if not wave.ops:
            return
        try:
            handles = self.t.messenger.exchange(wave.ops)
        except PostError as e:
            msg = self.b.messages[wave.ids[e.index]]
            self.fail(msg, msg.dst == self.t.rank, e.cause, posting=True)
        works = self.works
        for i, handle in zip(wave.ids, handles):
            works[i] = handle
        self.in_flight.append(wave.ids)

    def retire_oldest(self) -> None:
        for i in self.in_flight.pop(0):
            self.wait(i)

    def reduce(self, r) -> None:
        for i in r.sources:
            self.wait(i)
        if r.fast is not None:  # fp32 in place, left to right: what ordered_sum does, views made once
            acc, srcs = r.fast
            for s in srcs:
                acc.add_(s)
        else:
            ordered_sum(r.dst, r.bufs, self.t.layout.grad_dtype)

    def execute(self) -> None:
        for wave in self.b.waves:
            while len(self.in_flight) >= INFLIGHT_WAVES:
                self.retire_oldest()
            for r in wave.reduces:  # in task-list order: a relay's partial before it is sent
                self.reduce(r)
            for i in wave.deps:  # multicast: a relay forwards chunks it received
                self.wait(i)
            self.post(wave)
        while self.in_flight:
            self.retire_oldest()
        if self.t.device.type == "cuda":
            torch.cuda.current_stream(self.t.device).synchronize()
