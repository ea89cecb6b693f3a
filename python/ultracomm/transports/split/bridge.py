"""The ``split`` transport's bridge: moves one op's crossings (:mod:`.bridge_program`) between the
interpreter's shadows and the peers' real windows, honouring the window protocol on both ends.

Two lanes beside the interpreter (which runs unchanged over real windows and shadows), each a
thread that lives as long as the transport (:class:`BridgeLanes`; starting two threads per op
cost ~1 ms on a loaded 2-core host, perf/README.md section 6b).  Before the interpreter starts,
the calling thread posts this op's headers and every receive (pre-posted: a peer's data never
waits for a lane to be scheduled), then hands the rest to the lanes:

* header -- (this op's epoch and schedule digest) exchanged with a peer only when the op's
  digest differs from the last one exchanged with that peer for this op kind (the first op, a
  new plan): ranks run the same ops in the same order, so both ends decide alike.  Without a
  header the shadow's ``digest[op]`` / ``ready[op]`` words are set to this rank's own (what the
  peer's header would say), so the interpreter's joined checks pass at once.
* send lane -- per crossing in key order: wait (acquire, bounded) for the flag that says the
  chunk is complete -- multicast: the ``arrival`` flag the interpreter raised in its shadow of
  the receiver; reduce: this rank's own ``grad_ready`` -- and send the chunk.  Reduce: once a
  send completed the bytes have left the slot, so the bridge raises this rank's own
  ``consumed`` flag (release), which the parent's interpreter would have raised: the slot may
  be reused and the drain can finish.
* receive lane -- per peer the header: the peer's digest goes into the shadow's ``digest[op]``
  word, then its epoch into ``ready[op]`` (release), as the peer's own join would publish them,
  so the interpreter's joined/plan checks read the peer's real values; a digest other than ours
  raises ``PlanError`` (``rank q rejected its plan`` for the rejection digest), an epoch other
  than ours says the ranks are out of step.  Then per crossing in key order: wait for the
  message, and raise the flag a remote writer would have raised (release) -- multicast: own
  ``arrival`` (the chunk landed in the real slot, relays and the drain proceed); reduce: the
  shadow's ``grad_ready`` (the puller's interpreter sums it in its usual order).

Failures.  Every wait is bounded by the Context timeout and fails naming rank, op, epoch, peer,
expert, chunk and what was awaited.  The first failure of either side (bridge or interpreter)
wins and raises the abort word: the interpreter's workers stop at their next wait
(``_core.AbortedError``), the bridge at its next flag wait; a message wait already under way
ends within the timeout.
"""

from __future__ import annotations

import datetime
import queue
import threading
import weakref
from typing import Any, Callable, NoReturn, Optional

import numpy as np
import torch

from ... import _core
from ...errors import PlanError, UltracommError, UltracommTimeout
from ...records import Op
from .bridge_program import HEADER_TAG, BridgeProgram, Crossing
from ..p2p.messengers import PostError, peer_failure

__all__ = ["BridgeRun", "BridgeLanes", "INFLIGHT_SENDS"]

INFLIGHT_SENDS = 8  # sends posted before the oldest must complete


def _lane_loop(q: queue.SimpleQueue) -> None:
    while True:
        job = q.get()
        if job is None:
            return
        job()
        del job  # hold nothing of a finished op while idle


class BridgeLanes:
    """The send and the receive lane of one transport: two daemon threads that run each op's
    bridge work in turn, and the header state (``digests[(peer, op)]``: the op digest last
    exchanged with ``peer`` for ``op``).  The threads hold only their queues; dropping the
    lanes (with the transport) stops them."""

    def __init__(self, name: str):
        self.digests: dict[tuple[int, int], int] = {}
        self._queues = (queue.SimpleQueue(), queue.SimpleQueue())
        for q, lane in zip(self._queues, ("send", "recv")):
            threading.Thread(target=_lane_loop, args=(q,), name=f"{name}-{lane}", daemon=True).start()
        self._finalizer = weakref.finalize(self, _stop_lanes, self._queues)

    def submit(self, lane: int, job: Callable[[], None]) -> None:
        """Run ``job`` on lane 0 (send) or 1 (receive), after the lane's earlier jobs."""
        self._queues[lane].put(job)

    def close(self) -> None:
        self._finalizer()


