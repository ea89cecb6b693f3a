"""The p2p transport in one process: its message programs pair up on every rank, and a Context on
a loopback domain (mailboxes instead of gloo) leaves the same bytes as the host executor."""

from __future__ import annotations

import collections
import threading
import time

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan, UltracommTimeout
from ultracomm.records import Op
from ultracomm.schedule import build_schedule
from ultracomm.transports.p2p.waves import build_program

from conftest import expert_weights, hot_slot_src, random_slot_src


def layout_of(grad_dtype=torch.float32) -> ExpertLayout:
    # odd member sizes: padding between members, chunks that straddle them
    return ExpertLayout(
        (Member("fc1", (6, 17), torch.bfloat16), Member("fc2", (17, 3), torch.bfloat16)), grad_dtype=grad_dtype
    )


def programs(plan, layout, chunk, mode, node_of=None):
    sched = build_schedule(
        plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=chunk, relay_mode=mode, node_of=node_of
    )
    slot_src = plan.slot_src.numpy().astype(np.int64)
    home_of = plan.home_of.numpy().astype(np.int64)
    out = {}
    for op, nbytes, mo, mb in (
        (Op.MULTICAST, layout.weight_bytes, layout.weight_offsets, layout.weight_sizes),
        (Op.REDUCE, layout.grad_bytes, layout.grad_offsets, layout.grad_sizes),
    ):
        out[op] = [
            build_program(op, sched, r, sched.tasks(op, r), sched.refs(op, r), slot_src, home_of, chunk, nbytes, mo, mb)
            for r in range(plan.world)
        ]
    return sched, out


