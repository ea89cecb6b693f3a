"""The copy_engine transport: its stream commands run on simulated streams over host windows and
leave exactly the host executor's bytes; on a CPU machine it says why it is not available; on a
GPU (gpu marker) it matches the host executor on the one-GPU loopback domain."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.cuda_support import NotAvailableError
from ultracomm.records import Op
from ultracomm.transports.copy_engine_plan import multicast_commands, simulate
from ultracomm.transports.host import op_digest

from conftest import expert_weights, hot_slot_src, random_slot_src

LAYOUT = ExpertLayout((Member("fc1", (6, 17), torch.bfloat16), Member("fc2", (17, 3), torch.bfloat16)))


def host_contexts(world, epr, slots, mode, node_of=None):
    def body(group):
        ctx = Context(group, LAYOUT, epr, slots, num_layers=1, transport="host", window="local", relay_mode=mode,
                      node_of=node_of, chunk_bytes=128, tile_bytes=16, num_workers=2, timeout_s=30.0)
        per = [expert_weights(LAYOUT, e) for e in range(ctx.rank * epr, (ctx.rank + 1) * epr)]
        ctx.register_masters(0, [torch.stack([p[m] for p in per]).contiguous() for m in range(2)], None)
        return ctx

    domain = LoopbackDomain(world)
    ctxs = domain.run(body)
    return ctxs, lambda fn: domain.run(lambda g: fn(ctxs[g.rank]))  # fn on every rank, each in its thread


@pytest.mark.parametrize("world,mode,node_of", [(2, "off", None), (5, "force", None), (8, "auto", None),
                                                (4, "force", [0, 0, 1, 1])])
def test_commands_on_simulated_streams_match_the_host_executor(world, mode, node_of):
    epr, slots = 2, 3
    ctxs, each = host_contexts(world, epr, slots, mode, node_of)
    try:
        rng = np.random.default_rng(world)
        plans = [hot_slot_src(world, slots, epr, expert=1)] + [random_slot_src(rng, world, slots, epr, 0.9)
                                                                 for _ in range(3)]
        relayed = 0
        for i, src in enumerate(plans):
            plan = ReplicaPlan.make(src, experts_per_rank=epr)
            end = ctxs[0].wlayout["ready_off"]
            for c in ctxs:  # both executors start from empty slots (neither touches a slot the plan leaves empty)
                c.window.local[:end].zero_()
            vids = each(lambda c: c.begin(0))
            each(lambda c: c.weight_sync(vids[c.rank], plan))
            want = [c.window.local[:end].clone() for c in ctxs]
            sched = ctxs[0].schedule_for(plan)
            relayed += int(sched.stats("multicast")["depth"] >= 2)
            programs = []
            for c in ctxs:
                s = c.schedule_for(plan)
                programs.append(multicast_commands(
                    c.rank, c.wlayout, c.window.peer_bases, s.tasks(Op.MULTICAST, c.rank), s.refs(Op.MULTICAST, c.rank),
                    LAYOUT.weight_offsets, LAYOUT.weight_sizes, c._masters[0].weight_ptrs,
                    plan.local_index_of.tolist(), plan.slot_src[c.rank].tolist(), op_digest(s.digest, Op.MULTICAST)))
                c.window.local[:end].zero_()  # the slots the commands must fill again
            epoch = max(c._epoch for c in ctxs) + 1  # above every flag the host executor raised
            simulate(programs, epoch, seed=i)
            for c in ctxs:  # the next host operation runs above the simulated epoch
                c._epoch = epoch
            for r, c in enumerate(ctxs):
                assert torch.equal(c.window.local[:end], want[r]), f"plan {i} rank {r}: pools differ"
                wl = c.wlayout
                assert int(c.window.local[wl["ready_off"]:wl["ready_off"] + 8].view(torch.int64)) == epoch
            for c, v in zip(ctxs, vids):
                c.end(v)
        if mode == "force":
            assert relayed > 0
    finally:
        for c in ctxs:
            c.close()


def test_relay_without_its_arrival_wait_is_caught():
    """Drop a relay's arrival wait: on some stream order the relay forwards before its chunk came."""
    world, epr, slots = 5, 2, 3
    ctxs, each = host_contexts(world, epr, slots, "force")
    try:
        plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr)
        each(lambda c: c.weight_sync(c.begin(0), plan))
        end = ctxs[0].wlayout["ready_off"]
        want = [c.window.local[:end].clone() for c in ctxs]
        programs = []
        for c in ctxs:
            s = c.schedule_for(plan)
            cmds = multicast_commands(c.rank, c.wlayout, c.window.peer_bases, s.tasks(Op.MULTICAST, c.rank),
                                      s.refs(Op.MULTICAST, c.rank), LAYOUT.weight_offsets, LAYOUT.weight_sizes,
                                      c._masters[0].weight_ptrs, plan.local_index_of.tolist(),
                                      plan.slot_src[c.rank].tolist(), op_digest(s.digest, Op.MULTICAST))
            programs.append([x for x in cmds if not (x.kind == "wait" and "relay slot" in x.what)])
        differs = 0
        for seed in range(20):
            for c in ctxs:
                c.window.local[:end].zero_()
            simulate(programs, 10_000 + seed, seed=seed)
            differs += any(not torch.equal(c.window.local[:end], want[r]) for r, c in enumerate(ctxs))
        assert differs > 0
    finally:
        for c in ctxs:
            c.close()


