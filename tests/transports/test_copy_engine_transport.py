"""CopyEngineTransport's enqueue path on CPU, with a fake driver and fake CUDA streams/events: each
command becomes the driver call on the right stream (MAIN: the caller's; fork: an event recorded
on the caller's stream that every internal stream waits for first; joins last on the caller's
stream), a loopback set is enqueued once by the rank completing it in the merged order, a
rejection publishes kRejectedDigest, the watchdog watches every operation, and a failed transport
refuses further operations.  Nothing here runs on a device."""

from __future__ import annotations

import ctypes

import contextlib
import itertools
import threading
import types

import numpy as np
import pytest
import torch

import ultracomm.transports.copy_engine as ce
from ultracomm import ReplicaPlan, _core
from ultracomm.errors import UltracommError
from ultracomm.records import Op
from ultracomm.transports.copy_engine.plan import EPOCH, MAIN, flag_addr, submission_order

from conftest import hot_slot_src
from copy_engine_sim import host_contexts

WORLD, EPR, SLOTS, CALLER = 4, 2, 3, 0x77


class Recorder:
    def __init__(self):
        self.calls: list[tuple] = []
        self.handles = itertools.count(0x1000)
        self.events = itertools.count(1)
        self.created: list[tuple[int, int]] = []
        self.destroyed: list[int] = []
        self.bound: list[tuple[str, int, int]] = []  # (thread, device, driver calls made before)


class FakeDriver:
    def __init__(self, rec):
        self.rec = rec

    def bind(self, device):
        self.rec.bound.append((threading.current_thread().name, device, len(self.rec.calls)))

    def memcpy(self, dst, src, nbytes, stream):
        self.rec.calls.append(("copy", stream, dst, src, nbytes))

    def write_value(self, stream, addr, value):
        self.rec.calls.append(("write", stream, addr, value))

    def wait_value(self, stream, addr, value, equal=False):
        self.rec.calls.append(("wait_eq" if equal else "wait", stream, addr, value))

    def function(self, ptx, name):
        assert name == "uc_ce_gate" and ".entry uc_ce_gate" in ptx
        return 0xF00

    def launch(self, function, threads, stream, args):
        self.rec.calls.append(("gate", stream, args[0].value, args[1].value, args[2].value))

    def stream_create(self, priority=0):
        h = next(self.rec.handles)
        self.rec.created.append((h, priority))
        return h

    def stream_destroy(self, stream):
        self.rec.destroyed.append(stream)


