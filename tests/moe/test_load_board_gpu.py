"""The load board in GPU memory (``gpu`` marker; skipped without a device): the
k_load_exchange kernel with every rank of a loopback domain on one GPU, in one launch, against
the layout of ultracomm.moe.board_layout (the host board's); the exchange number advancing on
the device; a rank that never posts named by the kernel's bounded wait; a rank whose tag names
another exchange named by the kernel's tag check; and GpuLoadBoard over ``cuda_local`` windows with
one thread per rank, as ReplicaManager.step uses it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import LoopbackDomain, PlanMismatchError, UltracommTimeout
from ultracomm.moe.board_layout import BoardLayout, ExchangeTag

pytestmark = pytest.mark.gpu


def _cuda():
    from ultracomm.cuda.support import cuda_runtime

    # on a GPU run a missing _cuda or driver is a failure, not a skip (the gpu marker skips without a device)
    return cuda_runtime(torch.cuda.current_device(), "the GPU load board")


class Ranks:
    """Boards and per-rank buffers of a loopback world on one device (no Context)."""

    def __init__(self, world: int, E: int):
        self.L = BoardLayout(world, E)
        dev = torch.device("cuda", torch.cuda.current_device())
        self.boards = [torch.zeros(self.L.total_bytes, dtype=torch.uint8, device=dev) for _ in range(world)]
        self.bases = torch.tensor([b.data_ptr() for b in self.boards], dtype=torch.int64, device=dev)
        self.counts = [torch.zeros(E, dtype=torch.int32, device=dev) for _ in range(world)]
        self.out = [torch.full((world, E), -1, dtype=torch.int32, device=dev) for _ in range(world)]
        self.status = [torch.full((4,), -1, dtype=torch.int32, device=dev) for _ in range(world)]
        self.seq = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(world)]

    def entries(self, ranks, tags=None):
        return [
            dict(
                counts=self.counts[r].data_ptr(),
                out=self.out[r].data_ptr(),
                status=self.status[r].data_ptr(),
                bases=self.bases.data_ptr(),
                seq=self.seq[r].data_ptr(),
                rank=r,
                tag=0 if tags is None else tags[r],
            )
            for r in ranks
        ]

    def launch(self, cuda, ranks, timeout_s=10.0, tags=None):
        L = self.L
        cuda.load_exchange(
            self.entries(ranks, tags),
            L.world,
            L.num_experts,
            L.entries,
            L.record_bytes,
            timeout_s,
            torch.cuda.current_stream().cuda_stream,
        )


def test_one_launch_gathers_every_rank_in_the_board_layout():
    cuda = _cuda()
    R = Ranks(world=4, E=37)
    for n in range(1, 4):
        want = np.array([[1000 * n + 100 * r + e for e in range(37)] for r in range(4)], np.int32)
        for r in range(4):
            R.counts[r].copy_(torch.from_numpy(want[r]))
        tag = ExchangeTag(n, slot=1).value  # every rank alike: in step
        R.launch(cuda, range(4), tags=[tag] * 4)
        torch.cuda.synchronize()
        for r in range(4):
            assert R.status[r].tolist()[0] == 0
            assert np.array_equal(R.out[r].cpu().numpy(), want)
            assert R.seq[r].item() == n
            board = R.boards[r].cpu().numpy()
            for q in range(4):  # the host board's layout: flag n, q's tag, then q's counts
                off = R.L.record(n, q)
                assert int(board[off : off + 8].view(np.uint64)[0]) == n
                assert int(board[off + 8 : off + 16].view(np.uint64)[0]) == tag
                assert np.array_equal(board[off + 16 : off + 16 + 4 * 37].view(np.int32), want[q])


@pytest.mark.parametrize("world, E", [(64, 256), (288, 64), (5, 37)])
def test_vector_posts_and_parallel_read_back_at_scale(world, E):
    """16-byte posts and read-back (E % 4 == 0), 64 ranks in one launch and an EP288 loopback
    world (every rank's CTA co-resident: cooperative, after the occupancy check; a GPU that
    cannot hold them is refused with a message that says so); the records in the board layout."""
    cuda = _cuda()
    fit = cuda.load_exchange_max_coresident(world)
    R = Ranks(world, E)
    rng = np.random.default_rng(world)
    want = rng.integers(0, 2**31 - 1, size=(world, E), dtype=np.int64).astype(np.int32)
    for r in range(world):
        R.counts[r].copy_(torch.from_numpy(want[r]))
    if world > fit:
        with pytest.raises(ValueError, match=f"a loopback exchange of {world} ranks needs every rank's CTA resident"):
            R.launch(cuda, range(world))
        return
    for n in (1, 2, 3):  # both entries of the board, then the first again
        R.launch(cuda, range(world), tags=[ExchangeTag(n).value] * world)
        torch.cuda.synchronize()
        for r in (0, world // 2, world - 1):
            assert R.status[r].tolist()[0] == 0 and R.seq[r].item() == n
            assert np.array_equal(R.out[r].cpu().numpy(), want)
        board = R.boards[world - 1].cpu().numpy()
        for q in (0, world - 1):
            off = R.L.record(n, q)
            assert int(board[off : off + 8].view(np.uint64)[0]) == n
            assert np.array_equal(board[off + 16 : off + 16 + 4 * E].view(np.int32), want[q])


def test_a_graph_replay_runs_a_fresh_exchange():
    cuda = _cuda()
    R = Ranks(world=2, E=8)
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        R.launch(cuda, range(2))  # exchange 1, eager
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, stream=s):
            R.launch(cuda, range(2))
    torch.cuda.synchronize()
    for k in range(3):
        for r in range(2):
            R.counts[r].fill_(10 * k + r)
        g.replay()
        torch.cuda.synchronize()
        for r in range(2):
            assert R.out[r][:, 0].tolist() == [10 * k, 10 * k + 1]
            assert R.seq[r].item() == 2 + k


def test_the_kernel_names_the_rank_that_never_posts():
    cuda = _cuda()
    R = Ranks(world=3, E=4)
    R.launch(cuda, [0, 1], timeout_s=0.2)  # rank 2 never posts
    torch.cuda.synchronize()
    for r in (0, 1):
        assert R.status[r].tolist() == [cuda.LOAD_STATUS_TIMEOUT, 2, 0, 0]


def test_the_kernel_names_a_rank_whose_tag_differs():
    """Rank 1 posts layer 1 where ranks 0 and 2 post layer 0: every rank's status says
    LOAD_STATUS_MISMATCH with a rank whose tag differs and that tag (a 64-bit value: words 2-3)."""
    cuda = _cuda()
    R = Ranks(world=3, E=4)
    tags = [ExchangeTag(0).value, ExchangeTag(1, slot=3).value, ExchangeTag(0).value]
    R.launch(cuda, range(3), tags=tags)
    torch.cuda.synchronize()
    for r in range(3):
        code, q, lo, hi = R.status[r].tolist()
        assert code == cuda.LOAD_STATUS_MISMATCH and q in ({0, 2} if r == 1 else {1}), (r, code, q)
        assert (lo & 0xFFFFFFFF) | (hi & 0xFFFFFFFF) << 32 == tags[q]


def test_gpu_load_board_over_cuda_local_windows():
    _cuda()
    from ultracomm.moe.loads_gpu import GpuLoadBoard
    from ultracomm.windows import open_window

    world, E = 3, 6

    def body(group):
        L = BoardLayout(world, E)
        w = open_window("cuda_local", group, L.total_bytes, device=torch.device("cuda", 0))
        board = GpuLoadBoard(w, E, group.rank, world, timeout_s=3.0)  # the final wait's cost in gpu_check's capped step
        got = []
        for n in range(3):
            counts = torch.arange(E, device="cuda:0", dtype=torch.int64) + 100 * group.rank + 10 * n
            got.append(board.gather(counts, op=f"step(layer {n})"))
        mine = ExchangeTag(5 if group.rank == 1 else 4)  # rank 1 out of step
        with pytest.raises(PlanMismatchError) as err:
            board.gather(torch.zeros(E, device="cuda:0", dtype=torch.int64), op=str(mine), tag=mine.value)
        others = (
            [f"rank {q} posted step(layer 4)" for q in (0, 2)] if group.rank == 1 else ["rank 1 posted step(layer 5)"]
        )  # the kernel names the first rank it found
        assert any(
            str(err.value).startswith(
                f"ultracomm: rank {group.rank} {mine} (expert loads): ranks called "
                f"different operations ({o} in load exchange 4)"
            )
            for o in others
        ), str(err.value)
        if group.rank == 2:  # the others' next exchange waits for rank 2: it never comes
            return got, None
        with pytest.raises(UltracommTimeout) as err:
            board.gather(torch.zeros(E, device="cuda:0", dtype=torch.int64), op="step(layer 9)")
        return got, str(err.value)

    res = LoopbackDomain(world).run(body, timeout=120)
    for r, (got, msg) in enumerate(res):
        for n in range(3):
            want = np.arange(E)[None, :] + 100 * np.arange(world)[:, None] + 10 * n
            assert got[n].dtype == np.int64 and np.array_equal(got[n], want)
        if r != 2:
            assert msg.startswith(
                f"ultracomm: rank {r} step(layer 9) (expert loads) timed out after 3 s: "
                "ranks [2] did not post their loads"
            )
