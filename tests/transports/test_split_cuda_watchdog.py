"""The GPU split transport's watchdog on the CPU (host words in a plain tensor, a fake clock):
an op is retired when its done word arrives, its clock starts when the side stream reached it,
and past the timeout (issue 35: once, not twice) it fails naming the stuck message, releases the
caller's join, aborts the side stream's NCCL group and opens the side stream's gates; the
transport raises that error (loopback: on every rank) and reports its streams abandoned.  With a
simulated side stream (a thread running what was enqueued, a fake NCCL group whose sends and
receives block until it is aborted): a dead peer's blocked receive returns after the abort, the
gates behind it leave their waits and write nothing, and the caller gets UltracommTimeout naming
the message it waited for."""

from __future__ import annotations

import ctypes
import queue
import threading
import time
from types import SimpleNamespace

import pytest
import torch

from ultracomm import UltracommError, UltracommTimeout, _core
from ultracomm.records import Op
from ultracomm.transports.split import cuda as split_cuda
from ultracomm.transports.split.cuda_watchdog import (
    ABORT,
    DONE,
    OPEN,
    PROGRESS,
    SKIP,
    STARTED,
    SideWatchdog,
    progress_value,
)
from ultracomm.transports.split.cuda_gates import Gates, gate_args, gated, run_gate_on_host
from ultracomm.transports.split.cuda_movers import NcclMessenger, abort_group
from ultracomm.transports.split.stream import OWN, RECV, SEND, WAIT_GE, WRITE, Ref, StreamOp, stream_program

from test_split_cuda import FakeTma, Log, schedule, transport, window_of
from test_split_stream import DOM, WL, programs_2x2

OPS = stream_program(programs_2x2("force", Op.MULTICAST)[0], WL)  # rank 0: 2 header sends, 2 receives, 2 chunks


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def dog_of(clock, failures):
    return SideWatchdog(0, 5.0, failures.append, words=torch.zeros(5, dtype=torch.int64), clock=clock, autostart=False)


def test_done_retires_and_the_clock_starts_when_the_side_stream_reached_the_op():
    clock, failures = Clock(), []
    dog = dog_of(clock, failures)
    dog.add(7, "weight_sync", OPS)
    clock.t += 60.0
    dog.poll()  # not started: a long wait behind earlier work on the caller's stream is not this op's
    assert dog.pending() == 1 and not failures
    dog.words[STARTED] = 7
    dog.poll()
    clock.t += 4.9  # within the timeout
    dog.poll()
    assert not failures
    dog.words[DONE] = 7
    dog.poll()
    assert dog.pending() == 0 and not dog.failed()


def test_past_the_timeout_it_names_the_stuck_message_and_releases_the_join():
    clock, failures = Clock(), []
    dog = dog_of(clock, failures)
    dog.add(7, "weight_sync", OPS)
    dog.words[STARTED] = 7
    dog.words[PROGRESS] = progress_value(7, 4)  # headers moved; the first chunk's send never completed
    dog.poll()
    clock.t += 5.01
    dog.poll()
    assert len(failures) == 1 and dog.failed() and int(dog.words[DONE]) == ABORT and dog.pending() == 0
    assert dog.released() and int(dog.words[SKIP]) == int(dog.words[OPEN]) == 1  # no group: both at once
    msg = str(failures[0])
    assert isinstance(failures[0], UltracommTimeout)
    assert msg.startswith(
        "ultracomm: rank 0 weight_sync (epoch 7, transport split, side stream) gave up after 5 s "
        "sending message 5 of 6: multicast expert 0 chunk 0 (bytes [0, 128) of slot 0) rank 0 -> "
        "rank 2 (peer rank 2); the other end never took part"
    )
    dog.poll()
    assert len(failures) == 1  # once


def test_progress_of_an_older_epoch_counts_as_nothing_moved():
    clock, failures = Clock(), []
    dog = dog_of(clock, failures)
    dog.add(8, "grad_reduce", OPS)
    dog.words[STARTED] = 8
    dog.words[PROGRESS] = progress_value(7, 6)
    dog.poll()
    clock.t += 11
    dog.poll()
    assert "sending message 1 of 6: header (digest) rank 0 -> rank 2" in str(failures[0])


