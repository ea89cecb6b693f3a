"""The device-resident step on a GPU (issue 19; ``gpu`` marker: skipped without a device, run by
scripts/gpu_check.sh).  One-GPU loopback domains (cuda_local windows, every rank's CTAs in one
launch).

* A step's control plane captured ONCE in a CUDA graph -- the quota planner (plan_on_gpu), the
  schedule build into the vid's plan slot (ResidentPlan -> k_build_slot) and the operations that
  run from the slot (weight_sync, restore, grad_reduce) -- then replayed with three routings:
  each replay plans anew on the device, the planner's output equals its host build's, replica
  weights are exact and master grads bit-identical to the documented fp32 order of the portable
  schedule of that plan (expected_master_grads).
  The same calls run eagerly under ``torch.cuda.set_sync_debug_mode("error")`` first.
* ReplicaManager's training step (step, replica weights, a dense 2-layer toy MoE forward,
  backward with a restore) under ``set_sync_debug_mode("error")``: no host synchronisation, and
  master grads within 1e-5 of the float64 no-replication reference.  On ONE rank: a manager
  refuses a one-GPU loopback domain of more than one rank (its ranks' shares launch together, later than
  a rank's own compute; tests/moe/test_moe_manager.py checks the refusal), so on one GPU only a
  world of one exercises its device path end to end (replication itself is the first test's).
* The whole manager training step captured once and replayed with three routings, equal to eager
  execution bit for bit (world 1, as above)."""

from __future__ import annotations

import types

import numpy as np
import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain, ReplicaPlan
from ultracomm.planners import Domain
from ultracomm.planners import device as device_planner
from ultracomm.resident_plan import ResidentPlan
from ultracomm.schedule_portable import build_schedule_portable

from conftest import expected_master_grads
from test_gpu_context import bits, fresh_inputs, layout_of, make, need_tma  # noqa: F401 - fixture
from test_schedule_portable_context import AllRanks

pytestmark = pytest.mark.gpu


def zipf_loads(seed: int, world: int, experts: int, tokens: int = 512) -> np.ndarray:
    """int32 [world, E]: each rank's tokens per expert, a few hot experts that move with the seed."""
    rng = np.random.default_rng(seed)
    w = 1.0 / np.arange(1, experts + 1) ** 1.5
    w = w[rng.permutation(experts)]
    return np.stack([rng.multinomial(tokens, w / w.sum()) for _ in range(world)]).astype(np.int32)


