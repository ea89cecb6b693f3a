"""Blame by evidence on the stream-ordered transports (``tma``, ``copy_engine``, CUDA ``split``;
issue 35).  Their timeouts come from a kernel's error record or a watchdog and surface later, at
``Work.wait()`` / ``synchronize()``, through ``StreamOrdered.check()``: it strips the record's guess
("it is likely the stalled or dead rank") and names ranks by the Context's witness -- never by
silence (``wait=False``: a live peer publishes its failure only when its host thread next
synchronizes).  A stand-in transport whose record is a timeout awaiting rank q, q's process a
forked child: killed, it is named stopped; alive, of unknown state.  Then the copy_engine watchdog
on its CPU sim in tests/mp/copy_engine_release_worker.py's two-rank cases, its error through
``StreamOrdered``, checked by the GPU test's own check (test_copy_engine_gpu.check_lost_peer_error)."""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time

import numpy as np
import pytest

from ultracomm import ReplicaPlan, _core
from ultracomm.blame import Witness, process_identity
from ultracomm.cuda.stream_ordered import StreamOrdered
from ultracomm.cuda.support import _DIGEST_MISMATCH, _TIMEOUT, make_error_record, raise_record
from ultracomm.errors import PlanError, UltracommTimeout
from ultracomm.records import Op
from ultracomm.transports.copy_engine.plan import FLAG_READY, MAIN, simulate, word_addr
from ultracomm.transports.copy_engine.watchdog import Watchdog, pending_for, read_host
from ultracomm.transports.host import op_digest

from copy_engine_sim import host_contexts, host_reference, new_words, rank_commands, set_epoch
from test_blame_process import _child, _stop_and_wait
from test_copy_engine_gpu import check_lost_peer_error

pytestmark = pytest.mark.skipif(process_identity() is None, reason="needs /proc")

EPOCH = 5


def describe(e) -> dict:
    """The release workers' report of an error (tests/mp/release_common.py)."""
    path = os.path.join(os.path.dirname(__file__), "..", "mp", "release_common.py")
    spec = importlib.util.spec_from_file_location("release_common", path)
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    return common.describe(e)


class Raises:
    """A stream-ordered transport stand-in: ``check_error()`` raises ``error`` once (a copy_engine watchdog's)."""

    def __init__(self, error: BaseException):
        self.error = error

    def check_error(self) -> None:
        error, self.error = self.error, None
        if error is not None:
            raise error


class Recorded:
    """A stream-ordered transport stand-in: one device error record, handed out once by
    ``check_error()`` as the host executor words it (``raise_record``, the kernels' and the
    copy_engine watchdog's path)."""

    def __init__(self, code: int, peer: int):
        self.rec = make_error_record(
            code, 0, int(Op.MULTICAST), EPOCH, flag_kind=FLAG_READY, expert=0, chunk=0, slot=0, peer=peer,
            observed=EPOCH - 1, expected=1, peer_ready=EPOCH - 1,
        )  # fmt: skip

    def check_error(self) -> None:
        rec, self.rec = self.rec, None
        if rec is not None:
            raise_record(rec, "weight_sync", 30.0)


def checked(q: int, ident, code: int = _TIMEOUT, witness: bool = True):
    """Rank 0 of 4 (q's process ``ident``, ranks 1..3 but q unknown) checks a record awaiting q:
    (the error, what on_error got, seconds the check took, the StreamOrdered, the witness)."""
    wit = Witness(None, 0, 4, timeout_s=30.0)  # no store, no window: what /proc shows is all there is
    wit.processes = [process_identity()] + [ident if r == q else None for r in range(1, 4)]
    seen: list = []
    so = StreamOrdered(Recorded(code, q), None, seen.append, 0, wit if witness else None)
    t0 = time.monotonic()
    err = so.check()
    return err, seen, time.monotonic() - t0, so, wit


HEAD = (
    f"ultracomm: rank 0 weight_sync (multicast) epoch {EPOCH} timed out after 30 s waiting for rank 2 to join "
    f"the operation (ready flag) before sending expert 0 chunk 0 to its slot 0; rank 2 has not started this "
    f"operation (its ready flag is at epoch {EPOCH - 1}); by evidence, stopped: "
)


def test_a_timeout_names_the_awaited_rank_stopped_when_its_process_was_killed():
    pid, w, ident = _child()
    os.kill(pid, signal.SIGKILL)
    os.close(w)
    os.waitpid(pid, 0)
    err, seen, took, so, wit = checked(2, ident)
    text = str(err)
    assert (
        text
        == HEAD + f"ranks [2] (rank 2: its process (pid {pid} on this host) has exited); state unknown: ranks [1, 3]"
    )
    assert "likely" not in text
    # the same kind of error (the binding's TimeoutError, an UltracommTimeout), the record chained
    assert isinstance(err, UltracommTimeout) and isinstance(err, TimeoutError) and type(err) is _core.TimeoutError
    assert type(err.__cause__) is _core.TimeoutError and str(err.__cause__).endswith(
        ": it is likely the stalled or dead rank"
    )
    assert took < 5.0, took  # no wait for rank 2's record (its process shows it can never come)
    assert seen == [err] and so.check() is err and seen == [err]  # the first failure only, kept
    assert wit._published[:3] == (EPOCH, "weight_sync timed out", [2])  # its own failure, for its peers


