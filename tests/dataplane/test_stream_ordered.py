"""Context's stream-ordered path (what the tma transport uses), on CPU with a fake stream transport.

``FakeStreamTransport`` is a stream-ordered transport whose "kernel" is the host executor run
at enqueue time; its failures go into an error record that only ``check_error()`` raises, as
the device transport's do.  ``FakeStreams`` stands in for the CUDA stream/event calls, with
events that complete only when waited on or synchronized.  What is checked is Context's side:
epochs, the stream handed over, no collective per operation, errors surfacing at
``wait()``/``synchronize()`` with the record's text, refusal after a failure, rejection of a
local plan, capture rules.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import ultracomm
import ultracomm.cuda.stream_ordered as so
import ultracomm.transports as transports
from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.errors import UltracommError, UltracommTimeout
from ultracomm.records import Op
from ultracomm.schedule import build_schedule
from ultracomm.transports.host import HostTransport

from conftest import expected_master_grads, expert_weights, random_slot_src

STREAM = 0x5150


class FakeEvent:
    def __init__(self):
        self.done = False


class FakeStreams:
    def __init__(self):
        self.capturing = False
        self.recorded: list[FakeEvent] = []
        self.released: list[FakeEvent] = []
        self.syncs = self.host_waits = self.stream_waits = 0

    def check_current_device(self):
        pass

    def stream_handle(self):
        return STREAM

    def is_capturing(self):
        return self.capturing

    def record(self):
        ev = FakeEvent()
        self.recorded.append(ev)
        return ev

    def release(self, ev):
        self.released.append(ev)

    def query(self, ev):
        return ev.done

    def wait_event(self, ev):  # a host wait
        self.host_waits += 1
        ev.done = True

    def stream_wait(self, ev):  # the caller's stream waits: the host goes on
        self.stream_waits += 1

    def synchronize(self):
        self.syncs += 1
        for ev in self.recorded:
            ev.done = True


class FakeStreamTransport(HostTransport):
    name = "tma"
    stream_ordered = True
    names_by_evidence = False  # as tma's: StreamOrdered names the ranks of its timeouts by evidence
    window_providers = ("local",)
    options = HostTransport.options | {"multicast_sms", "reduce_sms"}

    def __init__(self, *, multicast_sms, reduce_sms, **kw):
        super().__init__(**kw)
        self.sms = (multicast_sms, reduce_sms)
        self.error: BaseException | None = None
        self.runs: list[tuple] = []
        self.rejects: list[tuple] = []
        self.withhold = False
        self.closed = False

    def run(self, op, schedule, epoch, masters, my_slots, local_index_of, op_name=None, *, stream):
        self.runs.append((Op(op), epoch, op_name, stream))
        if self.withhold or self.error is not None:  # withheld; or aborted after the first failure
            return
        try:
            super().run(op, schedule, epoch, masters, my_slots, local_index_of, op_name)
        except Exception as e:  # noqa: BLE001 - the device error record
            self.error = e

    def check_error(self):
        if self.error is not None:
            raise self.error

    def reject(self, op, epoch, *, stream):
        self.rejects.append((Op(op), epoch, stream))

    def close(self):
        self.closed = True


@pytest.fixture
def fake(monkeypatch):
    made: list[FakeStreams] = []

    def streams_for(device):
        s = FakeStreams()
        made.append(s)
        return s

    monkeypatch.setitem(transports.TRANSPORTS, "tma", FakeStreamTransport)
    monkeypatch.setattr(so, "streams_for", streams_for)
    return made


LAYOUT = ExpertLayout(
    (Member("fc1", (5, 3), torch.bfloat16), Member("fc2", (7,), torch.bfloat16)), grad_dtype=torch.float32
)


def masters(rank: int, epr: int):
    per = [expert_weights(LAYOUT, e) for e in range(rank * epr, (rank + 1) * epr)]
    weights = [torch.stack([p[m] for p in per]).contiguous() for m in range(2)]
    grads = [torch.zeros((epr, *m.shape), dtype=LAYOUT.grad_dtype) for m in LAYOUT.members]
    return weights, grads


def make_ctx(group, slots=2, epr=2, **kw):
    kw = dict(dict(transport="tma", window="local", chunk_bytes=64, tile_bytes=16, num_workers=2, timeout_s=20.0), **kw)
    return Context(group, LAYOUT, epr, slots, num_layers=1, **kw)


class CountingGroup:
    """Counts a rank's collectives (the Context holds this very object as its comm)."""

    def __init__(self, group):
        self.calls = 0
        inner = group.all_gather_object

        def counted(obj, **kw):
            self.calls += 1
            return inner(obj, **kw)

        group.all_gather_object = counted


