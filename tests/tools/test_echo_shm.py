"""ECHO's staged all-to-all over shared memory (the CPU bench's like-for-like baseline): exact
replica rows, gradients summed in the documented order, and a bounded wait for a missing peer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm.comm import run_loopback
from ultracomm.tools.echo_shm import EchoShm
from ultracomm.plan import ReplicaPlan

# 3 ranks x 2 experts; -1 = empty slot; no rank holds a replica of its own expert
SLOT_SRC = np.array([[2, 4], [0, 5], [1, -1]], dtype=np.int32)
N = 37  # elements per expert row


def master_rows(rank: int, dtype) -> torch.Tensor:
    return (torch.arange(2 * N, dtype=torch.float32).reshape(2, N) + 100 * rank).to(dtype)


def slot_grads(rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(rank)
    return torch.randn((2, N), generator=g)


@pytest.mark.parametrize("gdtype", [torch.float32, torch.bfloat16])
def test_weights_and_grads_exact(gdtype):
    plan = ReplicaPlan.make(SLOT_SRC, experts_per_rank=2)

    def body(group):
        r = group.rank
        echo = EchoShm(plan, group, N, torch.bfloat16, gdtype, timeout_s=30)
        try:
            slots = torch.zeros((2, N), dtype=torch.bfloat16)
            echo.weights(master_rows(r, torch.bfloat16), slots)
            grad = torch.ones((2, N), dtype=gdtype)
            echo.grads(slot_grads(r).to(gdtype), grad)
            return slots, grad
        finally:
            echo.close()

    out = run_loopback(3, body, timeout=60)
    for r, (slots, grad) in enumerate(out):
        for s, e in enumerate(SLOT_SRC[r].tolist()):
            if e >= 0:  # the home's row, bit for bit
                assert torch.equal(slots[s], master_rows(e // 2, torch.bfloat16)[e % 2])
            else:
                assert not slots[s].any()
        # home r adds its replicas' grads peer by peer in rank order, slot order within a peer
        want = torch.ones((2, N), dtype=gdtype)
        for d in range(3):
            for s, e in enumerate(SLOT_SRC[d].tolist()):
                if e >= 0 and e // 2 == r:
                    want[e % 2] += slot_grads(d).to(gdtype)[s]
        assert torch.equal(grad, want)


def test_missing_peer_times_out():
    plan = ReplicaPlan.make(SLOT_SRC, experts_per_rank=2)

    def body(group):
        echo = EchoShm(plan, group, N, torch.bfloat16, torch.float32, timeout_s=0.3)
        try:
            if group.rank == 0:  # ranks 1 and 2 never take part
                echo.weights(master_rows(0, torch.bfloat16), torch.zeros((2, N), dtype=torch.bfloat16))
        finally:
            group.barrier()
            echo.close()

    with pytest.raises(TimeoutError, match=r"rank 0: weights stage barrier 1 still waits for ranks \[1, 2\]"):
        run_loopback(3, body, timeout=60)