def _stop_lanes(queues: tuple) -> None:
    for q in queues:
        q.put(None)


class BridgeRun:
    """One op's bridge on one rank.  ``window``: this rank's real window (``local`` tensor and
    ``base``); ``shadows``: :class:`~.shadow.Shadows`; ``wl``: the window layout dict;
    ``abort``: an int64 tensor of one element, the abort word shared with the interpreter.
    :meth:`start` with the transport's :class:`BridgeLanes` (without: two threads of its own and a
    header with every peer, as a one-off bridge)."""

    def __init__(
        self,
        messenger: Any,
        prog: BridgeProgram,
        epoch: int,
        digest: int,
        local: torch.Tensor,
        own_base: int,
        shadows: Any,
        wl: dict,
        abort: torch.Tensor,
        timeout_s: float,
        where: str,
    ):
        self.m, self.prog, self.epoch, self.digest = messenger, prog, int(epoch), int(digest)
        self.local, self.own_base, self.shadows, self.wl = local, int(own_base), shadows, wl
        self.abort, self.abort_addr = abort, int(abort.data_ptr())
        self.timeout_s, self.where = float(timeout_s), where
        self.mc = prog.op == Op.MULTICAST
        self._lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self._finished = [threading.Event(), threading.Event()]  # send lane, receive lane
        self._hsend: list[tuple[int, Any]] = []  # posted header sends
        self._hrecv: list[tuple[int, Any, torch.Tensor]] = []  # posted header receives
        self._posted: list[tuple[Crossing, Any, str]] = []  # posted data receives

    # ------------------------------------------------------------------ failures
    def fail(self, error: BaseException) -> None:
        """Record ``error`` if it is the first failure of this op, and stop everyone."""
        with self._lock:
            if self.error is None:
                self.error = error
        _core.store_release(self.abort_addr, 1)

    def _guard(self, body: Callable[[], None], done: threading.Event) -> Callable[[], None]:
        def job() -> None:
            try:
                body()
            except BaseException as e:  # noqa: BLE001 - reported by run()
                self.fail(e)
            finally:
                done.set()

        return job

    def stopped(self) -> bool:
        return _core.load_acquire(self.abort_addr) != 0

    def _timeout(self, what: str, peer: int, cause: Optional[BaseException] = None, posting: bool = False) -> NoReturn:
        raise peer_failure(self.where, what, peer, self.timeout_s, cause, posting)

    # ------------------------------------------------------------------ addresses
    def _slot_off(self, slot: int) -> int:
        wl = self.wl
        return wl["weights_off"] + wl["weight_stride"] * slot if self.mc else wl["grads_off"] + wl["grad_stride"] * slot

    def _flag_off(self, kind: str, slot: int, chunk: int) -> int:
        wl = self.wl
        per = wl["weight_chunks"] if kind == "arrival" else wl["grad_chunks"]
        return wl[f"{kind}_off"] + 8 * (slot * per + chunk)

    def _chunk(self, x: Crossing) -> str:
        return f"expert {x.expert} chunk {x.chunk} (bytes [{x.lo}, {x.hi}) of"

    # ------------------------------------------------------------------ posting (calling thread)
    def _wait_flag(self, addr: int, waited: str) -> bool:
        """Wait for a flag this rank's own interpreter raises.  Bounded by twice the timeout: the
        interpreter's own waits (which name the peer they wait for) fail first and stop the bridge."""
        bound = 2 * self.timeout_s
        status, seen = _core.wait_flag(addr, self.epoch, bound, self.abort_addr)
        if status == 1:
            raise UltracommTimeout(
                f"ultracomm: {self.where} gave up after waiting up to {bound:g} s for {waited} "
                f"(flag {seen}, epoch {self.epoch}); this rank's interpreter never produced it "
                f"(timeout ULTRACOMM_TIMEOUT_S={self.timeout_s:g})"
            )
        return status == 0

    def _post(self, kind: str, buf: torch.Tensor, peer: int, tag: int, what: str) -> Any:
        try:
            return self.m.exchange([(kind, buf, peer, tag)])[0]
        except PostError as e:
            self._timeout(what, peer, e.cause, posting=True)

    def _complete(self, work: Any, what: str, peer: int) -> None:
        try:
            work.wait(datetime.timedelta(seconds=self.timeout_s))
        except Exception as e:  # noqa: BLE001 - gloo: timeout or a closed connection
            self._timeout(what, peer, e)

    def _post_early(self, header_peers: tuple[int, ...]) -> None:
        """Headers (with ``header_peers``) and every receive of this op, posted before the interpreter
        starts; the shadow words of peers without a header get this rank's own epoch and digest."""
        op = int(self.prog.op)
        for q in self.prog.peers:
            if q not in header_peers:  # what its header would say: same op digest, this epoch
                base = self.shadows.base(q)
                _core.store_release(base + self.wl["digest_off"] + 8 * op, self.digest)
                _core.store_release(base + self.wl["ready_off"] + 8 * op, self.epoch)
        if header_peers:
            hdr = torch.from_numpy(np.array([self.epoch, self.digest], dtype=np.uint64).view(np.uint8))
            self._hsend = [
                (q, self._post("send", hdr, q, HEADER_TAG, f"send its header to rank {q}")) for q in header_peers
            ]
            for q in header_peers:
                buf = torch.zeros(16, dtype=torch.uint8)
                self._hrecv.append((q, self._post("recv", buf, q, HEADER_TAG, f"receive the header of rank {q}"), buf))
        for x in self.prog.recvs:
            if self.mc:  # into the real slot
                what = f"receive {self._chunk(x)} its slot {x.slot}) from rank {x.src}"
                buf = self.local[self._slot_off(x.slot) + x.lo : self._slot_off(x.slot) + x.hi]
            else:  # into the shadow of the source
                what = f"receive {self._chunk(x)} rank {x.src}'s grad slot {x.slot}) from rank {x.src}"
                view = self.shadows.views[x.src]
                buf = view[self._slot_off(x.slot) + x.lo : self._slot_off(x.slot) + x.hi]
            self._posted.append((x, self._post("recv", buf, x.src, x.tag, what), what))

    # ------------------------------------------------------------------ send lane
    def _send(self) -> None:
        inflight: list[tuple[Crossing, Any, str]] = []
        for x in self.prog.sends:
            if self.mc:  # the interpreter wrote the chunk into its shadow of x.dst, then raised arrival there
                what = f"send {self._chunk(x)} rank {x.dst}'s slot {x.slot}) to rank {x.dst}"
                flag = self.shadows.base(x.dst) + self._flag_off("arrival", x.slot, x.chunk)
                buf = self.shadows.views[x.dst][self._slot_off(x.slot) + x.lo : self._slot_off(x.slot) + x.hi]
                waited = (
                    f"its own copy of {self._chunk(x)} rank {x.dst}'s slot {x.slot}) into its shadow of rank {x.dst}"
                )
            else:  # own grad slot, complete once own grad_ready is raised (leaf: join; relay: its partial)
                what = f"send {self._chunk(x)} its grad slot {x.slot}) to rank {x.dst}"
                flag = self.own_base + self._flag_off("grad_ready", x.slot, x.chunk)
                buf = self.local[self._slot_off(x.slot) + x.lo : self._slot_off(x.slot) + x.hi]
                waited = f"its own grad_ready of {self._chunk(x)} its grad slot {x.slot}) for rank {x.dst}"
            if not self._wait_flag(flag, waited):
                return
            inflight.append((x, self._post("send", buf, x.dst, x.tag, what), what))
            while len(inflight) > INFLIGHT_SENDS:
                self._retire(*inflight.pop(0))
        while inflight:
            self._retire(*inflight.pop(0))
        for q, work in self._hsend:
            self._complete(work, f"send its header to rank {q}", q)

    def _retire(self, x: Crossing, work: Any, what: str) -> None:
        self._complete(work, what, x.dst)
        if not self.mc:  # the bytes left the slot: what the parent's consumed flag says
            _core.store_release(self.own_base + self._flag_off("consumed", x.slot, x.chunk), self.epoch)

    # ------------------------------------------------------------------ receive lane
    def _recv(self) -> None:
        if not self._recv_headers():
            return
        for x, work, what in self._posted:
            if self.stopped():
                return
            self._complete(work, what, x.src)
            self._landed(x)

    def _recv_headers(self) -> bool:
        """The peers' headers (their joins), published as their windows would show them; False
        once the run stopped."""
        for q, work, buf in self._hrecv:
            if self.stopped():
                return False
            self._complete(work, f"receive the header of rank {q} (its join: it never started this op)", q)
            self._publish_header(q, buf.numpy().view(np.uint64))
        return True

    def _landed(self, x) -> None:
        """Crossing ``x``'s bytes arrived: raise the flag its reader waits on (multicast: own
        arrival; reduce: the source's grad_ready in its shadow)."""
        if self.mc:
            flag = self.own_base + self._flag_off("arrival", x.slot, x.chunk)
        else:
            flag = self.shadows.base(x.src) + self._flag_off("grad_ready", x.slot, x.chunk)
        _core.store_release(flag, self.epoch)

    def _publish_header(self, q: int, hdr: np.ndarray) -> None:
        """Peer ``q``'s join, as its window would show it: digest, then ready (release)."""
        epoch, digest = int(hdr[0]), int(hdr[1])
        base, op = self.shadows.base(q), int(self.prog.op)
        _core.store_release(base + self.wl["digest_off"] + 8 * op, digest)
        _core.store_release(base + self.wl["ready_off"] + 8 * op, epoch)
        if epoch != self.epoch:
            raise UltracommError(
                f"ultracomm: {self.where}: rank {q} sent the header of epoch {epoch}, this rank is at "
                f"epoch {self.epoch}: the ranks called their operations in different orders"
            )
        if digest != self.digest:
            why = (
                "rejected its plan"
                if digest == _core.REJECTED_DIGEST
                else f"runs another plan (schedule digest {digest:016x}, this rank's {self.digest:016x})"
            )
            raise PlanError(f"ultracomm: {self.where}: rank {q} {why}; every rank must pass the same valid plan")

    # ------------------------------------------------------------------ driver
    def start(self, lanes: Optional[BridgeLanes] = None) -> None:
        """Post the headers and receives here, then run the send and receive lanes: on ``lanes``
        (headers only with peers whose last exchanged digest for this op differs), or on two
        threads of this op's own (a header with every peer)."""
        op = int(self.prog.op)
        if lanes is None:
            header_peers = self.prog.peers
        else:
            header_peers = tuple(q for q in self.prog.peers if lanes.digests.get((q, op)) != self.digest)
            for q in self.prog.peers:  # both ends decide alike: they ran the same ops
                lanes.digests[(q, op)] = self.digest
        try:
            self._post_early(header_peers)
        except BaseException as e:  # noqa: BLE001 - reported by run(); the interpreter stops at once
            self.fail(e)
            for ev in self._finished:
                ev.set()
            return
        jobs = [
            (0, self._send, bool(self.prog.sends or self._hsend)),
            (1, self._recv, bool(self._posted or self._hrecv)),
        ]
        for lane, body, needed in jobs:
            if not needed:
                self._finished[lane].set()
            elif lanes is not None:
                lanes.submit(lane, self._guard(body, self._finished[lane]))
            else:
                threading.Thread(
                    target=self._guard(body, self._finished[lane]),
                    daemon=True,
                    name=f"ultracomm-bridge-{('send', 'recv')[lane]}-r{self.prog.rank}",
                ).start()

    def join(self) -> bool:
        """Wait for both lanes' work of this op (each wait of theirs is bounded); False if one is
        still blocked after twice the timeout (it is left to finish on its own)."""
        for ev in self._finished:
            ev.wait(2 * self.timeout_s + 5)
        return all(ev.is_set() for ev in self._finished)