@pytest.mark.parametrize("state", ["running", "stopped"])
def test_a_live_awaited_rank_is_not_called_stopped_for_its_silence(state):
    pid, w, ident = _child()
    try:
        if state == "stopped":  # SIGSTOP is evidence as well
            os.kill(pid, signal.SIGSTOP)
            _stop_and_wait(pid, "T")
        err, seen, took, _, _ = checked(2, ident)
    finally:
        os.kill(pid, signal.SIGKILL)
        os.close(w)
        os.waitpid(pid, 0)
    text = str(err)
    assert isinstance(err, UltracommTimeout) and "likely" not in text and seen == [err]
    if state == "running":  # silent, but wait=False: silence is no evidence on this path
        assert text == HEAD + "ranks []; state unknown: ranks [1, 2, 3]"
        assert took < 5.0, took  # waiting would take the timeout and the grace (40 s) for rank 2's record
    else:
        assert text == HEAD + (
            f"ranks [2] (rank 2: its process (pid {pid} on this host) is stopped (state T: SIGSTOP or a "
            "debugger)); state unknown: ranks [1, 3]"
        )


def test_other_failures_and_a_context_without_witness_keep_the_records_text():
    err, seen, _, _, wit = checked(2, None, code=_DIGEST_MISMATCH)
    assert isinstance(err, PlanError) and "by evidence" not in str(err) and seen == [err]
    assert wit._published is None  # nothing published here: the Context's on_error does that
    err, _, _, _, _ = checked(2, None, witness=False)
    assert isinstance(err, UltracommTimeout) and str(err).endswith("it is likely the stalled or dead rank")


@pytest.mark.parametrize("case", ["stall", "dead"])
def test_copy_engine_release_cases_on_the_cpu_sim_name_ranks_by_evidence(case):
    """tests/mp/copy_engine_release_worker.py's stall and dead cases, two loopback ranks, plan
    [[1], [0]]: rank 1 never joins (stall), or joins and sends nothing (dead); rank 0's watchdog
    times out; its error through a StreamOrdered with a witness as the GPU Context's (one process,
    no heartbeat in a CUDA window) reads as test_copy_engine_gpu requires on the device."""
    ctxs, each = host_contexts(2, 1, 1, "off")
    try:
        plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)
        _, epoch = host_reference(ctxs, each, plan)
        words = new_words(2)
        programs = [rank_commands(c, plan, words[c.rank]) for c in ctxs]
        programs[1] = [x for x in programs[1] if x.what in ("digest", "ready")] if case == "dead" else []
        now = [100.0]
        dog = Watchdog(0, 2.0, read_host, clock=lambda: now[0], check_s=0.5)
        digest = op_digest(ctxs[0].schedule_for(plan).digest, Op.MULTICAST)
        base = word_addr(words[0].ctypes.data, None)
        dog.add(
            pending_for(programs[0], epoch, digest, "weight_sync", ctxs[0].wlayout, ctxs[0].window.peer_bases, base)
        )

        def on_stall(stuck) -> bool:  # time passes while the watchdog polls, until MAIN is released
            dog.poll()
            now[0] += 0.5
            dog.poll()
            return now[0] < 120.0 and any(s == MAIN for r, s, _ in stuck if r == 0)

        simulate(programs, epoch, seed=1, on_stall=on_stall)
        set_epoch(ctxs, epoch)
        assert dog.failure is not None
        wit = Witness(None, 0, 2, timeout_s=2.0)
        wit.processes = [process_identity()] * 2  # a loopback domain: every rank is this process
        err = StreamOrdered(Raises(dog.take_error()), None, lambda e: None, 0, wit).check()
        check_lost_peer_error(case, describe(err))
    finally:
        for c in ctxs:
            c.close()


class _SlowWitness:
    """A witness whose naming of the first failure takes a while (its store calls, bounded)."""

    def __init__(self):
        self.entered, self.go = threading.Event(), threading.Event()

    def timeout_text(self, text: str, wait: bool = True) -> str:
        self.entered.set()
        self.go.wait(10.0)
        return f"{text}; by evidence, stopped: ranks []"


def test_a_check_while_the_first_failure_is_being_named_waits_for_it():
    """The transport hands its record out once: a second waiter's check() during the naming must
    not read "no failure" (its Work would complete as a success behind a failed operation)."""
    wit = _SlowWitness()
    so = StreamOrdered(Recorded(_TIMEOUT, 2), None, lambda e: None, 0, wit)
    first: list = []
    second: list = []
    a = threading.Thread(target=lambda: first.append(so.check()))
    a.start()
    assert wit.entered.wait(5.0)
    b = threading.Thread(target=lambda: second.append(so.check()))
    b.start()
    b.join(0.3)
    wit.go.set()
    a.join(5.0)
    b.join(5.0)
    assert first and second and second[0] is first[0], (first, second)
    assert isinstance(second[0], UltracommTimeout) and "by evidence" in str(second[0])
