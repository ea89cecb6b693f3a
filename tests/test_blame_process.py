"""A peer's process on this host as evidence of who stopped (ultracomm.blame, issue 35): ``/proc``
shows a rank's process exited or SIGSTOPped, so a failing rank names it stopped -- also a rank
nothing here waited for, which before was of "unknown state" (the fault matrix's two-victim p2p
cases) -- and stops waiting for a record that process can never publish."""

from __future__ import annotations

import os
import signal
import time

import pytest

from ultracomm.blame import Witness, process_identity, process_state

pytestmark = pytest.mark.skipif(process_identity() is None, reason="needs /proc")


def _child() -> tuple[int, int, tuple]:
    """A forked child that waits for a byte on a pipe, and its identity (as its Context would hand it over)."""
    r, w = os.pipe()
    ready_r, ready_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        os.close(w)
        os.write(ready_w, repr(process_identity()).encode())
        os.read(r, 1)
        os._exit(0)
    os.close(r)
    os.close(ready_w)
    ident = eval(os.read(ready_r, 4096).decode())  # noqa: S307 - a tuple of str and int we wrote
    os.close(ready_r)
    return pid, w, ident


def _stop_and_wait(pid: int, letter: str) -> None:
    """Wait (bounded) until the kernel shows ``pid`` in state ``letter`` (SIGSTOP and SIGKILL are asynchronous).
    Bounded by time, not by a count of yields: on two loaded cores a killed child took longer than
    2000 yields to become a zombie (CI run of 2026-12-07)."""
    deadline = time.monotonic() + 30.0
    while time.monotonic() < deadline:
        with open(f"/proc/{pid}/stat", "rb") as f:
            raw = f.read()
        if raw[raw.rindex(b")") + 2 :].split()[0].decode() == letter:
            return
        os.sched_yield()
    raise AssertionError(f"pid {pid} never reached state {letter} within 30 s")


def test_running_stopped_exited_and_reused_pids_are_told_apart():
    pid, w, ident = _child()
    try:
        assert ident[3] == pid and ident[:3] == process_identity()[:3]
        assert process_state(ident) is None  # running (blocked on the pipe)
        os.kill(pid, signal.SIGSTOP)
        _stop_and_wait(pid, "T")
        assert (
            process_state(ident) == f"its process (pid {pid} on this host) is stopped (state T: SIGSTOP or a debugger)"
        )
        os.kill(pid, signal.SIGCONT)
        for _ in range(2000):  # SIGCONT is asynchronous too
            if process_state(ident) is None:
                break
            os.sched_yield()
        assert process_state(ident) is None
        # the same pid with another start time is another process: the one we knew has exited
        assert process_state(ident[:4] + (ident[4] + 1,)) == f"its process (pid {pid} on this host) has exited"
        os.kill(pid, signal.SIGKILL)
        _stop_and_wait(pid, "Z")  # killed, not yet reaped
        assert process_state(ident) == f"its process (pid {pid} on this host) has exited"
    finally:
        os.close(w)
        os.waitpid(pid, 0)
    assert process_state(ident) == f"its process (pid {pid} on this host) has exited"  # reaped: no /proc entry


def test_nothing_is_told_of_other_hosts_namespaces_users_or_this_process():
    mine = process_identity()
    gone = (mine[0], mine[1], mine[2], 2**22 + 12345, 1)  # no such pid on this host
    assert process_state(gone) == f"its process (pid {2**22 + 12345} on this host) has exited"
    assert process_state(("another-boot",) + gone[1:]) is None
    # a VM cloned from a snapshot keeps its boot id: another host name is another host
    assert mine[0].endswith("/" + open("/proc/sys/kernel/random/boot_id").read().strip())
    assert process_state(("a-clone/" + mine[0].rsplit("/", 1)[1],) + gone[1:]) is None
    assert process_state(gone[:1] + ("pid:[1]",) + gone[2:]) is None
    assert process_state(gone[:2] + (mine[2] + 1,) + gone[3:]) is None
    assert process_state(mine) is None  # this process (a loopback domain: every rank is one process)
    assert process_state(None) is None and process_state(("short",)) is None