def test_captured_control_plane_replays_three_routings():
    world, epr, slots = 4, 2, 2
    E = world * epr
    layout = layout_of(torch.float32)
    ctxs, regs = make(world, layout, epr, slots, "tma", relay_mode="auto")
    domain = Domain.flat(world, epr)
    dev = torch.device("cuda", 0)
    loads = torch.from_numpy(zipf_loads(0, world, E)).to(dev)
    bufs = [device_planner.plan_on_gpu(loads, domain, slots) for _ in ctxs]  # per rank, as real ranks

    def step(vids):
        for b in bufs:  # every rank plans from the same gathered loads: the same plan, no broadcast
            device_planner.plan_on_gpu(loads, domain, slots, out=b)
        for c, v, b in zip(ctxs, vids, bufs):
            c.weight_sync(v, ResidentPlan(b["slot_src"]))
        for c, v in zip(ctxs, vids):
            c.restore(v)
        for c, v in zip(ctxs, vids):
            c.grad_reduce(v)

    step([c.begin(0) for c in ctxs])  # eager: the vid slot's templates are written here, not in the capture
    for c in ctxs:
        c.synchronize()
    torch.cuda.set_sync_debug_mode("error")  # the control plane's calls, eager: no host synchronisation
    try:
        step([c.begin(0) for c in ctxs])
    finally:
        torch.cuda.set_sync_debug_mode(0)
    for c in ctxs:
        c.synchronize()
    graph = torch.cuda.CUDAGraph()
    vids = [c.begin(0) for c in ctxs]
    with torch.cuda.graph(graph):
        step(vids)

    cfg = ctxs[0].config
    plans = []
    for k, seed in enumerate((1, 2, 3)):
        host_loads = zipf_loads(seed, world, E)
        loads.copy_(torch.from_numpy(host_loads))
        master, replica = fresh_inputs(ctxs, regs, layout, epr, slots, k, seed=200 + k)
        res = device_planner.plan(host_loads.astype(np.int64), domain, slots)  # the planner's host build
        plan = ReplicaPlan.make(np.asarray(res.slot_src, np.int32), experts_per_rank=epr)
        plans.append(plan.slot_src.tolist())
        scheds = [
            build_schedule_portable(
                plan,
                layout.weight_bytes,
                layout.grad_bytes,
                rank=r,
                chunk_bytes=ctxs[0].wlayout["chunk_bytes"],
                max_depth=cfg.max_depth,
                intra_bw=cfg.intra_bw,
            )
            for r in range(world)
        ]
        want = expected_master_grads(AllRanks(scheds), layout, plan, master, replica)
        graph.replay()
        for c in ctxs:
            c.synchronize()
        for b in bufs:
            assert b["slot_src"].cpu().tolist() == plan.slot_src.tolist(), f"replay {k}: the device planner"
        for c in ctxs:
            for s, e in enumerate(plan.slot_src[c.rank].tolist()):
                for m, t in enumerate(c.replica_weights):
                    want_w = regs[e // epr][0][m][e % epr] if e >= 0 else torch.zeros_like(t[s])
                    assert torch.equal(t[s].cpu(), want_w.cpu()), f"replay {k} rank {c.rank} slot {s} member {m}"
            for m, g in enumerate(regs[c.rank][1]):
                assert torch.equal(bits(g), bits(want[c.rank][m])), f"replay {k} rank {c.rank} grads {m}"
    assert len({str(p) for p in plans}) == 3  # three routings, three plans
    for c in ctxs:
        c.close()


def dense_rank_loss(step, rank, world, epr, K, batches, masters, replicas):
    """rank_loss of moe_harness without indexing (every token through every instance hosted here,
    weighted by its rerouted prob, 0 where not routed): no host sync in the model either."""
    E = world * epr
    loss = torch.zeros((), device=masters[0].device)
    for s in range(world):
        x, rmap, probs, up = batches[s]
        _, cprobs = step.rerouted("echo", rmap, probs, source=s)
        for j in range(epr):
            y = mh.expert_fn(x, masters[0][j], masters[1][j], mh_linear())
            loss = loss + (y * cprobs[:, rank * epr + j, None] * up).sum()
        for k in range(K):
            y = mh.expert_fn(x, replicas[0][k], replicas[1][k], mh_linear())
            loss = loss + (y * cprobs[:, E + rank * K + k, None] * up).sum()
    return loss


def gpu_manager(group, epr, K, layers, main_grad=False, window="cuda_local"):
    """A ReplicaManager on the loopback domain's GPU (tma, cuda_local; or ``window='torch_symm'`` on
    the default process group) with the harness's masters of this rank on the device (with an fp32
    ``main_grad`` each if asked, as Megatron's); the caller sets mh.H / mh.I to multiples of 4 floats
    first (TMA: 16-byte rows)."""
    from ultracomm.moe import ReplicaManager

    dev = torch.device("cuda", 0)
    mgr = ReplicaManager(
        None if window == "torch_symm" else group,
        mh.layout(),
        epr,
        K,
        layers,
        transport="tma",
        window=window,
        device="cuda:0",
        timeout_s=20,
    )
    assert mgr.control_plane == "device"
    params = [
        [torch.nn.Parameter(p.detach().to(dev)) for p in layer]
        for layer in mh.make_params(group.rank, epr, layers, torch.float32, "stacked", False, False)
    ]
    for p in (p for layer_params in params for p in layer_params):
        if main_grad:
            p.main_grad = torch.zeros(p.shape, dtype=torch.float32, device=dev)
    for layer in range(layers):
        mgr.register_layer(layer, params[layer])
    return mgr, params


def mh_linear():
    from ultracomm.moe import linear

    return linear


@pytest.mark.parametrize("window", ["cuda_local", "torch_symm"])
def test_manager_training_step_makes_no_host_sync(monkeypatch, tmp_path, window):
    """``torch_symm``: window='auto''s choice on a process group (here a gloo group of one); its load
    board is a torch_symm window as well, and the control plane stays on the device."""
    # the harness's model with every expert member a multiple of 16 bytes (TMA bulk copies)
    monkeypatch.setattr(mh, "H", 8)
    monkeypatch.setattr(mh, "I", 4)

    world, epr, K, layers, T = 1, 4, 2, 2, 16
    E = world * epr
    dev = torch.device("cuda", 0)

    def setup(group):
        mgr, params = gpu_manager(group, epr, K, layers, window=window)
        batches = [
            [tuple(t.to(dev) for t in mh.batch(s, layer, 0, E, T)) for s in range(world)] for layer in range(layers)
        ]
        return mgr, params, batches

    if window == "cuda_local":
        run = LoopbackDomain(world).run
    else:
        import torch.distributed as dist
        from ultracomm.windows.torch_symm import _symm_module

        if _symm_module() is None:
            pytest.skip(f"torch {torch.__version__} has no torch.distributed._symmetric_memory")
        dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)

        def run(fn):  # the process group's one rank
            return [fn(types.SimpleNamespace(rank=0))]

    try:
        _no_sync_training_step(run, setup, world, epr, K, layers, T, dev)
    finally:
        if window == "torch_symm":
            torch.distributed.destroy_process_group()


