"""The copy_engine transport's stream commands, on simulated streams over host windows: they leave
exactly the host executor's bytes in any stream interleaving; their order is the documented one
(digest first, fork before any internal stream, ready then digest-equality waits before any copy
into a rank, joins last); the loopback submission order never blocks even when every stream
shares one hardware queue; and on a CPU machine the transport says why it is not available.
The abort path is in test_copy_engine_watchdog.py, the GPU runs in test_copy_engine_gpu.py."""

from __future__ import annotations

import ctypes

import numpy as np
import pytest
import torch

from ultracomm import ReplicaPlan
from ultracomm.cuda.support import NotAvailableError
from ultracomm.transports.copy_engine.plan import (
    DRAIN,
    EPOCH,
    MAIN,
    flag_addr,
    geq,
    simulate,
    submission_order,
    word_addr,
)

from conftest import hot_slot_src, random_slot_src
from copy_engine_sim import host_contexts, host_reference, new_words, pools, rank_commands, set_epoch

CASES = [(2, "off", None), (5, "force", None), (8, "auto", None), (4, "force", [0, 0, 1, 1])]


def plans_for(world, epr, slots):
    rng = np.random.default_rng(world)
    srcs = [hot_slot_src(world, slots, epr, expert=1)] + [
        random_slot_src(rng, world, slots, epr, 0.9) for _ in range(3)
    ]
    return [ReplicaPlan.make(s, experts_per_rank=epr) for s in srcs]


@pytest.fixture(params=CASES, ids=lambda c: f"w{c[0]}-{c[1]}{'-nodes' if c[2] else ''}")
def domain(request):
    world, mode, node_of = request.param
    ctxs, each = host_contexts(world, 2, 3, mode, node_of)
    yield ctxs, each, mode
    for c in ctxs:
        c.close()