@pytest.mark.parametrize(
    "world,mode,node_of",
    [
        (2, "off", None),
        (5, "force", None),
        (8, "auto", None),
        (8, "force", [0, 0, 0, 0, 1, 1, 1, 1]),
        (4, "auto", [0, 0, 1, 1]),
    ],
)
def test_every_send_meets_one_receive_in_the_same_wave(world, mode, node_of):
    layout = layout_of()
    rng = np.random.default_rng(world)
    for trial in range(4):
        src = hot_slot_src(world, 3, 2, expert=1) if trial == 0 else random_slot_src(rng, world, 3, 2, 0.8)
        plan = ReplicaPlan.make(src, experts_per_rank=2)
        sched, progs = programs(plan, layout, 128, mode, node_of)
        for op, per_rank in progs.items():
            sends = collections.Counter(dataclass_key(x.msg) for p in per_rank for w in p.waves for x in w.sends)
            recvs = collections.Counter(dataclass_key(m) for p in per_rank for w in p.waves for m in w.recvs)
            assert sends == recvs and max(sends.values(), default=1) == 1, (op, trial)
            # wave index = the message's wave; tags number each pair's messages 0.. in (wave, slot, chunk, offset)
            pairs = collections.defaultdict(list)
            for p in per_rank:
                for i, w in enumerate(p.waves):
                    for x in w.sends:
                        assert x.msg.wave == i
                        pairs[(x.msg.src, x.msg.dst)].append(x.msg)
            for msgs in pairs.values():
                msgs.sort(key=lambda m: m.order())
                assert [m.tag for m in msgs] == list(range(len(msgs)))
            for p in per_rank:  # every wait points at an earlier wave
                for i, w in enumerate(p.waves):
                    for item in w.reduces:
                        assert all(s.wave < i for s in item.sources)
                    for x in w.sends:
                        if op == Op.MULTICAST and x.self_slot >= 0:
                            assert all(d.wave < i for d in p.forward_deps[(x.self_slot, x.msg.chunk)])
            if op == Op.MULTICAST:  # a relay tree really relays, and chunks pipeline along it
                depth = int(sched.stats("multicast")["depth"])
                if trial == 0 and mode == "force":
                    assert depth >= 2
                nchunks = -(-layout.weight_bytes // 128)
                assert max(len(p.waves) for p in per_rank) == nchunks + depth - 1


def dataclass_key(m):
    return (m.wave, m.src, m.dst, m.slot, m.chunk, m.member, m.lo, m.hi, m.expert, m.tag)


def test_tasks_that_disagree_with_the_tree_are_refused():
    layout = layout_of()
    plan = ReplicaPlan.make(hot_slot_src(4, 1, 1, expert=0), experts_per_rank=1)
    sched, _ = programs(plan, layout, 128, "off")
    tasks = sched.tasks(Op.MULTICAST, 0).copy()
    refs = sched.refs(Op.MULTICAST, 0).copy()
    refs[0]["slot"] = 0
    refs[0]["rank"] = 0  # a copy to its own rank
    with pytest.raises(ValueError, match="tasks and trees disagree: rank 0 copies expert 0 to its own slot 0"):
        build_program(
            Op.MULTICAST,
            sched,
            0,
            tasks,
            refs,
            plan.slot_src.numpy(),
            plan.home_of.numpy(),
            128,
            layout.weight_bytes,
            layout.weight_offsets,
            layout.weight_sizes,
        )


# ---------------------------------------------------------------------------------------------- Context
def run_ops(
    transport,
    world,
    plans,
    layout,
    epr,
    slots,
    mode,
    node_of=None,
    chunk=128,
    async_restore=True,
    window=None,
    expect=None,
    alpha_beta=True,
    **kw,
):
    """weight_sync + restore + grad_reduce of every plan; per rank, the pool's weight and grad bytes after
    each multicast and each reduce, and the master grads.  ``expect``: the transport ``transport`` must
    become (auto); ``alpha_beta=False``: a p2p Context builds its schedules as the host executor's
    (``chunk``, ``mode``) instead of choosing by its cost model; ``kw``: more Context arguments."""
    window = window or ("local" if transport == "host" else "private")

    def body(group):
        out = []
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            transport=transport,
            window=window,
            relay_mode=mode,
            node_of=node_of,
            chunk_bytes=chunk,
            tile_bytes=16,
            num_workers=2,
            timeout_s=30.0,
            **kw,
        ) as ctx:
            assert ctx.window.provider == window and ctx.transport.name == (expect or transport)
            if not alpha_beta:
                ctx.transport.message_costs = None
            r = ctx.rank
            per = [expert_weights(layout, e) for e in range(r * epr, (r + 1) * epr)]
            w = [torch.stack([p[m] for p in per]).contiguous() for m in range(2)]
            g = [torch.zeros((epr, *m.shape), dtype=layout.grad_dtype) for m in layout.members]
            ctx.register_masters(0, w, g)
            end = ctx.wlayout["ready_off"]
            for i, plan in enumerate(plans):
                vid = ctx.begin(0)
                ctx.weight_sync(vid, plan)
                out.append(ctx.window.local[:end].clone())
                for t in ctx.replica_weights:
                    t.zero_()
                work = ctx.restore(vid, async_op=async_restore)
                if work is not None:
                    work.wait()
                gen = torch.Generator().manual_seed(97 * i + r)
                for m in range(2):
                    ctx.replica_grads[m].copy_(torch.randn(ctx.replica_grads[m].shape, generator=gen))
                    g[m].copy_(torch.randn(g[m].shape, generator=gen))
                ctx.grad_reduce(vid)
                out.append(ctx.window.local[:end].clone())
                out += [x.clone() for x in g]
        return out

    return LoopbackDomain(world).run(body)


CASES = [  # world, node_of, relay mode, grad dtype
    (2, None, "off", torch.float32),
    (3, None, "force", torch.bfloat16),
    (4, [0, 0, 1, 1], "auto", torch.float32),
    (4, [0, 0, 1, 1], "force", torch.float16),
    (8, None, "force", torch.float32),
    (8, [0, 0, 0, 0, 1, 1, 1, 1], "auto", torch.bfloat16),
]


