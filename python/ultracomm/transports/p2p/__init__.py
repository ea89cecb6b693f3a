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
from typing import Any, NoReturn, Sequence

import torch

from ...alpha_beta import costs_for_backend
from ...records import MASTER, Op
from ..segments import ordered_sum
from ..host import Masters
from .messengers import PostError, messenger_for, peer_failure
from .waves import Message, Program, build_program, cached_program

__all__ = ["P2PTransport", "INFLIGHT_WAVES"]

#: waves posted before the oldest one must complete (chunks in flight per tree edge)
INFLIGHT_WAVES = 4
_CACHE = 128  # (schedule, op) programs kept


def _flat_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(-1).view(torch.uint8)


class P2PTransport:
    """Executor over ``torch.distributed`` point-to-point messages (gloo on the CPU, NCCL on GPUs).

    Args (given by the Context): ``comm`` (a ``TorchComm``: the process group), ``rank``,
    ``world``, ``window`` (a ``private`` pool), ``wlayout``, ``layout``, ``timeout_s``.
    """

    name = "p2p"
    window_providers = ("private",)

    def __init__(self, *, comm: Any, rank: int, world: int, window, wlayout: dict, layout, timeout_s: float):
        self.rank, self.world = rank, world
        self.window, self.wlayout, self.layout = window, wlayout, layout
        self.timeout_s = float(timeout_s)
        self.device = window.local.device
        self.messenger = messenger_for(comm, world, self.device)
        #: the alpha-beta costs the Context builds this transport's schedules with (chunk, tree)
        self.message_costs = costs_for_backend(getattr(self.messenger, "backend", "gloo"))
        self._members = {Op.MULTICAST: (list(layout.weight_offsets), list(layout.weight_sizes)),
                         Op.REDUCE: (list(layout.grad_offsets), list(layout.grad_sizes))}
        self._programs: dict[tuple[int, int], Program] = {}

    # ------------------------------------------------------------------ program and buffers
    def program(self, op: Op, schedule) -> Program:
        """This rank's (cached) message program of ``op`` for ``schedule``."""
        mo, mb = self._members[op]
        slot_bytes = self.wlayout["weight_slot_bytes" if op == Op.MULTICAST else "grad_slot_bytes"]
        return cached_program(self._programs, schedule, op, self.world, lambda slot_src, home_of: build_program(
            op, schedule, self.rank, schedule.tasks(op, self.rank), schedule.refs(op, self.rank), slot_src, home_of,
            schedule.chunk_bytes, slot_bytes, mo, mb), _CACHE)

    def _slot_bytes(self, op: Op, slot: int, lo: int, hi: int) -> torch.Tensor:
        if op == Op.MULTICAST:
            base = self.wlayout["weights_off"] + self.wlayout["weight_stride"] * slot
        else:
            base = self.wlayout["grads_off"] + self.wlayout["grad_stride"] * slot
        return self.window.local[base + lo:base + hi]

    def _master_bytes(self, members: tuple, li: int, m: int, member_off: int, lo: int, hi: int) -> torch.Tensor:
        t = members[m]
        if isinstance(t, torch.Tensor):
            flat = _flat_bytes(t)
            per = flat.numel() // t.shape[0]
            return flat[li * per + lo - member_off:li * per + hi - member_off]
        return _flat_bytes(t[li])[lo - member_off:hi - member_off]

    # ------------------------------------------------------------------ run
    def run(self, op: Op, schedule, epoch: int, masters: Masters, my_slots: Sequence[int],
            local_index_of: Sequence[int], op_name: str | None = None) -> None:
        """Run ``op`` of ``schedule`` for this rank at ``epoch``; blocks until this rank's messages
        are done.  ``op_name`` (``weight_sync``, ``restore``, ``grad_reduce``) names the operation
        in errors."""
        op = Op(op)
        prog = self.program(op, schedule)
        run = _Run(self, op, prog, masters, list(local_index_of), op_name or op.name.lower(), epoch)
        if self.device.type == "cuda":
            with torch.cuda.device(self.device):  # NCCL posts on the current device's streams
                run.execute()
        else:
            run.execute()


