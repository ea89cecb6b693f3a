"""ReplicaManager on the CPU ``split`` transport with its default control plane (``planner="device"``:
loads, plan and the portable schedule builder run on the host, ``ultracomm.schedule_portable``):
every master gradient and every replica weight equals the ``host`` transport's, bit for bit, on
each route (issue 32 item 7: the portable schedule's stats had no ``inter_egress`` /
``inter_ingress``, which the split transport's route choice reads -- KeyError at the first step)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain
from ultracomm.records import Op
from ultracomm.schedule_portable import PortableSchedule, build_schedule_portable
from ultracomm.plan import ReplicaPlan

WORLD, EPR, K, LAYERS = 4, 2, 2, 2
ORDER = "F0 F1 B1 B0"  # two micro-batches in flight: the backward restores the slots before reducing


def train_rank(group, transport: str, route: str, node_of):
    """One rank's run: ``(master grads [layer][member], replica weights and experts per forward, runs)``;
    ``runs``: per transport op ``(op, route, crosses domains, schedule type)``."""
    from ultracomm.moe import ReplicaManager, linear

    opts = (
        dict(transport="split", domain="a,a,b,b", split_route=route) if transport == "split" else dict(transport="host")
    )
    mgr = ReplicaManager(
        group, mh.layout(), EPR, K, LAYERS, max_microbatches=2, node_of=node_of, window="local", timeout_s=30, **opts
    )  # planner: the default (device control plane)
    runs = []
    t = mgr.ctx.transport
    real_run = t.run

    def run(op, sched, *a, **k):
        if transport == "split":
            r = t.route(op, sched).route
            runs.append((int(op), r, r == "messages" or bool(t.program(op, sched).peers), type(sched).__name__))
        else:
            runs.append((int(op), "host", False, type(sched).__name__))
        return real_run(op, sched, *a, **k)

    t.run = run
    r = group.rank
    params = mh.make_params(r, EPR, LAYERS, torch.float32, "stacked", False, False)
    for layer in range(LAYERS):
        mgr.register_layer(layer, params[layer])
    replicas = []
    losses = {}
    for kind, mb in mh.parse_schedule(ORDER):
        if kind == "B":
            losses.pop(mb).backward()
            continue
        total = 0
        for layer in range(LAYERS):
            _, rmap, probs, _ = mh.batch(r, layer, mb, WORLD * EPR)
            step = mgr.step(layer, rmap, probs)
            reps = step.replica_weights()
            replicas.append((step.replicas(), [[w.detach().clone() for w in m] for m in reps]))
            loss = mh.rank_loss(step, r, WORLD, layer, mb, params[layer], reps, linear)
            total = total + step.guard(loss)
        losses[mb] = total
    grads = mh.master_grads(params, False)
    mgr.close()
    return grads, replicas, runs


def train(transport: str, route: str = "auto", node_of=None):
    return LoopbackDomain(WORLD).run(lambda g: train_rank(g, transport, route, node_of), timeout=240)


@pytest.mark.parametrize(
    "route,node_of", [("auto", None), ("split", None), ("split", [0, 0, 1, 1]), ("messages", [0, 0, 1, 1])]
)
def test_manager_on_split_with_the_default_planner_matches_the_host_transport(route, node_of):
    host = train("host", node_of=node_of)
    split = train("split", route, node_of)
    for r in range(WORLD):
        (hg, hrep, hruns), (sg, srep, sruns) = host[r], split[r]
        assert {x[3] for x in hruns} == {x[3] for x in sruns} == {"PortableSchedule"}  # the default control plane
        assert len(hruns) == len(sruns) > 0
        for layer in range(LAYERS):
            for m in range(2):
                assert torch.equal(hg[layer][m], sg[layer][m]), (r, layer, m)
        assert len(hrep) == len(srep) == 2 * LAYERS
        for i, ((he, hw), (se, sw)) in enumerate(zip(hrep, srep)):
            assert he == se, (r, i)
            for m in range(2):
                for s in range(K):
                    assert torch.equal(hw[m][s], sw[m][s]), (r, i, m, s)
                    if se[s] >= 0:  # the expert really arrived (not two transports agreeing on zeros)
                        want = mh.master_weights(se[s])[m]
                        assert torch.equal(sw[m][s], want), (r, i, m, s)
    mh.check_grads([g for g, _, _ in split], WORLD, EPR, LAYERS, mbs=2)
    # the named route ran (auto: what split_route picked, the same on every rank) and something crossed
    routes = [{x[1] for x in split[r][2]} for r in range(WORLD)]
    assert all(x == routes[0] for x in routes)
    if route != "auto":
        assert routes[0] <= {route, "split"}  # messages keeps a relay-tree reduction on split
        assert route in routes[0]
    assert any(x[2] for r in range(WORLD) for x in split[r][2])
    assert any(he >= 0 for r in range(WORLD) for he_list, _ in split[r][1] for he in he_list)


def test_portable_stats_count_the_cross_node_bytes_as_the_host_builder():
    """inter_egress / inter_ingress of the portable builder: the bytes of tree edges between nodes of
    ``node_of``, on the parent's side (egress for multicast, ingress for reduce) and the child's."""
    plan = ReplicaPlan.make(np.array([[-1, -1], [0, -1], [0, 1], [0, 1]], np.int32), experts_per_rank=1)
    wb, gb = 1000, 2000
    for node_of in (None, [0, 0, 1, 1], [0, 1, 0, 1]):
        sched = build_schedule_portable(plan, wb, gb, rank=0, node_of=node_of, chunk_bytes=256)
        assert isinstance(sched, PortableSchedule)
        for op, name, B in ((Op.MULTICAST, "multicast", wb), (Op.REDUCE, "reduce", gb)):
            st = sched.stats(name)
            pr, _, _ = sched.tree(op)
            want_par, want_child = [0] * 4, [0] * 4
            for child in range(4):
                for s in range(2):
                    p = int(pr[child, s])
                    if p >= 0 and node_of is not None and node_of[p] != node_of[child]:
                        want_par[p] += B
                        want_child[child] += B
            par, kid = ("inter_egress", "inter_ingress") if name == "multicast" else ("inter_ingress", "inter_egress")
            assert st[par] == want_par and st[kid] == want_child, (node_of, name, st)
            total, cross = ("egress", "inter_egress") if name == "multicast" else ("ingress", "inter_ingress")
            assert all(0 <= c <= t for c, t in zip(st[cross], st[total]))
            if node_of == [0, 0, 1, 1]:
                assert sum(st[cross]) > 0  # expert 0 (rank 0, node 0) reaches node 1