def test_the_transport_raises_it_once_and_reports_abandoned_streams():
    log = Log()
    t = transport(0, log, window_of(0))
    t.run(Op.MULTICAST, schedule("force"), 3, None, [-1], [0], "weight_sync", 5)
    clock = Clock()
    t.dog.clock, t.dog.on_failure = clock, t._on_dog_failure
    t.dog.words[STARTED] = 3
    t.dog.poll()
    clock.t += 11
    t.dog.poll()
    assert t.abandoned_streams()
    t.quiesce()  # returns: nothing in flight can still end
    with pytest.raises(UltracommTimeout, match=r"rank 0 weight_sync \(epoch 3, transport split, side stream\)"):
        t.check_error()
    t.check_error()
    # closing frees nothing the blocked side stream may still use or that a cudaFree would wait for
    shadows = t.shadows
    t.close()
    assert ("tma_close", 0) not in log and shadows.views and (t.tma, shadows, t.dog) in split_cuda._KEPT


def test_quiesce_after_one_side_stream_of_a_loopback_domain_failed():
    """A loopback domain's side streams share the device: once one failed, quiesce (before any
    device-wide synchronize: Context.synchronize, close) waits only for the other side streams'
    ops that their stream reached.  It asked each for running(), which the side watchdog lacked:
    an AttributeError from every synchronize and close after a split failure on a device."""
    from ultracomm.transports.copy_engine.watchdog import quiesce

    clock = Clock()
    dogs = [dog_of(clock, []) for _ in range(3)]
    dogs[0].add(3, "weight_sync", OPS)
    dogs[0].words[STARTED] = 3
    dogs[0].poll()
    clock.t += 5.01
    dogs[0].poll()
    assert dogs[0].failed() and not dogs[1].failed()
    dogs[1].add(4, "weight_sync", OPS)  # queued behind the caller's earlier work: no clock, not waited for
    assert [d.running() for d in dogs] == [0, 0, 0]
    quiesce(dogs)
    dogs[1].words[STARTED] = 4  # its side stream reached it: it ends within the timeout
    assert dogs[1].running() == 1
    done = threading.Timer(0.05, lambda: (dogs[1].words.__setitem__(DONE, 4), dogs[1].poll()))
    done.start()
    t = time.monotonic()
    quiesce(dogs)  # returns once that op is done
    assert dogs[1].running() == 0 and time.monotonic() - t >= 0.04
    done.join()


def test_close_after_success_frees_the_kernel_plans_and_shadows():
    log = Log()
    t = transport(0, log, window_of(0))
    t.run(Op.MULTICAST, schedule("force"), 3, None, [-1], [0], "weight_sync", 5)
    assert t.shadows.views
    t.close()
    assert log[-1] == ("tma_close", 0) and not t.shadows.views and t.drv.bound[-1] == 0


def test_loopback_every_rank_raises_the_watchdogs_error():
    log = Log()
    shared: dict = {}
    wins = [window_of(r, bases=[1000, 2000, 3000, 4000], loopback=True, shared=shared) for r in range(4)]
    ts = [transport(r, log, wins[r]) for r in range(4)]
    for r in range(4):
        ts[r].run(Op.MULTICAST, schedule("force"), 6, None, [-1], [0], "weight_sync", 11)
    dog = ts[3].dog  # the launching rank's side stream
    clock = Clock()
    dog.clock = clock
    dog.words[STARTED] = 6
    dog.poll()
    clock.t += 11
    dog.on_failure = ts[3]._on_dog_failure
    dog.poll()
    assert all(t.abandoned_streams() for t in ts)  # they share the device
    for t in ts:
        with pytest.raises(UltracommTimeout, match="side stream\\) gave up after 5 s copying message 1 of 6"):
            t.check_error()
        t.check_error()


class FailingMessenger:
    def __init__(self):
        self.posted = 0

    def post(self, kind, buf, peer, side):
        self.posted += 1
        if self.posted == 2:
            raise RuntimeError("NCCL error: unhandled system error")


