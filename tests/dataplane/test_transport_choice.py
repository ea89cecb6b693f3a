"""transport="auto": host / tma inside one memory domain, p2p across domains; mixed domains say what
a split would do; ULTRACOMM_TRANSPORT overrides; the choice is logged once per Context."""

from __future__ import annotations

import logging
import threading

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.dataplane import domains
from ultracomm.env import Config
from ultracomm.schedule import build_schedule

from conftest import hot_slot_src


@pytest.mark.parametrize(
    "device_type,keys,transport,split",
    [
        ("cpu", ["a"] * 4, "host", False),
        ("cuda", ["a"] * 4, "tma", False),
        ("cpu", ["a", "b", "c"], "p2p", False),
        ("cuda", ["a", "b"], "p2p", False),
        ("cpu", ["a", "a", "b", "b"], "split", True),
        ("cuda", ["a", "a", "a", "b"], "split", True),
    ],
)
def test_choice_by_domains(device_type, keys, transport, split):
    c = domains.choose_transport(device_type, keys)
    assert c.transport == transport
    assert c.domain_of == domains.domain_of(keys)
    assert (c.split is not None) == split
    assert c.window is None
    if split:
        sizes = np.bincount(c.domain_of).tolist()
        memory = "GPU peer-access" if device_type == "cuda" else "shared-memory"
        if device_type == "cuda":
            assert c.edge_transport == {"intra": "tma", "cross": "p2p"}
            assert c.split == (
                "edges inside a domain run on tma (the persistent kernel over cuda_ipc windows) and "
                "edges across domains on p2p (NCCL on a side stream, through device shadows)"
            )
        else:
            assert c.edge_transport == {"intra": "host", "cross": "p2p"}
            assert c.split == (
                "edges inside a domain run on host (shared-memory windows) and edges across domains "
                "on p2p (gloo messages through shadow windows and a bridge)"
            )
        assert c.describe() == (
            f"transport auto -> {transport}: the ranks span {len(sizes)} {memory} domains of {sizes} ranks; {c.split}"
        )


def test_one_cuda_domain_over_hosts_takes_nvshmem():
    c = domains.choose_transport("cuda", ["nvlink:ab/7"] * 4, ["h1/x", "h1/x", "h2/y", "h2/y"])
    assert (c.transport, c.window) == ("tma", "nvshmem")
    assert c.describe() == (
        "transport auto -> tma: all 4 ranks share one GPU peer-access domain over 2 hosts "
        "(multi-node NVLink): window nvshmem, since CUDA IPC handles do not reach across hosts"
    )
    assert domains.choose_transport("cuda", ["h1/x"] * 2, ["h1/x"] * 2).window is None


def test_mixed_cuda_domains_split_unless_a_domain_spans_hosts():
    # two NVLink domains of one host each, and a single rank: split (tma inside, NCCL across)
    c = domains.choose_transport(
        "cuda", ["h1/x", "h1/x", "h2/y", "h2/y", "h3/z"], ["h1/x", "h1/x", "h2/y", "h2/y", "h3/z"]
    )
    assert (c.transport, c.domain_of, c.window) == ("split", (0, 0, 1, 1, 2), None)
    # a multi-node NVLink domain beside another: its window would be nvshmem, which the split does not map
    c = domains.choose_transport("cuda", ["nvlink:ab/7"] * 2 + ["h3/z"] * 2, ["h1/x", "h2/y", "h3/z", "h3/z"])
    assert (c.transport, c.edge_transport) == ("p2p", {"intra": "p2p", "cross": "p2p"})
    assert c.split == (
        "domains [0] span several hosts (multi-node NVLink), and the GPU split maps a domain with "
        "cuda_ipc, which does not reach across hosts: every edge runs on p2p (same results)"
    )
    assert c.edges(
        build_schedule(
            ReplicaPlan.make(hot_slot_src(4, 1, 1, expert=0), experts_per_rank=1), 1024, 2048, chunk_bytes=256
        )
    )["multicast"] == {"p2p": 3}