def replicas_ok(ctx, plan):
    for s, e in enumerate(plan.slot_src[ctx.rank].tolist()):
        if e >= 0:
            for m, w in enumerate(expert_weights(LAYOUT, e)):
                assert torch.equal(ctx.replica_weights[m][s], w), f"rank {ctx.rank} slot {s} member {m}"


@pytest.mark.parametrize("mode", ["off", "force"])
def test_end_to_end_without_collectives_per_op(fake, mode):
    world, slots, epr = 3, 2, 2
    plan = ReplicaPlan.make(
        random_slot_src(np.random.default_rng(3), world, slots, epr, fill=1.0), experts_per_rank=epr
    )
    full = build_schedule(plan, LAYOUT.weight_bytes, LAYOUT.grad_bytes, chunk_bytes=64, relay_mode=mode)
    gen = torch.Generator().manual_seed(11)
    init_master = [[torch.randn((epr, *m.shape), generator=gen) for m in LAYOUT.members] for _ in range(world)]
    init_replica = [[torch.randn((slots, *m.shape), generator=gen) for m in LAYOUT.members] for _ in range(world)]
    want = expected_master_grads(full, LAYOUT, plan, init_master, init_replica)

    def body(group):
        r = group.rank
        count = CountingGroup(group)
        with make_ctx(group, slots, epr, relay_mode=mode) as ctx:
            assert ctx.transport.sms == (11, 26)  # resolved (measured per-CTA fallback), never "auto"
            assert ctx.sm_counts == {"multicast": 11, "reduce": 26}
            weights, grads = masters(r, epr)
            ctx.register_masters(0, weights, grads)
            vid = ctx.begin(0)
            before = count.calls
            assert ctx.weight_sync(vid, plan) is None  # enqueued; no Work for async_op=False
            assert count.calls == before  # no per-operation plan agreement
            replicas_ok(ctx, plan)
            for t in ctx.replica_weights:
                t.zero_()
            group.barrier()
            before = count.calls
            work = ctx.restore(vid, async_op=True)
            assert isinstance(work, so.StreamWork) and isinstance(work, ultracomm.Work)
            assert not work.is_completed()  # its event has not completed yet
            assert work.wait() is True and work.is_completed()
            replicas_ok(ctx, plan)
            for m in range(2):
                grads[m].copy_(init_master[r][m])
                ctx.replica_grads[m].copy_(init_replica[r][m])
            group.barrier()
            assert ctx.grad_reduce(vid) is None
            ctx.synchronize()
            assert count.calls == before + 1  # the one barrier of this test
            streams = ctx._streams.streams
            assert streams.syncs == 1 and streams.released == streams.recorded[:1]
            assert ctx.transport.runs == [
                (Op.MULTICAST, 1, "weight_sync", STREAM),
                (Op.MULTICAST, 2, "restore", STREAM),
                (Op.REDUCE, 3, "grad_reduce", STREAM),
            ]
            transport = ctx.transport
        assert transport.closed and streams.syncs == 2  # close() lets queued kernels finish first
        return [g.clone() for g in grads]

    got = LoopbackDomain(world).run(body)
    for r in range(world):
        for m in range(2):
            assert torch.equal(got[r][m], want[r][m]), f"rank {r} member {m}"


