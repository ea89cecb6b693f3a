"""Worker of the CPU fault matrix (perf/fault_matrix.py, tests/test_fault_matrix.py): one rank of
a gloo group (the launcher hosts its store) training a small MoE with a ReplicaManager --
2 layers, one micro-batch, a step per layer (load exchange, plan, weight_sync), the backward's
restore and grad_reduce -- on the ``host``, ``p2p`` or ``split`` transport.

In the second iteration the victims SIGKILL or SIGSTOP themselves (thread-directed, so the
calling thread stops before it returns to Python) at one point:

* ``setup``: Context setup, once the window is open, before the transport is agreed;
* ``load``: entering layer 1's load exchange;
* ``step``: in layer 1's step after the loads' exchange (the planner), before its weight_sync;
* ``weight_sync``: as layer 1's multicast starts on the transport;
* ``between``: after the forward of both layers, before the backward;
* ``grad_reduce``: as the backward's first reduce starts on the transport.

Every rank writes ``rank<R>.json``: the error it raised (type, MRO, text), when it raised.
"""

from __future__ import annotations

import datetime
import os
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)
from fault_worker import fault, record_error, report  # noqa: E402

PHASES = ("setup", "load", "step", "weight_sync", "between", "grad_reduce")
TRANSPORTS = ("host", "p2p", "split")
ITERATIONS = 4  # a survivor that did not need the victims in one iteration meets them in the next


def manager_options(transport: str, world: int) -> dict:
    if transport == "host":
        return dict(transport="host", window="host_shm")
    if transport == "p2p":
        return dict(transport="p2p")
    half = world // 2  # two memory domains: every fault crosses a boundary from some survivor
    return dict(transport="split", domain=",".join("a" * half + "b" * (world - half)))


def main(
    rank: int,
    world: int,
    port: int,
    transport: str,
    phase: str,
    kind: str,
    victims: tuple,
    out_dir: str,
    timeout_s: float,
) -> None:
    import torch
    import torch.distributed as dist

    import moe_harness as mh
    from ultracomm import Context
    from ultracomm.moe import ReplicaManager, linear
    from ultracomm.records import Op

    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False, timeout=datetime.timedelta(seconds=120))
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
    victim = rank in victims
    armed = {"on": False}
    result: dict = {"rank": rank, "pid": os.getpid(), "error": None, "type": None, "victim": victim}

    def fault_here() -> None:
        if victim and armed["on"]:
            armed["on"] = False
            fault(kind)

    if victim and phase == "setup":
        real_attach = Context._attach

        def attach_then_fault(self):
            fault(kind)
            return real_attach(self)

        Context._attach = attach_then_fault
    epr, slots, layers = 1, 1, 2
    E = world * epr
    t0 = time.monotonic()
    try:
        mgr = ReplicaManager(
            None,
            mh.layout(),
            epr,
            slots,
            layers,
            max_microbatches=1,
            planner="quota",
            timeout_s=timeout_s,
            **manager_options(transport, world),
        )
        params = mh.make_params(rank, epr, layers, torch.float32, "stacked", False, False)
        for layer in range(layers):
            mgr.register_layer(layer, params[layer])
        if victim:
            if phase == "load":
                if mgr._board is not None:
                    real_gather = mgr._board.gather

                    def gather(counts, op="step", tag=0, _layer=[0]):
                        if _layer[0] % layers == 1:
                            fault_here()
                        _layer[0] += 1
                        return real_gather(counts, op=op, tag=tag)

                    mgr._board.gather = gather
                else:
                    from ultracomm.moe import manager as manager_mod

                    real_gl = manager_mod.gather_loads

                    def gather_loads(comm, counts, op="step", _layer=[0]):
                        if _layer[0] % layers == 1:
                            fault_here()
                        _layer[0] += 1
                        return real_gl(comm, counts, op=op)

                    manager_mod.gather_loads = gather_loads
            elif phase == "step":
                real_planner = mgr.planner

                def planner(*a, _layer=[0], **kw):
                    if _layer[0] % layers == 1:
                        fault_here()
                    _layer[0] += 1
                    return real_planner(*a, **kw)

                mgr.planner = planner
            elif phase in ("weight_sync", "grad_reduce"):
                real_run = mgr.ctx.transport.run
                target = Op.MULTICAST if phase == "weight_sync" else Op.REDUCE

                def run(op, *a, _n=[0], **kw):
                    if op == target:
                        # weight_sync: layer 1's (the second multicast of the iteration); grad_reduce: the first
                        if phase == "grad_reduce" or _n[0] % layers == 1:
                            fault_here()
                        _n[0] += 1
                    return real_run(op, *a, **kw)

                mgr.ctx.transport.run = run
        for it in range(ITERATIONS):
            armed["on"] = it == 1
            total = torch.zeros(())
            for layer in range(layers):
                _, rmap, probs, _ = mh.batch(rank, layer, it, E, 16)
                step = mgr.step(layer, rmap, probs)
                loss = mh.rank_loss(
                    step, rank, world, layer, it, params[layer], step.replica_weights(), linear, tokens=16
                )
                total = total + step.guard(loss)
            if phase == "between":
                fault_here()
            total.backward()
            result["iterations"] = it + 1
    except Exception as e:  # noqa: BLE001 - the outcome under test
        record_error(result, e)
    report(result, t0, out_dir, rank)