def _no_sync_training_step(run, setup, world, epr, K, layers, T, dev):
    state = run(setup)

    def train_step(group):
        mgr, params, batches = state[group.rank]
        for layer_params in params:
            for p in layer_params:
                p.grad = None
        total = torch.zeros((), device=dev)
        for layer in range(layers):
            _, rmap, probs, _ = batches[layer][group.rank]
            step = mgr.step(layer, rmap, probs)
            loss = dense_rank_loss(
                step, group.rank, world, epr, K, batches[layer], params[layer], step.replica_weights()
            )
            total = total + step.guard(loss)
        total.backward()
        return None

    run(train_step)  # warm-up: the vid slots' buffers and templates
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run(train_step)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    torch.cuda.synchronize()
    ref = mh.reference_grads(world, epr, layers, 1, tokens=T)
    for r, (mgr, params, _) in enumerate(state):
        mh.check_rank_grads([[p.grad.cpu() for p in layer] for layer in params], r, ref, epr, layers)
        mgr.ctx.synchronize()  # and no failure was recorded
    for mgr, _, _ in state:
        mgr.close()


def test_manager_training_step_captured_once_replays_three_routings(monkeypatch):
    """The whole training step through ReplicaManager -- loads' exchange, plan, schedule build,
    weight_sync, the dense toy MoE forward, backward with its restore and reduction into
    main_grad -- captured ONCE in a CUDA graph and replayed with three routings written into the
    captured input tensors: each replay's master grads equal an eager step's on that routing bit for
    bit.  World 1 (see the module docstring): the control plane runs entire, no replica is placed."""

    monkeypatch.setattr(mh, "H", 8)
    monkeypatch.setattr(mh, "I", 4)
    world, epr, K, layers, T = 1, 4, 2, 2, 16
    E = world * epr
    dev = torch.device("cuda", 0)

    ((mgr, params),) = LoopbackDomain(world).run(lambda g: gpu_manager(g, epr, K, layers, main_grad=True))
    static = [[t.to(dev) for t in mh.batch(0, layer, 0, E, T)] for layer in range(layers)]  # x, rmap, probs, up

    def route(seed):  # a new routing, written into the tensors the graph reads
        for layer in range(layers):
            _, rmap, probs, _ = mh.batch(0, layer, seed, E, T)
            static[layer][1].copy_(rmap)
            static[layer][2].copy_(probs)

    def zero(eager=True):
        for layer_params in params:
            for p in layer_params:
                p.main_grad.zero_()
                if eager:  # a replay writes the .grad tensors its capture allocated: keep them
                    p.grad = None

    def train_step():
        total = torch.zeros((), device=dev)
        for layer in range(layers):
            x, rmap, probs, up = static[layer]
            step = mgr.step(layer, rmap, probs)
            loss = dense_rank_loss(
                step, 0, world, epr, K, [(x, rmap, probs, up)], params[layer], step.replica_weights()
            )
            total = total + step.guard(loss)
        total.backward()
        # as Megatron's DDP hook: a parameter's autograd .grad (the experts here run on views of the
        # stacked parameters, which carry no main_grad) is added into its main_grad
        for layer_params in params:
            for p in layer_params:
                if p.grad is not None and not getattr(p, "grad_added_to_main_grad", False):
                    p.main_grad.add_(p.grad)

    def grads():
        return [[p.main_grad.clone() for p in layer_params] for layer_params in params]

    seeds = (1, 2, 3)
    want = []
    for seed in seeds:  # eager: the references, and the warm-up (vid slots' buffers, templates)
        route(seed)
        zero()
        train_step()
        torch.cuda.synchronize()
        want.append(grads())
    assert any(not torch.equal(a, b) for a, b in zip(want[0][0], want[1][0])), (
        f"the routings give equal grads: {[float(a.abs().sum()) for a in want[0][0]]}"
    )  # the routings differ
    route(seeds[0])
    zero()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        train_step()
    for k, seed in enumerate(seeds):
        route(seed)
        zero(eager=False)
        graph.replay()
        torch.cuda.synchronize()
        for layer, (got_l, want_l) in enumerate(zip(grads(), want[k])):
            for m, (g, w) in enumerate(zip(got_l, want_l)):
                assert torch.equal(bits(g), bits(w)), f"replay {k} layer {layer} member {m}"
    mgr.ctx.synchronize()
    mgr.close()
