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
def test_torch_default_group_initialised_again_gets_a_new_key_space(tmp_path):
    """TorchComm's board numbers itself: torch's default group destroyed and initialised again over
    one store (world 1 in a subprocess: a second rank's gloo rendezvous would itself read the old
    group's addresses from that store -- torch's own hazard, which made a two-process version of
    this test hang under load) keeps its exchanges under ultracomm/1/, then ultracomm/2/."""
    import subprocess
    import sys
    import textwrap

    script = tmp_path / "reinit.py"
    script.write_text(
        textwrap.dedent(
            """
            import torch.distributed as dist
            from ultracomm.comm import as_comm

            store = dist.HashStore()
            for group in range(2):
                dist.init_process_group("gloo", store=store, rank=0, world_size=1)
                comm = as_comm(None, timeout_s=30.0)
                for i in range(2):
                    comm.all_gather_object(i, op="test", what="x")
                # the group's prefix is "0/" both times; its last exchange's key, under each board number
                print([store.check([f"0//ultracomm/{n}/ultracomm/1/0"]) for n in (1, 2)], flush=True)
                dist.destroy_process_group()
            """
        )
    )
    p = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert p.stdout.split("\n")[:2] == ["[True, False]", "[True, True]"], p.stdout
