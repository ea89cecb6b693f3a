"""How a Context drives a stream-ordered transport (``tma``, ``copy_engine``): enqueue on the
caller's CUDA stream.

``transport.run(..., stream=)`` only enqueues the operation on the caller's current stream and
returns: no host synchronisation (``tma``: no device allocation either, the transport keeps the
plan's task lists in a device cache keyed by the schedule digest, so with a fixed plan the
operations can be captured in a CUDA graph).  Failures (a timeout, a digest mismatch) are
recorded by the device (``tma``'s kernel) or the transport's watchdog (``copy_engine``) and
raised by ``transport.check_error()``, which this module calls at ``Work.wait()`` and
``Context.synchronize()``: that is where a device error surfaces, with the record's text -- a
timeout's naming the ranks by evidence (:meth:`StreamOrdered._by_evidence`, issue 35).
A transport whose ``abandoned_streams()`` is true after a failure (``copy_engine``: internal
streams blocked for good on a lost peer) gets no device-wide synchronize from the Context, and
its window stays mapped.

``async_op=True`` returns a :class:`StreamWork` backed by a CUDA event recorded after the
launch; ``async_op=False`` returns ``None`` with the work queued on the stream (like
``torch.distributed`` collectives on NCCL): later work on that stream sees the result.
Events come from a small pool and go back to it once their Work has completed, so a steady
state creates none.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable, Optional

import torch

from ..errors import UltracommError, UltracommTimeout
from ..work import Work

__all__ = ["CudaStreams", "StreamWork", "StreamOrdered", "streams_for"]

# what a StreamWork waits for
STREAM_AWAITS = "the operation's completion event on its CUDA stream (the kernel, after the work queued before it)"

_EVENT_POOL = 64  # completed events kept for reuse


class CudaStreams:
    """The CUDA calls of the stream-ordered path, for one device (tests substitute a fake)."""

    def __init__(self, device: torch.device):
        self.device = device
        self._free: list[torch.cuda.Event] = []

    def check_current_device(self) -> None:
        cur = torch.cuda.current_device()
        if cur != self.device.index:
            raise UltracommError(
                f"ultracomm: the current CUDA device is cuda:{cur} but this Context lives on "
                f"{self.device}; call torch.cuda.set_device({self.device.index}) first"
            )

    def stream_handle(self) -> int:
        """The caller's current stream on this device, as a ``cudaStream_t`` integer."""
        return torch.cuda.current_stream(self.device).cuda_stream

    def is_capturing(self) -> bool:
        return torch.cuda.is_current_stream_capturing()

    def record(self) -> Any:
        ev = self._free.pop() if self._free else torch.cuda.Event()
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def timing_event(self) -> Any:
        """A new timing event recorded on the caller's current stream (the profiler keeps it
        until its step is written: not pooled)."""
        ev = torch.cuda.Event(enable_timing=True)
        ev.record(torch.cuda.current_stream(self.device))
        return ev

    def release(self, ev: Any) -> None:
        if len(self._free) < _EVENT_POOL:
            self._free.append(ev)

    def query(self, ev: Any) -> bool:
        return ev.query()

    def wait_event(self, ev: Any) -> None:
        ev.synchronize()

    def stream_wait(self, ev: Any) -> None:
        """The caller's current stream waits for ``ev`` (no host wait; capturable)."""
        torch.cuda.current_stream(self.device).wait_event(ev)

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)


def streams_for(device: Optional[torch.device]) -> CudaStreams:
    """The stream calls for a Context whose window is on ``device`` (the tests replace this)."""
    if device is None:
        raise UltracommError("ultracomm: a stream-ordered transport needs a CUDA window (device='cuda')")
    return CudaStreams(device)