def test_kernel_timeout_surfaces_at_wait_and_breaks_the_context(fake):
    plan = ReplicaPlan.make(np.array([[2, -1], [0, -1]], np.int32), experts_per_rank=2)

    def body(group):
        with make_ctx(group, timeout_s=0.3) as ctx:
            ctx.register_masters(0, *masters(group.rank, 2))
            ctx.transport.withhold = group.rank == 1  # rank 1 never runs its tasks
            vid = ctx.begin(0)
            work = ctx.weight_sync(vid, plan, async_op=True)  # returns at once, like a kernel launch
            if group.rank == 1:
                work.wait()
                return None
            with pytest.raises(TimeoutError) as ei:
                work.wait()
            text = str(ei.value)
            assert isinstance(ei.value, ultracomm.UltracommTimeout)
            assert "rank 0" in text and "weight_sync" in text and "epoch 1" in text
            # the record's guess ("it is likely the stalled or dead rank") gives way to the evidence
            # (issue 35): rank 1's heartbeat or its closed Context, never "stopped" for its silence
            assert (
                "rank 1 has not started this operation (its ready flag is at epoch 0); by evidence, stopped: ranks []"
                in (text)
                and "likely" not in text
            ), text
            assert "likely the stalled or dead rank" in str(ei.value.__cause__)  # the record, chained
            assert work.exception() is ei.value and work.is_completed()
            with pytest.raises(TimeoutError, match="weight_sync"):
                ctx.synchronize()  # the record stays: synchronize raises it too
            with pytest.raises(UltracommError, match=r"this Context failed earlier \(.*weight_sync"):
                ctx.restore(vid)
            return text

    text = LoopbackDomain(2).run(body)[0]
    assert "timed out" in text or "timeout" in text.lower()


def test_synchronize_raises_the_record(fake):
    def body(group):
        with make_ctx(group, slots=1, epr=1) as ctx:
            ctx.register_masters(0, *masters(group.rank, 1))
            boom = UltracommError("ultracomm: rank 0: weight_sync epoch 1: digest mismatch with rank 1")
            ctx.transport.error = boom
            with pytest.raises(UltracommError) as ei:
                ctx.synchronize()
            assert ei.value is boom
            vid = ctx.begin(0)
            with pytest.raises(UltracommError, match="failed earlier .*digest mismatch with rank 1"):
                ctx.weight_sync(vid, ReplicaPlan.make(np.full((1, 1), -1, np.int32), experts_per_rank=1))
        return True

    assert LoopbackDomain(1).run(body) == [True]


def test_invalid_plan_is_rejected_through_the_window(fake):
    good = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)
    bad = ReplicaPlan.make(np.full((2, 2), -1, np.int32), experts_per_rank=1)  # wrong slots per rank

    def body(group):
        with make_ctx(group, slots=1, epr=1, timeout_s=0.3) as ctx:
            ctx.register_masters(0, *masters(group.rank, 1))
            vid = ctx.begin(0)
            if group.rank == 1:
                with pytest.raises(ValueError, match="plan is for world 2, 2 slots per rank"):
                    ctx.weight_sync(vid, bad)
                assert ctx.transport.rejects == [(Op.MULTICAST, 1, STREAM)]  # published at the epoch peers use
                assert ctx.transport.runs == []
                with pytest.raises(UltracommError, match="failed earlier .*this rank rejected its plan"):
                    ctx.weight_sync(vid, good)
                return "rejected"
            work = ctx.weight_sync(vid, good, async_op=True)  # the peer's kernel fails (fake: times out)
            with pytest.raises(TimeoutError):
                work.wait()
            return "failed"

    assert LoopbackDomain(2).run(body) == ["failed", "rejected"]


def test_capture_rules(fake):
    plan = ReplicaPlan.make(np.full((1, 1), -1, np.int32), experts_per_rank=1)

    def body(group):
        with make_ctx(group, slots=1, epr=1) as ctx:
            ctx.register_masters(0, *masters(0, 1))
            vid = ctx.begin(0)
            ctx._streams.streams.capturing = True
            with pytest.raises(UltracommError, match="async_op=True inside CUDA graph capture"):
                ctx.weight_sync(vid, plan, async_op=True)
            assert ctx.transport.runs == []  # refused before anything was enqueued
            assert ctx.weight_sync(vid, plan) is None  # capturable form
            assert ctx.transport.runs == [(Op.MULTICAST, 1, "weight_sync", STREAM)]
        return True

    assert LoopbackDomain(1).run(body) == [True]