def test_a_failed_enqueue_abandons_the_side_stream_and_releases_the_join():
    log = Log()
    t = transport(0, log, window_of(0))
    t.messenger = FailingMessenger()
    with pytest.raises(
        split_cuda.UltracommError,
        match=r"rank 0 weight_sync \(epoch 3, transport split\): enqueueing the side stream failed "
        r"\(RuntimeError: NCCL error: unhandled system error\)",
    ):
        t.run(Op.MULTICAST, schedule("force"), 3, None, [-1], [0], "weight_sync", 5)
    # nothing waits for the half-queued op: released join, no pending op, streams reported abandoned
    assert int(t.dog.words[DONE]) == ABORT and t.dog.pending() == 0 and t.abandoned_streams()
    t.check_error()  # raised where it happened, not a second time
    t.close()
    assert ("tma_close", 0) not in log


def test_the_side_group_has_its_own_nccl_options(monkeypatch):
    import types

    import torch.distributed as dist

    from ultracomm.transports.split import cuda_movers as movers

    made = {}

    class Options:
        def __init__(self):
            self.config = types.SimpleNamespace()

    monkeypatch.setattr(dist, "ProcessGroupNCCL", types.SimpleNamespace(Options=Options), raising=False)
    monkeypatch.setattr(dist, "get_global_rank", lambda g, r: 10 + r)
    monkeypatch.setattr(dist, "new_group", lambda ranks, **kw: made.update(ranks=ranks, **kw) or "side-pg")
    monkeypatch.setattr(dist, "barrier", lambda group, device_ids: made.update(barrier=(group, device_ids)))
    m = movers.side_group("user-pg", 3, torch.device("cuda", 1), split_cuda.NCCL_SM_RESERVE)
    cfg = made["pg_options"].config
    assert (cfg.cga_cluster_size, cfg.min_ctas, cfg.max_ctas) == (1, 1, split_cuda.NCCL_SM_RESERVE)
    assert made["ranks"] == [10, 11, 12] and made["backend"] == "nccl" and made["use_local_synchronization"]
    assert made["barrier"] == ("side-pg", [1]) and m.group == "side-pg" and m.global_rank == [10, 11, 12] and m.owned


def test_one_hardware_queue_is_warned_about(monkeypatch, caplog):
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "1")
    with caplog.at_level("WARNING", logger="ultracomm"):
        transport(0, Log(), window_of(0))
    assert "CUDA_DEVICE_MAX_CONNECTIONS=1 puts every stream of the device in one hardware queue" in caplog.text
    caplog.clear()
    monkeypatch.setenv("CUDA_DEVICE_MAX_CONNECTIONS", "8")
    with caplog.at_level("WARNING", logger="ultracomm"):
        transport(0, Log(), window_of(0))
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in caplog.text


# ---------------------------------------------------------------- the release (issue 35)
class FakeGroup:
    """An NCCL group: its sends and receives (with a dead peer) return only once it is aborted."""

    def __init__(self, order):
        self.order, self.aborted = order, threading.Event()

    def abort(self):
        self.order.append("abort")
        self.aborted.set()


class SimSide:
    """The side stream: a thread runs what was enqueued on it, in order."""

    def __init__(self):
        self.q: queue.Queue = queue.Queue()
        self.errors: list = []
        self.thread = threading.Thread(target=self._loop, daemon=True)
        self.thread.start()

    def _loop(self):
        while (fn := self.q.get()) is not None:
            try:
                fn()
            except BaseException as e:  # noqa: BLE001 - checked by the test
                self.errors.append(e)

    def put(self, fn):
        self.q.put(fn)

    def get(self):
        return 77, "side77"

    def fork(self, caller):
        pass

    def close(self):
        self.q.put(None)


def _bounded(what):
    deadline = time.monotonic() + 20.0

    def waiting():
        assert time.monotonic() < deadline, f"{what} still blocked after 20 s"
        time.sleep(1e-4)  # a poll of host words, as the device spins

    return waiting


