"""The ``split`` transport on CUDA: the persistent ``tma`` kernel inside each memory domain, NCCL
across, one schedule, stream-ordered (the host never waits inside ``run``).

The kernel runs the rank's task lists unchanged over a pointer table in which ranks of other
domains are replaced by device shadows (:mod:`.cuda_shadow`).  A side stream moves the
chunks that cross domains -- the rank's :class:`~.bridge_program.BridgeProgram` compiled into
stream operations (:mod:`.stream`: why one side stream in one global order cannot
deadlock, and where each flag comes from) -- with NCCL, or on a one-GPU loopback domain with
one copy per message (:mod:`.cuda_movers`).  Per op, on the caller's stream::

    fork (event: the side stream starts after the caller's earlier work)
    kernel (tma; its join publishes digest and ready, which the side stream's headers send)
    join (wait for a host word the side stream writes last: the caller's later work starts after
          every crossing moved and was flagged, or after the watchdog gave up)

A peer on another plan: its digest lands in the shadow's ``digest[op]``, and the kernel's own
plan check raises ``PlanError``; a peer that never runs the op: the kernel's wait on the shadow
times out naming it (``UltracommTimeout``, its ready below the epoch).  Both come from
``check_error()`` like ``tma``'s.  A rank that rejects its plan publishes the rejection in its
window (``tma``'s ``reject``): ranks of its domain raise ``PlanError`` at once, ranks of other
domains (to which no header goes, as the rejecting rank has no program) time out naming it.

SMs: the kernel's CTAs per rank are capped at the device's SMs minus :data:`NCCL_SM_RESERVE`
(NCCL's point-to-point kernels need SMs of their own while the persistent kernel spins), and the
side stream's own NCCL group is made with at most that many CTAs and thread-block clusters off
(:func:`.cuda_movers.side_group`: sm_90's default clusters of 4 must fit in one GPC); the
loopback mover copies with copy engines and needs none.  16 is a guess until a device run.  Not capturable in a CUDA graph: the
side stream's flag operations carry the host's epoch as a literal (refused while capturing).

Failures (issue 35: no wait of the side stream whose only releaser is a peer): the caller's
stream joins the side stream through a pinned host word that a watchdog releases after the
timeout (:mod:`.cuda_watchdog`: the same bound as the kernel's own waits, so the named error
comes within a few 2 ms polls of start + timeout).  The watchdog then aborts the side stream's
own NCCL group (:meth:`.cuda_movers.NcclMessenger.abort`: a receive whose peer died returns) and
opens the side stream's gates (:mod:`.cuda_gates`: its flag writes are skipped from before the
abort, its flag waits leave after it), so the side stream drains and a later ``torch.cuda.synchronize()`` returns.  A cross-
domain peer that dies gives ``UltracommTimeout`` at ``Work.wait()`` (the kernel's, naming the peer
it waited for, or the watchdog's, naming the stuck message).  A failure the kernel reports (its
error at ``check_error``) releases a side stream with an op in flight the same way.  The side stream is the
transport's own non-blocking stream; nothing here synchronizes the device.  CUDA does not see
the ordering that stream waits make, so with ``CUDA_DEVICE_MAX_CONNECTIONS=1`` (one hardware
queue for all streams) work queued behind a blocked gate may wait for its release: a warning says
so.  After a failure the Context still skips device-wide synchronisation and keeps the window,
the kernel's plans and the shadows allocated (a gate or an NCCL kernel that passed its wait
just before the abort may still be writing).  Status: on an H200 (perf/gpu/README.md) a one-GPU
loopback domain matches the host executor bit for bit and refuses ranks on different plans; a
stalled cross-domain rank hung the caller's stream there before the gates and the group abort
(run 3); those have not run on a device yet.  Shadows are full-size allocations
(:mod:`.cuda_shadow`).
"""

from __future__ import annotations

import logging
import threading
from typing import Any, Callable, Sequence

import torch

