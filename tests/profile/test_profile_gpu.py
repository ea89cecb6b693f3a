"""The profiler's GPU op times on a one-GPU loopback domain (tma, copy_engine): the rank whose call
completes each set (the last, with one thread driving every rank) records a positive, finite
device time per operation from its CUDA events; the other ranks' calls only deposit their share
and have none.  Device-only (``gpu`` marker; scripts/gpu_check.sh runs it)."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.profile import Profiler, load_trace

from conftest import expert_weights, random_slot_src

pytestmark = pytest.mark.gpu

LAYOUT = ExpertLayout((Member("fc1", (40, 24), torch.float32), Member("fc2", (56,), torch.float32)))


@pytest.mark.parametrize("transport", ["tma", "copy_engine"])
def test_gpu_op_times_from_events(tmp_path, transport):
    world, epr, slots = 3, 1, 2
    plan = ReplicaPlan.make(
        random_slot_src(np.random.default_rng(2), world, slots, epr, fill=1.0), experts_per_rank=epr
    )
    profs = [Profiler(tmp_path / f"r{r}") for r in range(world)]
    ctxs = LoopbackDomain(world).run(
        lambda g: Context(
            g,
            LAYOUT,
            epr,
            slots,
            num_layers=1,
            transport=transport,
            window="cuda_local",
            device="cuda:0",
            chunk_bytes=1024,
            tile_bytes=256,
            timeout_s=20.0,
            profile=profs[g.rank],
        )
    )
    for c in ctxs:
        per = [expert_weights(LAYOUT, e) for e in range(c.rank * epr, (c.rank + 1) * epr)]
        w = [torch.stack([p[m] for p in per]).contiguous().cuda() for m in range(2)]
        c.register_masters(0, w, [torch.zeros_like(t) for t in w])
    vids = [c.begin(0) for c in ctxs]
    for op in ("weight_sync", "restore", "grad_reduce"):  # one thread drives every rank, op by op
        for c, v in zip(ctxs, vids):
            getattr(c, op)(v, plan) if op == "weight_sync" else getattr(c, op)(v)
    for c in ctxs:
        c.synchronize()
        c.close()
    for r, p in enumerate(profs):
        p.close()
        tr = load_trace(tmp_path / f"r{r}")
        assert len(tr) == 1 and tr["has_stats"][0]
        for op in ("weight_sync", "restore", "grad_reduce"):
            t = float(tr[f"time_{op}"][0])
            if r == world - 1:
                assert math.isfinite(t) and 0 < t < 20.0, (op, t)
            else:
                assert math.isnan(t), (r, op, t)
