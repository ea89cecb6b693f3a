"""GpuLoadBoard's Python side on a CPU machine (moe/loads_gpu.py), with ``_cuda.load_exchange``
replaced by a fake that does what the kernel does (every rank entry's counts gathered into its
``out``, or a status naming a rank): the kernel's arguments (board layout, timeout, tag, one
launch for every loopback rank, in rank order, from the rank completing the set), the host
result, and the errors -- a rank that never posts is named, by the kernel's status or, on a
loopback domain, by the launch that never came; a rank whose tag differs, by the kernel's status.
The kernel itself: test_load_board_gpu.py."""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import torch

from ultracomm import PlanMismatchError, UltracommTimeout
from ultracomm.moe import loads_gpu
from ultracomm.moe.board_layout import BoardLayout, ExchangeTag


class FakeCuda:
    def __init__(self, boards, status=None):
        self.boards, self.calls, self.status, self.tags = boards, [], status, []

    def load_exchange(self, ranks, world, num_experts, entries, record_bytes, timeout_s, stream):
        self.calls.append(([e["rank"] for e in ranks], world, num_experts, entries, record_bytes, timeout_s, stream))
        self.tags.append({e["rank"]: e["tag"] for e in ranks})
        counts = torch.stack([b._counts for b in self.boards])
        for e in ranks:
            b = self.boards[e["rank"]]
            assert (e["counts"], e["out"], e["status"]) == (b._counts.data_ptr(), b.out.data_ptr(), b._buf.data_ptr())
            b.out.copy_(counts)
            b._buf[:4] = torch.tensor(self.status or [0, 0, 0, 0], dtype=torch.int32)
            b._seq += 1


def boards(world, E, loopback, timeout_s=5.0, status=None, monkeypatch=None):
    made: list = []
    fake = FakeCuda(made, status)
    monkeypatch.setattr(loads_gpu, "cuda_runtime", lambda device, what="": fake)
    shared: dict = {}
    for r in range(world):
        win = types.SimpleNamespace(
            provider="cuda_local" if loopback else "cuda_ipc",
            world=world,
            loopback=loopback,
            shared=shared,
            local=torch.zeros(1),
            peer_bases=[0x7000_0000 + (q << 20) for q in range(world)],
            close=lambda: None,
        )
        b = loads_gpu.GpuLoadBoard(win, E, r, world, timeout_s)
        b._stream = lambda: 42
        made.append(b)
    return made, fake


def test_one_rank_per_process_launches_its_own_exchange(monkeypatch):
    bs, fake = boards(3, 5, loopback=False, monkeypatch=monkeypatch)
    for r, b in enumerate(bs):  # each rank on its own (the fake gathers what every board holds)
        b._counts.copy_(torch.arange(5) + 10 * r)
    got = bs[1].gather(torch.arange(5) + 10)
    L = BoardLayout(3, 5)
    assert fake.calls == [([1], 3, 5, 2, L.record_bytes, 5.0, 42)]
    assert got.dtype == np.int64 and got.tolist() == [[10 * r + e for e in range(5)] for r in range(3)]


def test_a_timeout_status_names_the_rank_awaited(monkeypatch):
    bs, _ = boards(2, 3, loopback=False, timeout_s=0.5, status=[1, 1, 0, 0], monkeypatch=monkeypatch)
    with pytest.raises(UltracommTimeout) as err:
        bs[0].gather(torch.zeros(3, dtype=torch.int64), op="step(layer 4)")
    assert str(err.value) == (
        "ultracomm: rank 0 step(layer 4) (expert loads) timed out after 0.5 s: ranks [1] did "
        "not post their loads (timeout ULTRACOMM_TIMEOUT_S=0.5); they are likely stalled or "
        "dead, or called a different operation: every rank must call step() for the same layers "
        "in the same order"
    )


def test_a_mismatch_status_names_both_sides(monkeypatch):
    """The kernel found rank 1's record naming another exchange (status 2, rank 1, its tag in
    words 2-3): PlanMismatchError, as the host board raises it; the tag went to the kernel."""
    theirs = ExchangeTag(1, slot=1).value
    bs, fake = boards(2, 3, loopback=False, status=[2, 1, theirs & 0xFFFFFFFF, theirs >> 32], monkeypatch=monkeypatch)
    mine = ExchangeTag(0)
    with pytest.raises(PlanMismatchError) as err:
        bs[0].gather(torch.zeros(3, dtype=torch.int64), op=str(mine), tag=mine.value)
    assert fake.tags == [{0: mine.value}]
    assert str(err.value) == (
        "ultracomm: rank 0 step(layer 0) (expert loads): ranks called different operations "
        "(rank 1 posted step(layer 1, micro-batch slot 1) in load exchange 1); every rank must "
        "call the same collective operations in the same order"
    )


def test_bad_counts_are_refused_before_anything_is_enqueued(monkeypatch):
    bs, fake = boards(2, 3, loopback=False, monkeypatch=monkeypatch)
    with pytest.raises(ValueError, match=r"^ultracomm: expert counts must be \[3\], got \[4\]$"):
        bs[0].gather(torch.zeros(4, dtype=torch.int64))
    assert not fake.calls


def _threads(bs, fn):
    out = [None] * len(bs)

    def run(r):
        try:
            out[r] = fn(r, bs[r])
        except BaseException as e:  # noqa: BLE001 - returned to the test
            out[r] = e

    ts = [threading.Thread(target=run, args=(r,)) for r in range(len(bs))]
    for t in ts:
        t.start()
    for t in ts:
        t.join(30)
    return out