def test_copy_engine_here_says_what_is_missing():
    from ultracomm import transports
    from ultracomm.cuda_support import torch_cuda_reason

    if torch_cuda_reason() is None:
        pytest.skip("this machine has a CUDA device")
    with pytest.raises(NotAvailableError, match=r"^ultracomm: transport 'copy_engine' is not available: ") as ei:
        transports.resolve_transport("copy_engine", "cuda")
    assert "CPU build" in str(ei.value) or "no CUDA device" in str(ei.value)
    import ultracomm.transports.copy_engine as ce  # the module imports without a GPU

    assert ce.CopyEngineTransport.window_providers == ("cuda_local", "torch_symm", "cuda_ipc", "nvshmem")


@pytest.mark.gpu
def test_copy_engine_matches_host_on_one_gpu_loopback():
    world, epr, slots = 4, 2, 3
    plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr)

    def run(transport, window, device):
        def body(group):
            with Context(group, LAYOUT, epr, slots, num_layers=1, transport=transport, window=window, device=device,
                         relay_mode="force", chunk_bytes=128, tile_bytes=16, timeout_s=30.0) as ctx:
                per = [expert_weights(LAYOUT, e) for e in range(ctx.rank * epr, (ctx.rank + 1) * epr)]
                w = [torch.stack([p[m] for p in per]).contiguous().to(ctx.window.device) for m in range(2)]
                g = [torch.full((epr, *m.shape), 0.5, device=ctx.window.device) for m in LAYOUT.members]
                ctx.register_masters(0, w, g)
                vid = ctx.begin(0)
                ctx.weight_sync(vid, plan)
                for m in range(2):
                    ctx.replica_grads[m].fill_(0.25 * (ctx.rank + 1))
                ctx.restore(vid)
                ctx.grad_reduce(vid)
                end = ctx.wlayout["ready_off"]
                return ctx.window.local[:end].cpu(), [x.cpu() for x in g]

        return LoopbackDomain(world).run(body)

    host = run("host", "local", None)
    ce = run("copy_engine", "cuda_local", "cuda")
    for r in range(world):
        assert torch.equal(host[r][0], ce[r][0]), f"rank {r}: pools differ"
        for a, b in zip(host[r][1], ce[r][1]):
            assert torch.equal(a, b), f"rank {r}: master grads differ"
