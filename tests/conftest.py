"""Shared test helpers: random valid plans, expert contents that any rank can recompute."""
from __future__ import annotations

import numpy as np
import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def random_slot_src(rng: np.random.Generator, world: int, slots: int, experts_per_rank: int,
                    fill: float = 0.7) -> np.ndarray:
    """A valid ``slot_src [world, slots]``: no replica on its home rank, no expert twice on a rank."""
    num_experts = world * experts_per_rank
    out = np.full((world, slots), -1, dtype=np.int32)
    for r in range(world):
        candidates = [e for e in range(num_experts) if e // experts_per_rank != r]
        rng.shuffle(candidates)
        for s in range(min(slots, len(candidates))):
            if rng.random() < fill:
                out[r, s] = candidates[s]
    return out


def hot_slot_src(world: int, slots: int, experts_per_rank: int, expert: int = 0) -> np.ndarray:
    """``expert`` replicated onto every other rank (slot 0), other slots empty."""
    out = np.full((world, slots), -1, dtype=np.int32)
    home = expert // experts_per_rank
    for r in range(world):
        if r != home and slots:
            out[r, 0] = expert
    return out


def expert_weights(layout, expert: int) -> list[torch.Tensor]:
    """Deterministic contents of ``expert``'s weights (one tensor per member), recomputable anywhere."""
    g = torch.Generator().manual_seed(1000 + expert)
    out = []
    for m in layout.members:
        if m.dtype.is_floating_point:
            out.append(torch.randn(m.shape, generator=g).to(m.dtype))
        else:
            out.append(torch.randint(-100, 100, m.shape, generator=g).to(m.dtype))
    return out
