"""The manager's device-resident step (``control_plane == "device"``) driven on the CPU.

On a GPU the step exchanges the loads through a :class:`~ultracomm.moe.loads_gpu.GpuLoadBoard`,
plans with :func:`ultracomm.planners.device.plan_on_gpu` and hands the Context a
:class:`~ultracomm.resident_plan.ResidentPlan`; the step keeps device copies of its loads and plan
(``Step._resident``) from which ``rerouted`` / ``result`` / ``replicas`` are made.  Here the GPU
pieces are stand-ins on CPU tensors -- a board whose ``exchange`` is the host board's gather, a
``plan_on_gpu`` that runs the same C++ planner (``_core.quota_device``) into the same buffers --
so every line of ``_step_on_device``, ``_plan_buffers`` and the Step's resident branches runs
(the Context takes the resident plan's host route: its transport builds on the host)."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import numpy as np
import pytest
import torch

import moe_harness as mh
from ultracomm import LoopbackDomain, _core
from ultracomm.moe import ReplicaManager
from ultracomm.moe import manager as manager_mod
from ultracomm.moe.loads_gpu import GpuLoadBoard
from ultracomm.moe.reroute import RerouteTable, reroute
from ultracomm.planners import device as device_planner

WORLD, EPR, K, LAYERS = 4, 2, 2, 2


class HostBackedBoard:
    """What ``_step_on_device`` uses of a GpuLoadBoard, over the host board: ``exchange`` returns
    the int32 ``[world, E]`` loads, ``status`` the exchange's status words (0: arrived)."""

    def __init__(self, board):
        self.board = board
        self.status = torch.zeros(8, dtype=torch.int32)
        self.calls: list[tuple[str, int]] = []

    def exchange(self, counts, op="step", tag=0):
        self.calls.append((op, tag))
        return torch.from_numpy(self.board.gather(counts, op, tag).astype(np.int32))

    def close(self):
        self.board.close()


def plan_on_cpu(loads, domain, slots_per_rank, *, eps=0.01, min_tokens=1, intra_node_only=False, stream=None, out=None):
    """plan_on_gpu's contract (buffers, ``result`` words) on CPU tensors, by the same C++ planner."""
    W, epr = domain.world, domain.experts_per_rank
    assert loads.dtype == torch.int32 and tuple(loads.shape) == (W, W * epr) and loads.is_contiguous()
    el = np.ascontiguousarray(loads.numpy().sum(0), dtype=np.int64)
    node = np.ascontiguousarray(domain.node_of, dtype=np.int32) if intra_node_only else None
    src, quota, info = _core.quota_device(
        el, node, W, epr, slots_per_rank, int(min_tokens), 0, device_planner._eps_bp(eps), 1, 1
    )
    info = dict(info)
    if out is None:
        out = dict(
            slot_src=torch.empty((W, slots_per_rank), dtype=torch.int32),
            slot_quota=torch.empty((W, slots_per_rank), dtype=torch.int64),
            result=torch.zeros(3, dtype=torch.int64),
        )
    out["slot_src"].copy_(torch.from_numpy(np.asarray(src, np.int32)))
    out["slot_quota"].copy_(torch.from_numpy(np.asarray(quota, np.int64)))
    words = [info["probes"] << 32, info["rounds"] | info["replicas"] << 32, info["threshold"]]
    out["result"].copy_(torch.tensor(words, dtype=torch.int64))
    return out


@pytest.fixture
def device_step(monkeypatch):
    """Managers built from here on run their steps through ``_step_on_device`` on CPU stand-ins."""
    boards: list[HostBackedBoard] = []

    def board_for_context(ctx):
        from ultracomm.moe.loads import LoadBoard

        boards.append(HostBackedBoard(LoadBoard.for_context(ctx)))
        return boards[-1]

    monkeypatch.setattr(manager_mod, "board_for_context", board_for_context)
    monkeypatch.setattr(ReplicaManager, "_control_plane", lambda self, planner: "device")
    monkeypatch.setattr(device_planner, "plan_on_gpu", plan_on_cpu)
    return boards