class StreamWork(Work):
    """A stream-ordered operation started with ``async_op=True``.

    ``wait()`` blocks until the operation's kernel has finished (its event), then raises the
    transport's error record if any kernel failed (``UltracommTimeout`` naming rank, operation
    and what was awaited, for instance).  ``is_completed()`` polls the event.
    """

    def __init__(self, name: str, event: Any, owner: "StreamOrdered"):
        super().__init__(name, STREAM_AWAITS)
        self._event = event
        self._owner = owner

    def _complete(self) -> None:
        if self._done.is_set():
            return
        error = self._owner.check()
        ev, self._event = self._event, None
        self._owner.streams.release(ev)
        self._finish(error)

    def is_completed(self) -> bool:
        if not self._done.is_set() and self._owner.streams.query(self._event):
            self._complete()
        return self._done.is_set()

    def wait_stream(self) -> None:
        """The caller's current stream waits for this operation's event: work enqueued there
        next runs after it, and the host does not wait (CUDA-graph capturable).  A failure is
        reported by the next ``wait()``, ``synchronize()`` or operation of the Context."""
        if not self._done.is_set() and self._event is not None:
            self._owner.streams.stream_wait(self._event)

    def wait(self, timeout: Optional[float] = None) -> bool:
        if not self._done.is_set():
            if timeout is None:
                self._owner.streams.wait_event(self._event)
            else:
                deadline = time.monotonic() + timeout
                while not self._owner.streams.query(self._event):
                    if time.monotonic() >= deadline:
                        raise self._timed_out(timeout)
                    time.sleep(min(1e-3, timeout))
            self._complete()
        return super().wait(0)