def test_a_failing_rank_names_a_dead_process_it_never_waited_for_and_does_not_wait_for_its_record():
    dead, w1, dead_ident = _child()
    live, w2, live_ident = _child()
    os.kill(dead, signal.SIGKILL)  # (not EOF on its pipe: the second child holds that pipe's write end too)
    os.close(w1)
    os.waitpid(dead, 0)
    try:
        wit = Witness(None, 0, 4, timeout_s=30.0)  # no store, no window: what /proc shows is all there is
        wit.processes = [process_identity(), dead_ident, live_ident, None]
        t0 = time.monotonic()
        # rank 0 waited for rank 1 (dead); ranks 2 (alive) and 3 (identity unknown) it did not wait for
        ev = wit.evidence(epoch=7, awaited=[1], since=t0)
        took = time.monotonic() - t0
        assert ev.stopped == {1: f"its process (pid {dead} on this host) has exited"}
        assert ev.unknown == [2, 3] and not ev.failed and not ev.alive
        assert took < 30.0, took  # without the process it waits out the timeout and grace (45 s) for rank 1's record
        # a rank it did not wait for: the process is evidence as well
        ev = wit.evidence(epoch=7, awaited=[], since=t0)
        assert sorted(ev.stopped) == [1] and ev.unknown == [2, 3]
        os.kill(live, signal.SIGSTOP)
        _stop_and_wait(live, "T")
        ev = wit.evidence(epoch=7, awaited=[], since=t0)
        assert sorted(ev.stopped) == [1, 2] and ev.unknown == [3]
        assert ev.sentence().startswith(
            f"by evidence, stopped: ranks [1, 2] (rank 1: its process (pid {dead} on this host) has exited; "
            f"rank 2: its process (pid {live} on this host) is stopped (state T: SIGSTOP or a debugger))"
        ), ev.sentence()
    finally:
        os.kill(live, signal.SIGKILL)
        os.close(w2)
        os.waitpid(live, 0)


def test_a_stopped_process_outweighs_a_heartbeat_that_is_still_fresh():
    """A heartbeat stays fresh for up to stale_s after its process stops; /proc says it at once."""
    pid, w, ident = _child()
    try:
        wit = Witness(None, 0, 3, timeout_s=30.0)
        wit.processes = [process_identity(), ident, None]
        wit._window = lambda q: (0, 0.01, 7)  # every peer's window: not failed, beat 10 ms ago, at epoch 7
        ev = wit.evidence(epoch=7, awaited=[1], wait=False)
        assert not ev.stopped and ev.alive == [1, 2]
        os.kill(pid, signal.SIGSTOP)
        _stop_and_wait(pid, "T")
        ev = wit.evidence(epoch=7, awaited=[1], wait=False)
        assert ev.stopped == {1: f"its process (pid {pid} on this host) is stopped (state T: SIGSTOP or a debugger)"}
        assert ev.alive == [2]
    finally:
        os.kill(pid, signal.SIGKILL)
        os.close(w)
        os.waitpid(pid, 0)


class _LateBoard:
    """A store whose record of rank 2 shows up after the first read: rank 2 failed, published and
    exited while the failing rank was already gathering its evidence."""

    def __init__(self):
        self.reads = 0

    def present(self, keys):
        self.reads += 1
        return [self.reads > 1 and k.endswith("/2") for k in keys]

    def read(self, keys):
        return [(7, "weight_sync timed out", [3], [], {3: "its process (pid 1 on this host) has exited"}) for _ in keys]


def test_a_process_that_published_then_exited_reads_as_failed_not_stopped():
    pid, w, ident = _child()
    os.kill(pid, signal.SIGKILL)
    os.close(w)
    os.waitpid(pid, 0)
    wit = Witness(None, 0, 3, timeout_s=30.0)
    wit.processes = [process_identity(), None, ident]
    board = _LateBoard()
    wit._board = lambda: board
    ev = wit.evidence(epoch=7, awaited=[], wait=False)
    assert ev.failed == {2: "at epoch 7 (weight_sync timed out)"} and not ev.stopped, ev
    assert ev.unknown == [1]