@pytest.fixture
def fake_cuda(monkeypatch):
    rec = Recorder()

    class Stream:
        def __init__(self, device=None, handle=None):
            self.cuda_stream = next(rec.handles) if handle is None else handle

        def wait_event(self, ev):
            rec.calls.append(("wait_event", self.cuda_stream, ev.id))

    class Event:
        def __init__(self):
            self.id = next(rec.events)

        def record(self, stream):
            rec.calls.append(("record", stream.cuda_stream, self.id))

        def query(self):
            return True

    monkeypatch.setattr(ce, "require", lambda *a, **k: None)
    monkeypatch.setattr(ce, "driver", lambda: FakeDriver(rec))
    monkeypatch.setattr(ce, "pinned_words", lambda n: torch.zeros(n, dtype=torch.int64))
    monkeypatch.setattr(torch.cuda, "Stream", lambda *a, **k: pytest.fail("a pooled torch stream was taken"))
    monkeypatch.setattr(torch.cuda, "Event", Event)
    monkeypatch.setattr(torch.cuda, "ExternalStream", lambda h, device=None: Stream(handle=h))
    monkeypatch.setattr(torch.cuda, "device", lambda d: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    return rec


@pytest.fixture(scope="module")
def domain():
    ctxs, each = host_contexts(WORLD, EPR, SLOTS, "force")
    yield ctxs
    for c in ctxs:
        c.close()


@pytest.fixture
def make_transports(fake_cuda, domain):
    """``make(loopback)``: one transport per rank of ``domain`` (closed after the test)."""
    made = []

    def make(loopback):
        made.extend(transports_for(domain, loopback))
        return made[-len(domain) :]

    yield make
    for t in made:
        t.close()


def transports_for(ctxs, loopback):
    shared: dict = {}
    out = []
    for c in ctxs:
        win = types.SimpleNamespace(
            local=types.SimpleNamespace(device="cuda:0"),
            peer_bases=list(c.window.peer_bases),
            loopback=loopback,
            shared=shared,
            world=len(ctxs),
            provider="cuda_local",
        )
        out.append(
            ce.CopyEngineTransport(
                rank=c.rank, world=len(ctxs), window=win, wlayout=c.wlayout, layout=c.layout, timeout_s=30.0
            )
        )
    return out


def args(c, plan):
    return (c.schedule_for(plan), c._masters[0], plan.slot_src[c.rank].tolist(), plan.local_index_of.tolist())


def run_all(ts, domain, plan, epoch, rec, rejecting=-1):
    """Every rank's multicast share (``rejecting`` rejects instead), in rank order; what each
    ``run`` returned.  Nothing is enqueued before the last share."""
    got = []
    for t, c in zip(ts, domain):
        if t.rank == rejecting:
            got.append(t.reject(Op.MULTICAST, epoch, stream=CALLER))
        else:
            sched, masters, my_slots, lio = args(c, plan)
            got.append(t.run(Op.MULTICAST, sched, epoch, masters, my_slots, lio, "restore", stream=CALLER))
        if t.rank < len(ts) - 1:
            assert rec.calls == []  # a share only
    return got


def expected_calls(t, cmds, epoch, caller, fork_id):
    """What ``cmds`` must become: (kind, stream handle, ...) per command, internal handles by key."""
    out = []
    for x in cmds if any(c.kind == "gate" for c in cmds) else t.gated(cmds):
        v = epoch if x.value == EPOCH else x.value
        h = caller if x.stream == MAIN else t._streams[x.stream].cuda_stream
        if x.kind == "gate":  # the gate kernel: its descriptor, the epoch, this rank's abort word
            out.append(("gate", h, x.src, epoch, t._abort_word()))
        elif x.kind == "fork":
            out.append(("record", caller, fork_id))
        elif x.kind == "forked":
            out.append(("wait_event", h, fork_id))
        elif x.kind == "copy":
            out.append(("copy", h, x.addr, x.src, x.nbytes))
        else:
            out.append((x.kind, h, x.addr, v))
    return out


def test_one_rank_maps_commands_to_driver_calls(fake_cuda, domain, make_transports):
    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    ts = make_transports(loopback=False)
    t, c = ts[0], domain[0]
    sched, masters, my_slots, lio = args(c, plan)
    assert t.run(Op.MULTICAST, sched, 7, masters, my_slots, lio, "weight_sync", stream=CALLER) is True
    cmds = t.commands(sched, masters, my_slots, lio)
    assert fake_cuda.calls == expected_calls(t, cmds, 7, CALLER, t._fork.id)
    main = [x for x in fake_cuda.calls if x[1] == CALLER]
    assert [x[0] for x in main[:4]] == ["write", "write", "write", "record"]
    assert main[0][2:] == (flag_addr(c.wlayout, c.window.peer_bases[0], "digest"), cmds[0].value) and main[1][3] == 7
    assert all(x[0] == "wait" for x in main[4:]) and fake_cuda.calls[-len(main[4:]) :] == main[4:]
    internal = {x[1] for x in fake_cuda.calls} - {CALLER}
    for h in internal:  # every internal stream waits for the fork before anything else
        assert [x for x in fake_cuda.calls if x[1] == h][0] == ("wait_event", h, t._fork.id)
    # no stream memory-op wait on an internal stream (only the caller's joins on host words): every
    # wait on a peer's flag is a gate, whose descriptor holds the digest's equality wait
    assert not any(x[0] in ("wait", "wait_eq") and x[1] != CALLER for x in fake_cuda.calls)
    gates = [x for x in t.gated(cmds) if x.kind == "gate"]
    assert gates and any(p.kind == "wait_eq" for g in gates for p in g.parts)
    for g in gates:  # each descriptor, as the kernel reads it, is the gate's parts
        n = 4 + 3 * sum(p.kind != "write" for p in g.parts) + 2 * sum(p.kind == "write" for p in g.parts)
        d = np.ctypeslib.as_array((ctypes.c_uint64 * n).from_address(g.src))
        assert list(d[:3]) == [
            sum(p.kind in ("wait", "wait_eq") for p in g.parts),
            sum(p.kind == "copy" for p in g.parts),
            sum(p.kind == "write" for p in g.parts),
        ]
        assert d[4] == g.parts[0].addr
    p = t._dog._pending[-1]
    assert p.abort == t._abort_word()
    assert (p.epoch, p.op_name, p.joins) == (7, "weight_sync", [x[2] for x in main[4:]])


def test_loopback_set_is_enqueued_once_in_the_merged_order(fake_cuda, domain, make_transports):
    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    ts = make_transports(loopback=True)
    got = run_all(ts, domain, plan, 9, fake_cuda)
    assert got == [False] * (WORLD - 1) + [True]
    programs = [t.gated(t.commands(*args(c, plan))) for t, c in zip(ts, domain)]
    want = []
    for r, x in submission_order(programs):
        want += expected_calls(ts[r], [x], 9, CALLER, ts[r]._fork.id)
    assert fake_cuda.calls == want
    assert all(t._dog.pending() == 1 for t in ts)


def test_loopback_rejection_is_a_share_of_the_set(fake_cuda, domain, make_transports):
    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    ts = make_transports(loopback=True)
    run_all(ts, domain, plan, 4, fake_cuda, rejecting=2)
    base, wl = domain[2].window.peer_bases[2], domain[2].wlayout
    mine = [
        x
        for x in fake_cuda.calls
        if x[2] in (flag_addr(wl, base, "digest"), flag_addr(wl, base, "ready")) and x[0] == "write"
    ]
    assert mine == [
        ("write", CALLER, flag_addr(wl, base, "digest"), int(_core.REJECTED_DIGEST)),
        ("write", CALLER, flag_addr(wl, base, "ready"), 4),
    ]
    assert ts[2]._dog.pending() == 0 and ts[0]._dog.pending() == 1


def test_a_failed_transport_refuses_and_hands_its_error_out_once(fake_cuda, domain, make_transports):
    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    t = make_transports(loopback=False)[1]
    boom = UltracommError("ultracomm: rank 1 weight_sync (multicast) epoch 3 timed out")
    assert not t.abandoned_streams()
    t._dog.fail(boom)
    assert t.abandoned_streams()
    with pytest.raises(UltracommError) as ei:
        t.check_error()
    assert ei.value is boom
    t.check_error()  # handed out once; the Context keeps it
    sched, masters, my_slots, lio = args(domain[1], plan)
    with pytest.raises(
        UltracommError,
        match=r"rank 1 restore: an earlier copy_engine operation failed \(.*timed "
        r"out\); create a new Context",
    ):
        t.run(Op.MULTICAST, sched, 4, masters, my_slots, lio, "restore", stream=CALLER)
    assert fake_cuda.calls == []


def test_graph_capture_is_refused(fake_cuda, domain, make_transports, monkeypatch):
    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    t = make_transports(loopback=False)[0]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    sched, masters, my_slots, lio = args(domain[0], plan)
    with pytest.raises(UltracommError, match="cannot be captured in a CUDA graph"):
        t.run(Op.MULTICAST, sched, 1, masters, my_slots, lio, stream=CALLER)
    assert fake_cuda.calls == []


def test_words_are_where_the_commands_write(fake_cuda, domain, make_transports):
    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    t = make_transports(loopback=False)[0]
    cmds = t.commands(*args(domain[0], plan))
    base = t._words.data_ptr()
    host = [x.addr for x in cmds if x.what == "started" or x.what.startswith("done")]
    assert host and all(base <= a < base + 8 * t._words.numel() for a in host)
    assert np.all(t._words.numpy() == 0)


def test_a_loopback_ranks_failure_abandons_the_shared_device(fake_cuda, domain, make_transports):
    """Loopback ranks share one device: after any rank's failure none may synchronise it."""
    loop, alone = make_transports(loopback=True), make_transports(loopback=False)
    loop[1]._dog.fail(UltracommError("ultracomm: rank 1 weight_sync (multicast) epoch 3 timed out"))
    alone[1]._dog.fail(UltracommError("ultracomm: rank 1 weight_sync (multicast) epoch 3 timed out"))
    assert all(t.abandoned_streams() for t in loop)
    assert [t.abandoned_streams() for t in alone] == [False, True, False, False]


def test_internal_streams_are_its_own_and_released_at_close(fake_cuda, domain):
    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    ts = transports_for(domain, loopback=False)
    # every transport made its watchdog's read stream at setup, at the highest priority: made
    # later, from the watchdog, cuStreamCreate waited for a caller's legacy stream that was
    # blocked on a join only the watchdog releases (a deadlock seen on an H200)
    assert [p for _, p in fake_cuda.created] == [-1] * len(ts)
    t, setup = ts[0], {h for h, _ in fake_cuda.created}
    side = t._streams[ce._SIDE].cuda_stream
    sched, masters, my_slots, lio = args(domain[0], plan)
    t.run(Op.MULTICAST, sched, 2, masters, my_slots, lio, "weight_sync", stream=CALLER)
    handles = {x[1] for x in fake_cuda.calls} - {CALLER}
    assert handles and handles == {h for h, _ in fake_cuda.created} - setup  # driver-made, none from torch's pool
    t.close()
    for other in ts[1:]:
        other.close()
    assert side in fake_cuda.destroyed and set(handles) <= set(fake_cuda.destroyed)


def test_quiesce_waits_for_operations_in_flight_to_end(fake_cuda, domain, make_transports):
    """A device-wide synchronize may only start once no operation can still fail: quiesce
    returns when the watchdogs retired every operation (here: one fails)."""
    import threading

    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    ts = make_transports(loopback=True)
    run_all(ts, domain, plan, 5, fake_cuda)
    assert all(t._dog.pending() == 1 for t in ts)
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ts[0].quiesce(), done.set()), daemon=True)
    waiter.start()
    assert not done.wait(0.2)  # still in flight: quiesce waits
    ts[3]._dog.fail(UltracommError("ultracomm: rank 3 restore (multicast) epoch 5 timed out"))
    assert done.wait(10) and ts[0].abandoned_streams()