def test_wait_with_timeout_polls_the_event(fake):
    plan = ReplicaPlan.make(np.full((1, 1), -1, np.int32), experts_per_rank=1)

    def body(group):
        with make_ctx(group, slots=1, epr=1) as ctx:
            ctx.register_masters(0, *masters(0, 1))
            work = ctx.weight_sync(ctx.begin(0), plan, async_op=True)
            with pytest.raises(
                UltracommTimeout,
                match=r"^ultracomm: weight_sync \(rank 0, epoch 1\) did not finish "
                r"within wait\(timeout=0.01 s\); awaited: the operation's completion event on its "
                r"CUDA stream",
            ):
                work.wait(timeout=0.01)  # the fake event completes only when synchronized
            assert not work.is_completed()
            ctx._streams.streams.recorded[0].done = True
            assert work.wait(timeout=0.01) is True
        return True

    assert LoopbackDomain(1).run(body) == [True]


def test_streams_need_a_cuda_window():
    with pytest.raises(UltracommError, match="a stream-ordered transport needs a CUDA window"):
        so.streams_for(None)


def test_debug_log_names_the_sm_counts_and_their_source(fake, caplog):
    import logging

    def body(group):
        with make_ctx(group, slots=1, epr=1, log_level="debug", reduce_sms=5) as ctx:
            return ctx.sm_counts

    with caplog.at_level(logging.DEBUG, logger="ultracomm"):
        got = LoopbackDomain(1).run(body)
    assert got == [{"multicast": 11, "reduce": 5}]
    assert (
        "rank 0: multicast_sms=11 (auto: ceil(nvlink bw 3.7e+11 / measured per-CTA fallback 3.45e+10 B/s" in caplog.text
    )
    assert "rank 0: reduce_sms=5 (ULTRACOMM_REDUCE_SMS=5)" in caplog.text


class OnceStreamTransport(FakeStreamTransport):
    """A transport that hands each error record out once (as the loopback runner does per rank)."""

    def check_error(self):
        error, self.error = self.error, None
        if error is not None:
            self.withhold = True  # the kernel stays aborted for later operations
            raise error


def test_a_failure_stays_after_the_record_was_taken(fake, monkeypatch):
    monkeypatch.setitem(transports.TRANSPORTS, "tma", OnceStreamTransport)
    plan = ReplicaPlan.make(np.full((1, 1), -1, np.int32), experts_per_rank=1)

    def body(group):
        with make_ctx(group, slots=1, epr=1) as ctx:
            ctx.register_masters(0, *masters(0, 1))
            vid = ctx.begin(0)
            first = ctx.weight_sync(vid, plan, async_op=True)
            second = ctx.restore(vid, async_op=True)  # queued behind the failing one
            boom = UltracommError("ultracomm: rank 0: weight_sync epoch 1: kernel failed")
            ctx.transport.error = boom
            for work in (second, first):  # the record is taken by the first wait; both raise it
                with pytest.raises(UltracommError) as ei:
                    work.wait()
                assert ei.value is boom
            with pytest.raises(UltracommError) as ei:
                ctx.synchronize()
            assert ei.value is boom
        return True

    assert LoopbackDomain(1).run(body) == [True]


class AbandoningTransport(OnceStreamTransport):
    """A transport that, after a failure, leaves streams blocked for good (copy_engine's waits on
    a lost peer): no device-wide synchronize may wait for them, and the window stays mapped."""

    def abandoned_streams(self):
        return self.error is not None or self.withhold


def test_abandoned_streams_skip_the_device_sync_and_keep_the_window(fake, monkeypatch):
    import ultracomm.dataplane.queue as queue

    monkeypatch.setitem(transports.TRANSPORTS, "tma", AbandoningTransport)
    monkeypatch.setattr(queue, "_KEPT_WINDOWS", [])

    def body(group):
        ctx = make_ctx(group, slots=1, epr=1)
        ctx.register_masters(0, *masters(0, 1))
        streams = ctx._streams.streams
        ctx.synchronize()
        assert streams.syncs == 1  # healthy: a device-wide synchronize
        boom = UltracommError("ultracomm: rank 0: weight_sync epoch 1: timed out")
        ctx.transport.error = boom
        with pytest.raises(UltracommError) as ei:
            ctx.synchronize()
        assert ei.value is boom and streams.syncs == 1  # failed, streams abandoned: no device sync
        window = ctx.window
        ctx.close()
        assert streams.syncs == 1 and queue._KEPT_WINDOWS == [window] and ctx.transport.closed
        return True

    assert LoopbackDomain(1).run(body) == [True]


