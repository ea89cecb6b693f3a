"""The vLLM EPLB communicator adapter, driven by a stand-in of vLLM's ``move_to_buffer``
(``vllm/distributed/eplb/rebalance_execute.py``): for one layer and an (old, new)
``phy2log`` pair it calls ``set_transfer_context``, ``add_send([w[row] for w in weights],
dst, expert_id=e)`` / ``add_recv([b[row] for b in buffers], src, expert_id=e)`` for every
remote move (receivers split over the expert's holders, as vLLM does), copies local moves
itself, then ``execute()``."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import LoopbackDomain
from ultracomm.errors import PlanError
from ultracomm.integrations.vllm_eplb import UltracommEplbCommunicator

PPR = 3  # physical experts per rank
SHAPES = [((10, 6), torch.bfloat16), ((7,), torch.float32)]  # e.g. w13 and w2 rows; 20 B rows: unaligned


def expert_rows(e: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(77 + e)
    return [torch.randn(shape, generator=g).to(dtype) for shape, dtype in SHAPES]


def layer_weights(old: list[int], rank: int) -> list[torch.Tensor]:
    rows = [expert_rows(e) if e >= 0 else [torch.zeros(s, dtype=d) for s, d in SHAPES]
            for e in old[rank * PPR:(rank + 1) * PPR]]
    return [torch.stack([r[m] for r in rows]) for m in range(len(SHAPES))]


def move_to_buffer(comm, old: list[int], new: list[int], weights, buffers, rank: int, layer: int) -> None:
    """vLLM's send/recv pattern for one layer (its non-batched path, rewritten here)."""
    holders = {e: sorted({p // PPR for p, x in enumerate(old) if x == e}) for e in set(old) if e >= 0}
    needers = {e: sorted({p // PPR for p, x in enumerate(new) if x == e} - set(holders.get(e, ())))
               for e in set(new) if e >= 0}
    mine_old = old[rank * PPR:(rank + 1) * PPR]
    mine_new = new[rank * PPR:(rank + 1) * PPR]
    comm.set_transfer_context(np.asarray(old), layer)

    def share(e: int, sender: int) -> list[int]:  # receivers split evenly over the holders, in order
        hs, rs = holders[e], needers.get(e, [])
        return [d for i, d in enumerate(rs) if hs[i % len(hs)] == sender]

    for e in sorted({x for x in mine_old if x >= 0}):
        for dst in share(e, rank):
            comm.add_send([w[mine_old.index(e)] for w in weights], dst, expert_id=e)
    for e in sorted({x for x in mine_new if x >= 0}):
        row = mine_new.index(e)
        if e in mine_old:  # a local move: vLLM copies it without the communicator
            for w, b in zip(weights, buffers):
                b[row].copy_(w[mine_old.index(e)])
            continue
        hs = holders[e]
        src = hs[needers[e].index(rank) % len(hs)]
        comm.add_recv([b[row] for b in buffers], src, expert_id=e)
    comm.execute()


def run(old: list[int], new: list[int], layers: int = 2, **options):
    world = len(old) // PPR

    def body(group):
        r = group.rank
        comm = UltracommEplbCommunicator(group, layer_weights(old, r), timeout_s=20, **options)
        out = []
        try:
            for layer in range(layers):  # one communicator serves every layer
                weights = layer_weights(old, r)
                buffers = [torch.full_like(w, -7) for w in weights]
                move_to_buffer(comm, old, new, weights, buffers, r, layer)
                out.append((buffers, comm.last_plan, comm.last_stats))
        finally:
            comm.ctx.close()
        return out

    return LoopbackDomain(world).run(body)


OLD = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # 4 ranks x 3 physical slots; experts 0..3 have two copies
NEW = [0, 1, 4, 3, 5, 0, 6, 7, 0, 0, 2, 1]  # expert 0 onto ranks 1 and 3, 4 onto rank 0, 1 within rank 3


@pytest.mark.parametrize("relay", ["off", "force"])
def test_every_received_row_holds_its_expert_and_each_expert_is_one_multicast(relay):
    results = run(OLD, NEW, relay_mode=relay)
    for r, per_layer in enumerate(results):
        for buffers, plan, stats in per_layer:
            for row, e in enumerate(NEW[r * PPR:(r + 1) * PPR]):
                if e == OLD[r * PPR + row]:
                    continue  # unchanged rows are not moved
                for m, want in enumerate(expert_rows(e)):  # received, or copied locally (rank 3's expert 1)
                    assert torch.equal(buffers[m][row], want), f"rank {r} row {row} expert {e} member {m}"
            # vLLM splits expert 0's receivers (ranks 1, 3) over its holders (ranks 0, 2): two sends;
            # here one source (rank 0) multicasts to both and rank 2 sends nothing
            src0 = 0 * PPR + 0  # plan expert id: rank 0's first sent expert (logical 0)
            assert [rk for rk, _ in plan.replicas_of(src0)] == [1, 3]
            assert int(plan.num_replicas.sum()) == 3  # 0 -> ranks 1 and 3, 4 -> rank 0
            egress = stats["multicast"]["egress"]
            expert_bytes = sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size() for s, d in SHAPES)
            assert egress[2] == 0
            if relay == "force":  # home -> relay -> leaf: rank 0 sends expert 0 once
                assert egress[0] <= expert_bytes + 16 * len(SHAPES) and stats["multicast"]["depth"] >= 2


def test_nothing_to_move_and_mismatched_moves():
    assert all(plan is None for per_layer in run(OLD, OLD, layers=1) for _, plan, _ in per_layer)

    def body(group):
        comm = UltracommEplbCommunicator(group, layer_weights(OLD, group.rank), timeout_s=20)
        try:
            w = layer_weights(OLD, group.rank)
            if group.rank == 1:  # expects expert 0 from rank 0, which sends nothing
                comm.add_recv([t[0] for t in w], 0, expert_id=0)
            with pytest.raises(PlanError, match="rank 1 expects expert 0 from rank 0, which queued no add_send"):
                comm.execute()
            with pytest.raises(ValueError, match="expert_id"):
                comm.add_send([t[0] for t in w], 1)
        finally:
            comm.ctx.close()

    LoopbackDomain(4).run(body)