def test_quiesce_is_bounded_when_no_stream_reaches_the_operations(fake_cuda, domain, make_transports):
    """Operations the caller's stream never reaches have no clock of their own: quiesce gives up
    after its bound with an UltracommTimeout that says what it waited for (it waited forever)."""
    import time

    from ultracomm.errors import UltracommTimeout
    from ultracomm.transports.copy_engine.watchdog import quiesce

    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    ts = make_transports(loopback=True)
    run_all(ts, domain, plan, 5, fake_cuda)
    assert all(t._dog.pending() == 1 and t._dog.running() == 0 for t in ts)
    t0 = time.monotonic()
    with pytest.raises(
        UltracommTimeout, match=r"4 operation\(s\) of rank\(s\) \[0, 1, 2, 3\] still in flight after 0.2 s"
    ):
        quiesce(ts[0]._dogs, bound_s=0.2)
    assert 0.2 <= time.monotonic() - t0 < 5
    assert ts[0]._dogs[0].timeout_s == 30.0  # the default bound: twice the watchdogs' timeout
    ts[2]._dog.fail(UltracommError("ultracomm: rank 2 weight_sync (multicast) epoch 5 timed out"))
    quiesce(ts[0]._dogs, bound_s=0.2)  # failed, nothing running: returns at once


