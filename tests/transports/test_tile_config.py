"""ULTRACOMM_TILE_BYTES reaches the host executor (issue 34's tiles): the host and CPU split
transports hand the configured tile to every run, and the bytes and sums do not depend on it."""

from __future__ import annotations

import numpy as np
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan

LAYOUT = ExpertLayout((Member("fc1", (64, 24), torch.float32), Member("fc2", (40,), torch.float32)))
PLAN = ReplicaPlan.make(np.array([[2, -1], [0, 3], [0, 1], [0, 2]], np.int32), experts_per_rank=1)


def _run(tile: int, transport: str = "host", **kw):
    def body(group):
        with Context(
            group,
            LAYOUT,
            1,
            2,
            num_layers=1,
            transport=transport,
            chunk_bytes=4096,
            tile_bytes=tile,
            num_workers=3,
            timeout_s=30.0,
            relay_mode="force",
            **kw,
        ) as ctx:
            g = torch.Generator().manual_seed(7 + ctx.rank)
            w = [torch.randn((1, *m.shape), generator=g) for m in LAYOUT.members]
            grads = [torch.zeros((1, *m.shape)) for m in LAYOUT.members]
            ctx.register_masters(0, w, grads)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, PLAN)
            reps = [t.clone() for t in ctx.replica_weights]
            ctx.grad_reduce(vid, grads=[torch.randn((2, *m.shape), generator=g) for m in LAYOUT.members])
            host = ctx.transport.host if transport == "split" else ctx.transport
            return host.tile_bytes, reps, [t.clone() for t in grads]

    return LoopbackDomain(4).run(body)


def test_the_configured_tile_reaches_the_executor_and_changes_no_bit():
    small, large = _run(16), _run(4096)
    for (ts, rs, gs), (tl, rl, gl) in zip(small, large):
        assert (ts, tl) == (16, 4096)
        for a, b in zip(rs + gs, rl + gl):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))


def test_the_cpu_split_passes_it_to_its_host_executor():
    out = _run(256, "split", domain="a,a,b,b")
    assert all(t == 256 for t, _, _ in out)