def test_commands_on_simulated_streams_match_the_host_executor(domain):
    ctxs, each, mode = domain
    relayed = 0
    for i, plan in enumerate(plans_for(len(ctxs), 2, 3)):
        want, epoch = host_reference(ctxs, each, plan)
        relayed += int(ctxs[0].schedule_for(plan).stats("multicast")["depth"] >= 2)
        words = new_words(len(ctxs))
        programs = [rank_commands(c, plan, words[c.rank]) for c in ctxs]
        assert simulate(programs, epoch, seed=i) == []
        set_epoch(ctxs, epoch)
        for r, (c, got) in enumerate(zip(ctxs, pools(ctxs))):
            assert torch.equal(got, want[r]), f"plan {i} rank {r}: pools differ"
            wl = c.wlayout
            assert int(c.window.local[wl["ready_off"] : wl["ready_off"] + 8].view(torch.int64)) == epoch
            streams = {x.stream for x in programs[r] if x.stream != MAIN}
            assert words[r][0] == epoch  # started
            for k in streams:  # every internal stream wrote its done word, which the caller's stream joined
                assert words[r][(word_addr(0, k)) // 8] == epoch
    if mode == "force":
        assert relayed > 0


def test_command_order(domain):
    """Per rank: digest, ready, started, fork on the caller's stream; each internal stream forked
    first; towards each destination a ready wait then a digest-equality wait before its first
    copy; a relay's arrival wait before its copies; arrival writes after their copies; done
    last on each internal stream; the caller's stream ends joining exactly the internal streams."""
    ctxs, _, _ = domain
    words = new_words(len(ctxs))
    for plan in plans_for(len(ctxs), 2, 3):
        for c in ctxs:
            cmds = rank_commands(c, plan, words[c.rank], digest=0xABC)
            me, wl = c.window.peer_bases[c.rank], c.wlayout
            main = [x for x in cmds if x.stream == MAIN]
            assert [(x.kind, x.addr, x.value) for x in main[:4]] == [
                ("write", flag_addr(wl, me, "digest"), 0xABC),
                ("write", flag_addr(wl, me, "ready"), EPOCH),
                ("write", word_addr(words[c.rank].ctypes.data, None), EPOCH),
                ("fork", 0, EPOCH),
            ]
            assert cmds[:4] == main[:4]  # submitted before anything else
            internal = [x.stream for x in cmds if x.kind == "forked"]
            joins = main[4:]
            w0 = words[c.rank].ctypes.data
            assert [(x.kind, x.addr) for x in joins] == [("wait", word_addr(w0, k)) for k in internal]
            assert not joins or cmds[-len(joins) :] == joins
            for k in internal:
                mine = [x for x in cmds if x.stream == k]
                assert mine[0].kind == "forked" and [x.kind for x in mine].count("forked") == 1
                assert (mine[-1].kind, mine[-1].addr) == ("write", word_addr(w0, k))
                if k == DRAIN:
                    filled = [s for s, e in enumerate(plan.slot_src[c.rank]) if e >= 0]
                    assert [x.slot for x in mine[1:-1]] == [s for s in filled for _ in range(wl["weight_chunks"])]
                    assert all(x.kind == "wait" and x.peer >= 0 for x in mine[1:-1])
                    continue
                base = c.window.peer_bases[k]
                assert [(x.kind, x.addr) for x in mine[1:3]] == [
                    ("wait", flag_addr(wl, base, "ready")),
                    ("wait_eq", flag_addr(wl, base, "digest")),
                ]
                assert mine[2].value == 0xABC and all(x.peer == k for x in mine[1:3])
                arrived: set = set()  # (own slot, chunk) this stream waited for
                copied: set = set()
                for x in mine[3:-1]:
                    if x.kind == "wait":  # a relay's own arrival
                        assert x.addr == flag_addr(wl, me, "arrival", x.slot, x.chunk)
                        arrived.add((x.slot, x.chunk))
                    elif x.kind == "copy":
                        assert base <= x.addr and x.addr + x.nbytes <= base + wl["ready_off"]
                        if me <= x.src < me + wl["ready_off"]:  # from an own slot: a relay's forward
                            assert ((x.src - me - wl["weights_off"]) // wl["weight_stride"], x.chunk) in arrived
                        copied.add((x.addr, x.chunk))
                    else:
                        assert x.kind == "write" and any(ch == x.chunk for _, ch in copied)


def run_one_queue(order, epoch):
    """Execute ``(rank, cmd)`` in exactly this order on ONE queue (every stream aliased to one
    hardware queue, the worst case): a wait that is not satisfied when reached is a deadlock."""
    forked = set()
    for r, c in order:
        v = epoch if c.value == EPOCH else c.value
        if c.kind in ("wait", "wait_eq"):
            have = ctypes.c_uint64.from_address(c.addr).value
            if not (have == v if c.kind == "wait_eq" else geq(have, v)):
                return f"rank {r}: {c.what}"
        elif c.kind == "forked":
            assert r in forked
        elif c.kind == "fork":
            forked.add(r)
        elif c.kind == "copy":
            ctypes.memmove(c.addr, c.src, c.nbytes)
        else:
            ctypes.c_uint64.from_address(c.addr).value = v
    return None


def test_loopback_submission_order_runs_on_one_queue(domain):
    ctxs, each, mode = domain
    blocked_rank_by_rank = 0
    for plan in plans_for(len(ctxs), 2, 3):
        want, epoch = host_reference(ctxs, each, plan)
        words = new_words(len(ctxs))
        programs = [rank_commands(c, plan, words[c.rank]) for c in ctxs]
        assert run_one_queue(submission_order(programs), epoch) is None
        set_epoch(ctxs, epoch)
        assert all(torch.equal(a, b) for a, b in zip(pools(ctxs), want))
        # the order matters: rank after rank, a relay's wait would block the copy it waits for
        _, epoch = host_reference(ctxs, each, plan)
        blocked_rank_by_rank += run_one_queue([(r, x) for r, p in enumerate(programs) for x in p], epoch) is not None
        set_epoch(ctxs, epoch)
    if mode == "force":
        assert blocked_rank_by_rank > 0


def test_submission_order_refuses_an_unsorted_program(domain):
    ctxs, _, _ = domain
    plan = plans_for(len(ctxs), 2, 3)[0]
    words = new_words(len(ctxs))
    programs = [rank_commands(c, plan, words[c.rank]) for c in ctxs]
    r = max(range(len(ctxs)), key=lambda i: len({x.order for x in programs[i] if x.phase == 1}))
    body = [i for i, x in enumerate(programs[r]) if x.phase == 1]
    assert len({programs[r][i].order for i in body}) >= 2
    programs[r] = programs[r][: body[0]] + programs[r][body[0] : body[-1] + 1][::-1] + programs[r][body[-1] + 1 :]
    with pytest.raises(RuntimeError, match=rf"rank {r}'s copy_engine commands are not in \(chunk, level\) order"):
        submission_order(programs)


def test_relay_without_its_arrival_wait_is_caught():
    """Drop a relay's arrival wait: on some stream order the relay forwards before its chunk came."""
    world, epr, slots = 5, 2, 3
    ctxs, each = host_contexts(world, epr, slots, "force")
    try:
        plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr)
        differs = 0
        for seed in range(20):
            want, epoch = host_reference(ctxs, each, plan)
            words = new_words(world)
            programs = [
                [x for x in rank_commands(c, plan, words[c.rank]) if not (x.kind == "wait" and "relay slot" in x.what)]
                for c in ctxs
            ]
            simulate(programs, epoch, seed=seed)
            set_epoch(ctxs, epoch)
            differs += any(not torch.equal(a, b) for a, b in zip(pools(ctxs), want))
        assert differs > 0
    finally:
        for c in ctxs:
            c.close()


def test_copy_engine_here_says_what_is_missing():
    from ultracomm import transports
    from ultracomm.cuda.support import torch_cuda_reason

    if torch_cuda_reason() is None:
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(NotAvailableError, match=r"^ultracomm: transport 'copy_engine' is not available: ") as ei:
        transports.resolve_transport("copy_engine", "cuda")
    assert "CPU build" in str(ei.value) or "no CUDA device" in str(ei.value)
    import ultracomm.transports.copy_engine as ce  # the module imports without a GPU

    assert ce.CopyEngineTransport.window_providers == ("cuda_local", "torch_symm", "cuda_ipc", "nvshmem")
    assert ce.CopyEngineTransport.stream_ordered is True
