"""The portable schedule builder (include/ultracomm/impl/sched_build.h via _core.build_schedule_portable):
valid trees (topology rule included), task lists in the host builder's format (field-equal to
lists derived from its own trees by reference.tasks_from_trees, refs shared across chunks), identical trees and digests on
every rank, execution on the host executor (exact bytes for multicast, the documented fp32 order
for reduce), tree quality against the bytes lower bound, and bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ultracomm.records import MASTER, Op, TaskKind
from ultracomm.tools.reference import reference_reduce_tree, tasks_from_trees
from ultracomm.schedule_portable import build_schedule_portable

from test_schedule import hot_plan, make_plan, random_plan

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def random_problem(seed, world, slots, epr, nodes):
    """(plan, node_of, weight bytes, grad bytes) of a random problem: a plan 90% filled, ``nodes``
    nodes of consecutive ranks (0: none), member sizes in whole 16-byte units (weights may be 0)."""
    rng = np.random.default_rng(seed)
    plan = random_plan(rng, world, slots, world * epr, fill=0.9)
    node_of = None if nodes == 0 else (np.arange(world) * min(nodes, world) // world).astype(np.int32)
    return plan, node_of, int(rng.integers(0, 200)) * 16, int(rng.integers(1, 200)) * 16


def build_all(plan, wb, gb, **kw):
    return [build_schedule_portable(plan, wb, gb, rank=r, **kw) for r in range(plan.world)]


def children_of(plan, sched, op):
    """{(expert, home, {node: [children by (rank, slot)]})} of one op's tree (tasks_from_trees' input)."""
    pr, ps, _ = sched.tree(op)
    kids: dict = {}
    for r in range(plan.world):
        for s in range(plan.slots_per_rank):
            if pr[r, s] >= 0:
                e = int(plan.slot_src[r, s])
                kids.setdefault(e, {}).setdefault((int(pr[r, s]), int(ps[r, s])), []).append((r, s))
    return [(e, int(plan.home_of[e]), {n: sorted(c) for n, c in ch.items()}) for e, ch in sorted(kids.items())]


def expand(tasks, refs):
    """Every field of every task, its ref range replaced by the refs it names."""
    out = []
    for t in tasks:
        b, n = int(t["ref_begin"]), int(t["ref_count"])
        row = tuple(int(t[k]) for k in t.dtype.names if k not in ("ref_begin", "ref_count"))
        out.append((row, refs[b : b + n].tobytes()))
    return out


def check(plan, scheds, wb, gb, chunk, node_of=None, max_depth=8):
    """Everything a schedule must satisfy, over the per-rank builds of one plan."""
    W, S = plan.world, plan.slots_per_rank
    src, home = plan.slot_src, plan.home_of
    s0 = scheds[0]
    # every rank: the same trees and digest
    for s in scheds[1:]:
        assert s.digest == s0.digest
        for op in (Op.MULTICAST, Op.REDUCE):
            for a, b in zip(s.tree(op), s0.tree(op)):
                assert np.array_equal(a, b)
    for op, nbytes in ((Op.MULTICAST, wb), (Op.REDUCE, gb)):
        pr, ps, depth = s0.tree(op)
        for r in range(W):
            for s in range(S):
                e = int(src[r, s])
                if e < 0:
                    assert pr[r, s] == -1 and depth[r, s] == 0
                    continue
                p, q = int(pr[r, s]), int(ps[r, s])
                if q == MASTER:
                    assert p == home[e] and depth[r, s] == 1
                else:
                    assert src[p, q] == e and depth[r, s] == depth[p, q] + 1
                assert 1 <= depth[r, s] <= max_depth
        if node_of is not None and max_depth >= 2:  # each expert enters a remote node once, from the home's node
            cross: dict = {}
            for r in range(W):
                for s in range(S):
                    e = int(src[r, s])
                    if e >= 0 and node_of[pr[r, s]] != node_of[r]:
                        assert node_of[pr[r, s]] == node_of[home[e]]
                        cross[(e, node_of[r])] = cross.get((e, node_of[r]), 0) + 1
            assert all(v == 1 for v in cross.values()), cross
        # task lists: exactly the records derived from the tree in the host builder's format
        kind = TaskKind.COPY if op == Op.MULTICAST else TaskKind.REDUCE
        want_t, want_r = tasks_from_trees(W, children_of(plan, s0, op), nbytes, chunk, kind)
        for r, s in enumerate(scheds):
            got_t, got_r = s.tasks(op, r), s.refs(op, r)
            assert expand(got_t, got_r) == expand(want_t[r], want_r[r]), (op, r)
            # as the host builder: a sender's refs are stored once, shared by its chunks' tasks
            assert len(got_r) == sum(int(t["ref_count"]) for t in got_t if t["chunk"] == 0)
            keys = [(int(t["chunk"]), int(t["level"]), int(t["expert"]), int(t["self_slot"])) for t in got_t]
            assert keys == sorted(keys)


@SETTINGS
@given(
    seed=st.integers(0, 10**6),
    world=st.integers(2, 64),
    slots=st.integers(1, 4),
    epr=st.integers(1, 3),
    nodes=st.sampled_from([0, 2, 4]),
    chunk=st.sampled_from([16, 64, 4096]),
    max_depth=st.sampled_from([1, 2, 8]),
)
def test_random_plans_valid_identical_on_every_rank(seed, world, slots, epr, nodes, chunk, max_depth):
    plan, node_of, wb, gb = random_problem(seed, world, slots, epr, nodes)
    scheds = build_all(plan, wb, gb, node_of=node_of, chunk_bytes=chunk, max_depth=max_depth)
    check(plan, scheds, wb, gb, chunk, node_of, max_depth)


def test_hot_expert_relays_within_depth():
    plan = hot_plan(64, 60)
    scheds = build_all(plan, 1 << 20, 1 << 20, chunk_bytes=1 << 16, max_depth=4)
    check(plan, scheds, 1 << 20, 1 << 20, 1 << 16, max_depth=4)
    st_ = scheds[0].stats("multicast")
    assert st_["relayed"] and st_["depth"] <= 4
    assert st_["max_egress"] < 60 * (1 << 20)  # not the direct tree's hot home


def test_digest_depends_on_plan_and_builder():
    plan = hot_plan(8, 6)
    a = build_schedule_portable(plan, 4096, 4096, rank=0)
    b = build_schedule_portable(plan, 4096, 8192, rank=3)
    src = plan.slot_src.copy()
    src[6, 0] = -1
    c = build_schedule_portable(make_plan(src, plan.home_of), 4096, 4096, rank=0)
    assert len({a.digest, b.digest, c.digest}) == 3
    from ultracomm.schedule import build_schedule

    assert build_schedule(plan, 4096, 4096).digest != a.digest


# ---------------------------------------------------------------------------- execution


def run_plan(plan, scheds, wb_members, chunk, seed):
    from test_host_executor import Cluster, check_multicast, ok

    W, S = plan.world, plan.slots_per_rank
    cl = Cluster(
        W, S, wb_members, chunk=chunk, num_experts=plan.num_experts, home_of=[int(h) for h in plan.home_of], seed=seed
    )
    my = [[int(x) for x in plan.slot_src[r]] for r in range(W)]
    tasks = lambda op: [s.tasks(op, r) for r, s in enumerate(scheds)]  # noqa: E731
    refs = lambda op: [s.refs(op, r) for r, s in enumerate(scheds)]  # noqa: E731
    ok(cl.run(Op.MULTICAST, tasks(Op.MULTICAST), refs(Op.MULTICAST), my, num_workers=2))
    check_multicast(cl, my)
    # reduce: the documented order, from the tree, bit for bit
    init, master_init = cl.random_replica_grads(my, seed + 1)
    ok(cl.run(Op.REDUCE, tasks(Op.REDUCE), refs(Op.REDUCE), my, num_workers=2))
    assert len(cl.g_off) == 1 and cl.g_off[0] == 0
    n = cl.g_bytes[0] // 4
    grads = {
        (r, s): init[r][s][: n * 4].view(torch.float32).numpy() for r in range(W) for s in range(S) if my[r][s] >= 0
    }
    master = {e: master_init[e][0].numpy() for e in master_init}
    ref = reference_reduce_tree(scheds[0], grads, master)
    for e, want in ref.items():
        assert cl.master_grads[e][0].numpy().tobytes() == want.tobytes(), e
    for e in range(plan.num_experts):
        if e not in ref:
            assert torch.equal(cl.master_grads[e][0], master_init[e][0])


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    world=st.integers(2, 64),
    slots=st.integers(1, 4),
    nodes=st.sampled_from([0, 2, 4]),
    max_depth=st.sampled_from([2, 8]),
)
def test_random_plans_run_on_host_executor(seed, world, slots, nodes, max_depth):
    rng = np.random.default_rng(seed)
    plan = random_plan(rng, world, slots, world, fill=0.9)
    node_of = None if nodes == 0 else (np.arange(world) * min(nodes, world) // world).astype(np.int32)
    nbytes, chunk = 1000, 256  # 4 chunks, the last one short
    scheds = build_all(plan, 1008, 1008, node_of=node_of, chunk_bytes=chunk, max_depth=max_depth)
    run_plan(plan, scheds, [nbytes], chunk, seed)


def test_hot_plan_runs_on_host_executor():
    plan = hot_plan(16, 15)
    scheds = build_all(plan, 1008, 1008, chunk_bytes=128, max_depth=3, intra_latency_s=0.0)
    assert scheds[0].stats("reduce")["relayed"]
    run_plan(plan, scheds, [1000], 128, 7)


# ---------------------------------------------------------------------------- bad input


@pytest.mark.parametrize(
    "over, msg",
    [
        (dict(chunk_bytes=24), "multiple of 16"),
        (dict(rank=8), r"rank in \[0, world\)"),
        (dict(max_depth=0), "max_depth"),
        (dict(node_of=np.full(8, 9, np.int32)), "node_of"),
        (dict(node_of=np.zeros(3, np.int32)), r"node_of must be int32 \[world\]"),
    ],
)
def test_bad_input(over, msg):
    plan = hot_plan(8, 6)
    kw = dict(rank=0)
    kw.update(over)
    with pytest.raises(ValueError, match=msg):
        build_schedule_portable(plan, 4096, 4096, **kw)


def test_bad_plan():
    src = np.full((4, 2), -1, np.int32)
    src[0, 0] = 0  # expert 0's replica on its home rank 0
    with pytest.raises(ValueError, match="replica on its home rank"):
        build_schedule_portable(make_plan(src, np.arange(4)), 64, 64, rank=0)
    src[0, 0], src[1, 0], src[1, 1] = -1, 2, 2
    with pytest.raises(ValueError, match="twice on a rank"):
        build_schedule_portable(make_plan(src, np.arange(4)), 64, 64, rank=0)
    with pytest.raises(ValueError, match="capacity"):
        build_schedule_portable(make_plan(np.full((2000, 1), -1), np.arange(2000)), 64, 64, rank=0)


# ---------------------------------------------------------------------------- tree quality


def _eval_cases():
    """The planners' evaluation plans (planners/eval.py: TAOT EP16/EP32 on 2/4 nodes, UltraEP EP64
    on one node), planned by the device planner."""
    from ultracomm import scenarios as workloads
    from ultracomm.planners import Domain, get_planner
    from ultracomm.tools import planner_eval as ev

    out = []
    for label, nodes, gpn, mname, _ in ev.TAOT_CASES:
        model = workloads.get_model(mname)
        W = nodes * gpn
        dom = Domain.nodes(nodes, gpn, model.experts_per_rank(W))
        for imb in ev.IMBALANCES:
            load = workloads.zipf_load(
                W, model.num_experts, ev.TOKENS_PER_RANK, model.top_k, 1.0 + imb, seed=int(imb * 100) + W
            )
            out.append((f"{label} {imb}", get_planner("device")(load, dom, ev.K).plan, dom.node_of, model))
    label, W, mname, _ = ev.EP64
    model = workloads.get_model(mname)
    dom = Domain.flat(W, model.experts_per_rank(W))
    E = model.num_experts
    loads = [workloads.zipf_load(W, E, ev.TOKENS_PER_RANK, model.top_k, t, seed=1) for t in ev.ZIPF_TARGETS]
    loads += [workloads.rank_blocked_load(W, E, ev.TOKENS_PER_RANK, model.top_k, t, seed=1) for t in ev.BLOCKED_TARGETS]
    loads += [workloads.hot_rank_load(W, E, ev.TOKENS_PER_RANK, model.top_k, f, seed=1) for f in ev.HOT_FRACTIONS]
    for i, load in enumerate(loads):
        out.append((f"EP64 {i}", get_planner("device")(load, dom, ev.K).plan, None, model))
    return out


def test_quality_on_eval_plans():
    """One node (EP64): max link bytes within 1.05x of the bytes lower bound on every plan.  Several
    nodes (EP16/EP32), where the topology rule can make the bound unreachable: never above the host
    builder's ratio (measured: 7 of 10 at 1.0, the rest 1.5, host 1.0-2.0)."""
    from ultracomm.schedule import build_schedule

    for name, plan, node_of, model in _eval_cases():
        wb, gb = model.expert_weight_bytes(), model.expert_grad_bytes()
        p = build_schedule_portable(plan, wb, gb, rank=0, node_of=node_of)
        h = build_schedule(plan, wb, gb, node_of=node_of)
        for op in ("multicast", "reduce"):
            ps, hs = p.stats(op), h.stats(op)
            assert ps["lower_bound_bytes"] == hs["lower_bound_bytes"], name
            if node_of is None:
                assert ps["ratio"] <= 1.05, (name, op, ps["ratio"])
            else:
                assert ps["max_link_bytes"] <= hs["max_link_bytes"], (name, op, ps["ratio"])


# ---------------------------------------------------------------------------- CUDA build


def test_kernel_compiles_without_local_memory():
    """csrc/cuda/k_build.cu (the builder under nvcc) for every listed architecture: warnings as
    errors (the build flags), no stack frame, spills or local memory (ptxas -v), and no local
    loads/stores in its SASS."""
    import re

    import cuda_build as cb

    if cb.find_nvcc() is None:
        pytest.skip("nvcc not found (CUDA compile checks need it)")
    c = cb.compile_all()["k_build"]
    assert "warning" not in c.log.lower(), c.log
    for kernel in ("k_build_schedule", "k_build_slot"):  # the builder, and the device step's build into a slot
        found = {a for a, f in cb.ptxas_functions(c.log) if kernel in f}
        assert found == {f"sm_{a}" for a in cb.real_archs()}, (kernel, found)
    funcs = {k: v for k, v in cb.ptxas_functions(c.log).items() if "k_build_" in k[1]}
    for key, props in funcs.items():
        assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in props, (key, props)
    if cb.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    for arch in cb.real_archs():
        text = cb.sass(c, arch)
        assert "k_build_schedule" in text and "k_build_slot" in text
        assert not re.search(r"\b(LDL|STL)\b", text), f"local memory in sm_{arch} SASS"
