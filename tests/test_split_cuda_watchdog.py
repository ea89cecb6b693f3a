"""The GPU split transport's watchdog on the CPU (host words in a plain tensor, a fake clock):
an op is retired when its done word arrives, its clock starts when the side stream reached it,
and past twice the timeout it fails naming the stuck message and releases the caller's join;
the transport raises that error (loopback: on every rank) and reports its streams abandoned."""
from __future__ import annotations

import pytest
import torch

from ultracomm import UltracommTimeout
from ultracomm.records import Op
from ultracomm.transports.split import cuda as split_cuda
from ultracomm.transports.split.cuda_watchdog import ABORT, DONE, PROGRESS, STARTED, SideWatchdog, progress_value
from ultracomm.transports.split.stream import stream_program

from test_split_cuda import Log, schedule, transport, window_of
from test_split_stream import WL, programs_2x2

OPS = stream_program(programs_2x2("force", Op.MULTICAST)[0], WL)  # rank 0: 2 header sends, 2 receives, 2 chunks


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def dog_of(clock, failures):
    return SideWatchdog(0, 5.0, failures.append, words=torch.zeros(3, dtype=torch.int64), clock=clock,
                        autostart=False)


def test_done_retires_and_the_clock_starts_when_the_side_stream_reached_the_op():
    clock, failures = Clock(), []
    dog = dog_of(clock, failures)
    dog.add(7, "weight_sync", OPS)
    clock.t += 60.0
    dog.poll()  # not started: a long wait behind earlier work on the caller's stream is not this op's
    assert dog.pending() == 1 and not failures
    dog.words[STARTED] = 7
    dog.poll()
    clock.t += 9.9  # within twice the timeout
    dog.poll()
    assert not failures
    dog.words[DONE] = 7
    dog.poll()
    assert dog.pending() == 0 and not dog.failed()


def test_past_twice_the_timeout_it_names_the_stuck_message_and_releases_the_join():
    clock, failures = Clock(), []
    dog = dog_of(clock, failures)
    dog.add(7, "weight_sync", OPS)
    dog.words[STARTED] = 7
    dog.words[PROGRESS] = progress_value(7, 4)  # headers moved; the first chunk's send never completed
    dog.poll()
    clock.t += 10.01
    dog.poll()
    assert len(failures) == 1 and dog.failed() and int(dog.words[DONE]) == ABORT and dog.pending() == 0
    msg = str(failures[0])
    assert isinstance(failures[0], UltracommTimeout)
    assert msg.startswith("ultracomm: rank 0 weight_sync (epoch 7, transport split, side stream) gave up after 10 s "
                          "sending message 5 of 6: multicast expert 0 chunk 0 (bytes [0, 128) of slot 0) rank 0 -> "
                          "rank 2 (peer rank 2); the other end never took part")
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
        with pytest.raises(UltracommTimeout, match="side stream\\) gave up after 10 s copying message 1 of 6"):
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
    with pytest.raises(split_cuda.UltracommError,
                       match=r"rank 0 weight_sync \(epoch 3, transport split\): enqueueing the side stream failed "
                             r"\(RuntimeError: NCCL error: unhandled system error\)"):
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
