"""The split transport in one process: ranks of declared memory domains (ULTRACOMM_DOMAIN's syntax,
as ``domain=``) run intra-domain edges on the host executor and cross-domain edges through shadows
and the bridge; every byte equals the host executor's; failures name what was awaited."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan, UltracommTimeout, _core
from ultracomm.env import ConfigError
from ultracomm.dataplane import domains
from ultracomm.records import Op
from ultracomm.schedule import build_schedule
from ultracomm.transports.split.bridge_program import build_bridge_program

from conftest import expert_weights, hot_slot_src, random_slot_src
from test_p2p import layout_of, run_ops


@pytest.fixture(autouse=True)
def _bridge_route(monkeypatch):
    """These tests are about the bridge: the split route, whatever the alpha-beta model would pick for
    their small experts (tests that compare the routes say which one they run)."""
    monkeypatch.setenv("ULTRACOMM_SPLIT_ROUTE", "split")


def run_split(world, plans, layout, epr, slots, mode, node_of, domain, route="split"):
    """run_ops's sequence under transport auto with declared domains (it must pick split), on ``route``."""
    return run_ops(
        "auto",
        world,
        plans,
        layout,
        epr,
        slots,
        mode,
        node_of,
        window="local",
        expect="split",
        domain=domain,
        alpha_beta=False,  # the host executor's trees: a byte-for-byte comparison
        split_route=route,
    )


def crossings(plans, layout, world, mode, node_of, domain) -> int:
    """Chunk messages the bridge moves for ``plans`` (both ops, all ranks)."""
    dom = domains.domain_of(domain.split(","))
    n = 0
    for plan in plans:
        sched = build_schedule(
            plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=128, relay_mode=mode, node_of=node_of
        )
        for op, nbytes in ((Op.MULTICAST, layout.weight_bytes), (Op.REDUCE, layout.grad_bytes)):
            for r in range(world):
                n += len(
                    build_bridge_program(
                        op,
                        sched,
                        r,
                        sched.tasks(op, r),
                        sched.refs(op, r),
                        plan.slot_src.numpy(),
                        plan.home_of.numpy(),
                        dom,
                        128,
                        nbytes,
                    ).recvs
                )
    return n


CASES = [  # world, domains, node_of, relay mode, grad dtype
    (4, "a,a,b,b", [0, 0, 1, 1], "force", torch.float32),
    (4, "a,a,b,b", [0, 0, 1, 1], "off", torch.bfloat16),
    (4, "n0,n0,n0,n1", [0, 0, 0, 1], "force", torch.bfloat16),  # uneven: 3 + 1
    (4, "n0,n0,n0,n1", None, "auto", torch.float32),  # the schedule ignores the domains: more crossings
    (8, "a,a,a,a,b,b,b,b", [0, 0, 0, 0, 1, 1, 1, 1], "auto", torch.bfloat16),
    (8, "a,a,a,a,b,b,b,b", [0, 0, 0, 0, 1, 1, 1, 1], "force", torch.float32),
    (8, "x,y,x,y,z,z,x,y", None, "force", torch.float16),  # three domains, interleaved ranks
]