class _Run:
    """One operation's progress: posted works by message, waves in flight, receive buffers."""

    def __init__(self, t: P2PTransport, op: Op, prog: Program, masters: Masters, local_index_of: list[int],
                 op_name: str, epoch: int):
        self.t, self.op, self.prog = t, op, prog
        self.local_index_of = local_index_of
        self.where = f"rank {t.rank} {op_name} (epoch {epoch}, transport p2p)"
        mc = op == Op.MULTICAST
        self.members = masters.weights if mc else masters.grads
        self.member_off = t._members[op][0]
        self.dtype = t.layout.grad_dtype
        self.works: dict[Message, Any] = {}   # message -> its Work (a coalesced batch: the batch's one Work)
        self.done: set[int] = set()           # ids of Works that completed
        self.inbox: dict[Message, torch.Tensor] = {}  # reduce: received bytes until their task ran
        self.in_flight: list[list[Message]] = []

    def source(self, expert: int, self_slot: int, m: int, lo: int, hi: int) -> torch.Tensor:
        if self_slot == MASTER:
            return self.t._master_bytes(self.members, self.local_index_of[expert], m, self.member_off[m], lo, hi)
        return self.t._slot_bytes(self.op, self_slot, lo, hi)

    def wait(self, msg: Message, incoming: bool) -> None:
        work = self.works[msg]
        if id(work) in self.done:
            return
        try:
            work.wait(datetime.timedelta(seconds=self.t.timeout_s))
        except Exception as e:  # gloo: timeout or a closed connection (a dead peer)
            self.fail(msg, incoming, e)
        self.done.add(id(work))

    def fail(self, msg: Message, incoming: bool, cause: BaseException, posting: bool = False) -> NoReturn:
        raise peer_failure(self.where, self.describe(msg, incoming), msg.src if incoming else msg.dst, self.t.timeout_s,
                           cause, posting) from None

    def describe(self, msg: Message, incoming: bool) -> str:
        """What a wait was for: the peer, the expert, the chunk and the bytes."""
        what = f"expert {msg.expert} chunk {msg.chunk} (bytes [{msg.lo}, {msg.hi}) of"
        if self.op == Op.MULTICAST:
            return (f"receive {what} its slot {msg.slot}) from rank {msg.src}" if incoming else
                    f"send {what} rank {msg.dst}'s slot {msg.slot}) to rank {msg.dst}")
        return (f"receive {what} rank {msg.src}'s grad slot {msg.slot}) from rank {msg.src}" if incoming else
                f"send {what} its grad slot {msg.slot}) to rank {msg.dst}")

    def post(self, sends: list, recvs: list[Message]) -> None:
        ops, msgs = [], []
        for item in sends:
            m = item.msg
            ops.append(("send", self.source(m.expert, item.self_slot, m.member, m.lo, m.hi), m.dst, m.tag))
            msgs.append(m)
        for m in recvs:
            if self.op == Op.MULTICAST:
                buf = self.t._slot_bytes(self.op, m.slot, m.lo, m.hi)
            else:  # receive buffers live with the (cached) program: no allocation per operation
                buf = self.inbox[m] = self.prog.buffer(m, self.t.device)
            ops.append(("recv", buf, m.src, m.tag))
            msgs.append(m)
        if not ops:
            return
        try:
            handles = self.t.messenger.exchange(ops)
        except PostError as e:
            self.fail(msgs[e.index], msgs[e.index].dst == self.t.rank, e.cause, posting=True)
        for m, handle in zip(msgs, handles):
            self.works[m] = handle
        self.in_flight.append(msgs)

    def retire_oldest(self) -> None:
        for m in self.in_flight.pop(0):
            self.wait(m, incoming=m.dst == self.t.rank)

    def reduce(self, item) -> None:
        for m in item.sources:
            self.wait(m, incoming=True)
        dst = self.source(item.expert, item.self_slot, item.member, item.lo, item.hi)
        ordered_sum(dst, [self.inbox.pop(m) for m in item.sources], self.dtype)

    def execute(self) -> None:
        try:
            for wave in self.prog.waves:
                while len(self.in_flight) >= INFLIGHT_WAVES:
                    self.retire_oldest()
                for item in wave.reduces:  # in task-list order: a relay's partial before it is sent
                    self.reduce(item)
                for item in wave.sends:
                    if item.self_slot != MASTER and self.op == Op.MULTICAST:
                        for dep in self.prog.forward_deps[(item.self_slot, item.msg.chunk)]:
                            self.wait(dep, incoming=True)
                self.post(wave.sends, wave.recvs)
            while self.in_flight:
                self.retire_oldest()
        finally:
            self.inbox.clear()
        if self.t.device.type == "cuda":
            torch.cuda.current_stream(self.t.device).synchronize()
