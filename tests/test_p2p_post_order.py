"""The p2p transport posts each wave's receives before its sends (a peer's message lands in its
buffer as it arrives instead of waiting for this rank's sends to be posted), and the bytes stay
those of the host executor."""
from __future__ import annotations

import numpy as np
import torch

from ultracomm.transports import p2p_messengers

from conftest import random_slot_src
from test_p2p import layout_of, run_ops
from ultracomm import ReplicaPlan


def test_receives_are_posted_before_sends_in_every_batch(monkeypatch):
    batches: list[list[str]] = []
    real = p2p_messengers.LoopbackMessenger.exchange

    def spy(self, ops):
        batches.append([kind for kind, *_ in ops])
        return real(self, ops)

    monkeypatch.setattr(p2p_messengers.LoopbackMessenger, "exchange", spy)
    layout, epr, slots, world = layout_of(torch.float32), 2, 3, 4
    rng = np.random.default_rng(7)
    plans = [ReplicaPlan.make(random_slot_src(rng, world, slots, epr, 0.9), experts_per_rank=epr) for _ in range(2)]
    host = run_ops("host", world, plans, layout, epr, slots, "force")
    p2p = run_ops("p2p", world, plans, layout, epr, slots, "force", alpha_beta=False)
    mixed = [b for b in batches if "send" in b and "recv" in b]
    assert mixed, "no wave both sent and received: the test would not see the order"
    assert all(b == sorted(b) for b in batches), [b for b in batches if b != sorted(b)][:3]  # "recv" < "send"
    for r in range(world):
        for a, b in zip(host[r], p2p[r]):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))