@pytest.mark.parametrize("route", ["split", "messages"])
@pytest.mark.parametrize("world,domain,node_of,mode,grad_dtype", CASES)
def test_split_is_bit_identical_to_the_host_executor(world, domain, node_of, mode, grad_dtype, route):
    """Both routes (ultracomm.alpha_beta.split_route): every byte of every pool and master grad as the
    host executor's.  The messages route multicasts with the direct schedule and reduces with the
    split schedule where its tree is direct (else on the split route: the bits follow the tree)."""
    layout, epr, slots = layout_of(grad_dtype), 2, 3
    rng = np.random.default_rng(world * 13 + len(mode))
    plans = [ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr)] + [
        ReplicaPlan.make(random_slot_src(rng, world, slots, epr, 0.9), experts_per_rank=epr) for _ in range(2)
    ]
    host = run_ops("host", world, plans, layout, epr, slots, mode, node_of)
    split = run_split(world, plans, layout, epr, slots, mode, node_of, domain, route)
    assert crossings(plans, layout, world, mode, node_of, domain) > 0  # chunks really crossed domains
    for r in range(world):
        assert len(host[r]) == len(split[r])
        for i, (a, b) in enumerate(zip(host[r], split[r])):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"rank {r} result {i} differs"
    stride = -(-layout.weight_bytes // 256) * 256  # and the experts arrived (not two executors agreeing on zeros)
    for r in range(world):
        for s, e in enumerate(plans[0].slot_src[r].tolist()):
            if e >= 0:
                for m, want in enumerate(expert_weights(layout, e)):
                    off = stride * s + layout.weight_offsets[m]
                    got = split[r][0][off : off + layout.weight_sizes[m]]
                    assert torch.equal(got, want.reshape(-1).view(torch.uint8)), (r, s, m)


def test_choice_is_logged_once_and_says_which_edges_go_where(caplog):
    world, epr, slots = 4, 1, 1
    plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=0), experts_per_rank=epr)  # 0 -> 1, 2, 3

    def body(group):
        with Context(
            group,
            layout_of(),
            epr,
            slots,
            num_layers=1,
            timeout_s=30.0,
            chunk_bytes=128,
            tile_bytes=16,
            relay_mode="off",
            domain="a,a,b,b",
            log_level="info",
        ) as ctx:
            return ctx.transport_choice, ctx.domain_of, ctx.transport_choice.edges(ctx.schedule_for(plan))

    with caplog.at_level(logging.INFO, logger="ultracomm"):
        res = LoopbackDomain(world).run(body)
    choice, dom, edges = res[0]
    assert all(r == res[0] for r in res)
    assert dom == (0, 0, 1, 1) and choice.domain_of == dom
    assert choice.edge_transport == {"intra": "host", "cross": "p2p"}
    # direct tree: rank 0 feeds 1 (same domain), 2 and 3 (the other); the reduce mirrors it
    assert edges == {"multicast": {"host": 1, "p2p": 2}, "reduce": {"host": 1, "p2p": 2}}
    lines = sorted(r.getMessage() for r in caplog.records if "transport auto ->" in r.getMessage())
    assert lines == [
        f"ultracomm: rank {r}: transport auto -> split: the ranks span 2 shared-memory domains of [2, 2] "
        "ranks; edges inside a domain run on host (shared-memory windows) and edges across domains on "
        "p2p (gloo messages through shadow windows and a bridge)"
        for r in range(world)
    ]


@pytest.mark.parametrize("direct", [False, True])
def test_shadows_keep_flags_and_slot_pages_until_the_plan_changes(monkeypatch, direct):
    """After an op the shadow of the receiving peer holds its ready/digest words (from its header) and
    -- shadow protocol -- the arrival flags its interpreter raised and the crossing's bytes: the slot
    pages stay for the next op of the same plan (faulting them in again each op cost as much as the
    message, perf/README.md section 6b), and are handed back (read as zeros) once an op runs another
    plan.  Direct crossings (transports/split/bridge_direct.py) never touch the shadow's slots or
    arrival flags: the chunk goes from the master to the peer."""
    from ultracomm.transports import split as split_mod

    monkeypatch.setattr(split_mod, "DIRECT_CROSSINGS", direct)
    world, epr, slots = 2, 1, 1
    layout = ExpertLayout((Member("w", (64, 64), torch.float32),))  # slot bytes span whole pages
    plan = ReplicaPlan.make(np.array([[-1], [0]], np.int32), experts_per_rank=epr)
    other = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=epr)

    def body(group):
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            transport="split",
            window="local",
            domain="a,b",
            chunk_bytes=4096,
            tile_bytes=4096,
            timeout_s=30.0,
        ) as ctx:
            ctx.register_masters(
                0,
                [torch.ones((1, *m.shape), dtype=m.dtype) for m in layout.members],
                [torch.zeros((1, *m.shape)) for m in layout.members],
            )
            wl = ctx.wlayout
            shadow = ctx.transport.shadows.views[1 - ctx.rank]
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            first = shadow[: wl["ready_off"]].clone()
            ctx.restore(vid)  # the same plan: the pages stay
            again = shadow[: wl["ready_off"]].clone()
            ctx.end(vid)
            ctx.weight_sync(ctx.begin(0), other)  # another plan over the same peer: handed back after it
            after = shadow[: wl["ready_off"]].clone()
            if ctx.rank != 0:
                return None
            flags = shadow[wl["ready_off"] :].view(torch.int64)
            nchunks = wl["weight_chunks"]
            arrival = shadow[wl["arrival_off"] : wl["arrival_off"] + 8 * nchunks].view(torch.int64)
            return (
                int(flags[0]),
                first,
                again,
                after,
                arrival.tolist(),
                ctx.window.local[wl["ready_off"] : wl["ready_off"] + 8].view(torch.int64).item(),
                wl["chunk_bytes"],
                wl["weights_off"],
            )

    ready, first, again, after, arrival, own_ready, chunk, woff = LoopbackDomain(world).run(body)[0]
    assert ready == 3 and own_ready == 3  # rank 1's header said epoch 3, as its own window does
    # the crossing chunk is raised to what a gloo message pays for (ultracomm.alpha_beta): the whole slot
    assert chunk == 16384 and arrival == [0 if direct else 3]
    want = torch.zeros_like(first)
    if not direct:  # the interpreter wrote rank 1's replica (ones) into its shadow of rank 1
        want[woff : woff + 16384] = torch.ones(64 * 64).view(torch.uint8)
    assert torch.equal(first, want) and torch.equal(again, want)
    assert int(after.count_nonzero()) == 0


