"""copy_engine on a one-GPU loopback domain (cuda_local), against the host executor: bytes of
weight_sync and restore, master grads of grad_reduce (the tma kernel), a Work that completes
with the caller's stream; issue 35's failures (a stalled rank's UltracommTimeout, a dead peer's,
a peer on another plan's PlanError), each in its own process (tests/mp/copy_engine_release_worker.py).

Device-only (``gpu`` marker; scripts/gpu_check.sh runs them).  As with tma, operations take no
collective: one thread drives every loopback rank on one stream.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ultracomm
from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan

import gpu_worker
from conftest import expert_weights, hot_slot_src, random_slot_src

pytestmark = pytest.mark.gpu

LAYOUT = ExpertLayout(
    (Member("fc1", (40, 24), torch.bfloat16), Member("fc2", (56,), torch.bfloat16)), grad_dtype=torch.float32
)


def make(world, epr, slots, transport, mode):
    opts = dict(relay_mode=mode, chunk_bytes=1024, tile_bytes=256, timeout_s=20.0)
    if transport == "host":
        opts.update(transport="host", window="local", num_workers=2)
        dev = "cpu"
    else:
        opts.update(transport=transport, window="cuda_local", device="cuda:0")
        dev = "cuda:0"
    ctxs = LoopbackDomain(world).run(lambda g: Context(g, LAYOUT, epr, slots, num_layers=1, **opts))
    grads = []
    for c in ctxs:
        per = [expert_weights(LAYOUT, e) for e in range(c.rank * epr, (c.rank + 1) * epr)]
        w = [torch.stack([p[m] for p in per]).contiguous().to(dev) for m in range(2)]
        g = [torch.full((epr, *m.shape), 0.5, dtype=torch.float32, device=dev) for m in LAYOUT.members]
        c.register_masters(0, w, g)
        grads.append(g)
    return ctxs, grads


def fill_replica_grads(ctxs):
    for c in ctxs:
        for m, t in enumerate(c.replica_grads):
            t.copy_(torch.arange(t.numel(), dtype=torch.float32).reshape(t.shape) * 1e-3 + 0.25 * (c.rank + 1) + m)


def host_reference(hosts, hgrads, plan):
    """The host executor's results on loopback Contexts ``hosts`` (master grads ``hgrads``):
    weight_sync, replica grads filled, restore, grad_reduce; per rank (weights, master grads)."""

    def body(group):
        c = hosts[group.rank]
        vid = c.begin(0)
        c.weight_sync(vid, plan)
        w = [t.clone() for t in c.replica_weights]
        group.barrier()
        if group.rank == 0:
            fill_replica_grads(hosts)
        group.barrier()
        c.restore(vid)
        c.grad_reduce(vid)
        return w, [t.clone() for t in hgrads[group.rank]]

    return LoopbackDomain(len(hosts)).run(body)


@pytest.mark.parametrize("mode", ["off", "force"])
@pytest.mark.parametrize("which", ["random", "hot"])
def test_copy_engine_matches_host_bit_for_bit(mode, which):
    world, epr, slots = 4, 2, 2
    src = (
        random_slot_src(np.random.default_rng(3), world, slots, epr, fill=1.0)
        if which == "random"
        else hot_slot_src(world, slots, epr, expert=1)
    )
    plan = ReplicaPlan.make(src, experts_per_rank=epr)

    hosts, hgrads = make(world, epr, slots, "host", mode)
    host = host_reference(hosts, hgrads, plan)
    for c in hosts:
        c.close()

    ctxs, grads = make(world, epr, slots, "copy_engine", mode)
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):  # every rank on one (non-default) stream
        vids = [c.begin(0) for c in ctxs]
        works = [c.weight_sync(v, plan, async_op=True) for c, v in zip(ctxs, vids)]
        # ordered after the operation on the caller's stream: no wait in between
        snaps = [[t.clone() for t in c.replica_weights] for c in ctxs]
    works[-1].wait()  # the last rank's Work covers the set's enqueue (loopback)
    for w in works:
        w.wait()
    side.synchronize()
    for c in ctxs:
        for m in range(2):
            assert torch.equal(snaps[c.rank][m].cpu(), host[c.rank][0][m]), f"weight_sync rank {c.rank} member {m}"
            c.replica_weights[m].zero_()
    fill_replica_grads(ctxs)
    for c, v in zip(ctxs, vids):
        assert c.restore(v) is None
    for c, v in zip(ctxs, vids):
        c.grad_reduce(v)
    for c in ctxs:
        c.synchronize()
    for c in ctxs:
        for m in range(2):
            assert torch.equal(c.replica_weights[m].cpu(), host[c.rank][0][m]), f"restore rank {c.rank} member {m}"
            assert torch.equal(grads[c.rank][m].cpu(), host[c.rank][1][m]), f"master grad rank {c.rank} member {m}"
    for c in ctxs:
        c.close()


@pytest.mark.parametrize("case", ["stall", "stall_stream", "dead", "mismatch"])
def test_failure_returns_a_named_error_near_its_deadline_then_the_device_synchronizes(case):
    """Issue 35: the gates release every internal stream on the abort, so the operation's named
    error comes within 10 ms of its deadline (start + timeout; a plan mismatch before it) and a
    device-wide synchronize afterwards returns; nothing reached the rank that was not in the epoch.
    ``stall_stream``: the stall with the caller's work on a fresh non-blocking stream instead of the
    default stream.  The measurements go to GPU_CHECK_RECORDS (scripts/gpu_check.sh, which also
    runs the stall cases with CUDA_DEVICE_MAX_CONNECTIONS=32)."""
    p = gpu_worker.run_worker("copy_engine_release_worker.py", case)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(out))  # the device run's record (-s / the log)
    gpu_worker.record(f"copy_engine/{case}", out)
    assert out["synced"] and out["sync_s"] < 1.0, out
    if case == "mismatch":
        assert all(e["plan_error"] and "PlanMismatchError" in e["error"].split(":")[0] for e in out["errors"]), out
        for r, e in enumerate(out["errors"]):  # each rank names the other
            assert f"rank {1 - r} runs a different plan for this operation" in e["error"], out
        assert out["late_s"] < 0.010 and out["untouched"] == [True, True], out
    else:
        check_lost_peer_error(case, out)
        assert -0.001 <= out["late_s"] <= 0.010, out
        assert out["untouched"] and out["later_work"], out


def check_lost_peer_error(case: str, out: dict) -> None:
    """A stall's or a dead peer's error as the release worker reports it: rank 0's Context's
    (``StreamOrdered.check()``, what ``Work.wait()`` / ``synchronize()`` raise), naming ranks by
    evidence (issue 35).  tests/dataplane/test_stream_ordered_blame.py feeds it the watchdog's error
    of the same two-rank cases on the copy_engine CPU sim."""
    assert out["timeout"] and out["error"].startswith("TimeoutError: ultracomm: rank 0 weight_sync"), out
    if case != "dead":  # rank 1 never joined: named as the host executor names it
        assert "waiting for rank 1 to join the operation (ready flag)" in out["error"], out
        assert "rank 1 has not started this operation (its ready flag is at epoch" in out["error"], out
    else:  # it joined, then its copy never came
        assert "waiting for rank 1 to deliver expert 1 chunk " in out["error"], out
    # every rank is this one process (a loopback domain) and a CUDA window shows no heartbeat: no
    # evidence says rank 1 stopped, so it is of unknown state -- and the record's guess is gone
    assert "; by evidence, stopped: ranks []; state unknown: ranks [1]" in out["error"], out
    assert "likely" not in out["error"], out


def assert_refuses_capture(ctxs, monkeypatch):
    """Two loopback Contexts: a weight_sync while a capture is in progress is refused, then closed."""
    plan = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)
    vids = [c.begin(0) for c in ctxs]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    with pytest.raises(ultracomm.UltracommError, match="cannot be captured in a CUDA graph"):
        ctxs[0].weight_sync(vids[0], plan)
    monkeypatch.undo()
    for c in ctxs:
        c.close()


def test_copy_engine_refuses_graph_capture(monkeypatch):
    """Its commands carry the epoch as a literal: a replayed graph would rerun an old epoch."""
    assert_refuses_capture(make(2, 1, 1, "copy_engine", "off")[0], monkeypatch)