def test_loopback_ranks_share_one_launch(monkeypatch):
    bs, fake = boards(4, 6, loopback=True, monkeypatch=monkeypatch)
    res = _threads(bs, lambda r, b: [b.gather(torch.arange(6) + 100 * r + n) for n in range(3)])
    assert len(fake.calls) == 3 and all(c[0] == [0, 1, 2, 3] and c[6] == 42 for c in fake.calls)
    for r in range(4):
        for n in range(3):
            assert res[r][n].tolist() == [[100 * q + n + e for e in range(6)] for q in range(4)]


def test_a_loopback_rank_that_never_posts_is_named(monkeypatch):
    bs, fake = boards(3, 2, loopback=True, timeout_s=0.3, monkeypatch=monkeypatch)

    def body(r, b):
        if r == 2:
            return None
        return b.gather(torch.zeros(2, dtype=torch.int64), op="step(layer 0)")

    res = _threads(bs, body)
    assert not fake.calls
    for r in (0, 1):
        assert isinstance(res[r], UltracommTimeout)
        assert str(res[r]).startswith(
            f"ultracomm: rank {r} step(layer 0) (expert loads) timed out after 0.3 s: "
            "ranks [2] did not post their loads"
        )


def test_without_cuda_the_store_exchange_stays(monkeypatch):
    from ultracomm.cuda.support import NotAvailableError

    def unavailable(device, what=""):
        raise NotAvailableError("ultracomm: the GPU load board is not available: no CUDA device")

    monkeypatch.setattr(loads_gpu, "cuda_runtime", unavailable)
    win = types.SimpleNamespace(
        provider="cuda_ipc", local=types.SimpleNamespace(device=torch.device("cuda", 0)), peer_bases=[1, 2]
    )
    assert loads_gpu.GpuLoadBoard.for_context(types.SimpleNamespace(window=win)) is None


@pytest.mark.parametrize("provider", ["cuda_ipc", "torch_symm", "nvshmem", "cuda_local", "host_shm", "local"])
def test_every_gpu_window_that_maps_its_peers_gets_a_board(monkeypatch, provider):
    """torch_symm (window='auto''s choice on a process group) and nvshmem windows get a GPU board, as
    cuda_ipc does: the kernel needs only every peer's board mapped here.  A board of the Context's own
    provider, on its device, sized for world x E; a window with an unmapped peer (nvshmem beyond the
    fabric) or a CPU window keeps the store exchange."""
    import ultracomm.windows as windows

    fake = FakeCuda([])
    monkeypatch.setattr(loads_gpu, "cuda_runtime", lambda device, what="": fake)
    opened = []

    def open_window(name, comm, nbytes, op="", device=None):
        opened.append((name, comm, nbytes, op, device))
        return types.SimpleNamespace(provider=name, local=torch.zeros(1), peer_bases=[0x7000_0000, 0x7100_0000])

    monkeypatch.setattr(windows, "open_window", open_window)
    gpu = provider not in ("host_shm", "local")
    dev = torch.device("cuda", 1) if gpu else torch.device("cpu")
    win = types.SimpleNamespace(provider=provider, local=types.SimpleNamespace(device=dev), peer_bases=[1, 2])
    ctx = types.SimpleNamespace(
        window=win, comm="the comm", world=2, num_experts=6, rank=1, config=types.SimpleNamespace(timeout_s=3.0)
    )
    board = loads_gpu.GpuLoadBoard.for_context(ctx)
    if not gpu:
        assert board is None and opened == []
        return
    assert isinstance(board, loads_gpu.GpuLoadBoard)
    assert opened == [(provider, "the comm", BoardLayout(2, 6).total_bytes, "ReplicaManager setup (load board)", dev)]
    assert (board.rank, board.world, board.E, board.timeout_s) == (1, 2, 6, 3.0)
    win.peer_bases = [1, 0]  # a peer this window does not map
    opened.clear()
    assert loads_gpu.GpuLoadBoard.for_context(ctx) is None and opened == []


def test_the_binding_refuses_bad_launches_before_touching_the_device():
    """_cuda.load_exchange validates first (no driver needed): up to LOAD_EXCHANGE_MAX_RANKS (an
    EP288 loopback world) entries per launch, each rank once -- also past rank 64."""
    cuda = pytest.importorskip("ultracomm._cuda")
    assert cuda.LOAD_EXCHANGE_MAX_RANKS == 288
    e = dict(counts=16, out=16, status=16, bases=16, seq=16)
    L = BoardLayout(300, 4)
    with pytest.raises(ValueError, match="one launch runs 1 to 288 rank entries, got 289"):
        cuda.load_exchange([dict(e, rank=r) for r in range(289)], 300, 4, L.entries, L.record_bytes, 1.0, 0)
    with pytest.raises(ValueError, match="rank 100 appears twice in one launch"):
        cuda.load_exchange(
            [dict(e, rank=100), dict(e, rank=7), dict(e, rank=100)], 300, 4, L.entries, L.record_bytes, 1.0, 0
        )
    with pytest.raises(ValueError, match="rank entry 0: 'counts' must be a 4-byte aligned device address"):
        cuda.load_exchange([dict(e, counts=2, rank=0)], 300, 4, L.entries, L.record_bytes, 1.0, 0)