def test_a_cross_domain_peer_that_never_runs_is_named():
    """Rank 2 (domain b) skips its part: rank 0 (domain a), whose expert goes to rank 2, raises within about
    the timeout naming rank 2 and what it waited for; rank 1 (same domain as 0, no replica) is unaffected."""
    world, epr, slots = 3, 1, 1
    layout = layout_of()
    plan = ReplicaPlan.make(np.array([[-1], [-1], [0]], np.int32), experts_per_rank=epr)
    started = threading.Event()

    def body(group):
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            transport="split",
            window="local",
            domain="a,a,b",
            relay_mode="off",
            chunk_bytes=128,
            tile_bytes=16,
            timeout_s=0.5,
        ) as ctx:
            ctx.register_masters(
                0,
                [torch.ones((1, *m.shape), dtype=m.dtype) for m in layout.members],
                [torch.zeros((1, *m.shape)) for m in layout.members],
            )
            vid = ctx.begin(0)
            if ctx.rank == 2:
                ctx.transport.run = lambda *a, **k: started.wait(10)
            t0 = time.monotonic()
            try:
                ctx.weight_sync(vid, plan)
            except UltracommTimeout as e:
                return str(e), time.monotonic() - t0
            finally:
                if ctx.rank == 0:
                    started.set()
            return None, 0.0

    res = LoopbackDomain(world).run(body)
    assert res[1] == (None, 0.0) and res[2] == (None, 0.0)
    msg, elapsed = res[0]
    assert msg is not None and 0.5 <= elapsed < 6, (msg, elapsed)  # the timeout, then the grace (ultracomm.blame)
    bridge = (
        "ultracomm: rank 0 weight_sync (epoch 1, transport split, bridge) gave up after waiting up to 0.5 s to "
        "receive the header of rank 2 (its join: it never started this op) (timeout ULTRACOMM_TIMEOUT_S=0.5); "
        "the peer, rank 2, did not complete it"
    )
    # or the interpreter's own wait on its shadow of rank 2's ready flag, whichever expires first
    interp = (
        "ultracomm: rank 0 weight_sync (multicast) epoch 1 timed out after 0.5 s waiting for rank 2 to join the "
        "operation (ready flag) before sending expert 0 chunk "
    )
    assert msg.startswith(bridge) or (
        msg.startswith(interp) and "rank 2 has not started this operation (its ready flag is at epoch 0)" in msg
    ), msg
    # rank 2 waits elsewhere (alive); in this loopback domain its heartbeat can be read, so the evidence says
    # it has not started the operation, or, where no window shows it, that it was silent past the grace;
    # rank 1 finished and closed its Context: never called stopped
    assert (
        "by evidence, stopped: ranks [2] (rank 2: awaited, silent for the timeout" in msg
        or "by evidence, stopped: ranks []; alive (heartbeat fresh): ranks [2] (rank 2 has not started this operation"
        in msg
    ), msg
    assert "rank 1: heartbeat stale" not in msg, msg