from ...cuda.support import make_error_record, raise_record
from ...env import cuda_device_max_connections
from ...errors import InputError, UltracommError
from ...cuda.loopback_launch import Deposit, launches_for
from ...records import Op
from .bridge_program import build_bridge_program
from ..base import Masters, Transport, op_digest
from ..p2p.waves import cached_program
from .cuda_gates import GATE_SM_RESERVE, Gates
from .cuda_movers import Spaces, enqueue_loopback, enqueue_rank_stream, side_group
from ..copy_engine.watchdog import KEPT, abandoned, device_watchdogs, quiesce
from .cuda_shadow import DeviceShadows
from .cuda_watchdog import DONE, PROGRESS, STARTED, SideWatchdog, progress_value
from .stream import loopback_sequence, stream_program
from ..tma.loopback import raiser

__all__ = ["SplitCudaTransport", "NCCL_SM_RESERVE"]

log = logging.getLogger("ultracomm")

NCCL_SM_RESERVE = 16  # SMs the persistent kernel leaves free for NCCL's kernels (its p2p uses a few channels)
_CACHE = 128
_LOCK = threading.Lock()  # the loopback domain's shared dict
_DIGEST_MISMATCH = 2  # ErrorCode kDigestMismatch (include/ultracomm/records/error_record.h)
_KEPT = KEPT  # (kernel, shadows, watchdog) of transports closed with a blocked side stream land here


class SideStream:
    """The transport's own side stream (driver-made, non-blocking: no other code's work shares it),
    forked from the caller's stream with an event (the join is a host word: :meth:`SplitCudaTransport._bridged`)."""

    def __init__(self, drv: Any, device: Any):
        self.drv, self.device = drv, device
        self.handle: int | None = None
        self.stream: Any = None
        self.event: Any = None

    def get(self) -> tuple[int, Any]:
        """(stream handle, the same as a torch stream)."""
        if self.handle is None:
            self.handle = self.drv.stream_create()
            self.stream = torch.cuda.ExternalStream(self.handle, device=self.device)
        return self.handle, self.stream

    def fork(self, caller: int) -> None:
        if self.event is None:  # one event, re-recorded: wait_event captures its state when called
            self.event = torch.cuda.Event()
        self.event.record(torch.cuda.ExternalStream(caller, device=self.device))
        self.get()[1].wait_event(self.event)

    def close(self) -> None:
        if self.handle is not None:
            self.drv.stream_destroy(self.handle)
            self.handle, self.stream = None, None


