"""The profiler's op times on the stream-ordered path (tma, copy_engine), on CPU with fakes: a
Context records a (start, end) pair of timing events on the caller's stream around each
operation, never synchronises them, and the writer turns them into seconds once the end event
completed; a loopback rank's share (nothing enqueued) and a failed submit have no time."""

from __future__ import annotations

import numpy as np
import pytest

import ultracomm.cuda.stream_ordered as so
import ultracomm.transports as transports
from ultracomm import LoopbackDomain, ReplicaPlan
from ultracomm.profile import Profiler, load_trace
from ultracomm.records import Op

from test_stream_ordered import FakeStreams, FakeStreamTransport, make_ctx, masters


class TimedEvent:
    """A timing event at ``ms`` (device clock); completes when the fake stream says so."""

    def __init__(self, ms: float, streams: "TimedStreams"):
        self.ms, self.streams, self.synced = ms, streams, False

    def query(self) -> bool:
        return self.streams.device_done

    def synchronize(self) -> None:  # a host sync: must never happen inside an operation
        self.synced = True

    def elapsed_time(self, end: "TimedEvent") -> float:
        assert self.streams.device_done and end.streams.device_done, "read before the end event completed"
        return end.ms - self.ms


class TimedStreams(FakeStreams):
    """FakeStreams whose device clock advances 1.25 ms per recorded timing event; work counts as
    done on the device once ``device_done`` is set (the test decides when)."""

    def __init__(self):
        super().__init__()
        self.clock_ms, self.timed, self.device_done = 0.0, [], False

    def timing_event(self):
        self.clock_ms += 1.25
        ev = TimedEvent(self.clock_ms, self)
        self.timed.append(ev)
        return ev


class ShareTransport(FakeStreamTransport):
    """A loopback rank's share: run() enqueues nothing and says so."""

    def run(self, *a, **k):
        super().run(*a, **k)
        return False


@pytest.fixture
def timed(monkeypatch):
    made: list[TimedStreams] = []

    def streams_for(device):
        made.append(TimedStreams())
        return made[-1]

    monkeypatch.setitem(transports.TRANSPORTS, "tma", FakeStreamTransport)
    monkeypatch.setattr(so, "streams_for", streams_for)
    return made


PLAN = ReplicaPlan.make(np.array([[2, -1], [0, -1]], np.int32), experts_per_rank=2)


def run_ops(tmp_path, timed):
    """weight_sync, restore (async), grad_reduce on 2 ranks; returns every rank's trace."""

    def body(group):
        prof = Profiler(tmp_path / f"r{group.rank}")
        with make_ctx(group, profile=prof) as ctx:
            ctx.register_masters(0, *masters(group.rank, 2))
            vid = ctx.begin(0)
            ctx.weight_sync(vid, PLAN)
            ctx.restore(vid, async_op=True).wait()
            group.barrier()
            ctx.grad_reduce(vid)
            streams = ctx._streams.streams
            assert all(not ev.synced for ev in streams.timed)  # nothing synchronised in an operation
            assert streams.syncs == 0
            streams.device_done = True  # the device finished: the writer may read the events now
        prof.close()
        return load_trace(tmp_path / f"r{group.rank}")

    return LoopbackDomain(2).run(body)


def test_stream_ordered_ops_are_timed_by_events_read_after_completion(tmp_path, timed):
    traces = run_ops(tmp_path, timed)
    for tr in traces:
        assert len(tr) == 1
        # each op: start and end events 1.25 ms apart on the fake device clock
        for op in ("weight_sync", "restore", "grad_reduce"):
            assert tr[f"time_{op}"][0] == pytest.approx(1.25e-3, abs=0)
        assert tr["has_stats"][0]
    for s in timed:
        assert len(s.timed) == 6 and not any(ev.synced for ev in s.timed)


def test_a_loopback_share_and_a_failed_submit_have_no_time(tmp_path, timed, monkeypatch):
    monkeypatch.setitem(transports.TRANSPORTS, "tma", ShareTransport)

    def body(group):
        prof = Profiler(tmp_path / f"r{group.rank}")
        with make_ctx(group, profile=prof) as ctx:
            ctx.register_masters(0, *masters(group.rank, 2))
            vid = ctx.begin(0)
            ctx.weight_sync(vid, PLAN)  # a share: enqueued by another call, no time of its own
            ctx._streams.streams.device_done = True
            ctx.transport.run = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("launch failed"))
            with pytest.raises(RuntimeError, match="launch failed"):
                ctx.restore(vid)
        prof.close()
        return load_trace(tmp_path / f"r{group.rank}")

    for tr in LoopbackDomain(2).run(body):
        assert np.isnan(tr["time_weight_sync"][0]) and np.isnan(tr["time_restore"][0])
        assert tr["has_stats"][0]


def test_an_end_event_that_never_completes_gives_nan_not_a_hang(tmp_path, timed):
    def body(group):
        prof = Profiler(tmp_path / f"r{group.rank}", op_wait_s=0.2)
        with make_ctx(group, profile=prof) as ctx:
            ctx.register_masters(0, *masters(group.rank, 2))
            ctx.weight_sync(ctx.begin(0), PLAN)
            runs = [r[0] for r in ctx.transport.runs]
        prof.close()  # the device never completes: the writer gives up after op_wait_s
        return load_trace(tmp_path / f"r{group.rank}"), runs

    for tr, runs in LoopbackDomain(2).run(body):
        assert runs == [Op.MULTICAST] and np.isnan(tr["time_weight_sync"][0]) and tr["has_stats"][0]


def test_captured_operations_are_not_timed(tmp_path, timed):
    """Under CUDA graph capture the operation runs at replay: no events are recorded for it."""

    def body(group):
        prof = Profiler(tmp_path / f"r{group.rank}")
        with make_ctx(group, profile=prof) as ctx:
            ctx.register_masters(0, *masters(group.rank, 2))
            streams = ctx._streams.streams
            streams.capturing = True
            ctx.weight_sync(ctx.begin(0), PLAN)
            streams.capturing, streams.device_done = False, True
            assert streams.timed == []
        prof.close()
        return load_trace(tmp_path / f"r{group.rank}")

    for tr in LoopbackDomain(2).run(body):
        assert np.isnan(tr["time_weight_sync"][0]) and tr["has_stats"][0]