class StreamOrdered:
    """Submission, completion and error collection for one Context's stream-ordered transport.

    ``on_error(exc)`` is called with the first failure seen (the Context marks itself broken).
    ``witness``: the Context's :class:`ultracomm.blame.Witness`; a timeout then names ranks by
    evidence (:meth:`_by_evidence`).
    """

    def __init__(
        self, transport: Any, streams: Any, on_error: Callable[[BaseException], None], rank: int, witness: Any = None
    ):
        self.rank = rank  # named in each Work's name
        self.transport = transport
        self.streams = streams
        self._on_error = on_error
        self.witness = witness
        self.failure: Optional[BaseException] = None  # the first failure seen: it stays
        # held while the first failure is named (store calls, bounded): a transport hands a record out
        # once, so a concurrent check() must wait for it, not read "no failure" meanwhile
        self._lock = threading.RLock()

    def _first(self, e: BaseException) -> None:
        """Keep ``e`` (a timeout with its ranks named by evidence) as this Context's failure."""
        with self._lock:
            if self.failure is None:
                self.failure = self._by_evidence(e)
                self._on_error(self.failure)

    def _by_evidence(self, e: BaseException) -> BaseException:
        """Blame by evidence (issue 35) for the stream-ordered transports, whose timeouts come from
        a kernel's error record or a watchdog and carry the older guess ("... it is likely the
        stalled or dead rank"): the same kind of error (its type; ``e`` chained) with that guess
        stripped and the evidence sentence appended (:meth:`ultracomm.blame.Witness.timeout_text`).
        ``wait=False``: a live peer's host thread publishes its failure only when it next
        synchronizes, so silence is no evidence here; a peer's process on this host (exited,
        stopped), its failure record or word, its heartbeat are.  Other failures, and texts that
        already name ranks by evidence, stay as they are."""
        if self.witness is None or not isinstance(e, UltracommTimeout) or "by evidence, stopped:" in str(e):
            return e
        try:
            text = self.witness.timeout_text(str(e), wait=False)
        except Exception:  # noqa: BLE001 - the failure being reported matters more than its note
            return e
        try:
            named = type(e)(text)
        except Exception:  # noqa: BLE001 - a type that takes other arguments: still a timeout
            named = UltracommTimeout(text)
        named.__cause__ = e
        return named

    def check(self) -> Optional[BaseException]:
        """The first failure of this Context's operations (the transport's error record, reported
        to ``on_error`` when first seen), or ``None``.  Once one failed, every later check returns
        it: a transport may hand each record out once, but the operations queued behind a failed
        one were aborted, so no later completion may look like a success."""
        with self._lock:
            try:
                self.transport.check_error()
            except Exception as e:  # noqa: BLE001 - handed to the waiter
                self._first(e)
            return self.failure

    def check_submit(self, name: str, async_op: bool) -> None:
        """Refuse an operation before it takes an epoch (a refused one must not shift the epochs)."""
        self.streams.check_current_device()
        if async_op and self.streams.is_capturing():
            raise UltracommError(
                f"ultracomm: {name}: async_op=True inside CUDA graph capture; a captured operation has no "
                "completion to wait for. Use async_op=False while capturing and synchronize after replay"
            )

    def submit(
        self,
        name: str,
        op: Any,
        epoch: int,
        schedule: Any,
        masters: Any,
        my_slots: Any,
        local_index_of: Any,
        async_op: bool,
        on_time: Optional[Callable[[Any], None]] = None,
        after: Optional[Callable[[], None]] = None,
        slot: Optional[int] = None,
    ) -> Optional[StreamWork]:
        """Enqueue ``op`` at ``epoch`` on the caller's current stream; a Work when ``async_op``.
        Call :meth:`check_submit` first.  ``on_time`` (the profiler) gets ``(start, end)``
        timing events recorded on the stream around the operation -- never synchronised here --
        or ``None`` when the call enqueued nothing (it failed, or it was a loopback rank's share,
        enqueued by the rank completing the set) and under CUDA graph capture (a captured
        operation runs at replay, not between events recorded now).  ``after`` runs right after
        the operation is enqueued (to enqueue follow-up work behind it on the same stream).  ``slot``:
        the plan-arena slot of the operation's vid, passed to transports that take one."""
        if on_time is not None and self.streams.is_capturing():
            on_time(None)
            on_time = None
        start = self.streams.timing_event() if on_time is not None else None
        try:
            enqueued = self.transport.run(
                op,
                schedule,
                epoch,
                masters,
                my_slots,
                local_index_of,
                name,
                stream=self.streams.stream_handle(),
                **({"slot": slot} if slot is not None else {}),
            )
        except BaseException as e:
            if on_time is not None:
                on_time(None)
            self._on_error(e)
            raise
        if after is not None:  # enqueued behind the operation, ahead of its Work's event
            after()
        if on_time is not None:
            on_time((start, self.streams.timing_event()) if enqueued is not False else None)
        if not async_op:
            return None
        return StreamWork(f"{name} (rank {self.rank}, epoch {epoch})", self.streams.record(), self)

    def reject(self, op: Any, epoch: int) -> None:
        """Tell peers this rank rejected its plan at ``epoch`` (when the transport can publish it)."""
        if self.transport.window_flags:
            self.transport.reject(op, epoch, stream=self.streams.stream_handle())

    def _abandoned(self) -> bool:
        """The transport left streams blocked for good after a failure (``copy_engine``: waits
        only a lost peer can satisfy): a device-wide synchronize would never return.  A
        transport with ``quiesce()`` is asked first to let its operations in flight end (done
        or failed), so that the answer holds for them too.  One that no stream reaches within the
        quiesce's bound fails this Context (``UltracommTimeout``, raised by ``synchronize``) and
        counts as abandoned: nothing then waits on the device for it."""
        try:
            self.transport.quiesce()
        except UltracommTimeout as e:
            self._first(e)
            return True
        return bool(self.transport.abandoned_streams())

    def synchronize(self) -> None:
        """Wait for all work on the device, then raise the transport's error record if any."""
        if not self._abandoned():
            self.streams.synchronize()
        error = self.check()
        if error is not None:
            raise error

    def close(self) -> bool:
        """Let queued kernels finish before the window goes away (errors stay in the record).
        Returns whether the window must stay mapped (streams abandoned after a failure)."""
        abandoned = self._abandoned()
        if not abandoned:
            self.streams.synchronize()
        self.transport.close()
        return abandoned