class SplitCudaTransport(Transport):
    """``tma`` inside a domain, NCCL (loopback: copies) across; see the module docstring.

    Args (given by the Context): ``comm``, ``rank``, ``world``, ``window`` (``cuda_ipc`` mapping
    this rank's domain, or ``cuda_local``), ``wlayout``, ``layout``, ``timeout_s``,
    ``multicast_sms``/``reduce_sms`` and ``domain_of`` (every rank's domain index).  ``tma``,
    ``drv``, ``messenger``, ``side``, ``dog`` and ``gates`` replace the parts built here (tests)."""

    name = "split"
    window_providers = ("cuda_ipc", "cuda_local")
    stream_ordered = True
    options = frozenset({"comm", "num_workers", "jitter_us", "multicast_sms", "reduce_sms", "domain_of"})
    window_flags = True

    def __init__(
        self,
        *,
        comm: Any,
        rank: int,
        world: int,
        window,
        wlayout: dict,
        layout,
        num_workers: int,
        timeout_s: float,
        jitter_us: int = 0,
        multicast_sms: int | None = None,
        reduce_sms: int | None = None,
        domain_of: Sequence[int] | None = None,
        tma: Any = None,
        drv: Any = None,
        messenger: Any = None,
        side: Any = None,
        dog: Any = None,
        gates: Any = None,
    ):
        if domain_of is None or len(domain_of) != world:
            raise InputError(
                f"ultracomm: transport 'split' needs domain_of, one memory domain per rank ({world}); got {domain_of!r}"
            )
        self.rank, self.world = rank, world
        self.window, self.wlayout, self.layout = window, dict(wlayout), layout
        self.timeout_s = float(timeout_s)
        self.domain_of = tuple(int(d) for d in domain_of)
        me = self.domain_of[rank]
        for r, b in enumerate(window.peer_bases):
            if self.domain_of[r] == me and not b:
                raise InputError(
                    f"ultracomm: transport 'split': rank {r} is in this rank's memory domain but the "
                    "window does not reach it"
                )
        self.loopback = bool(getattr(window, "loopback", False))
        if drv is None:
            from ...cuda.driver import driver

            drv = driver()
        if tma is None:
            from ..tma import TmaTransport

            tma = TmaTransport(
                rank=rank,
                world=world,
                window=window,
                wlayout=wlayout,
                layout=layout,
                num_workers=num_workers,
                timeout_s=timeout_s,
                multicast_sms=multicast_sms,
                reduce_sms=reduce_sms,
            )
            # the side stream's gates (one CTA each) and NCCL's kernels run beside the persistent kernel
            cap = (
                max(1, tma.runner.sm_count - NCCL_SM_RESERVE)
                if not self.loopback
                else max(1, (tma.runner.sm_count - GATE_SM_RESERVE) // world)
            )  # loopback: one launch of every rank
            tma.multicast_sms, tma.reduce_sms = min(tma.multicast_sms, cap), min(tma.reduce_sms, cap)
        self.tma, self.drv = tma, drv
        self.shadows = DeviceShadows(rank, self.domain_of, wlayout["total_bytes"], window.local.device)
        self.spaces = Spaces(window.local, self.shadows)
        # other domains' entries: their shadows (NO_SHADOW until an op crosses there), never their real
        # windows, even where the window reaches them (cuda_local: every rank on one GPU)
        self.tma._bases = self.shadows.bases(window.peer_bases)
        crosses = any(d != me for d in self.domain_of)
        if messenger is None and crosses and not self.loopback:
            from ..p2p.messengers import messenger_for

            m = messenger_for(comm, world, window.local.device)  # checks the group is NCCL
            messenger = side_group(m.group, world, window.local.device, NCCL_SM_RESERVE)
        self.messenger = messenger
        if crosses and cuda_device_max_connections() == 1:
            log.warning(
                "ultracomm split: CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of the device in one "
                "hardware queue: if a cross-domain peer fails, the watchdog's release of this rank's "
                "stream may not reach work queued behind the blocked side stream (it can hang instead of "
                "raising UltracommTimeout); leave the variable unset or > 1 with this transport"
            )
        self.side = side if side is not None else SideStream(drv, window.local.device)
        self.dog = dog if dog is not None else SideWatchdog(rank, timeout_s, self._on_dog_failure)
        if getattr(self.dog, "abort_group", None) is None and hasattr(self.messenger, "abort"):
            self.dog.abort_group = self.messenger.abort  # a timeout aborts the side stream's NCCL group
        self.gates = gates if gates is not None else Gates(self.dog.gate_addrs())
        self._errors: list[BaseException] = []
        self._programs: dict = {}
        self._seqs: dict = {}  # loopback: (op digest) -> the domain's merged side-stream sequence
        if self.loopback:
            self._launches = launches_for(window, "ultracomm.split_cuda_launches")
            key = ("ultracomm.split_cuda_spaces", tuple(int(b) for b in window.peer_bases))
            with _LOCK:
                self._spaces_of = window.shared.setdefault(key, {})
                self._spaces_of[rank] = self.spaces
        # loopback: the domain's side streams share the device: one failed, all skip device-wide syncs
        self._dogs = device_watchdogs(window, "ultracomm.split_cuda_dogs", self.dog, self.loopback)

    # ------------------------------------------------------------------ plans
    def program(self, op: Op, schedule) -> tuple[Any, list]:
        """(BridgeProgram, this rank's stream operations) of ``op`` for ``schedule``, cached."""
        slot_bytes = self.wlayout["weight_slot_bytes" if op == Op.MULTICAST else "grad_slot_bytes"]

        def build(slot_src, home_of):
            prog = build_bridge_program(
                op,
                schedule,
                self.rank,
                schedule.tasks(op, self.rank),
                schedule.refs(op, self.rank),
                slot_src,
                home_of,
                self.domain_of,
                self.wlayout["chunk_bytes"],
                slot_bytes,
            )
            return prog, stream_program(prog, self.wlayout)

        return cached_program(self._programs, schedule, op, self.world, build, _CACHE)

    def _ensure_shadows(self, peers: Sequence[int]) -> None:
        if self.shadows.ensure(peers):  # new shadows: later plans get them in their pointer table
            self.tma._bases = self.shadows.bases(self.window.peer_bases)
            log.debug(
                "ultracomm split: rank %d holds %d device shadows (%d bytes)",
                self.rank,
                len(self.shadows.views),
                self.shadows.bytes_held(),
            )

    # ------------------------------------------------------------------ run
    def run(
        self,
        op: Op,
        schedule,
        epoch: int,
        masters: Masters,
        my_slots: Sequence[int],
        local_index_of: Sequence[int],
        op_name: str | None,
        stream: int,
    ) -> bool:
        """Enqueue ``op`` of ``schedule`` for this rank at ``epoch`` on ``stream`` (module docstring)."""
        op = Op(int(op))
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise UltracommError(
                "ultracomm: transport 'split' cannot be captured in a CUDA graph (its side stream's "
                "flag operations carry the epoch as a literal); run it outside the capture"
            )
        self._bind()  # before the first driver call (shadows, the side stream) on this thread
        self.gates.collect(idle=self.dog.pending() == 0 and not self.dog.failed())
        prog, ops = self.program(op, schedule)
        self._ensure_shadows(prog.peers)
        if self.loopback:
            self.tma.loopback_arena(masters, local_index_of)  # the launch writes the plan into its arena
            key, make = self.tma._rank_args(op, schedule, masters, my_slots, local_index_of)
            ctas = self.tma.multicast_sms if op == Op.MULTICAST else self.tma.reduce_sms
            item = ((key, make, ctas, op_name), prog, op_digest(schedule.digest, op))
            return self._launches.deposit(
                Deposit(self.rank, int(op), int(epoch), int(stream), item), self._launch_loopback
            )
        if not prog.peers:  # nothing crosses here in this op: the kernel alone
            return self.tma.run(op, schedule, epoch, masters, my_slots, local_index_of, op_name, stream)
        side, side_stream = self.side.get()
        self._bridged(
            stream,
            int(epoch),
            op_name or op.name.lower(),
            ops,
            lambda: self.tma.run(op, schedule, epoch, masters, my_slots, local_index_of, op_name, stream),
            lambda mark: enqueue_rank_stream(
                ops, int(epoch), self.spaces, side, self.drv, self.messenger, side_stream, mark, gates=self.gates
            ),
        )
        return True

    def _bridged(
        self,
        stream: int,
        epoch: int,
        name: str,
        ops: Sequence,
        launch: Callable[[], Any],
        enqueue: Callable[[Callable[[int], None]], None],
    ) -> None:
        """fork; the kernel (``launch``); on the side stream started, the crossings with a progress
        word after each message (``enqueue(mark)``), done; the caller's stream joins on done (a
        host word the watchdog can release)."""
        dog, drv = self.dog, self.drv
        self.side.fork(stream)
        launch()
        side = self.side.get()[0]
        try:
            drv.write_value(side, dog.addr(STARTED), epoch)
            enqueue(lambda k: drv.write_value(side, dog.addr(PROGRESS), progress_value(epoch, k)))
            drv.write_value(side, dog.addr(DONE), epoch)
            drv.wait_value(stream, dog.addr(DONE), epoch)
        except BaseException as e:
            # part of the op is queued (the kernel, maybe waits or a receive on the side stream) and may
            # never finish: fail like a watchdog timeout so nothing waits for it (abandoned_streams)
            err = UltracommError(
                f"ultracomm: rank {self.rank} {name} (epoch {epoch}, transport split): enqueueing "
                f"the side stream failed ({type(e).__name__}: {e}); this Context cannot be used "
                f"further: close it"
            )
            dog.abandon(err)
            if self.loopback:  # the other ranks of the launch raise it at their check_error
                self.tma._loopback.record_failure(raiser(err), None, raised_by=self.rank)
            raise err from e
        dog.add(epoch, name, ops)

    def _launch_loopback(self, deps: Sequence[Deposit]) -> None:
        """Every loopback rank deposited: fork, one kernel launch for all, the merged crossings on
        one side stream, join (all on the one stream every rank used)."""
        stream, epoch = deps[0].stream, max(d.epoch for d in deps)
        self._bind()  # the launching rank's thread
        self._check_plans(deps, epoch)
        seq = self._seqs.get(deps[0].item[2])  # every rank's op digest is the same (checked above)
        if seq is None:
            if len(self._seqs) >= _CACHE:
                self._seqs.clear()
            seq = self._seqs[deps[0].item[2]] = loopback_sequence(
                [d.item[1] for d in deps if d.item[1].peers], self.wlayout
            )
        kernel = [Deposit(d.rank, d.op, d.epoch, d.stream, d.item[0]) for d in deps]
        if not seq:
            self.tma._loopback.launch(kernel, self.rank)
            return
        spaces_of, side = self._spaces_of, self.side.get()[0]
        self._bridged(
            stream,
            int(epoch),
            deps[0].item[0][3] or Op(int(deps[0].op)).name.lower(),
            seq,
            lambda: self.tma._loopback.launch(kernel, self.rank),
            lambda mark: enqueue_loopback(seq, int(epoch), spaces_of, side, self.drv, mark, gates=self.gates),
        )

    def _check_plans(self, deps: Sequence[Deposit], epoch: int) -> None:
        """Loopback ranks on different plans would merge bridge programs that do not pair up: raise
        the kernel's own PlanError on every rank instead (rank r names the first rank whose digest
        differs from its own), before anything is enqueued."""
        digests = [d.item[2] for d in deps]
        if len(set(digests)) == 1:
            return
        op, name = int(deps[0].op), deps[0].item[0][3]

        def throw(me: int, op_name: str | None, timeout_s: float) -> None:
            q = next(r for r, d in enumerate(digests) if d != digests[me])
            raise_record(
                make_error_record(_DIGEST_MISMATCH, me, op, epoch, peer=q, observed=digests[q], expected=digests[me]),
                op_name,
                timeout_s,
            )

        self.tma._loopback.record_failure(throw, name, raised_by=self.rank)
        throw(self.rank, name, self.timeout_s)

    # ------------------------------------------------------------------ the rest of the contract
    def reject(self, op: Op, epoch: int, stream: int) -> None:
        """This rank rejected its plan: publish it in its window (module docstring: who learns)."""
        self.tma.reject(op, epoch, stream)

    def _on_dog_failure(self, err: BaseException) -> None:
        """The watchdog released a join (its thread): loopback -- every rank raises it; else this rank."""
        if self.loopback:
            self.tma._loopback.record_failure(raiser(err), None)
        else:
            self._errors.append(err)

    def check_error(self) -> None:
        """Raise the first failure recorded since the last call: the kernel's (as ``tma``: it names
        the peer it waited for), then the watchdog's (a side-stream message that never completed).
        A kernel's failure releases a side stream with an op still in flight
        (:meth:`.cuda_watchdog.SideWatchdog.abandon`: the group abort, the gates) before it is
        raised: its later waits may never be satisfied.  One with nothing in flight (e.g. plans
        that differ, found before anything was enqueued) is left as it is."""
        try:
            self.tma.check_error()
        except BaseException as e:
            for d in self._dogs:  # loopback: the domain's side streams (the launching rank's holds the op)
                if d.pending():
                    d.abandon(e)
            raise
        if self._errors:
            raise self._errors.pop(0)

    def quiesce(self) -> None:
        """Wait until no op of this domain's side streams is in flight (each ends done or failed
        within the timeout once its stream reached it), before a device-wide synchronize."""
        quiesce(self._dogs)

    def abandoned_streams(self) -> bool:
        """True after a watchdog released a join: a side stream stays blocked (module docstring), so a
        device-wide synchronize would not return and the window must stay mapped."""
        return abandoned(self._dogs)

    def close(self) -> None:
        """Stop the watchdog; free plans, shadows and the side stream (after the caller's synchronize;
        after a failure the Context keeps the window mapped: :meth:`abandoned_streams`)."""
        self.dog.stop()
        self._bind()
        if self.abandoned_streams():
            # freeing the kernel's plans, its runner or the shadows is a cudaFree, which waits for every
            # stream of the device: the blocked side stream never finishes (and may still write shadows)
            _KEPT.append((self.tma, self.shadows, self.dog))  # the dog's pinned words too: queued writes
        else:
            self.tma.close()
            self.shadows.close()
            if self.messenger is not None and hasattr(self.messenger, "close"):
                self.messenger.close()
        self.side.close()

    def _bind(self) -> None:
        """Make the device's primary context current on this thread before driver calls (a rank's
        or the closing thread may have made no runtime call yet: :meth:`Driver.bind`)."""
        self.drv.bind(self.window.local.device.index or 0)
