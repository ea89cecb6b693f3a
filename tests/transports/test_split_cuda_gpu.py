"""The GPU split transport on a one-GPU loopback domain (cuda_local) with declared memory domains:
the tma kernel inside a domain, the crossings as copies on the side stream, against the host
executor bit for bit (weight_sync, restore, grad_reduce); ranks on different plans raise
PlanError; the transport refuses CUDA-graph capture.

Issue 35: a stalled cross-domain rank, a dead cross-domain peer and a plan mismatch each return a
named error within 10 ms of the deadline (start + timeout; a mismatch before it), every loopback
rank learns of a stall, the watchdog releases the caller's stream and a device-wide synchronize
after it returns (the side stream's gates released).  Each failure runs in its own process
(tests/mp/split_cuda_release_worker.py).

Device-only (``gpu`` marker; scripts/gpu_check.sh runs them).  As with tma, one thread drives
every loopback rank on one stream.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, PlanError, ReplicaPlan

import gpu_worker
from conftest import expert_weights, hot_slot_src, random_slot_src
from test_copy_engine_gpu import (
    assert_refuses_capture,
    fill_replica_grads,
    host_reference,
)  # the copy_engine gpu test's grads and reference

pytestmark = pytest.mark.gpu

LAYOUT = ExpertLayout(
    (Member("fc1", (40, 24), torch.bfloat16), Member("fc2", (56,), torch.bfloat16)), grad_dtype=torch.float32
)


def make(world, epr, slots, transport, mode, domain, node_of, grad_dtype=torch.float32):
    layout = ExpertLayout(LAYOUT.members, grad_dtype=grad_dtype)
    # tiny shapes: a short timeout, so that a failure cannot eat gpu_check's whole test step
    opts = dict(relay_mode=mode, chunk_bytes=1024, tile_bytes=256, timeout_s=3.0, node_of=node_of)
    if transport == "host":
        opts.update(transport="host", window="local", num_workers=2)
        dev = "cpu"
    else:
        opts.update(transport=transport, window="cuda_local", device="cuda:0", domain=domain)
        dev = "cuda:0"
    ctxs = LoopbackDomain(world).run(lambda g: Context(g, layout, epr, slots, num_layers=1, **opts))
    grads = []
    for c in ctxs:
        per = [expert_weights(layout, e) for e in range(c.rank * epr, (c.rank + 1) * epr)]
        w = [torch.stack([p[m] for p in per]).contiguous().to(dev) for m in range(2)]
        g = [torch.full((epr, *m.shape), 0.5, dtype=grad_dtype, device=dev) for m in layout.members]
        c.register_masters(0, w, g)
        grads.append(g)
    return ctxs, grads


def run_all(ctxs, grads, plan, host: bool):
    """weight_sync, restore, grad_reduce of ``plan`` on every rank; per rank (weights, master grads)."""
    if host:
        return host_reference(ctxs, grads, plan)
    vids = [c.begin(0) for c in ctxs]
    for c, v in zip(ctxs, vids):
        c.weight_sync(v, plan)
    for c in ctxs:
        c.synchronize()
    w = [[t.clone().cpu() for t in c.replica_weights] for c in ctxs]
    fill_replica_grads(ctxs)
    for c, v in zip(ctxs, vids):
        c.restore(v)
    for c, v in zip(ctxs, vids):
        c.grad_reduce(v)
    for c in ctxs:
        c.synchronize()
    return [(w[c.rank], [t.cpu() for t in grads[c.rank]]) for c in ctxs]


CASES = [  # world, domains, node_of, relay mode, grad dtype, plan (kept small: gpu_check.sh's gpu step is capped)
    (4, "a,a,b,b", [0, 0, 1, 1], "force", torch.float32, "hot"),
    (4, "a,a,b,b", [0, 0, 1, 1], "off", torch.bfloat16, "random"),
    (4, "n0,n0,n0,n1", [0, 0, 0, 1], "force", torch.float32, "random"),
    (4, "n0,n0,n0,n1", None, "auto", torch.bfloat16, "hot"),
]


@pytest.mark.parametrize("world,domain,node_of,mode,grad_dtype,which", CASES)
def test_split_on_the_gpu_matches_the_host_executor_bit_for_bit(world, domain, node_of, mode, grad_dtype, which):
    epr, slots = 2, 2
    src = (
        random_slot_src(np.random.default_rng(7), world, slots, epr, fill=1.0)
        if which == "random"
        else hot_slot_src(world, slots, epr, expert=1)
    )
    plan = ReplicaPlan.make(src, experts_per_rank=epr)
    hosts, hgrads = make(world, epr, slots, "host", mode, None, node_of, grad_dtype)
    want = run_all(hosts, hgrads, plan, host=True)
    for c in hosts:
        c.close()
    ctxs, grads = make(world, epr, slots, "auto", mode, domain, node_of, grad_dtype)
    assert all(c.transport.name == "split" and type(c.transport).__name__ == "SplitCudaTransport" for c in ctxs)
    got = run_all(ctxs, grads, plan, host=False)
    assert any(c.transport.shadows.views for c in ctxs)  # chunks crossed domains (not a tma-only run)
    for r in range(world):
        for m in range(2):
            assert torch.equal(got[r][0][m].view(torch.uint8), want[r][0][m].view(torch.uint8)), (r, m, "weights")
            assert torch.equal(got[r][1][m].view(torch.uint8), want[r][1][m].view(torch.uint8)), (r, m, "grads")
    for c in ctxs:
        c.close()


def test_loopback_ranks_on_different_plans_raise_plan_error_everywhere():
    ctxs, _ = make(4, 1, 1, "split", "off", "a,a,b,b", None)
    a = ReplicaPlan.make(np.array([[-1], [-1], [0], [0]], np.int32), experts_per_rank=1)
    b = ReplicaPlan.make(np.array([[-1], [-1], [0], [1]], np.int32), experts_per_rank=1)
    errors: list = [None] * len(ctxs)
    # every rank deposits first (ranks 0-2 only join the launch set; rank 3's call completes it and
    # raises), then each synchronizes: the check runs when the set is complete, not at each call
    for c in ctxs:
        try:
            c.weight_sync(c.begin(0), b if c.rank == 3 else a)
        except PlanError as e:
            errors[c.rank] = str(e)
    for c in ctxs:
        try:
            c.synchronize()
        except PlanError as e:
            errors[c.rank] = str(e)
    assert all(e is not None and "runs a different plan for this operation" in e for e in errors), errors
    for c in ctxs:
        c.close()


def test_split_refuses_graph_capture(monkeypatch):
    assert_refuses_capture(make(2, 1, 1, "split", "off", "a,b", None)[0], monkeypatch)


@pytest.mark.parametrize("case", ["stall", "dead", "mismatch"])
def test_split_failure_returns_a_named_error_near_its_deadline_then_the_device_synchronizes(case):
    """Issue 35 (tests/mp/split_cuda_release_worker.py says what each case does): the named error
    within 10 ms of start + timeout (a plan mismatch: before it, on every rank), then
    ``torch.cuda.synchronize()`` returns and later work runs; the measurements go to
    GPU_CHECK_RECORDS (scripts/gpu_check.sh)."""
    p = gpu_worker.run_worker("split_cuda_release_worker.py", case)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    print(json.dumps(out))  # the device run's record (-s / the log)
    gpu_worker.record(f"split/{case}", out)
    check_release(case, out)


def check_release(case: str, out: dict) -> None:
    """What the release worker's JSON must show (tests/transports/test_split_cuda_cpu_run.py feeds it
    the errors a loopback launch hands out, on the CPU)."""
    assert out["synced"] and out["sync_s"] < 1.0, out
    if case == "mismatch":
        assert all(
            e["plan_error"] and "runs a different plan for this operation" in e["error"] for e in out["errors"]
        ), out
        assert out["late_s"] < 0.0, out
        return
    # both receivers (ranks 2 and 3) raise a timeout naming rank 0, whose chunk (or header) they waited
    # for: the launch's kernel record, or the domain's side-stream watchdog's if that came last.  A
    # loopback launch keeps ONE error record (its first CTA to fail, of rank 2 or 3) and every rank
    # raises that one (transports/tma/loopback.py): rank 3 may raise rank 2's words, and the reverse
    for r in (2, 3):
        e = out["errors"][r]
        text = e["error"].split(": ", 1)[1]
        assert e["timeout"] and (
            text.startswith(("ultracomm: rank 2 weight_sync", "ultracomm: rank 3 weight_sync"))
            or "transport split, side stream)" in text
        ), out
        assert "rank 0" in text, out
        # each rank's Context names ranks by evidence (issue 35): one process, no heartbeat in a CUDA
        # window, so none is called stopped -- and no guess of who stopped
        assert "; by evidence, stopped: ranks [];" in text and "likely" not in text, out
    if case == "stall":  # every loopback rank learns of the failure
        assert all(e["error"] is not None for e in out["errors"]), out
    assert -0.001 <= out["late_s"] <= 0.010, out
    assert out["later_work"] and any(out["released"]) and out["closed"], out
