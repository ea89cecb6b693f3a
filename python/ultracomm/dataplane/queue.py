"""How a Context's operations reach its transport: one order, one epoch each, one failure.

Epochs are taken under a lock in the order the caller submits, whatever thread calls.  A
blocking transport (host, p2p, split on the CPU) runs each operation on the Context's own thread
(:class:`~ultracomm.work.OrderedRunner`; a synchronous call with nothing queued runs on the
calling thread); a stream-ordered one enqueues it on the caller's CUDA stream
(:class:`~ultracomm.cuda.stream_ordered.StreamOrdered`).  The first failure breaks the queue:
it is published in the window (blame by evidence) and every later operation is refused with an
error of the same kind (a timeout stays an ``UltracommTimeout``, a plan mismatch a
``PlanMismatchError``), naming it.
"""

from __future__ import annotations

import functools
import logging
import threading
from typing import Any, Callable

from ..errors import PlanError, UltracommError, same_kind
from ..records import Op
from ..transports.device_schedule import DeviceSchedule
from ..work import OrderedRunner, Work

__all__ = ["OpQueue", "release"]

log = logging.getLogger("ultracomm")


class OpQueue:
    """The operations of one Context on one rank (see the module docstring).

    ``streams``: the stream-ordered front end (None for a blocking transport); ``slot_of(mb)``:
    the plan-arena slot an operation passes (None: the transport takes none); ``profiler``: the
    Context's recorder or None."""

    def __init__(
        self,
        transport: Any,
        rank: int,
        runner: OrderedRunner,
        witness: Any,
        profiler: Any,
        slot_of: Callable[[Any], int | None],
    ):
        self.transport, self.rank, self.runner, self.witness = transport, rank, runner, witness
        self.profiler, self.slot_of = profiler, slot_of
        self.streams: Any = None
        self.epoch = 0
        self.lock = threading.Lock()
        self.broken: str | None = None  # the first failure's text ("Type: message")
        self.broken_by: BaseException | None = None  # and the failure itself: later refusals raise its kind

    # -- failure --------------------------------------------------------------------------------
    def fail(self, error: BaseException) -> None:
        """Remember the first failure: later operations are refused (ranks' epochs no longer line up)."""
        self.witness.publish_once(self.epoch, f"{type(error).__name__}")
        if self.broken is None:
            self.broken, self.broken_by = f"{type(error).__name__}: {error}", error

    def failed_earlier(self, text: str) -> UltracommError:
        """An operation refused because an earlier one failed: the same kind of error as that
        failure, with its text."""
        return same_kind(self.broken_by, f"{text} ({self.broken}); create a new Context")

    def check(self) -> None:
        if self.broken is not None:
            raise self.failed_earlier("ultracomm: this Context failed earlier")

    def reject(self, error: BaseException) -> None:
        """Window plan check: this rank's plan is invalid.  It takes the operation's epoch and
        publishes a rejection in its window instead of running it -- after the operations
        submitted before it, as the operation would have run -- so peers fail at once; then
        the queue is broken.  Raises ``error``."""
        if self.broken is None:
            reason = PlanError(f"ultracomm: this rank rejected its plan ({error})")
            with self.lock:
                self.epoch += 1
                epoch = self.epoch
                reject = self.streams.reject if self.streams is not None else self.transport.reject

                def publish() -> None:
                    try:
                        reject(Op.MULTICAST, epoch)
                    finally:
                        self.fail(reason)

                if self.streams is not None:  # stream-ordered: enqueued now, after the earlier operations
                    publish()
                else:
                    self.runner.submit(f"plan rejection (rank {self.rank}, epoch {epoch})", publish)
        raise error

    # -- operations -----------------------------------------------------------------------------
    def submit(
        self,
        name: str,
        op: Op,
        mb: Any,
        masters: Any,
        async_op: bool,
        before: Callable[[], None] | None = None,
        after: Callable[[], None] | None = None,
    ) -> Work | None:
        """Run (or enqueue) ``op`` of ``mb``'s schedule as operation ``name``: ``before`` runs
        ahead of it in the queue, ``after`` behind it, ahead of any later operation."""
        self.check()
        if self.streams is not None:
            return self._enqueue(name, op, mb, masters, async_op, before, after)
        sched, slot = mb.schedule, self.slot_of(mb)

        def body() -> None:
            if self.broken is not None:  # queued before an earlier operation failed: never start it
                raise self.failed_earlier(
                    f"ultracomm: {name} (epoch {epoch}) not started: an earlier operation of this Context failed"
                )
            try:
                if before is not None:
                    before()
                self.transport.run(
                    op,
                    sched,
                    epoch,
                    masters,
                    mb.my_slots,
                    mb.local_index_of,
                    name,
                    **({} if slot is None else {"slot": slot}),
                )
                if after is not None:  # in the queue: before any later operation starts
                    after()
            except BaseException as e:
                self.broken, self.broken_by = f"{type(e).__name__}: {e}", e
                self.witness.publish_once(epoch, f"{name}: {type(e).__name__}")
                raise

        if self.profiler is not None:  # records the plan, its stats and this op's host time
            body = self.profiler.wrap(body, name, mb.vid, mb.layer, mb.plan, sched)
        with self.lock:
            self.epoch += 1
            epoch = self.epoch
            # a synchronous call with nothing queued runs here, in the same order (no thread hand-off)
            inline = None if async_op else self.runner.claim_inline()
            if inline is None:
                work = self.runner.submit(f"{name} (rank {self.rank}, epoch {epoch})", body)
        if inline is not None:
            log.debug("rank %d: %s vid-layer %d epoch %d runs on the calling thread", self.rank, name, mb.layer, epoch)
            inline(body)
            return None
        log.debug("rank %d: %s vid-layer %d epoch %d submitted", self.rank, name, mb.layer, epoch)
        if async_op:
            return work
        work.wait()
        return None

    def _enqueue(
        self,
        name: str,
        op: Op,
        mb: Any,
        masters: Any,
        async_op: bool,
        before: Callable[[], None] | None,
        after: Callable[[], None] | None,
    ) -> Work | None:
        """The stream-ordered path: enqueued on the caller's current stream under the lock."""
        sched = mb.schedule
        on_time = None
        if self.profiler is not None:  # device time from CUDA events around the enqueue, read lazily
            resident = isinstance(sched, DeviceSchedule)  # its plan is on the device: times only
            on_time = functools.partial(
                self.profiler.op_end,
                self.profiler.op_begin(
                    name, mb.vid, mb.layer, None if resident else mb.plan, None if resident else sched
                ),
                name,
            )
        with self.lock:
            try:
                self.streams.check_submit(name, async_op)
                if before is not None:  # enqueued on the caller's stream, ahead of the operation
                    before()
            except BaseException:
                if on_time is not None:
                    on_time(None)
                raise
            self.epoch += 1
            return self.streams.submit(
                name,
                op,
                self.epoch,
                sched,
                masters,
                mb.my_slots,
                mb.local_index_of,
                async_op,
                on_time=on_time,
                after=after,
                slot=self.slot_of(mb),
            )

    def synchronize(self) -> None:
        """Wait for every operation submitted so far (stream-ordered: all work on the device),
        then raise the first failure, if any."""
        if self.streams is not None:
            self.streams.synchronize()
            return
        self.runner.submit(f"synchronize (rank {self.rank})", lambda: None).wait()


_KEPT_WINDOWS: list = []  # windows that stay mapped for the life of the process (see release)


def release(runner: OrderedRunner, window: Any, streams: Any, witness: Any = None) -> None:
    """Stop ``runner`` (after its queue), let queued kernels finish (stream-ordered transports) and
    unmap ``window``: ``Context.close()``, or a dropped Context's finaliser."""
    runner.close()
    if witness is not None:  # its heartbeat writes into the window: stopped before the window is unmapped
        witness.detach()
    keep = False
    try:
        if streams is not None:
            keep = streams.close()
    finally:
        if keep:  # a failed copy_engine operation's streams may still reference it
            _KEPT_WINDOWS.append(window)
        else:
            window.close()
