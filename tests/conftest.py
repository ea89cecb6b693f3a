"""Shared test helpers: random valid plans, expert contents that any rank can recompute."""

from __future__ import annotations


import numpy as np
import pytest
import torch


#: With a device (scripts/gpu_check.sh: every gpu test in one capped step) the tests that tell
#: most run first, in this order of node-id parts: issue 35's failure workers (a named error near
#: its deadline, then the device synchronizes), the data plane bit for bit against the host
#: executor, the device control plane against its host builds; then the rest in file order.
GPU_FIRST = (
    ("near_its_deadline",),
    ("bit_exact", "bit_for_bit"),
    (
        "test_planner_device.py::",
        "test_reroute_device.py::",
        "test_load_board_gpu.py::",
        "test_device_step_gpu.py::test_captured_control_plane",
    ),
)
#: The TMA-staged reduce's bit-exactness cases (reduce_path="tma": node ids with a ``tma`` param of
#: test_cuda_loopback.py) run after the control plane: the default path's answer comes first.
GPU_STAGED = ("test_cuda_loopback.py::",), ("-tma-", "[tma-", "-tma]")


def gpu_order(item) -> tuple:
    """Sort key of a test on a machine with a device: slow (multi-process) tests last, before
    them :data:`GPU_FIRST`'s groups in order (the sort is stable: file order within a group)."""
    files, params = GPU_STAGED
    if any(f in item.nodeid for f in files) and any(p in item.nodeid for p in params):
        return ("slow" in item.keywords, len(GPU_FIRST) - 0.5)
    group = next((i for i, parts in enumerate(GPU_FIRST) if any(p in item.nodeid for p in parts)), len(GPU_FIRST))
    return ("slow" in item.keywords, group)


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        items.sort(key=gpu_order)
        return
    skip = pytest.mark.skip(reason="needs a CUDA device; none on this machine")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def random_slot_src(
    rng: np.random.Generator, world: int, slots: int, experts_per_rank: int, fill: float = 0.7
) -> np.ndarray:
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


def expected_master_grads(schedule, layout, plan, init_master, init_replica, with_slots: bool = False):
    """Master grads after grad_reduce, by replaying ``schedule``'s reduce tasks (all ranks' lists)
    with ``ultracomm.tools.reference.reference_reduce``.

    ``init_master[r][m]``: rank r's master grads ``[experts_per_rank, *shape]`` before;
    ``init_replica[r][m]``: rank r's replica grads ``[slots, *shape]`` before.
    Returns per rank, per member, ``[experts_per_rank, *shape]``; with ``with_slots`` also the
    replica grads after (relays hold their partial sums), per rank, per member ``[slots, *shape]``.
    """
    from ultracomm.tools.reference import reference_reduce, slot_image, split_image

    world, slots = plan.world, plan.slots_per_rank
    home = plan.home_of.tolist()
    local = plan.local_index_of.tolist()
    grads_by_rank = [
        torch.stack(
            [
                slot_image(
                    [init_replica[r][m][s] for m in range(len(layout.members))], layout.grad_offsets, layout.grad_bytes
                )
                for s in range(slots)
            ]
        )
        if slots
        else torch.zeros((0, layout.grad_bytes), dtype=torch.uint8)
        for r in range(world)
    ]
    masters = {
        e: [init_master[home[e]][m][local[e]] for m in range(len(layout.members))] for e in range(plan.num_experts)
    }
    slots_after, new = reference_reduce(
        [schedule.tasks("reduce", r) for r in range(world)],
        [schedule.refs("reduce", r) for r in range(world)],
        grads_by_rank,
        masters,
        layout.grad_offsets,
        layout.grad_sizes,
        layout.grad_dtype,
    )
    out = []
    for r in range(world):
        mine = [e for e in range(plan.num_experts) if home[e] == r]
        mine.sort(key=lambda e: local[e])
        out.append([torch.stack([new[e][m] for e in mine]) for m in range(len(layout.members))])
    if not with_slots:
        return out
    after = [
        [
            torch.stack(
                [
                    split_image(
                        slots_after[r][s],
                        [init_replica[r][m][s] for m in range(len(layout.members))],
                        layout.grad_offsets,
                    )[m]
                    for s in range(slots)
                ]
            )
            for m in range(len(layout.members))
        ]
        for r in range(world)
    ]
    return out, after


def shm_segments() -> set[str]:
    """ultracomm's named segments in /dev/shm now."""
    import os

    return {n for n in os.listdir("/dev/shm") if n.startswith("ultracomm-")} if os.path.isdir("/dev/shm") else set()


def leftover_segments(before: set[str], pids: set[int] | None = None) -> set[str]:
    """Segments that appeared since ``before`` and were left behind: created by one of ``pids``,
    or (``pids=None``) by a process that has exited.  Other test runs on the machine may hold
    live segments of their own for a moment; those are not leftovers."""
    import os

    out = set()
    for name in shm_segments() - before:
        pid = int(name.split("-")[1])
        if pids is not None:
            if pid in pids:
                out.add(name)
            continue
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            out.add(name)
        except PermissionError:
            pass
    return out


def window_bytes(ctx) -> torch.Tensor:
    """A copy of ``ctx``'s window as a "nothing moved" check compares it: every byte but this rank's
    heartbeat word, which the process's heartbeat thread rewrites every 0.1 s (ultracomm.blame), so
    a whole-window compare fails whenever a beat falls between the two copies (a loaded machine)."""
    from ultracomm.blame import status_offsets

    out = ctx.window.local.detach().clone().view(torch.uint8)
    beat = status_offsets(ctx.wlayout)[1]
    out[beat : beat + 8] = 0
    return out


def live_threads() -> int:
    """``threading.active_count()`` once ultracomm's heartbeat thread (ultracomm.blame) has ended:
    it is process-wide, started with the first host window and ending within ``HEARTBEAT_S`` of
    the last one's close, so counted right after a close and not 0.1 s later it read as a thread
    that came or went.  (A window still open keeps it: the join gives up, and it counts.)"""
    import threading

    for t in threading.enumerate():
        if t.name == "ultracomm-heartbeat":
            t.join(timeout=2.0)
    return threading.active_count()