@pytest.mark.parametrize("world,node_of,mode,grad_dtype", CASES)
def test_p2p_context_is_bit_identical_to_the_host_executor(world, node_of, mode, grad_dtype):
    layout, epr, slots = layout_of(grad_dtype), 2, 3
    rng = np.random.default_rng(world * 7 + len(mode))
    plans = [ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr)] + [
        ReplicaPlan.make(random_slot_src(rng, world, slots, epr, 0.9), experts_per_rank=epr) for _ in range(2)
    ]
    host = run_ops("host", world, plans, layout, epr, slots, mode, node_of)
    p2p = run_ops("p2p", world, plans, layout, epr, slots, mode, node_of, alpha_beta=False)
    for r in range(world):
        assert len(host[r]) == len(p2p[r])
        for i, (a, b) in enumerate(zip(host[r], p2p[r])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"rank {r} result {i} differs"
    # and the multicast really delivered the experts (not two executors agreeing on zeros)
    stride = -(-layout.weight_bytes // 256) * 256
    for r in range(world):
        for s, e in enumerate(plans[0].slot_src[r].tolist()):
            if e < 0:
                continue
            for m, want in enumerate(expert_weights(layout, e)):
                off = stride * s + layout.weight_offsets[m]
                assert torch.equal(p2p[r][0][off : off + layout.weight_sizes[m]], want.reshape(-1).view(torch.uint8))


def test_p2p_timeout_names_rank_expert_and_chunk():
    """A rank that never runs its part: the home's peer waits the timeout, then raises naming who and what."""
    world, epr, slots = 2, 1, 1
    layout = layout_of()
    plan = ReplicaPlan.make(np.array([[-1], [0]], np.int32), experts_per_rank=epr)
    domain = LoopbackDomain(world)
    started = threading.Event()

    def body(group):
        with Context(
            group, layout, epr, slots, num_layers=1, transport="p2p", chunk_bytes=128, tile_bytes=16, timeout_s=0.5
        ) as ctx:
            ctx.register_masters(
                0,
                [torch.ones((1, *m.shape), dtype=m.dtype) for m in layout.members],
                [torch.zeros((1, *m.shape)) for m in layout.members],
            )
            vid = ctx.begin(0)
            if ctx.rank == 0:
                # rank 0 (the home) skips its sends: its transport never runs this op
                ctx.transport.run = lambda *a, **k: started.wait(5)
            t0 = time.monotonic()
            try:
                ctx.weight_sync(vid, plan)
            except UltracommTimeout as e:
                return str(e), time.monotonic() - t0
            finally:
                started.set()
            return None, 0.0

    res = domain.run(body)
    msg, elapsed = res[1]
    assert msg is not None and res[0][0] is None
    assert msg.startswith(
        "ultracomm: rank 1 weight_sync (epoch 1, transport p2p) gave up after waiting up to 0.5 s "
        "to receive expert 0 chunk 0 (bytes [0, 204) of its slot 0) from rank 0"
    ), msg  # direct: one
    # message per member (the alpha-beta choice: no chunking without a relay to pipeline)
    # rank 0's thread never sends and publishes no failure: named stopped by that silence (ultracomm.blame)
    assert (
        "the peer, rank 0, did not complete it" in msg
        and "by evidence, stopped: ranks [0] (rank 0: awaited, silent for the timeout" in msg
    ), msg
    assert 0.5 <= elapsed < 6


def test_p2p_bound_buffers_follow_new_masters_and_repeat_exactly():
    """The p2p transport resolves each message's tensors once per (program, masters, local index map)
    (transports/p2p/bound.py) and reuses them: a repeated restore / grad_reduce moves the same exact
    bytes, and masters registered again (new tensors, new addresses) are read from, not the old ones."""
    world, epr, slots = 4, 2, 3
    layout = layout_of()
    plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr)

    def body(group):
        out = []
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            transport="p2p",
            window="private",
            chunk_bytes=128,
            tile_bytes=16,
            timeout_s=30.0,
        ) as ctx:
            r = ctx.rank
            per = [expert_weights(layout, e) for e in range(r * epr, (r + 1) * epr)]
            w = [torch.stack([p[m] for p in per]).contiguous() for m in range(2)]
            g = [torch.zeros((epr, *m.shape), dtype=layout.grad_dtype) for m in layout.members]
            ctx.register_masters(0, w, g)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            for _ in range(2):  # the second restore reuses the binding of the first
                for t in ctx.replica_weights:
                    t.zero_()
                ctx.restore(vid)
                out.append([t.clone() for t in ctx.replica_weights])
            w2 = [(x.float() + 1).to(x.dtype) for x in w]  # new tensors, other bytes
            g2 = [torch.full_like(x, 0.5) for x in g]
            ctx.register_masters(0, w2, g2)
            ctx.restore(vid)
            out.append([t.clone() for t in ctx.replica_weights])
            for k in range(2):  # grads 1.0 from every filled slot, twice into the same master grads
                for t in ctx.replica_grads:
                    t.fill_(1.0)
                ctx.grad_reduce(vid, release=k == 1)
            out.append([x.clone() for x in g2] + [x.clone() for x in g])
        return out

    res = LoopbackDomain(world).run(body)
    counts = plan.num_replicas.tolist()
    for r in range(world):
        first, again, renewed, grads = res[r]
        assert all(torch.equal(a, b) for a, b in zip(first, again))
        for s, e in enumerate(plan.slot_src[r].tolist()):
            if e < 0:
                continue
            for m, want in enumerate(expert_weights(layout, e)):
                assert torch.equal(first[m][s], want)
                assert torch.equal(renewed[m][s], (want.float() + 1).to(want.dtype))
        for i in range(epr):  # exact: 0.5 + n (two reductions of n ones each), the old grads untouched
            n = counts[r * epr + i]
            for m in range(2):
                assert torch.equal(grads[m][i], torch.full_like(grads[m][i], 0.5 + 2 * n))
                assert torch.equal(grads[2 + m][i], torch.zeros_like(grads[2 + m][i]))


