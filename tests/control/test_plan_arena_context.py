"""Context's side of the plan arena (issue 19 item 5), with the stream-ordered fake transport of
test_stream_ordered: a transport that names ``experts_per_rank`` and ``plan_slots`` gets the
Context's shape at setup (num_layers x max_microbatches vid slots), each operation carries its
vid's slot (weight_sync, restore and grad_reduce of one vid the same slot; the next vid of that
layer's micro-batch slot the same again), and ``Context.plan_arena_bytes()`` reports the
transport's arena; a transport without an arena reports 0 and gets no slot."""

from __future__ import annotations

import numpy as np

from ultracomm import LoopbackDomain, ReplicaPlan
from ultracomm.transports import TRANSPORTS

from test_stream_ordered import FakeStreamTransport, fake, make_ctx, masters  # noqa: F401 - fixture


class SlotTransport(FakeStreamTransport):
    plan_arena_bytes = 12345
    options = FakeStreamTransport.options | {"experts_per_rank", "plan_slots"}
    takes_slot = True

    def __init__(self, *, experts_per_rank, plan_slots, **kw):
        super().__init__(**kw)
        self.shape = (experts_per_rank, plan_slots)
        self.slots: list[tuple] = []

    def run(self, op, schedule, epoch, masters, my_slots, local_index_of, op_name=None, *, stream, slot=None):
        self.slots.append((op_name, slot))
        return super().run(op, schedule, epoch, masters, my_slots, local_index_of, op_name, stream=stream)


def plan_for(world, slots, epr):
    src = np.full((world, slots), -1, np.int32)
    src[1, 0] = 0
    return ReplicaPlan.make(src, experts_per_rank=epr)


def test_operations_carry_their_vids_plan_slot(fake, monkeypatch):  # noqa: F811
    monkeypatch.setitem(TRANSPORTS, "tma", SlotTransport)
    world, slots, epr = 3, 2, 2
    plan = plan_for(world, slots, epr)

    def body(group):
        with make_ctx(group, slots, epr) as ctx:
            assert ctx.transport.shape == (epr, 1)  # default: one layer, one micro-batch
        kw = dict(transport="tma", window="local", chunk_bytes=64, tile_bytes=16, num_workers=2, timeout_s=20.0)
        from ultracomm import Context
        from test_stream_ordered import LAYOUT

        with Context(group, LAYOUT, epr, slots, num_layers=3, max_microbatches=2, **kw) as ctx:
            assert ctx.transport.shape == (epr, 6) and ctx.plan_arena_bytes() == 12345
            for layer in range(3):
                ctx.register_masters(layer, *masters(group.rank, epr))
            got = []
            for _ in range(2):  # two steps: the second vid of layer 1 lands in the same slot
                a = ctx.begin(1)
                b = ctx.begin(1)
                ctx.weight_sync(a, plan)
                ctx.weight_sync(b, plan)
                ctx.restore(b)
                ctx.grad_reduce(b)
                ctx.restore(a)
                ctx.grad_reduce(a)
                got.append((a % 6, b % 6))
            ctx.synchronize()
            return got, ctx.transport.slots

    for got, runs in LoopbackDomain(world).run(body, timeout=120):
        assert got == [(2, 3), (2, 3)]
        assert (
            runs
            == [
                ("weight_sync", 2),
                ("weight_sync", 3),
                ("restore", 3),
                ("grad_reduce", 3),
                ("restore", 2),
                ("grad_reduce", 2),
            ]
            * 2
        )


def test_a_transport_without_an_arena_reports_none(fake):  # noqa: F811
    def body(group):
        with make_ctx(group) as ctx:
            return ctx.plan_arena_bytes(), ctx.transport.takes_slot

    assert LoopbackDomain(2).run(body, timeout=60) == [(0, False)] * 2
