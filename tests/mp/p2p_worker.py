"""torchrun worker: the p2p transport over gloo against the host executor, byte for byte.

Run as ``torchrun --nproc-per-node N tests/mp/p2p_worker.py``.  ``P2P_NODE_OF`` (comma list, optional)
sets the node layout; ``P2P_TRANSPORT=split`` checks the split transport instead of p2p, over the memory
domains that ``ULTRACOMM_DOMAIN`` declares for the whole group (the pair groups then declare ``a,b``); ``P2P_PAIRS=1`` then repeats the checks on the groups {0, 1}, {2, 3}, ... (group
ranks that are not global ranks).  Each rank builds two Contexts on the same group -- ``transport="p2p"``
(private pool, gloo messages) and ``transport="host"`` (host_shm window) -- runs the same
weight_sync / restore (async) / grad_reduce sequence for a hot-expert plan and random plans under
every relay mode, and compares the pools (weights and grads, relays' partials included) and the
master grads bit for bit.  Prints ``rank R OK <n> checks <m> relayed`` (and ``rank R pair OK``); exits non-zero on the first
difference.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from conftest import expert_weights, hot_slot_src, random_slot_src  # noqa: E402

from ultracomm import Context, ExpertLayout, Member, ReplicaPlan  # noqa: E402


def check_group(group, node_of, transport: str = "p2p", domain: str | None = None) -> tuple[int, int]:
    """Every relay mode and plan on ``group`` with ``transport`` against host; ``domain``: the declaration
    for the transport's Context (``None``: ULTRACOMM_DOMAIN); returns (checks, plans that relayed)."""
    rank, world = dist.get_rank(group), dist.get_world_size(group)
    extra = {} if domain is None else {"domain": domain}
    epr, slots = 2, 3
    checks = relayed = 0
    for mode, grad_dtype in (("force", torch.bfloat16), ("auto", torch.float32), ("off", torch.float32)):
        layout = ExpertLayout(
            (Member("fc1", (6, 17), torch.bfloat16), Member("fc2", (17, 3), torch.bfloat16)), grad_dtype=grad_dtype
        )
        kw = dict(num_layers=1, relay_mode=mode, node_of=node_of, chunk_bytes=128, tile_bytes=16, timeout_s=60.0)
        ctxs = {
            "p2p": Context(group, layout, epr, slots, transport=transport, **kw, **extra),
            "host": Context(group, layout, epr, slots, transport="host", window="host_shm", domain="", **kw),
        }
        assert ctxs["p2p"].transport.name == transport
        # the host executor's schedules (chunk, relay mode), not the p2p cost model's choice: this
        # compares the executors byte for byte (tests/control/test_alpha_beta.py tests the choice)
        ctxs["p2p"].transport.message_costs = None
        assert ctxs["p2p"].window.provider == ("private" if transport == "p2p" else "host_shm")
        if transport == "split":  # host_shm maps only this rank's domain; the others are reached by messages
            dom = ctxs["p2p"].domain_of
            assert [b != 0 for b in ctxs["p2p"].window.peer_bases] == [d == dom[rank] for d in dom], dom
        masters = {}
        for name, ctx in ctxs.items():
            per = [expert_weights(layout, e) for e in range(rank * epr, (rank + 1) * epr)]
            w = [torch.stack([p[m] for p in per]).contiguous() for m in range(2)]
            g = [torch.zeros((epr, *m.shape), dtype=grad_dtype) for m in layout.members]
            ctx.register_masters(0, w, g)
            masters[name] = g
        rng = np.random.default_rng(11)
        plans = [hot_slot_src(world, slots, epr, expert=1)] + [
            random_slot_src(rng, world, slots, epr, 0.9) for _ in range(2)
        ]
        for i, src in enumerate(plans):
            plan = ReplicaPlan.make(src, experts_per_rank=epr)
            relayed += int(ctxs["p2p"].schedule_for(plan).stats("multicast")["depth"] >= 2)
            pools = {}
            for name, ctx in ctxs.items():
                vid = ctx.begin(0)
                ctx.weight_sync(vid, plan)
                end = ctx.wlayout["ready_off"]
                after_sync = ctx.window.local[:end].clone()
                for t in ctx.replica_weights:
                    t.zero_()
                ctx.restore(vid, async_op=True).wait()
                after_restore = ctx.window.local[:end].clone()  # empty slots keep their zeros now
                gen = torch.Generator().manual_seed(1000 * i + rank)
                for m in range(2):
                    ctx.replica_grads[m].copy_(torch.randn(ctx.replica_grads[m].shape, generator=gen))
                    masters[name][m].copy_(torch.randn(masters[name][m].shape, generator=gen))
                ctx.grad_reduce(vid)
                pools[name] = (
                    after_sync,
                    after_restore,
                    ctx.window.local[:end].clone(),
                    [x.clone() for x in masters[name]],
                )
            for s, e in enumerate(plan.slot_src[rank].tolist()):  # the experts arrived (not zeros on both)
                if e >= 0:
                    for m, want in enumerate(expert_weights(layout, e)):
                        assert torch.equal(ctxs["p2p"].replica_weights[m][s], want), (mode, i, s, m)
            (hw, hr, hg, hm), (pw, pr, pg, pm) = pools["host"], pools["p2p"]
            assert torch.equal(hw, pw), f"rank {rank} {mode} plan {i}: multicast pools differ"
            assert torch.equal(hr, pr), f"rank {rank} {mode} plan {i}: pools after restore differ"
            assert torch.equal(hg, pg), f"rank {rank} {mode} plan {i}: grad pools (relay partials) differ"
            for m in range(2):
                assert torch.equal(hm[m].view(torch.uint8), pm[m].view(torch.uint8)), (
                    f"rank {rank} {mode} plan {i}: master grads of member {m} differ"
                )
            checks += 1
        for ctx in ctxs.values():
            ctx.close()
    return checks, relayed


def say(line: str) -> None:
    """One write per line: the launcher merges every rank's stdout into one pipe."""
    sys.stdout.write(line + "\n")
    sys.stdout.flush()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    node_of = [int(x) for x in os.environ["P2P_NODE_OF"].split(",")] if os.environ.get("P2P_NODE_OF") else None
    transport = os.environ.get("P2P_TRANSPORT", "p2p")
    checks, relayed = check_group(None, node_of, transport)
    say(f"rank {rank} OK {checks} checks {relayed} relayed")
    if os.environ.get("P2P_PAIRS"):  # also every pair of ranks (2r, 2r+1) as its own group: group ranks differ
        pairs = [dist.new_group([2 * k, 2 * k + 1]) for k in range(world // 2)]
        checks, _ = check_group(pairs[rank // 2], None, transport, "a,b" if transport == "split" else None)
        say(f"rank {rank} pair OK {checks} checks")
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
