"""Work handles for ``async_op=True`` (the ``torch.distributed`` convention) and the one
ordered worker thread per Context that runs operations in call order on every rank."""

from __future__ import annotations

import queue
import threading
from typing import Callable

from .errors import UltracommTimeout

# what a Work of the ordered worker thread waits for
RUNNER_AWAITS = "its turn on this rank's ordered worker thread, then its run there (peers' flags and data)"


class Work:
    """Handle of an operation started with ``async_op=True``.

    ``wait()`` blocks until the operation finished on this rank and re-raises its error
    (an ``UltracommTimeout`` naming what was awaited, for instance).  ``is_completed()`` polls.
    """

    def __init__(self, name: str, awaited: str = RUNNER_AWAITS):
        self.name = name  # names the operation and this rank, e.g. "weight_sync (rank 0, epoch 3)"
        self.awaited = awaited
        self._done = threading.Event()
        self._error: BaseException | None = None

    def _finish(self, error: BaseException | None) -> None:
        self._error = error
        self._done.set()

    def is_completed(self) -> bool:
        return self._done.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait for completion; raise the operation's error if it failed.  Returns True.

        Raises:
            UltracommTimeout: ``timeout`` (seconds) passed first.  Only this wait gave up: the
                operation goes on (bounded by the Context's ``ULTRACOMM_TIMEOUT_S``), so
                ``wait()`` may be called again.
        """
        if not self._done.wait(timeout):
            raise self._timed_out(timeout)
        if self._error is not None:
            raise self._error
        return True

    def wait_stream(self) -> None:
        """Order what the caller enqueues next after this operation, with as little host
        waiting as the transport allows.  Host-executed operations (this class) can only be
        waited for on the host: the same as :meth:`wait`.  Stream-ordered ones make the
        caller's current CUDA stream wait (:meth:`ultracomm.cuda.stream_ordered.StreamWork.wait_stream`)."""
        self.wait()

    def _timed_out(self, timeout: float | None) -> UltracommTimeout:
        return UltracommTimeout(
            f"ultracomm: {self.name} did not finish within wait(timeout={timeout:g} s); awaited: {self.awaited}. "
            "The operation goes on (bounded by ULTRACOMM_TIMEOUT_S) and the Context stays usable: call wait() "
            "again to keep waiting"
        )

    def exception(self) -> BaseException | None:
        return self._error if self._done.is_set() else None

    def __repr__(self) -> str:
        state = "done" if self._done.is_set() else "running"
        return f"<ultracomm.Work {self.name} {state}>"


class OrderedRunner:
    """Runs submitted callables one at a time, in submission order, on one daemon thread.

    Every rank submits the same operations in the same order, so epochs line up across
    ranks whether a caller waits at once or later.  The thread holds a submitted callable
    only while it is queued or running, so an idle runner keeps nothing alive (a Context
    dropped without ``close()`` is freed, and its finaliser stops the runner).

    :meth:`claim_inline`: a caller that would only wait for its callable (a synchronous
    operation) runs it on its own thread when nothing is queued or running -- the same order,
    without a hand-off to the runner thread and back (two wake-ups, ~0.1-1 ms on a loaded
    2-core host; perf/README.md section 6b).
    """

    def __init__(self, name: str):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._mu = threading.Lock()
        self._pending = 0  # submitted or claimed inline, not finished (under _mu)
        self._running = threading.Lock()  # held while a callable runs, on either thread
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            fn, work = item
            del item
            try:
                with self._running:  # after an inline callable claimed earlier
                    fn()
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                self._done()
                work._finish(e)
                del e
            else:
                self._done()
                work._finish(None)
            # drop the callable (and what it references, e.g. a Context) before waiting again
            del fn, work

    def _done(self) -> None:
        with self._mu:
            self._pending -= 1

    def submit(self, name: str, fn: Callable[[], None]) -> Work:
        work = Work(name)
        with self._mu:
            self._pending += 1
        self._q.put((fn, work))
        return work

    def claim_inline(self) -> "Callable[[Callable[[], None]], None] | None":
        """If nothing is queued or running, claim the next turn for the caller's thread and return
        ``run(fn)``, which runs ``fn`` there (callables submitted after the claim wait for it);
        else None (submit instead).  Call ``run`` exactly once."""
        if threading.current_thread() is self._thread:
            return None
        with self._mu:
            if self._pending:
                return None
            self._pending += 1
        self._running.acquire()  # free: nothing was pending (a later submit waits for it in _loop)

        def run(fn: Callable[[], None]) -> None:
            try:
                fn()
            finally:
                self._running.release()
                self._done()

        return run

    def close(self) -> None:
        """Finish what is queued, then stop the thread (idempotent; from the runner's own
        thread -- a finaliser run there -- it only asks the thread to stop)."""
        self._q.put(None)
        if threading.current_thread() is not self._thread:
            self._thread.join()