@pytest.mark.parametrize(
    "domain,error,match",
    [
        ("a,b,b", ValueError, r"ULTRACOMM_DOMAIN='a,b,b' lists 3 domain keys but the Context's group has 2 ranks"),
        ("a b", ConfigError, r"domain='a b' is invalid: key 'a b' is not 1 to 128 characters"),
        ("a,,b", ConfigError, r"domain='a,,b' is invalid: key '' is not 1 to 128 characters"),
    ],
)
def test_bad_declarations_are_refused_before_anything_moves(domain, error, match):
    def body(group):
        Context(group, layout_of(), 1, 1, num_layers=1, timeout_s=30.0, domain=domain)

    with pytest.raises(error, match=match):
        LoopbackDomain(2).run(body)


def test_ranks_that_declare_different_lists_are_refused():
    def body(group):
        Context(
            group, layout_of(), 1, 1, num_layers=1, timeout_s=30.0, domain="a,a,b,b" if group.rank < 2 else "a,b,b,b"
        )

    with pytest.raises(
        ValueError,
        match=r"ranks declare different ULTRACOMM_DOMAIN values \(ranks \[0, 1\]: "
        r"'a,a,b,b'; ranks \[2, 3\]: 'a,b,b,b'\)",
    ):
        LoopbackDomain(4).run(body)


def test_one_cpu_domain_over_two_hosts_is_refused(monkeypatch):
    from ultracomm.dataplane import domains

    hosts = ["h1/x", "h1/x", "h2/y", "h2/y"]
    monkeypatch.setattr(domains, "host_key", lambda: hosts[int(threading.current_thread().name.rsplit("rank", 1)[1])])

    def body(group):
        Context(group, layout_of(), 1, 1, num_layers=1, timeout_s=30.0, domain="same")

    with pytest.raises(
        ValueError,
        match=r"memory domain 'same' spans several hosts \(ranks \[0, 1\] on h1/x; ranks "
        r"\[2, 3\] on h2/y\), but CPU ranks share memory only within one host",
    ):
        LoopbackDomain(4).run(body)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message of a machine without a GPU")
def test_split_on_a_cuda_device_without_a_gpu_says_what_is_missing():
    from ultracomm.cuda.support import NotAvailableError

    with pytest.raises(NotAvailableError, match="transport 'split' on CUDA is not available: "):
        LoopbackDomain(1).run(lambda g: Context(g, layout_of(), 1, 1, num_layers=1, transport="split", device="cuda"))


def test_the_cpu_split_refuses_a_cuda_window():
    from types import SimpleNamespace

    from ultracomm.transports.split import SplitTransport

    win = SimpleNamespace(local=torch.empty(0, device="meta"), peer_bases=[1, 1])
    with pytest.raises(ValueError, match="SplitTransport runs on the CPU .* ultracomm.transports.split.cuda"):
        SplitTransport(
            comm=None,
            rank=0,
            world=2,
            window=win,
            wlayout={},
            layout=None,
            num_workers=1,
            timeout_s=1.0,
            domain_of=[0, 1],
        )


def test_run_host_abort_word_stops_a_waiting_interpreter():
    """A rank waiting for a peer that never comes stops when its abort word is raised, long before the timeout."""
    layout = layout_of()
    plan = ReplicaPlan.make(np.array([[-1], [0]], np.int32), experts_per_rank=1)

    def body(group):
        with Context(
            group,
            layout,
            1,
            1,
            num_layers=1,
            transport="host",
            window="local",
            chunk_bytes=128,
            tile_bytes=16,
            timeout_s=30.0,
        ) as ctx:
            ctx.register_masters(0, [torch.ones((1, *m.shape), dtype=m.dtype) for m in layout.members], None)
            if ctx.rank == 0:
                return None
            sched = ctx.schedule_for(plan)
            abort = torch.zeros(1, dtype=torch.int64)
            raised_at = []

            def raise_abort():
                raised_at.append(time.monotonic())
                _core.store_release(abort.data_ptr(), 1)

            threading.Timer(0.2, raise_abort).start()
            with pytest.raises(_core.AbortedError, match=r"rank 1 weight_sync \(epoch 1\) stopped: its abort word"):
                ctx.transport.run(
                    Op.MULTICAST, sched, 1, ctx._masters[0], [0], [0, -1], "weight_sync", abort_word=abort.data_ptr()
                )
            return raised_at, time.monotonic()

    raised_at, stopped_at = LoopbackDomain(2).run(body)[1]
    # it waited for the abort word (raised before it stopped) and stopped long before the 30 s timeout
    assert len(raised_at) == 1 and 0 <= stopped_at - raised_at[0] < 5