class SimDriver:
    """Stream operations of the side stream (77) run on it; the caller's join is recorded."""

    def __init__(self, side, order):
        self.side, self.order, self.joins = side, order, []

    def bind(self, device):
        pass

    def write_value(self, stream, addr, value):
        assert stream == 77
        self.side.put(lambda: _core.store_release(addr, value))

    def wait_value(self, stream, addr, value, equal=False):
        self.joins.append((stream, addr, value))  # the caller's stream: released by the done word

    def function(self, ptx, name):
        return 0xF00

    def launch(self, function, threads, stream, args):
        assert stream == 77

        writes = (ctypes.c_uint64 * 4).from_address(gate_args(args)[0])[2]

        def gate():
            if not run_gate_on_host(*gate_args(args), _core.load_acquire, _core.store_release, _bounded("a gate")):
                self.order.append("write skipped" if writes else "wait released")

        self.side.put(gate)


class SimMessenger(NcclMessenger):
    """The real messenger's abort; post() queues an NCCL op whose dead peer never takes part."""

    def __init__(self, group, side):
        super().__init__(group, [0, 1, 2, 3], owned=True)
        self.side = side

    def post(self, kind, buf, peer, side):
        def op():
            waiting = _bounded(f"{kind} with rank {peer}")
            while not self.group.aborted.is_set():
                waiting()  # moves nothing: the aborted communicator's kernels leave their waits

        self.side.put(op)


def sim_transport(rank, order, kernel_error=None):
    side = SimSide()
    win = window_of(rank)
    dog = SideWatchdog(
        rank, 5.0, lambda e: None, words=torch.zeros(5, dtype=torch.int64), clock=Clock(), autostart=False
    )
    group = FakeGroup(order)
    tma = FakeTma(Log(), rank)
    if kernel_error is not None:

        def check_error():
            raise kernel_error

        tma.check_error = check_error
    t = split_cuda.SplitCudaTransport(
        comm=None,
        rank=rank,
        world=4,
        window=win,
        wlayout=WL,
        layout=None,
        num_workers=1,
        timeout_s=5.0,
        domain_of=DOM,
        tma=tma,
        drv=SimDriver(side, order),
        messenger=SimMessenger(group, side),
        side=side,
        dog=dog,
        gates=Gates(dog.gate_addrs(), alloc=lambda n: torch.zeros(n, dtype=torch.int64)),
    )
    dog.on_failure = t._on_dog_failure
    win.local[WL["ready_off"] : WL["ready_off"] + 8].view(torch.int64)[0] = 3  # the kernel joined epoch 3
    return t, side, group


def wait_until(cond, what):
    waiting = _bounded(what)
    while not cond():
        waiting()


@pytest.mark.parametrize(
    "rank,awaited",
    [
        (0, "sending message 1 of 6: header (digest) rank 0 -> rank 2 (peer rank 2)"),
        (2, "receiving message 1 of 6: header (digest) rank 0 -> rank 2 (peer rank 0)"),
    ],
)
def test_a_dead_peer_the_watchdog_aborts_the_group_the_side_stream_drains_and_the_caller_gets_a_named_timeout(
    rank, awaited
):
    order: list = []
    t, side, group = sim_transport(rank, order)
    t.run(Op.MULTICAST, schedule("force"), 3, None, [-1], [0], "weight_sync", 5)
    drained = threading.Event()
    side.put(drained.set)
    assert t.drv.joins == [(5, t.dog.addr(DONE), 3)]  # the caller's stream joins on the done word
    wait_until(lambda: int(t.dog.words[STARTED]) == 3, "the side stream's start")
    t.dog.poll()  # the clock starts: the side stream reached the op
    t.dog.clock.t += 4.99
    t.dog.poll()
    assert not group.aborted.is_set() and not drained.is_set()  # blocked in NCCL, within the timeout
    t.dog.clock.t += 0.02  # past start + timeout (not twice it)
    t.dog.poll()
    assert group.aborted.is_set() and t.dog.released()
    assert drained.wait(20.0), "the side stream did not drain after the abort"
    assert not side.errors
    # the group abort came before any gate left its wait, and nothing claims a chunk arrived
    assert order[0] == "abort" and order.count("abort") == 1
    arrivals = t.window.local[WL["arrival_off"] : WL["arrival_off"] + 16].view(torch.int64)
    assert arrivals.tolist() == [0, 0]
    if rank == 0:  # its kernel never copied the chunks into the shadow: both chunk waits were released
        assert order.count("wait released") == 2 and "write skipped" not in order
    else:  # the flag writes behind the receives the abort released were skipped
        assert order.count("write skipped") == 2
    t.dog.poll()
    assert int(t.dog.words[DONE]) == ABORT  # the side stream's late done write does not lower the join
    with pytest.raises(UltracommTimeout) as ei:
        t.check_error()
    assert f"rank {rank} weight_sync (epoch 3, transport split, side stream) gave up after 5 s {awaited}" in str(
        ei.value
    )
    t.check_error()  # once
    assert t.abandoned_streams()
    t.close()  # keeps what the failed side stream may use (the group: aborted, not destroyed)
    assert t.messenger.aborted and ("tma_close", rank) not in t.tma.log
    side.close()