class FailsWhileQuiescing(AbandoningTransport):
    """An operation in flight fails while the Context waits for it to end (quiesce)."""

    def quiesce(self):
        self.error = self.error or UltracommError("ultracomm: rank 0: weight_sync epoch 1: a peer runs another plan")


def test_synchronize_lets_operations_end_before_any_device_sync(fake, monkeypatch):
    monkeypatch.setitem(transports.TRANSPORTS, "tma", FailsWhileQuiescing)

    def body(group):
        ctx = make_ctx(group, slots=1, epr=1)
        ctx.register_masters(0, *masters(0, 1))
        streams = ctx._streams.streams
        with pytest.raises(UltracommError, match="a peer runs another plan"):
            ctx.synchronize()
        assert streams.syncs == 0  # the failure came first: no device-wide synchronize
        ctx.close()
        assert streams.syncs == 0
        return True

    assert LoopbackDomain(1).run(body) == [True]


class NeverReached(AbandoningTransport):
    """Operations in flight that the caller's stream never reaches: quiesce gives up (its bound)."""

    def quiesce(self):
        from ultracomm.errors import UltracommTimeout

        raise UltracommTimeout("ultracomm: 1 operation(s) of rank(s) [0] still in flight after 0.1 s")


def test_a_quiesce_that_gives_up_fails_the_context_without_a_device_sync(fake, monkeypatch):
    import ultracomm.dataplane.queue as queue
    from ultracomm.errors import UltracommTimeout

    monkeypatch.setitem(transports.TRANSPORTS, "tma", NeverReached)
    monkeypatch.setattr(queue, "_KEPT_WINDOWS", [])

    def body(group):
        ctx = make_ctx(group, slots=1, epr=1)
        ctx.register_masters(0, *masters(0, 1))
        streams = ctx._streams.streams
        with pytest.raises(UltracommTimeout, match="still in flight after 0.1 s"):
            ctx.synchronize()
        assert streams.syncs == 0  # a synchronize would not return: none started
        with pytest.raises(UltracommTimeout, match="still in flight"):  # the failure stays
            ctx.synchronize()
        window = ctx.window
        ctx.close()
        assert streams.syncs == 0 and queue._KEPT_WINDOWS == [window]
        return True

    assert LoopbackDomain(1).run(body) == [True]


def test_manager_step_forward_and_backward_never_wait_on_the_host(fake):
    """ReplicaManager over a stream-ordered transport (issue 19 item 6): weight_sync before the
    expert compute, the staging reuse and the end of the backward are stream waits, not host
    waits; the master grads equal the host executor's bit for bit."""
    import moe_harness as mh
    from ultracomm.moe import ReplicaManager, linear

    world, epr, slots, layers = 2, 2, 1, 2
    E = world * epr

    def run(stream_ordered: bool):
        def body(group):
            r = group.rank
            kw = dict(transport="tma", window="local") if stream_ordered else dict(transport="host")
            mgr = ReplicaManager(
                group,
                mh.layout(),
                epr,
                slots,
                layers,
                max_microbatches=2,
                timeout_s=20,
                chunk_bytes=64,
                tile_bytes=16,
                **kw,
            )
            params = mh.make_params(r, epr, layers, torch.float32, "stacked", False, False)
            for layer in range(layers):
                mgr.register_layer(layer, params[layer])
            for mb in range(2):
                total = 0
                anchor = torch.ones((), requires_grad=True)
                for layer in range(layers):
                    _, rmap, probs, _ = mh.batch(r, layer, mb, E)
                    step = mgr.step(layer, rmap, probs)
                    loss = mh.rank_loss(step, r, world, layer, mb, params[layer], step.replica_weights(), linear)
                    total = total + step.guard(loss) * anchor
                total.backward()
            out = mh.master_grads(params, False)
            mgr.close()
            return out

        return LoopbackDomain(world).run(body)

    got = run(True)
    assert fake and all(s.host_waits == 0 and s.stream_waits > 0 for s in fake), [
        (s.host_waits, s.stream_waits) for s in fake
    ]
    want = run(False)
    for a, b in zip(got, want):
        for la, lb in zip(a, b):
            for x, y in zip(la, lb):
                assert torch.equal(x, y)
