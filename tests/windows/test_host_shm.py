"""host_shm windows across real processes (torch.multiprocessing + gloo), and cleanup of /dev/shm."""

from __future__ import annotations

import os
import signal
import sys
import time

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from ultracomm.windows.host_shm import SHM_DIR, sweep_stale_segments

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/
from conftest import expert_weights, leftover_segments, shm_segments  # noqa: E402

pytestmark = pytest.mark.skipif(not os.path.isdir(SHM_DIR), reason="needs POSIX shared memory (/dev/shm)")


def _launcher_store() -> dist.TCPStore:
    """The group's store, hosted here as torchrun's agent hosts it, on a port its server binds
    itself: a port picked, closed and bound later by a rank could be taken meanwhile."""
    return dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)


def _init(rank: int, world: int, port: int) -> None:
    store = dist.TCPStore("127.0.0.1", port, world, is_master=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)


def _spawned_context(rank: int, world: int, port: int, results) -> None:
    from ultracomm import Context, ExpertLayout, Member, ReplicaPlan

    _init(rank, world, port)
    layout = ExpertLayout((Member("w", (33, 5), torch.float16),))
    ctx = Context(
        None,
        layout,
        1,
        2,
        num_layers=1,
        window="host_shm",
        chunk_bytes=64,
        tile_bytes=64,
        relay_mode="force",
        timeout_s=60,
    )
    ctx.register_masters(0, [expert_weights(layout, rank)[0].unsqueeze(0).contiguous()], [torch.zeros((1, 33, 5))])
    # every rank holds the two experts after it: chains through relays
    plan = ReplicaPlan.make(
        np.array([[(r + 1) % world, (r + 2) % world] for r in range(world)], np.int32), experts_per_rank=1
    )
    vid = ctx.begin(0)
    ctx.weight_sync(vid, plan)
    ok = all(
        torch.equal(ctx.replica_weights[0][s], expert_weights(layout, (rank + 1 + s) % world)[0]) for s in range(2)
    )
    ctx.end(vid)
    ctx.close()
    results[rank] = (ok, os.getpid())
    dist.destroy_process_group()


@pytest.mark.slow
def test_torch_multiprocessing_spawn_context():
    world = 3
    before = shm_segments()
    with mp.Manager() as manager:
        results = manager.dict()
        store = _launcher_store()
        mp.spawn(_spawned_context, args=(world, store.port, results), nprocs=world, join=True)
        results = dict(results)
    assert {r: ok for r, (ok, _) in results.items()} == {r: True for r in range(world)}
    assert not leftover_segments(before, {pid for _, pid in results.values()})


def _killed_after_setup(rank: int, world: int, port: int) -> None:
    from ultracomm.comm import as_comm
    from ultracomm.windows import open_window

    _init(rank, world, port)
    w = open_window("host_shm", as_comm(None), 4096)
    w.local[:8] = rank
    dist.barrier()
    os.kill(os.getpid(), signal.SIGKILL)  # a crash: no Python cleanup runs


@pytest.mark.slow
def test_nothing_left_in_dev_shm_after_a_crash():
    before = shm_segments()
    ctx = mp.get_context("spawn")
    store = _launcher_store()
    procs = [ctx.Process(target=_killed_after_setup, args=(r, 2, store.port)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(120)
    assert [p.exitcode for p in procs] == [-signal.SIGKILL] * 2
    # only this test's ranks: another test run on the machine may have crashed ranks of its own
    assert not leftover_segments(before, {p.pid for p in procs}), "a crashed rank left its window in /dev/shm"


def test_sweep_removes_segments_of_dead_processes(tmp_path):
    dead = mp.get_context("spawn").Process(target=int)
    dead.start()
    dead.join()
    stale = tmp_path / f"ultracomm-{dead.pid}-0123456789ab-r0"
    fresh = tmp_path / f"ultracomm-{dead.pid}-0123456789ac-r1"  # dead pid, but may be another namespace's
    live = tmp_path / f"ultracomm-{os.getpid()}-0123456789ab-r1"
    other = tmp_path / "not-ours"
    for f in (stale, fresh, live, other):
        f.write_bytes(b"x")
    old = time.time() - 3600
    for f in (stale, live, other):
        os.utime(f, (old, old))
    removed = sweep_stale_segments(str(tmp_path))
    assert removed == [stale.name]
    assert not stale.exists() and fresh.exists() and live.exists() and other.exists()


def test_one_rank_failing_to_create_fails_every_rank(monkeypatch):
    from ultracomm import LoopbackDomain, PeerError
    from ultracomm.windows import host_shm

    real_map = host_shm._map

    def flaky(path, nbytes, create):
        if create and path.endswith("-r1"):
            raise RuntimeError("ultracomm: cannot reserve (simulated full /dev/shm)")
        return real_map(path, nbytes, create)

    monkeypatch.setattr(host_shm, "_map", flaky)
    before = shm_segments()

    def body(group):
        if group.rank == 1:
            with pytest.raises(RuntimeError, match="simulated full"):
                host_shm.HostShmWindow.create(group, 4096)
        else:
            with pytest.raises(
                PeerError,
                match=r"host_shm segment creation\): ranks \[1\] failed: rank 1: "
                r"RuntimeError: .*simulated full",
            ):
                host_shm.HostShmWindow.create(group, 4096)
        return True

    assert LoopbackDomain(3).run(body, timeout=60) == [True] * 3
    assert not leftover_segments(before, {os.getpid()})


def test_a_name_collision_leaves_the_other_file_alone(monkeypatch):
    """Rank 1's segment name is already taken (another process's file -- as root setup used to
    unlink it): every rank fails with a clear error, the planted file keeps its bytes, and the
    segments the ranks did create are gone."""
    from ultracomm import LoopbackDomain
    from ultracomm.windows import host_shm

    planted = os.path.join(SHM_DIR, f"ultracomm-{os.getpid()}-{'ab' * 6}-r1")
    with open(planted, "wb") as f:
        f.write(b"someone's data")
    real_name = host_shm.segment_name
    monkeypatch.setattr(
        host_shm, "segment_name", lambda rank: os.path.basename(planted) if rank == 1 else real_name(rank)
    )
    before = shm_segments() - {os.path.basename(planted)}

    def body(group):
        with pytest.raises(RuntimeError) as err:
            host_shm.HostShmWindow.create(group, 4096)
        assert str(err.value) == (
            f"ultracomm: host_shm segment names of ranks [1] already exist in {SHM_DIR} ({os.path.basename(planted)}): "
            "another process holds them; they were left alone. Retry (names are random), and check what else "
            "writes to /dev/shm"
        )
        return True

    try:
        assert LoopbackDomain(3).run(body, timeout=60) == [True] * 3
        with open(planted, "rb") as f:
            assert f.read() == b"someone's data"
        assert not leftover_segments(before, {os.getpid()}) - {os.path.basename(planted)}
    finally:
        os.unlink(planted)