def test_a_failure_the_kernel_reports_releases_the_side_stream_before_it_is_raised():
    order: list = []
    err = UltracommTimeout("ultracomm: rank 0 weight_sync (epoch 3): waiting for rank 2 (kernel)")
    t, side, group = sim_transport(0, order, kernel_error=err)
    t.run(Op.MULTICAST, schedule("force"), 3, None, [-1], [0], "weight_sync", 5)
    drained = threading.Event()
    side.put(drained.set)
    with pytest.raises(UltracommTimeout, match=r"waiting for rank 2 \(kernel\)"):
        t.check_error()
    assert group.aborted.is_set() and t.dog.released() and t.dog.pending() == 0
    assert drained.wait(20.0) and not side.errors
    t.dog.poll()  # the watchdog thread's next poll: the side stream's late done write does not lower the join
    assert int(t.dog.words[DONE]) == ABORT and t.abandoned_streams()
    side.close()


def test_an_abort_that_does_not_return_still_opens_the_gates_within_the_grace():
    started, unblock = threading.Event(), threading.Event()

    def stuck_abort():  # ncclCommAbort waiting for the device (NCCL issue 1013)
        started.set()
        assert unblock.wait(20.0)

    dog = SideWatchdog(
        0,
        5.0,
        lambda e: None,
        words=torch.zeros(5, dtype=torch.int64),
        autostart=False,
        abort_group=stuck_abort,
        grace_s=0.05,
    )
    dog.add(3, "weight_sync", OPS)
    t0 = time.monotonic()
    dog.abandon(UltracommTimeout("x"))
    took = time.monotonic() - t0
    assert started.is_set() and dog.released() and int(dog.words[DONE]) == ABORT and dog.pending() == 0
    assert 0.05 <= took < 5.0  # waited the grace for the abort, then opened the gates anyway
    dog.abandon(UltracommTimeout("y"))  # once: no second abort
    unblock.set()
    dog._aborter.join(20.0)
    assert not dog._aborter.is_alive() and dog.abort_error is None


def test_an_abort_that_raises_is_logged_and_the_gates_open(caplog):
    def failing():
        raise RuntimeError("NCCL error: invalid usage")

    dog = SideWatchdog(
        1, 5.0, lambda e: None, words=torch.zeros(5, dtype=torch.int64), autostart=False, abort_group=failing
    )
    with caplog.at_level("WARNING", logger="ultracomm"):
        dog.abandon(UltracommTimeout("x"))
    assert dog.released() and isinstance(dog.abort_error, RuntimeError)
    assert (
        "rank 1: aborting the side stream's NCCL group failed: RuntimeError: NCCL error: invalid usage" in caplog.text
    )


