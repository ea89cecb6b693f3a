"""torchrun worker: README.md's ``Context`` and FP8 snippets, run as written (gloo, host executor).

Run as ``torchrun --nproc-per-node 2 tests/mp/readme_snippets_worker.py``.  Each snippet is read
from README.md (the fenced block that holds its first line) and executed statement by statement
in a namespace that supplies what the README leaves to the reader (the masters, a layer, the
routing, ``mgr`` and ``step`` for the FP8 lines); a renamed call or argument fails here.  Prints
``rank R OK`` per rank.
"""

from __future__ import annotations

import ast
import os
import re
from typing import Callable

import torch
import torch.distributed as dist

import ultracomm
from ultracomm import Context, ExpertLayout, ReplicaManager, ReplicaPlan
from ultracomm.fp8 import quantize
from ultracomm.moe import linear

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def readme_block(first_line: str) -> str:
    """The fenced python block of README.md that contains ``first_line``."""
    text = open(os.path.join(ROOT, "README.md"), encoding="utf-8").read()
    blocks = re.findall(r"```python\n(.*?)```", text, re.S)
    found = [b for b in blocks if first_line in b]
    assert len(found) == 1, f"README.md: {len(found)} python blocks contain {first_line!r}"
    return found[0]


def run_block(src: str, ns: dict, hook: Callable[[str, dict], None]) -> None:
    """Execute ``src`` one statement at a time; ``hook(statement source, ns)`` runs before each."""
    for node in ast.parse(src).body:
        hook(ast.get_source_segment(src, node), ns)
        exec(compile(ast.Module([node], []), "README.md", "exec"), ns)


def master(e: int, shape: tuple, dtype: torch.dtype) -> torch.Tensor:
    """Expert ``e``'s weights, the same on every rank."""
    return torch.randn(shape, generator=torch.Generator().manual_seed(1000 + e)).to(dtype)


def context_snippet(rank: int, world: int) -> None:
    epr, H, I = 4, 64, 32
    mine = range(rank * epr, (rank + 1) * epr)
    ns = {
        "Context": Context,
        "ReplicaPlan": ReplicaPlan,
        "world": world,
        "layer": 5,
        "layout": ExpertLayout.swiglu(hidden=H, moe_inter=I),
        "fc1_w": torch.stack([master(e, (2 * I, H), torch.bfloat16) for e in mine]),
        "fc2_w": torch.stack([master(e + 100, (H, I), torch.bfloat16) for e in mine]),
        "fc1_main_grad": torch.zeros(epr, 2 * I, H),
        "fc2_main_grad": torch.zeros(epr, H, I),
        # slot 0 of rank r: the first expert of rank r + 1; slot 1 empty
        "experts_to_copy": torch.tensor([[(r + 1) % world * epr, -1] for r in range(world)], dtype=torch.int32),
    }

    def hook(stmt: str, ns: dict) -> None:
        if stmt.startswith("ctx.restore"):  # after weight_sync: check the slots, write replica grads
            ctx, plan = ns["ctx"], ns["plan"]
            src = int(plan.slot_src[rank, 0])
            assert torch.equal(ctx.replica_weights[0][0], master(src, (2 * I, H), torch.bfloat16))
            assert torch.equal(ctx.replica_weights[1][0], master(src + 100, (H, I), torch.bfloat16))
            for g in ctx.replica_grads:
                g[0].fill_(1.0)

    run_block(readme_block("ctx = Context(None, layout"), ns, hook)
    # expert rank*epr was replicated on rank - 1: its replica's grads (ones) were added into it
    assert ns["fc1_main_grad"][0].eq(1).all() and ns["fc1_main_grad"][1:].eq(0).all()
    assert ns["fc2_main_grad"][0].eq(1).all() and ns["fc2_main_grad"][1:].eq(0).all()
    ns["ctx"].close()


def fp8_snippet(rank: int, world: int) -> None:
    epr, H, I, T = 2, 64, 32, 16
    mine = range(rank * epr, (rank + 1) * epr)

    class Moe:
        fc1 = torch.nn.Parameter(torch.stack([master(e, (2 * I, H), torch.bfloat16) for e in mine]))
        fc2 = torch.nn.Parameter(torch.stack([master(e + 100, (H, I), torch.bfloat16) for e in mine]))

    routing_map = torch.zeros(T, epr * world, dtype=torch.bool)
    routing_map[:, 0] = True  # every token to expert 0: it gets replicas
    x = torch.randn(T, H, generator=torch.Generator().manual_seed(rank)).to(torch.bfloat16)
    ns = {
        "torch": torch,
        "ExpertLayout": ExpertLayout,
        "linear": linear,
        "hidden": H,
        "moe_inter": I,
        "moe": Moe,
        "layer": 0,
        "x": x,
        "s": 0,
        "j": 0,
    }
    out = {}

    def hook(stmt: str, ns: dict) -> None:
        if stmt.startswith("mgr.") and "mgr" not in ns:
            ns["mgr"] = ReplicaManager(None, ns["layout"], experts_per_rank=epr, slots_per_rank=1, num_layers=1)
        if "step." in stmt and "step" not in ns:  # the comment line's refresh, then the step
            quantize(Moe.fc1, out=(ns["q1"], ns["s1"]))
            quantize(Moe.fc2, out=(ns["q2"], ns["s2"]))
            ns["step"] = ns["mgr"].step(0, routing_map, routing_map.float())
        if stmt.startswith("h = x @"):
            out["replica"] = ns["h"]

    run_block(readme_block("from ultracomm.fp8 import"), ns, hook)
    step, mgr = ns["step"], ns["mgr"]
    e = step.replicas()[0]
    filled = torch.tensor([int(e >= 0)])
    dist.all_reduce(filled)
    assert filled.item() >= 1, "the hot expert got no replica"
    if e >= 0:  # the slot holds expert e's FP8 bytes and scales, unchanged
        q, sc = quantize(master(e, (2 * I, H), torch.bfloat16))
        assert torch.equal(ns["fc1_q"][0].view(torch.uint8), q.view(torch.uint8))
        assert torch.equal(ns["fc1_s"][0].view(torch.uint8), sc.view(torch.uint8))
    loss = step.guard(out["replica"]).float().sum() + ns["h"].float().sum()
    loss.backward()
    g = Moe.fc1.grad
    assert g is not None and torch.isfinite(g.float()).all() and g.float().abs().sum() > 0
    mgr.close()


def main() -> None:
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    assert ultracomm.__version__
    context_snippet(rank, world)
    fp8_snippet(rank, world)
    print(f"rank {rank} OK (pid {os.getpid()})", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