def test_quiesce_after_a_failure_waits_for_the_other_ranks_running_operations(fake_cuda, domain, make_transports):
    """A loopback rank's failure must not cut short another rank's operation that is running:
    that rank's own watchdog still reports its error (an H200 run of the plan-mismatch case
    returned None for the second rank).  Operations no stream reached are not waited for."""
    import threading

    from ultracomm.transports.copy_engine.plan import word_addr
    from ultracomm.transports.copy_engine.watchdog import write_host

    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    ts = make_transports(loopback=True)
    run_all(ts, domain, plan, 5, fake_cuda)
    write_host(word_addr(ts[1]._words.data_ptr(), None), 5)  # rank 1's caller stream reached its op
    done = threading.Event()
    waiter = threading.Thread(target=lambda: (ts[0].quiesce(), done.set()), daemon=True)
    waiter.start()
    ts[3]._dog.fail(UltracommError("ultracomm: rank 3 weight_sync (multicast) epoch 5 timed out"))
    assert not done.wait(0.3)  # rank 1's running op has not ended
    assert ts[1]._dog.running() == 1 and ts[2]._dog.running() == 0
    ts[1]._dog.fail(UltracommError("ultracomm: rank 1 weight_sync (multicast) epoch 5: rank 0 runs a different plan"))
    assert done.wait(10)
    with pytest.raises(UltracommError, match="rank 1 weight_sync"):
        ts[1].check_error()


