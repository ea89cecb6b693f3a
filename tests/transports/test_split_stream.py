"""The GPU split transport's bridge as stream operations (ultracomm.transports.split.stream):
exact records for small 2x2 schedules, the order argument under a rendezvous model, and the
stream lists executed beside the real host interpreter (tests/split_stream_sim.py) giving the
host executor's bytes; a wrong order is caught as a deadlock, not by a timer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import ReplicaPlan, _core
from ultracomm.records import Op
from ultracomm.schedule import build_schedule
from ultracomm.transports import split as split_mod
from ultracomm.transports.split.bridge_program import Crossing, build_bridge_program
from ultracomm.transports.split.stream import (
    COPY,
    OWN,
    RECV,
    SEND,
    WAIT_GE,
    WRITE,
    loopback_sequence,
    messages,
    rank_stream,
    stream_program,
)

from conftest import hot_slot_src, random_slot_src
from split_stream_sim import SimHub, StreamDeadlock, run_key_model, streams_of
from test_p2p import layout_of
from test_split import run_split

# one expert of 256 bytes of weights and of grads, two 128-byte chunks, one slot per rank
WL = _core.window_layout(1, 256, 256, 128)
DOM = (0, 0, 1, 1)


def test_the_layout_the_literals_below_assume():
    assert (WL["weights_off"], WL["grads_off"], WL["ready_off"], WL["digest_off"]) == (0, 256, 512, 528)
    assert (WL["arrival_off"], WL["grad_ready_off"], WL["consumed_off"]) == (576, 640, 704)


def programs_2x2(mode: str, op: Op):
    """Expert 0 (home rank 0) on ranks 2 and 3; domains {0, 1} and {2, 3}."""
    plan = ReplicaPlan.make(np.array([[-1], [-1], [0], [0]], dtype=np.int32), experts_per_rank=1)
    s = build_schedule(plan, 256, 256, chunk_bytes=128, relay_mode=mode, node_of=[0, 0, 1, 1])
    return [
        build_bridge_program(
            op, s, r, s.tasks(op, r), s.refs(op, r), plan.slot_src.numpy(), plan.home_of.numpy(), DOM, 128, 256
        )
        for r in range(4)
    ]


def records(ops):
    return [(o.kind, o.ref.shadow, o.ref.off, o.peer, o.nbytes) for o in ops]


def header(me, peer, ready, digest, first_send: bool):
    """The four header messages between ``me`` and ``peer`` in the global order (src, dst)."""
    send = [(WAIT_GE, OWN, ready, -1, 0), (SEND, OWN, digest, peer, 8), (SEND, OWN, ready, peer, 8)]
    recv = [(RECV, peer, digest, peer, 8), (RECV, peer, ready, peer, 8)]
    return send + recv if first_send else recv + send


def test_multicast_relay_records():
    # relay tree: 0 -> 2 crosses (both chunks), 2 -> 3 stays inside domain 1 (the interpreter's)
    p = programs_2x2("force", Op.MULTICAST)
    assert [x.peers for x in p] == [(2,), (), (0,), ()]
    assert records(stream_program(p[0], WL)) == header(0, 2, 512, 528, True) + [
        (WAIT_GE, 2, 576, -1, 0),
        (SEND, 2, 0, 2, 128),  # arrival in the shadow of 2, chunk 0 from it
        (WAIT_GE, 2, 584, -1, 0),
        (SEND, 2, 128, 2, 128),
    ]
    assert records(stream_program(p[2], WL)) == header(2, 0, 512, 528, False) + [
        (RECV, OWN, 0, 0, 128),
        (WRITE, OWN, 576, -1, 0),  # into the real slot, then own arrival
        (RECV, OWN, 128, 0, 128),
        (WRITE, OWN, 584, -1, 0),
    ]
    assert stream_program(p[1], WL) == [] and stream_program(p[3], WL) == []


def test_multicast_direct_records():
    p = programs_2x2("off", Op.MULTICAST)
    assert [x.peers for x in p] == [(2, 3), (), (0,), (0,)]
    assert records(stream_program(p[0], WL)) == (
        header(0, 2, 512, 528, True)[:3]
        + header(0, 3, 512, 528, True)[:3]
        + header(0, 2, 512, 528, True)[3:]
        + header(0, 3, 512, 528, True)[3:]
        + [
            (WAIT_GE, 2, 576, -1, 0),
            (SEND, 2, 0, 2, 128),
            (WAIT_GE, 3, 576, -1, 0),
            (SEND, 3, 0, 3, 128),
            (WAIT_GE, 2, 584, -1, 0),
            (SEND, 2, 128, 2, 128),
            (WAIT_GE, 3, 584, -1, 0),
            (SEND, 3, 128, 3, 128),
        ]
    )
    assert records(stream_program(p[3], WL)) == header(3, 0, 512, 528, False) + [
        (RECV, OWN, 0, 0, 128),
        (WRITE, OWN, 576, -1, 0),
        (RECV, OWN, 128, 0, 128),
        (WRITE, OWN, 584, -1, 0),
    ]


def test_reduce_relay_records():
    # 3 -> 2 inside domain 1; 2's partial crosses to the home 0 at level (height) 1
    p = programs_2x2("force", Op.REDUCE)
    assert [x.peers for x in p] == [(2,), (), (0,), ()]
    assert records(stream_program(p[0], WL)) == header(0, 2, 520, 536, True) + [
        (RECV, 2, 256, 2, 128),
        (WRITE, 2, 640, -1, 0),  # into the shadow of 2, then its grad_ready
        (RECV, 2, 384, 2, 128),
        (WRITE, 2, 648, -1, 0),
    ]
    assert records(stream_program(p[2], WL)) == header(2, 0, 520, 536, False) + [
        (WAIT_GE, OWN, 640, -1, 0),
        (SEND, OWN, 256, 0, 128),
        (WRITE, OWN, 704, -1, 0),  # own consumed after
        (WAIT_GE, OWN, 648, -1, 0),
        (SEND, OWN, 384, 0, 128),
        (WRITE, OWN, 712, -1, 0),
    ]
    assert [o.key for o in stream_program(p[2], WL) if o.kind == SEND][2:] == [(0, 1, 0, 2, 0, 0), (1, 1, 0, 2, 0, 0)]


def test_reduce_direct_records():
    p = programs_2x2("off", Op.REDUCE)
    assert records(stream_program(p[0], WL))[10:] == [
        (RECV, 2, 256, 2, 128),
        (WRITE, 2, 640, -1, 0),
        (RECV, 3, 256, 3, 128),
        (WRITE, 3, 640, -1, 0),
        (RECV, 2, 384, 2, 128),
        (WRITE, 2, 648, -1, 0),
        (RECV, 3, 384, 3, 128),
        (WRITE, 3, 648, -1, 0),
    ]


def test_loopback_sequence_pairs_each_send_with_its_receive():
    p = programs_2x2("force", Op.REDUCE)
    seq = loopback_sequence(p, WL)
    got = [
        (o.kind, o.rank, o.ref.shadow, o.ref.off)
        + ((o.peer, o.src.shadow, o.src.off, o.nbytes) if o.kind == COPY else ())
        for o in seq
    ]
    assert got == [
        (WAIT_GE, 0, OWN, 520),
        (COPY, 2, 0, 536, 0, OWN, 536, 8),
        (COPY, 2, 0, 520, 0, OWN, 520, 8),
        (WAIT_GE, 2, OWN, 520),
        (COPY, 0, 2, 536, 2, OWN, 536, 8),
        (COPY, 0, 2, 520, 2, OWN, 520, 8),
        (WAIT_GE, 2, OWN, 640),
        (COPY, 0, 2, 256, 2, OWN, 256, 128),
        (WRITE, 2, OWN, 704),
        (WRITE, 0, 2, 640),
        (WAIT_GE, 2, OWN, 648),
        (COPY, 0, 2, 384, 2, OWN, 384, 128),
        (WRITE, 2, OWN, 712),
        (WRITE, 0, 2, 648),
    ]


def test_bad_inputs_are_clear_errors():
    p = programs_2x2("force", Op.MULTICAST)
    with pytest.raises(ValueError, match="unknown stream order 'fifo'"):
        rank_stream(messages(p[0], WL), 0, "fifo")
    with pytest.raises(ValueError, match="does not involve rank 3"):
        rank_stream(messages(p[0], WL), 3)
    with pytest.raises(ValueError, match=r"listed by ranks \[0\] \(expected both ends"):
        loopback_sequence([p[0]], WL)  # rank 2's side missing
    alien = Crossing(0, 0, 2, 0, 0, 0, 0, 128, 1)
    with pytest.raises(ValueError, match="sends .* of another rank"):
        messages(type(p[0])(Op.MULTICAST, 0, (2,), (alien,), ()), WL)


# ---------------------------------------------------------------------------------------- model
LAYOUTS = [
    ("a,a,b,b", [0, 0, 1, 1]),
    ("n0,n0,n0,n1", [0, 0, 0, 1]),
    ("a,a,a,a,b,b,b,b", [0, 0, 0, 0, 1, 1, 1, 1]),
    ("x,y,x,y,z,z,x,y", None),
]


def all_programs(world, domain, node_of, mode, seed):
    layout, epr, slots = layout_of(torch.float32), 2, 3
    rng = np.random.default_rng(seed)
    dom = tuple(int(d) for d in np.unique(domain.split(","), return_inverse=True)[1])
    wl = _core.window_layout(slots, layout.weight_bytes, layout.grad_bytes, 64)
    out = []
    for slot_src in (hot_slot_src(world, slots, epr, expert=1), random_slot_src(rng, world, slots, epr, 0.9)):
        plan = ReplicaPlan.make(slot_src, experts_per_rank=epr)
        s = build_schedule(
            plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=64, relay_mode=mode, node_of=node_of
        )
        for op, nbytes in ((Op.MULTICAST, layout.weight_bytes), (Op.REDUCE, layout.grad_bytes)):
            out.append(
                [
                    build_bridge_program(
                        op,
                        s,
                        r,
                        s.tasks(op, r),
                        s.refs(op, r),
                        plan.slot_src.numpy(),
                        plan.home_of.numpy(),
                        dom,
                        64,
                        nbytes,
                    )
                    for r in range(world)
                ]
            )
    return wl, out


@pytest.mark.parametrize("domain,node_of", LAYOUTS)
@pytest.mark.parametrize("mode", ["force", "off"])
def test_global_order_finishes_and_sends_first_deadlocks_in_the_key_model(domain, node_of, mode):
    world = len(domain.split(","))
    wl, cases = all_programs(world, domain, node_of, mode, world * 3 + len(mode))
    for progs in cases:
        streams = streams_of(progs, wl)
        assert streams, "nothing crossed: the case tests nothing"
        n = sum(len(p.sends) + 2 * len(p.peers) for p in progs)  # crossings + 2 header words per direction
        assert run_key_model(streams) == n
        with pytest.raises(StreamDeadlock, match="no stream can move: rank .*: send header"):
            run_key_model(streams_of(progs, wl, "sends_first"))


def test_the_key_model_catches_a_wait_ahead_of_what_it_depends_on():
    # relay multicast 0 -> 2 -> 3 with 2 and 3 in different domains: rank 2 forwards chunk 0 only
    # after receiving it; put its send to 3 before its receive from 0 and the model is stuck
    plan = ReplicaPlan.make(np.array([[-1], [-1], [0], [0]], dtype=np.int32), experts_per_rank=1)
    s = build_schedule(plan, 256, 256, chunk_bytes=128, relay_mode="force", node_of=[0, 0, 1, 1])
    dom = (0, 0, 1, 2)
    progs = [
        build_bridge_program(
            Op.MULTICAST,
            s,
            r,
            s.tasks(Op.MULTICAST, r),
            s.refs(Op.MULTICAST, r),
            plan.slot_src.numpy(),
            plan.home_of.numpy(),
            dom,
            128,
            256,
        )
        for r in range(4)
    ]
    streams = streams_of(progs, WL)
    assert run_key_model(streams) == 2 * (2 + 2) + 2 * 2  # two crossing edges, 2 chunks each, and headers
    s2 = streams[2]
    recv0 = next(i for i, o in enumerate(s2) if o.kind == RECV and o.peer == 0 and o.nbytes == 128)
    wait3 = next(i for i, o in enumerate(s2) if o.kind == WAIT_GE and o.ref.shadow == 3)
    bad = (
        s2[:recv0] + s2[wait3 : wait3 + 2] + [o for i, o in enumerate(s2[recv0:], recv0) if i not in (wait3, wait3 + 1)]
    )
    with pytest.raises(StreamDeadlock, match="rank 2: wait_ge wait before multicast expert 0 chunk 0"):
        run_key_model({**streams, 2: bad})


# ------------------------------------------------------------------- beside the real interpreter
SIM_CASES = [  # world, domains, node_of, relay mode, grad dtype
    (4, "a,a,b,b", [0, 0, 1, 1], "force", torch.float32),
    (4, "a,a,b,b", [0, 0, 1, 1], "off", torch.bfloat16),
    (4, "n0,n0,n0,n1", [0, 0, 0, 1], "force", torch.bfloat16),
    (8, "a,a,a,a,b,b,b,b", [0, 0, 0, 0, 1, 1, 1, 1], "auto", torch.float32),
]


def _plans(world, slots, epr, seed):
    rng = np.random.default_rng(seed)
    return [
        ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr),
        ReplicaPlan.make(random_slot_src(rng, world, slots, epr, 0.9), experts_per_rank=epr),
    ]


@pytest.mark.parametrize("order", ["global", "loopback"])
@pytest.mark.parametrize("world,domain,node_of,mode,grad_dtype", SIM_CASES)
def test_streams_beside_the_interpreter_give_the_host_executors_bytes(
    monkeypatch, order, world, domain, node_of, mode, grad_dtype
):
    from test_p2p import run_ops

    layout, epr, slots = layout_of(grad_dtype), 2, 3
    plans = _plans(world, slots, epr, world * 11 + len(mode))
    host = run_ops("host", world, plans, layout, epr, slots, mode, node_of)
    hub = SimHub(order)
    monkeypatch.setattr(split_mod, "BridgeRun", hub.bridge)
    monkeypatch.setattr(split_mod, "DIRECT_CROSSINGS", False)  # the GPU stream's (shadow) protocol
    split = run_split(world, plans, layout, epr, slots, mode, node_of, domain)
    assert hub.moved > 0 and hub.deadlocks == []
    for r in range(world):
        assert len(host[r]) == len(split[r])
        for i, (a, b) in enumerate(zip(host[r], split[r])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"rank {r} result {i} differs"


def test_sends_before_receives_deadlock_beside_the_interpreter(monkeypatch):
    # ranks 0 and 2 (different domains) swap one expert each; ranks 1 and 3 take no part, so
    # every rank that could wait is stopped by the detected deadlock at once (no timeout runs)
    layout, epr, slots = layout_of(torch.float32), 2, 3
    slot_src = np.full((4, slots), -1, dtype=np.int32)
    slot_src[0, 0], slot_src[2, 0] = 4, 1
    hub = SimHub("sends_first")
    monkeypatch.setattr(split_mod, "BridgeRun", hub.bridge)
    monkeypatch.setattr(split_mod, "DIRECT_CROSSINGS", False)
    with pytest.raises(StreamDeadlock, match="no stream can move: rank 0: send header"):
        run_split(
            4, [ReplicaPlan.make(slot_src, experts_per_rank=epr)], layout, epr, slots, "force", [0, 0, 1, 1], "a,a,b,b"
        )
    assert hub.moved == 0 and hub.deadlocks