def test_wait_flag_reports_reached_timeout_and_abort():
    words = torch.zeros(2, dtype=torch.int64)
    flag, abort = words.data_ptr(), words.data_ptr() + 8
    assert _core.wait_flag(flag, 1, 0.05) == (1, 0)
    _core.store_release(flag, 7)
    assert _core.wait_flag(flag, 7, 0.05) == (0, 7) and _core.load_acquire(flag) == 7
    _core.store_release(abort, 1)
    assert _core.wait_flag(flag, 8, 30.0, abort) == (2, 7)
    with pytest.raises(ValueError, match="8-byte aligned"):
        _core.wait_flag(flag + 4, 1, 1.0)


def _run_two(plan_of, epoch_of, timeout_s=20.0):
    """Ranks 0 and 1 in two domains call the split transport directly (no plan agreement), each with its own
    plan and epoch; returns (error text or None, seconds) per rank."""
    layout = layout_of()

    def body(group):
        with Context(
            group,
            layout,
            1,
            2,
            num_layers=1,
            transport="split",
            window="local",
            domain="a,b",
            relay_mode="off",
            chunk_bytes=128,
            tile_bytes=16,
            timeout_s=timeout_s,
        ) as ctx:
            ctx.register_masters(0, [torch.ones((1, *m.shape), dtype=m.dtype) for m in layout.members], None)
            plan = plan_of(ctx.rank)
            sched = ctx.schedule_for(plan)
            t0 = time.monotonic()
            try:
                ctx.transport.run(
                    Op.MULTICAST,
                    sched,
                    epoch_of(ctx.rank),
                    ctx._masters[0],
                    plan.slot_src[ctx.rank].tolist(),
                    plan.local_index_of.tolist(),
                    "weight_sync",
                )
            except Exception as e:  # noqa: BLE001 - the test inspects it
                return f"{type(e).__name__}: {e}", time.monotonic() - t0
            return None, time.monotonic() - t0

    return LoopbackDomain(2).run(body)


def test_a_peer_on_another_plan_is_a_plan_error_at_once():
    """Rank 1 holds expert 0 in slot 0 under one plan, in slot 1 under the other: the headers carry the
    schedule digests, so both ranks raise PlanError naming the other long before the timeout."""
    plans = [ReplicaPlan.make(np.array([[-1, -1], s], np.int32), experts_per_rank=1) for s in ([0, -1], [-1, 0])]
    res = _run_two(lambda r: plans[r], lambda r: 1)
    for r, (err, elapsed) in enumerate(res):
        bridge = (
            f"PlanError: ultracomm: rank {r} weight_sync (epoch 1, transport split, bridge): rank {1 - r} runs "
            "another plan (schedule digest "
        )
        # or the interpreter, reading the digest the bridge put in its shadow of the peer, was first
        assert err is not None and (
            err.startswith(bridge) or (err.startswith("PlanMismatchError") and f"rank {1 - r}" in err)
        ), err
        assert elapsed < 10, (err, elapsed)


def test_ranks_at_different_epochs_are_out_of_step():
    plan = ReplicaPlan.make(np.array([[-1, -1], [0, -1]], np.int32), experts_per_rank=1)
    res = _run_two(lambda r: plan, lambda r: 1 + r)
    err0, elapsed0 = res[0]
    assert err0 == (
        "UltracommError: ultracomm: rank 0 weight_sync (epoch 1, transport split, bridge): rank 1 sent "
        "the header of epoch 2, this rank is at epoch 1: the ranks called their operations in different "
        "orders"
    ), err0
    assert elapsed0 < 10
    assert res[1][0] == (
        "UltracommError: ultracomm: rank 1 weight_sync (epoch 2, transport split, bridge): rank 0 "
        "sent the header of epoch 1, this rank is at epoch 2: the ranks called their operations in "
        "different orders"
    ), res[1][0]