def test_each_thread_binds_the_device_context_before_its_driver_calls(fake_cuda, domain, make_transports):
    """Driver calls need a current context, which a thread has only after a runtime call of its
    own: the enqueuing thread and the watchdog's reads bind the device first."""
    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    me = threading.current_thread().name
    t = make_transports(loopback=False)[0]
    n0 = len(fake_cuda.bound)  # each transport's setup binds before it makes its watchdog's stream
    assert fake_cuda.bound == [(me, 0, 0)] * WORLD
    sched, masters, my_slots, lio = args(domain[0], plan)
    t.run(Op.MULTICAST, sched, 3, masters, my_slots, lio, "weight_sync", stream=CALLER)
    assert fake_cuda.bound[n0:] == [(me, 0, 0)] and fake_cuda.calls
    before = len(fake_cuda.calls)
    reader = threading.Thread(target=t._read_device, args=([t._words.data_ptr()],), name="reader")
    reader.start()
    reader.join(10)
    assert fake_cuda.bound[n0 + 1 :] == [("reader", 0, before)] and fake_cuda.calls[before][0] == "copy"


def test_a_failed_enqueue_releases_the_joins_and_abandons_the_streams(fake_cuda, domain, make_transports):
    """A driver call that fails halfway leaves earlier commands queued (the caller's stream may wait
    on joins nobody writes, the operation may have no clock): the watchdogs fail at once."""
    from ultracomm.cuda.driver import DriverError
    from ultracomm.transports.copy_engine.watchdog import ABORT, read_host

    plan = ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)
    ts = make_transports(loopback=True)
    boom = DriverError("ultracomm: cuStreamWaitValue64 failed: CUDA driver error 801 (operation not supported)")

    def refuse(*a, **k):
        raise boom

    for t in ts:
        t.driver.wait_value = refuse
    with pytest.raises(DriverError, match="not supported"):
        run_all(ts, domain, plan, 6, fake_cuda)
    assert fake_cuda.calls  # the prefixes were enqueued before the failing wait
    for t in ts:
        assert t.abandoned_streams() and t._dog.pending() == 0
        joins = sorted(t._dog._all_joins)
        assert joins and read_host(joins) == [ABORT] * len(joins)
        with pytest.raises(UltracommError, match=r"enqueueing a copy_engine operation \(epoch 6\) failed: .*801"):
            t.check_error()
    ts[1].quiesce()  # returns: nothing is left in flight


def test_close_after_a_failure_keeps_the_reduce_kernel(fake_cuda, domain):
    """Freeing the tma reducer's device plans is a cudaFree, a device-wide wait that blocked streams
    never end: after a failure the transport keeps it for good; otherwise it frees it."""
    closed = []
    failed, healthy = transports_for(domain, loopback=False)[:2]
    for t in (failed, healthy):
        t._tma = types.SimpleNamespace(close=lambda t=t: closed.append(t.rank))
    failed._dog.fail(UltracommError("ultracomm: rank 0 weight_sync (multicast) epoch 2 timed out"))
    kept = failed._tma
    failed.close()
    healthy.close()
    assert closed == [healthy.rank] and kept in ce._KEPT