def test_two_contexts_on_one_group_never_take_each_others_messages():
    """Both Contexts number a pair's messages from 0, and operations of different Contexts need not
    run in the same order on every rank (async ops run on each Context's own thread).  Here the
    sender runs Context B's weight_sync first, the receiver A's: A's replica got B's expert, no
    error (two Contexts' async weight_syncs on loopback p2p: 26-30 of 100 per rank, without
    forcing the order).  Each Context now sends on tags of its own (messengers.channel_of)."""
    layout = ExpertLayout((Member("w", (16, 16), torch.float32),))
    plan = ReplicaPlan.make(np.array([[-1], [0]], np.int32), experts_per_rank=1)  # rank 0 -> rank 1 only

    def hold(ctx, wait_for=None, started=None, done=None):
        real = ctx.transport.run

        def run(*a, **kw):
            if started is not None:
                started.set()
            if wait_for is not None:
                assert wait_for.wait(20)
            try:
                return real(*a, **kw)
            finally:
                if done is not None:
                    done.set()

        ctx.transport.run = run

    def body(group):
        ctxs = [
            Context(group, layout, 1, 1, num_layers=1, transport="p2p", timeout_s=20, relay_mode="off")
            for _ in range(2)
        ]
        for c, ctx in enumerate(ctxs):
            ctx.register_masters(0, [torch.full((1, 16, 16), float(100 * c + group.rank))], [torch.zeros(1, 16, 16)])
        first = threading.Event()
        if group.rank == 0:  # the sender: A's operation waits until B's has sent
            hold(ctxs[0], wait_for=first)
            hold(ctxs[1], done=first)
        else:  # the receiver: B's operation waits until A's is receiving
            hold(ctxs[0], started=first)
            hold(ctxs[1], wait_for=first)
        works = [ctx.weight_sync(ctx.begin(0), plan, async_op=True) for ctx in ctxs]
        for w in works:
            w.wait()
        got = [ctx.replica_weights[0][0].unique().tolist() for ctx in ctxs]
        for ctx in ctxs:
            ctx.close()
        return got

    assert LoopbackDomain(2).run(body, timeout=120)[1] == [[0.0], [100.0]]