def test_routes_run_where_they_say_and_auto_follows_the_model(monkeypatch):
    """ULTRACOMM_SPLIT_ROUTE / split_route: ``messages`` runs the multicast through the p2p transport
    (direct schedule) and never the bridge; a relay-tree reduction stays on the split route (its bits
    follow the tree); ``auto`` asks ultracomm.alpha_beta.split_route per op -- 1 KiB experts: messages;
    ``split`` never calls p2p.  Bytes checked against the experts either way."""
    from ultracomm.transports.split.bridge_direct import DirectBridge

    world, epr, slots = 4, 1, 2
    layout = layout_of(torch.float32)
    plan = ReplicaPlan.make(np.array([[-1, -1], [0, -1], [0, 1], [0, 1]], np.int32), experts_per_rank=epr)
    # patched once for every rank (the ranks are threads: patching per rank would race)
    bridge_calls: list = []
    real_start = DirectBridge.start
    monkeypatch.setattr(
        DirectBridge,
        "start",
        lambda self, *a, **k: (bridge_calls.append(("bridge", int(self.prog.op))), real_start(self, *a, **k))[1],
    )

    def body(group, route, relay):
        calls = []
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            transport="split",
            window="local",
            domain="a,a,b,b",
            node_of=[0, 0, 1, 1],
            relay_mode=relay,
            chunk_bytes=128,
            tile_bytes=16,
            timeout_s=30.0,
            split_route=route,
        ) as ctx:
            t = ctx.transport
            real_p2p = t.p2p.run
            t.p2p.run = lambda op, sched, *a, **k: (
                calls.append(("p2p", int(op), sched.stats("multicast")["depth"])),
                real_p2p(op, sched, *a, **k),
            )[1]
            w = [torch.stack([expert_weights(layout, ctx.rank)[m]]) for m in range(2)]
            g = [torch.zeros((epr, *m.shape), dtype=layout.grad_dtype) for m in layout.members]
            ctx.register_masters(0, w, g)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            for s, e in enumerate(plan.slot_src[ctx.rank].tolist()):
                if e >= 0:
                    for m, want in enumerate(expert_weights(layout, e)):
                        assert torch.equal(ctx.replica_weights[m][s], want), (ctx.rank, s, m)
            for t_ in ctx.replica_grads:
                t_.fill_(1.0)
            ctx.grad_reduce(vid)  # releases the vid
            sched = ctx.schedule_for(plan)
            routes = [t.route(op, sched).route for op in (Op.MULTICAST, Op.REDUCE)]
            return calls, routes, sched.stats("reduce")["depth"], [x.clone() for x in g]

    counts = plan.num_replicas.tolist()
    for route, relay in (("messages", "force"), ("auto", "force"), ("split", "off"), ("auto", "off")):
        bridge_calls.clear()
        res = LoopbackDomain(world).run(lambda g: body(g, route, relay))
        for r, (calls, routes, depth, grads) in enumerate(res):
            assert depth == (1 if relay == "off" else 2)
            want = {
                "messages": ["messages", "split" if depth > 1 else "messages"],
                "auto": ["messages", "split" if depth > 1 else "messages"],  # 1 KiB: nothing pays
                "split": ["split", "split"],
            }[route]
            assert routes == want, (route, relay, r, routes)
            # what ran: p2p with the direct schedule for a messages op, the bridge for a split op that crosses
            assert [c for c in calls if c[0] == "p2p"] == [
                ("p2p", int(op), 1) for op, x in zip((Op.MULTICAST, Op.REDUCE), routes) if x == "messages"
            ]
            # the master grads: one per replica plus the home's own zero, exact
            for m, gt in enumerate(grads):
                assert torch.equal(gt[0], torch.full_like(gt[0], float(counts[r]))), (route, relay, r, m)
        # the bridge ran for exactly the ops on the split route (some rank of each has crossings)
        bridged = {c[1] for c in bridge_calls}
        assert bridged == {int(op) for op, x in zip((Op.MULTICAST, Op.REDUCE), res[0][1]) if x == "split"}, route