def test_device_step_runs_on_cpu_stand_ins_and_matches_the_host_control_plane(device_step):
    schedule = "F0 F1 B0 B1"
    resident = mh.train(WORLD, EPR, K, LAYERS, schedule, planner="device", max_microbatches=2)
    assert len(device_step) == WORLD and all(len(b.calls) == LAYERS * 2 for b in device_step)
    mh.check_grads([g for g, _ in resident], WORLD, EPR, LAYERS, 2)
    before, after = resident[0][1][0]  # Step.result built from the step's resident copies
    assert before > 3 and after < 1.1
    device_step.clear()


def test_resident_step_equals_the_host_control_plane_bit_for_bit(device_step, monkeypatch):
    resident = mh.train(WORLD, EPR, K, LAYERS, "F0 B0", planner="device")
    monkeypatch.undo()  # the same training with the host control plane (board + host planner)
    host = mh.train(WORLD, EPR, K, LAYERS, "F0 B0", planner="device")
    for (ga, ia), (gb, ib) in zip(resident, host):
        assert ia == ib
        for la, lb in zip(ga, gb):
            for a, b in zip(la, lb):
                assert torch.equal(a, b)


def test_resident_step_replicas_and_reroute_tables_come_from_its_own_copies(device_step):
    def body(group):
        mgr = ReplicaManager(group, mh.layout(), EPR, K, 1, max_microbatches=2, planner="device", timeout_s=20)
        mgr.register_layer(0, mh.make_params(group.rank, EPR, 1, torch.float32, "stacked", False, False)[0])
        _, rmap, probs, _ = mh.batch(group.rank, 0, 0, WORLD * EPR, 24)
        with torch.no_grad():
            step = mgr.step(0, rmap, probs)
        assert step._result is None and step._resident is not None
        replicas = step.replicas()  # from the resident copy, before the host result exists
        assert step._result is None
        assert replicas == step.result.slot_src[group.rank].tolist()
        got = step.rerouted("echo")
        want = reroute(rmap, probs, RerouteTable.from_result(step.result, group.rank, "echo"))
        assert torch.equal(got[0], want[0]) and torch.equal(got[1], want[1])
        mgr.close()
        return replicas

    out = LoopbackDomain(WORLD).run(body)
    assert any(e >= 0 for row in out for e in row)  # the skewed router got replicas


def test_device_control_plane_takes_only_the_gpu_planners_options():
    """``planner_options`` go to ``plan_on_gpu`` on the device control plane: the host build's
    ``lanes`` / ``groups`` (and anything it does not take) are refused when the manager is built,
    not by a TypeError at the first step on the GPU."""
    mgr = ReplicaManager.__new__(ReplicaManager)
    mgr._board = GpuLoadBoard.__new__(GpuLoadBoard)
    mgr.ctx = SimpleNamespace(transport=SimpleNamespace(build_on_device=True))
    for bad in ({"lanes": 8}, {"groups": 8}, {"eps": 0.01, "min_token": 2}):
        mgr.planner_options = bad
        with pytest.raises(ValueError, match="planner_options"):
            mgr._control_plane("device")
    taken = {
        n for n, p in inspect.signature(device_planner.plan_on_gpu).parameters.items() if p.kind is p.KEYWORD_ONLY
    } - {"stream", "out"}
    assert taken == {"eps", "min_tokens", "intra_node_only"}
    mgr.planner_options = {"eps": 0.05, "min_tokens": 2, "intra_node_only": True}
    assert mgr._control_plane("device") == "device"
    mgr.planner_options = {"lanes": 8, "groups": 8}  # the host build takes them
    mgr.ctx.transport.build_on_device = False
    assert mgr._control_plane("device") == "host"
