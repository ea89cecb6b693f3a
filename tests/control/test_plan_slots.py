"""Where the GPU transports' plans live (transports/plan_slots.py, issue 19 item 5): one plan
arena per transport, a slot per vid (restore / grad_reduce reuse what weight_sync wrote, a
later vid in the slot rewrites it), scratch slots for calls without a vid, and the pinning that
keeps a plan a captured CUDA graph reads from ever being reused (a captured graph keeps the
slot's address; before the arena, the cache freed such a plan after 64 newer ones and a replay
ran freed memory)."""

from __future__ import annotations

import pytest

from ultracomm import UltracommError
from ultracomm.transports.tma.plan_slots import SCRATCH, PlanSlots, arena_bounds


def run(slots, op, key, vid=None):
    slot, upload = slots.place(op, key, vid)
    slots.written(slot, op, key)
    return slot, upload


def test_a_vid_slot_is_written_once_per_plan_and_op():
    s = PlanSlots(4, capturing=lambda: False)
    assert s.num_slots == 4 + SCRATCH
    assert run(s, 0, "a", 2) == (2, True)  # weight_sync
    assert run(s, 0, "a", 2) == (2, False)  # restore: same plan, nothing to write
    assert run(s, 1, "a", 2) == (2, True)  # grad_reduce: the slot's reduce area
    assert run(s, 1, "a", 2) == (2, False)
    assert run(s, 0, "b", 2) == (2, True)  # the next vid in the slot
    assert run(s, 0, "a", 3) == (3, True)  # another slot holds its own
    with pytest.raises(ValueError, match=r"^ultracomm: plan slot 4 is out of range 0\.\.3 "):
        s.place(0, "a", 4)


def test_scratch_slots_rotate_least_recently_used_first():
    s = PlanSlots(2, capturing=lambda: False)
    keys = [f"k{i}" for i in range(SCRATCH)]
    assert [run(s, 0, k)[0] for k in keys] == list(range(2, 2 + SCRATCH))
    assert run(s, 0, "k0") == (2, False)  # a hit; k1 is now the least recently used
    assert run(s, 0, "new") == (3, True)  # takes k1's slot
    assert run(s, 0, "k1") == (4, True)  # k1 comes back into k2's slot


def test_a_scratch_slot_a_graph_captured_is_never_reused():
    capturing = [False]
    s = PlanSlots(0, capturing=lambda: capturing[0])
    assert run(s, 0, "warm") == (0, True)  # eager first
    capturing[0] = True
    assert run(s, 0, "warm") == (0, False)  # captured: pinned from now on
    capturing[0] = False
    for i in range(100):  # 100 newer plans afterwards
        slot, _ = run(s, 0, i)
        assert slot != 0
    assert s.pinned == {0} and run(s, 0, "warm") == (0, False)  # still there, never rewritten
    capturing[0] = True
    for i in range(SCRATCH - 1):  # pin every other scratch slot too
        run(s, 0, ("cap", i))
    with pytest.raises(UltracommError, match=f"^ultracomm: {SCRATCH} plans without a vid slot are pinned"):
        s.place(0, "one more", None)


def test_arena_bounds_follow_the_schedule_builders_limits():
    wl = dict(slots=3, weight_chunks=5, grad_chunks=7)
    assert arena_bounds(nranks=1, world=8, experts_per_rank=2, members=4, wlayout=wl) == dict(
        nranks=1, world=8, num_experts=16, masters=8, slots=3, tasks=(25, 35), refs=(24, 24)
    )


@pytest.mark.parametrize("seed", range(12))
def test_every_schedule_fits_the_arena_bounds(seed):
    # the arena is sized once from these bounds; any plan the builder makes must fit them
    import numpy as np

    from ultracomm import ReplicaPlan, _core
    from ultracomm.records import Op
    from ultracomm.schedule import build_schedule

    rng = np.random.default_rng(seed)
    world, epr, S = int(rng.integers(2, 9)), int(rng.integers(1, 4)), int(rng.integers(1, 4))
    E = world * epr
    src = np.full((world, S), -1, np.int32)
    for r in range(world):  # distinct experts homed elsewhere, some slots empty
        others = [e for e in range(E) if e // epr != r]
        picks = rng.choice(others, size=min(S, len(others)), replace=False)
        src[r, : len(picks)] = np.where(rng.random(len(picks)) < 0.8, picks, -1)
    plan = ReplicaPlan.make(src, experts_per_rank=epr)
    wl = _core.window_layout(S, int(rng.integers(100, 5000)), int(rng.integers(100, 5000)), 256)
    node_of = [r // 2 for r in range(world)] if seed % 2 else None
    mode = ("auto", "off", "force")[seed % 3]
    sched = build_schedule(
        plan, wl["weight_slot_bytes"], wl["grad_slot_bytes"], chunk_bytes=256, relay_mode=mode, node_of=node_of
    )
    b = arena_bounds(nranks=1, world=world, experts_per_rank=epr, members=2, wlayout=wl)
    for op in (Op.MULTICAST, Op.REDUCE):
        for r in range(world):
            assert len(sched.tasks(op, r)) <= b["tasks"][int(op)], (op, r)
            assert len(sched.refs(op, r)) <= b["refs"][int(op)], (op, r)


def test_real_binding_sizes_the_arena_and_checks_its_bounds():
    try:
        from ultracomm import _cuda
    except ImportError as e:
        pytest.skip(f"ultracomm._cuda not built ({e})")
    b = dict(nranks=1, world=2, num_experts=2, masters=1, slots=1, tasks=(2, 2), refs=(2, 2))
    # per area: the views, then 16-byte aligned arrays, rounded up to 256 bytes (768); per slot the
    # device builder's scratch (psched::scratch_words with 8 candidate warps, the CTA build's global
    # fallback: 1280 bytes) (as the stub runtime test in test_cuda_host_calls.py sees it allocated:
    # 3 slots = 8448 bytes)
    assert _cuda.plan_arena_bytes(1, **b) == 2 * 768 + 1280 and _cuda.plan_arena_bytes(3, **b) == 8448
    with pytest.raises(ValueError, match=r"^ultracomm\._cuda\.PlanArena: num_slots must be >= 1$"):
        _cuda.plan_arena_bytes(0, **b)
    with pytest.raises(ValueError, match=r"^ultracomm\._cuda\.PlanArena: nranks must be 1\.\.64, got 65$"):
        _cuda.plan_arena_bytes(1, **dict(b, nranks=65))
    with pytest.raises(ValueError, match="the arena would exceed 2\\^44 bytes; lower num_layers x max_microbatches"):
        _cuda.plan_arena_bytes(1 << 20, **dict(b, tasks=(1 << 20, 1 << 20)))
