"""torchrun worker: the Context API over gloo + host_shm, checked on every rank.

Run as ``torchrun --nproc-per-node 4 tests/mp/context_worker.py``; exits non-zero (and
prints why) on the first wrong byte.  Prints ``rank R OK`` per rank.
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import expected_master_grads, expert_weights, random_slot_src  # noqa: E402

from ultracomm import Context, ExpertLayout, Member, ReplicaPlan  # noqa: E402
from ultracomm.schedule import build_schedule  # noqa: E402


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    epr, slots, layers = 2, 2, 3
    layout = ExpertLayout((Member("fc1", (6, 17), torch.bfloat16), Member("fc2", (17, 3), torch.bfloat16)))
    ctx = Context(
        None,
        layout,
        epr,
        slots,
        num_layers=layers,
        max_microbatches=layers,
        window="host_shm",
        chunk_bytes=128,
        tile_bytes=128,
        relay_mode="force",
        timeout_s=60.0,
    )
    assert ctx.window.provider == "host_shm"
    masters = []
    for layer in range(layers):
        per = [expert_weights(layout, 100 * layer + e) for e in range(rank * epr, (rank + 1) * epr)]
        w = [torch.stack([p[m] for p in per]).contiguous() for m in range(2)]
        g = [torch.zeros((epr, *m.shape), dtype=torch.float32) for m in layout.members]
        ctx.register_masters(layer, w, g)
        masters.append((w, g))

    for it in range(3):
        rng = np.random.default_rng(it)
        plans = [
            ReplicaPlan.make(random_slot_src(rng, world, slots, epr, 0.8), experts_per_rank=epr) for _ in range(layers)
        ]
        # forward: every layer in flight (one vid each), in order; backward in reverse with restore
        vids = []
        for layer in range(layers):
            vid = ctx.begin(layer)
            ctx.weight_sync(vid, plans[layer])
            for s, e in enumerate(plans[layer].slot_src[rank].tolist()):
                if e >= 0:
                    want = expert_weights(layout, 100 * layer + e)
                    for m in range(2):
                        assert torch.equal(ctx.replica_weights[m][s], want[m]), (rank, layer, s, e, m)
            vids.append((layer, vid))
        for layer, vid in reversed(vids):
            work = ctx.restore(vid, async_op=True)
            work.wait()
            plan = plans[layer]
            for s, e in enumerate(plan.slot_src[rank].tolist()):
                if e >= 0:
                    want = expert_weights(layout, 100 * layer + e)
                    for m in range(2):
                        assert torch.equal(ctx.replica_weights[m][s], want[m]), ("restore", rank, layer, s, e, m)
            # replica grads: a value any rank can recompute
            gen = torch.Generator().manual_seed(it * 1000 + layer * 10 + rank)
            replica = [torch.randn((slots, *m.shape), generator=gen) for m in layout.members]
            master = [torch.randn((epr, *m.shape), generator=gen) for m in layout.members]
            for m in range(2):
                ctx.replica_grads[m].copy_(replica[m])
                masters[layer][1][m].copy_(master[m])
            all_replica = [None] * world
            all_master = [None] * world
            dist.all_gather_object(all_replica, replica)
            dist.all_gather_object(all_master, master)
            ctx.grad_reduce(vid)
            full = build_schedule(plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=128, relay_mode="force")
            # every rank's copy of every rank's task lists, byte for byte, plus the runtime's digest
            h = hashlib.sha256()
            for op in ("multicast", "reduce"):
                for r in range(world):
                    h.update(full.tasks(op, r).tobytes())
                    h.update(full.refs(op, r).tobytes())
            digests = [None] * world
            dist.all_gather_object(digests, (ctx.schedule_for(plan).digest, full.digest, h.hexdigest()))
            assert len(set(digests)) == 1, f"schedules differ across ranks: {digests}"
            assert digests[0][0] == digests[0][1]  # the runtime's one-rank build has the full build's digest
            want = expected_master_grads(full, layout, plan, all_master, all_replica)
            for m in range(2):
                assert torch.equal(masters[layer][1][m], want[rank][m]), ("grad", rank, layer, m)
    ctx.close()
    left = [n for n in os.listdir("/dev/shm") if n.startswith(f"ultracomm-{os.getpid()}-")]
    assert not left, f"segments left in /dev/shm: {left}"
    print(f"rank {rank} OK (pid {os.getpid()})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