def test_abort_group_uses_what_this_torch_offers():
    calls = []
    abort_group(SimpleNamespace(abort=lambda: calls.append("ProcessGroup.abort")))  # torch >= 2.7
    backend = SimpleNamespace(_abort=lambda: calls.append("ProcessGroupNCCL._abort"))  # torch 2.1-2.6
    abort_group(SimpleNamespace(_get_backend=lambda device: backend))
    assert calls == ["ProcessGroup.abort", "ProcessGroupNCCL._abort"]
    with pytest.raises(UltracommError, match="offers no abort of a process group"):
        abort_group(SimpleNamespace(_get_backend=lambda device: SimpleNamespace()))
    # a messenger aborts only a group it owns (never the user's), once
    m = NcclMessenger(SimpleNamespace(abort=lambda: calls.append("owned")), [0, 1], owned=True)
    m.abort()
    m.abort()
    NcclMessenger(SimpleNamespace(abort=lambda: calls.append("user's")), [0, 1], owned=False).abort()
    assert calls[2:] == ["owned"]
    m.close()  # an aborted group is not destroyed (destroy_process_group would shut its gone communicators down)
    assert m.group is None
    if hasattr(torch.distributed, "ProcessGroup"):  # the installed torch has the method abort_group calls first
        assert hasattr(torch.distributed.ProcessGroup, "abort") or hasattr(
            torch.distributed.ProcessGroup, "_get_backend"
        )


def test_the_gates_group_waits_then_writes_and_never_move_a_wait_before_a_write():
    ops = [
        StreamOp(WAIT_GE, Ref(OWN, 8)),
        StreamOp(WAIT_GE, Ref(OWN, 16)),
        StreamOp(SEND, Ref(OWN, 0), 2, 8),
        StreamOp(RECV, Ref(OWN, 24), 2, 8),
        StreamOp(WRITE, Ref(OWN, 32)),
        StreamOp(WAIT_GE, Ref(OWN, 40)),
        StreamOp(WRITE, Ref(OWN, 48)),
        StreamOp(WRITE, Ref(OWN, 56)),
    ]
    steps = gated(ops, lambda o: 1000 + o.ref.off)
    assert steps == [
        ("gate", (1008, 1016), ()),
        ("op", ops[2]),
        ("op", ops[3]),
        ("gate", (), (1032,)),
        ("gate", (1040,), ()),
        ("gate", (), (1048, 1056)),
    ]
    g = Gates((0x5000, 0x6000), alloc=lambda n: torch.zeros(n, dtype=torch.int64))
    out = g.steps(ops, lambda o: 1000 + o.ref.off)
    assert g.steps(ops, lambda o: 1000 + o.ref.off) is out  # cached per (ops, addresses)
    assert g.steps(ops, lambda o: 2000 + o.ref.off) is not out  # a new shadow address: a new table
    gates = [s for s in out if s[0] == "gate"]
    assert all(s[1] % 16 == 0 for s in gates)
    assert [s[2] for s in gates] == [0x6000, 0x5000, 0x6000, 0x5000]  # waits: open; writes: skip
    # the host emulation of the kernel: a skipped write gate writes nothing; a wait gate leaves on open
    mem = {1040: 0, 1048: 0, 1056: 0, 0x5000: 1, 0x6000: 0}
    assert run_gate_on_host(gates[3][1], 9, 0x5000, mem.__getitem__, mem.__setitem__) is False and mem[1048] == 0
    mem[0x5000] = 0
    assert run_gate_on_host(gates[3][1], 9, 0x5000, mem.__getitem__, mem.__setitem__) and mem[1048] == mem[1056] == 9
    mem[0x6000] = 1  # the flag at 1040 never comes: the open word releases the wait
    assert run_gate_on_host(gates[2][1], 9, 0x6000, mem.__getitem__, mem.__setitem__) is False


def test_a_kernel_failure_with_nothing_in_flight_leaves_the_side_stream_alone():
    """Plans that differ are found before anything is enqueued: nothing to release, nothing aborted,
    the streams are not abandoned (close frees the plans and shadows)."""
    order: list = []
    err = UltracommError("ultracomm: rank 0 weight_sync: rank 2 runs a different plan for this operation")
    t, side, group = sim_transport(0, order, kernel_error=err)
    with pytest.raises(UltracommError, match="runs a different plan"):
        t.check_error()
    assert not group.aborted.is_set() and not t.dog.released() and not t.abandoned_streams()
    side.close()
