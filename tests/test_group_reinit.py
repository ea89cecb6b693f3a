"""A process group re-created under the same name -- ``destroy_process_group`` then
``init_process_group`` (torch restarts its group names, so the new group's store prefix is the
old one's) over a store that outlives both, as a torchrun agent's does -- starts its exchanges
afresh: it never reads what the old group's exchanges left in the store (their last keys, a
rank's tombstone after a timeout).  It used to: a rank ahead of its peer took the peer's value
from the old group (wrong data, no error), or the old tombstone ("had already timed out").

Two ranks as threads, each with its own board on one shared store (ultracomm.comm._StoreBoard,
as TorchComm builds it per group and process); a new set of boards is a new group."""

from __future__ import annotations

import threading

import pytest
import torch.distributed as dist

from ultracomm import UltracommTimeout
from ultracomm import comm as C


class _Rank(C.Comm):
    world, kind = 2, "torch"

    def __init__(self, board: C._StoreBoard, rank: int, timeout_s: float):
        self.board, self.rank, self.timeout_s = board, rank, timeout_s

    def _board(self) -> C._Board:
        return self.board

    def _next_sequence(self) -> int:
        with self.board.lock:
            self.board.sequence += 1
            return self.board.sequence - 1


def _group(store, steps, timeout_s: float = 5.0) -> list:
    """Both ranks run ``steps[rank](comm, out)`` on new boards (a new group); their outputs."""
    boards = [C._StoreBoard(store, r) for r in range(2)]
    outs: list = [[], []]

    def body(r: int) -> None:
        try:
            steps[r](_Rank(boards[r], r, timeout_s), outs[r])
        except Exception as e:  # noqa: BLE001 - the outcome under test
            outs[r].append(e)

    threads = [threading.Thread(target=body, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    for b in boards:
        b.stop()
    return outs


def test_a_rank_ahead_never_reads_its_peers_value_from_the_old_group():
    store = dist.HashStore()

    def exchanges(group: str, late: threading.Event | None = None):
        def step(comm, out):
            for i in range(3):
                if late is not None and comm.rank == 1 and i == 2:
                    late.wait(1.0)  # rank 0 reaches exchange 2 first (before the fix it returned alone)
                out.append(comm.all_gather_object((group, i, comm.rank), op="test", what=f"exchange {i}"))
                if late is not None and comm.rank == 0 and i == 2:
                    late.set()

        return step

    old = _group(store, [exchanges("old")] * 2)
    assert old == [[[("old", i, 0), ("old", i, 1)] for i in range(3)]] * 2
    late = threading.Event()
    new = _group(store, [exchanges("new", late)] * 2)
    assert new == [[[("new", i, 0), ("new", i, 1)] for i in range(3)]] * 2, new


def test_a_group_recreated_after_a_timeout_does_not_see_the_old_tombstone():
    store = dist.HashStore()

    def old_step(comm, out):
        out.append(comm.all_gather_object(comm.rank, op="test", what="first"))
        if comm.rank == 0:  # rank 1 never comes to the second: rank 0 gives up (a tombstone)
            with pytest.raises(UltracommTimeout, match=r"ranks \[1\] did not arrive"):
                comm.all_gather_object(0, op="test", what="second")

    assert _group(store, [old_step] * 2, timeout_s=0.3) == [[[0, 1]], [[0, 1]]]
    rank0_late = threading.Event()

    def new_step(comm, out):
        out.append(comm.all_gather_object(comm.rank, op="test", what="first"))
        if comm.rank == 0:
            rank0_late.wait(1.0)  # rank 1 reads exchange 1 first (the old group's tombstone was there)
        out.append(comm.all_gather_object(10 + comm.rank, op="test", what="second"))
        rank0_late.set()

    assert _group(store, [new_step] * 2) == [[[0, 1], [10, 11]]] * 2


@pytest.mark.slow
def test_default_group_destroyed_and_initialised_again_over_one_store():
    """The same with real processes, torch's own default group and TorchComm (tests/mp/group_reinit_worker.py)."""
    import json
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    p = subprocess.run(
        [sys.executable, os.path.join(here, "mp", "group_reinit_worker.py")],
        capture_output=True,
        text=True,
        timeout=240,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    got = json.loads(p.stdout.strip().splitlines()[-1])
    want = [[[g, i, r] for r in range(2)] for g in range(2) for i in range(3)]
    assert got == [want, want], got