def test_a_proc_of_another_pid_namespace_gives_no_identity(monkeypatch):
    """A process in a pid namespace whose /proc is its parent namespace's (``unshare -p`` without
    a new /proc): its pids name other processes there, so it tells nothing of itself or its peers."""
    pid, w, _ = _child()
    try:
        monkeypatch.setattr(os, "getpid", lambda: pid)  # this process's pid as its namespace numbers it
        assert process_identity() is None
    finally:
        monkeypatch.undo()
        os.close(w)
        os.waitpid(pid, 0)


def test_a_live_process_hidden_from_proc_is_not_called_exited(monkeypatch):
    """hidepid=invisible (or a peer not dumpable) hides a live process's /proc entry: no entry is
    not exit then (kill(pid, 0) finds it); a reaped one still has exited."""
    import ultracomm.blame as blame

    pid, w, ident = _child()
    stat = blame._stat
    monkeypatch.setattr(blame, "_stat", lambda p: None if p == pid else stat(p))
    try:
        assert process_state(ident) is None
    finally:
        os.close(w)
        os.waitpid(pid, 0)
    assert process_state(ident) == f"its process (pid {pid} on this host) has exited"


def test_a_process_that_failed_or_closed_then_exited_reads_so_not_stopped():
    """Its window read before its process was seen gone: the failure word or closed Context it
    wrote meanwhile is read after that sight, as its record is."""
    kids = [_child() for _ in range(2)]
    for pid, w, _ in kids:
        os.kill(pid, signal.SIGKILL)
        os.close(w)
        os.waitpid(pid, 0)
    wit = Witness(None, 0, 3, timeout_s=30.0)
    wit.processes = [process_identity()] + [ident for _, _, ident in kids]
    reads = {1: 0, 2: 0}
    later = {1: (0, -1.0, 7), 2: ((1 << 63) | 7, 0.01, 7)}  # rank 1 closed its Context, rank 2 failed

    def window(q):
        reads[q] += 1
        return (0, 0.01, 7) if reads[q] == 1 else later[q]

    wit._window = window
    ev = wit.evidence(epoch=7, awaited=[], wait=False)
    assert not ev.stopped and ev.left == {1: 7} and ev.failed == {2: "at epoch 7 (its failure word)"}, ev


def test_the_awaited_ranks_epoch_and_operation_are_read_from_every_timeout_wording():
    """The executor's and kernels' ("waiting for rank N"), the CUDA split side stream's ("(peer rank
    N)", its epoch in parentheses): what a stream-ordered timeout's evidence starts from."""
    from ultracomm.blame import awaited_ranks

    side = (
        "ultracomm: rank 0 weight_sync (epoch 7, transport split, side stream) gave up after 5 s sending message "
        "5 of 6: multicast expert 0 chunk 0 (bytes [0, 128) of slot 0) rank 0 -> rank 2 (peer rank 2); the other "
        "end never took part"
    )
    assert awaited_ranks(side) == [2]
    assert awaited_ranks("receiving message 1 of 6: header (digest) rank 0 -> rank 2 (peer rank 0)") == [0]
    kernel = (
        "ultracomm: rank 0 grad_reduce (reduce) epoch 9 timed out after 2 s waiting for rank 3's grad of expert "
        "1 chunk 0 in slot 0 (grad_ready flag)"
    )
    assert awaited_ranks(kernel) == [3]
    assert awaited_ranks("timed out after 2 s waiting for its parent rank to deliver expert 0 chunk 0") == []
    for text, published in ((side, (7, "weight_sync timed out", [2])), (kernel, (9, "grad_reduce timed out", [3]))):
        wit = Witness(None, 0, 4, timeout_s=30.0)
        assert wit.timeout_text(text, wait=False).startswith(text + "; by evidence, stopped: ranks []")
        assert wit._published[:3] == published