def test_domain_of_numbers_by_first_appearance():
    assert domains.domain_of(["x", "y", "x", "z", "y"]) == (0, 1, 0, 2, 1)
    key = domains.host_key()
    assert key.count("/") >= 1 and key.split("/")[0]


def test_split_edges_counts_the_tree_edges_across_domains():
    world, epr, slots = 4, 1, 1
    plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=0), experts_per_rank=epr)  # expert 0 -> 1, 2, 3
    sched = build_schedule(plan, 1024, 2048, node_of=[0, 0, 1, 1], chunk_bytes=256, relay_mode="auto")
    got = domains.split_edges(sched, [0, 0, 1, 1])
    for op in ("multicast", "reduce"):
        pr = np.asarray(sched.tree(op)[0])
        cross = sum(1 for r in (1, 2, 3) if [0, 0, 1, 1][int(pr[r, 0])] != [0, 0, 1, 1][r])
        assert got[op] == {"intra": 3 - cross, "cross": cross}
        assert got[op]["cross"] >= 1  # node 1 is fed across the domain boundary at least once
    assert domains.split_edges(sched, [0, 0, 0, 0]) == {
        "multicast": {"intra": 3, "cross": 0},
        "reduce": {"intra": 3, "cross": 0},
    }


def _layout() -> ExpertLayout:
    return ExpertLayout((Member("w", (8, 4), torch.float32),))


def test_loopback_auto_is_host_and_logged_once(caplog):
    def body(group):
        with Context(group, _layout(), 1, 1, num_layers=1, timeout_s=30.0, log_level="info") as ctx:
            return ctx.transport.name, ctx.transport_choice

    with caplog.at_level(logging.INFO, logger="ultracomm"):
        res = LoopbackDomain(2).run(body)
    assert [r[0] for r in res] == ["host", "host"]
    assert res[0][1].transport == "host" and res[0][1].domain_of == (0, 0)
    lines = [r.getMessage() for r in caplog.records if "transport auto ->" in r.getMessage()]
    assert sorted(lines) == [
        f"ultracomm: rank {r}: transport auto -> host: all 2 ranks share one shared-memory domain (host)"
        for r in (0, 1)
    ]


def test_env_override_takes_the_transport_as_given(monkeypatch):
    monkeypatch.setenv("ULTRACOMM_TRANSPORT", "p2p")

    def body(group):
        with Context(group, _layout(), 1, 1, num_layers=1, config=Config.from_env(), timeout_s=30.0) as ctx:
            return ctx.transport.name, ctx.window.provider, ctx.transport_choice

    assert LoopbackDomain(2).run(body) == [("p2p", "private", None)] * 2


def test_auto_over_hosts_picks_split(monkeypatch):
    """Ranks that report different hosts (a loopback domain standing in for two machines) get the split
    transport, and moving bytes still works."""
    world, epr, slots = 4, 1, 1
    keys = ["host-a/1", "host-a/1", "host-b/2", "host-b/2"]
    plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=0), experts_per_rank=epr)

    # every rank is a thread "loopback-rank<r>": the stand-in host key follows the calling thread
    monkeypatch.setattr(domains, "host_key", lambda: keys[int(threading.current_thread().name.rsplit("rank", 1)[1])])

    def body(group):
        with Context(
            group,
            _layout(),
            epr,
            slots,
            num_layers=1,
            timeout_s=30.0,
            chunk_bytes=64,
            tile_bytes=16,
            node_of=[0, 0, 1, 1],
        ) as ctx:
            ctx.register_masters(0, [torch.full((1, 8, 4), 1.0 + group.rank)], None)
            ctx.weight_sync(ctx.begin(0), plan)
            return ctx.transport.name, ctx.transport_choice, ctx.replica_weights[0][0].clone()

    res = LoopbackDomain(world).run(body)
    for r, (name, choice, w) in enumerate(res):
        assert name == "split" and choice.domain_of == (0, 0, 1, 1) and choice.split is not None
        if r:
            assert torch.equal(w, torch.full((8, 4), 1.0))
