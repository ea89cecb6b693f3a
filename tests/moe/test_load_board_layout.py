"""The load board's one layout and protocol (ultracomm.moe.board_layout), as the host board
writes it: exact offsets, every sender's record pushed into every rank's board with its flag and
tag, entries alternating by exchange number; a rank whose tag names another exchange (out of step)
makes every rank raise PlanMismatchError; bad counts refused before anything is written; and
_cuda.load_exchange's argument checks (before any launch, so no GPU needed).  The kernel side
is compile-checked in test_cuda_build.py and run in test_load_board_gpu.py (gpu marker)."""

from __future__ import annotations

import threading

import numpy as np
import pytest
import torch

from ultracomm.errors import PlanError, PlanMismatchError
from ultracomm.moe.board_layout import BoardLayout, ExchangeTag
from ultracomm.moe.loads import LoadBoard


def test_layout_offsets():
    L = BoardLayout(world=3, num_experts=20)
    assert L.record_bytes == 128  # 16 + 80 rounded up to 64
    assert L.total_bytes == 2 * 3 * 128
    assert [L.record(1, q) for q in range(3)] == [384, 512, 640]  # odd exchanges: entry 1
    assert [L.record(2, q) for q in range(3)] == [0, 128, 256]
    assert L.tag(3, 2) == 640 + 8 and L.counts(3, 2) == 640 + 16
    assert BoardLayout(1, 12).record_bytes == 64 and BoardLayout(1, 13).record_bytes == 128
    with pytest.raises(ValueError, match="entries >= 2"):
        BoardLayout(2, 4, entries=1)


class _Boards:
    """Every rank's board as a numpy buffer of one process (what host_shm maps)."""

    def __init__(self, L: BoardLayout):
        self.bufs = [np.zeros(L.total_bytes, np.uint8) for _ in range(L.world)]
        self.peer_bases = [b.ctypes.data for b in self.bufs]

    def close(self) -> None:
        pass


def _exchange(
    boards,
    L,
    counts_of,
    n_exchanges,
    timeout_s=20.0,
    tag_of=lambda n, r: 0,
    op_of=lambda n, r: "step",
    expect_errors=False,
):
    results = [[None] * L.world for _ in range(n_exchanges)]
    errors = []

    def rank(r):
        board = LoadBoard(boards, L.num_experts, r, L.world, timeout_s)
        try:
            for n in range(n_exchanges):
                results[n][r] = board.gather(torch.tensor(counts_of(n, r)), op=op_of(n, r), tag=tag_of(n, r))
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)
            results[n][r] = e

    ts = [threading.Thread(target=rank, args=(r,)) for r in range(L.world)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(60)
    assert expect_errors or not errors, errors
    return results


def test_host_board_pushes_every_record_with_its_flag():
    L = BoardLayout(world=3, num_experts=5)
    boards = _Boards(L)

    def counts_of(n, r):
        return [100 * n + 10 * r + e for e in range(5)]

    results = _exchange(boards, L, counts_of, 3, tag_of=lambda n, r: ExchangeTag(n).value)
    for n in range(3):
        want = np.array([counts_of(n, q) for q in range(3)], np.int64)
        for r in range(3):
            assert results[n][r].dtype == np.int64 and np.array_equal(results[n][r], want)
    # after exchanges 1, 2, 3: entry 1 holds exchange 3 (counts_of(2, .)), entry 0 exchange 2
    for r in range(3):
        buf = boards.bufs[r]
        for q in range(3):
            for n, k in ((3, 2), (2, 1)):
                off = L.record(n, q)
                assert int(buf[off : off + 8].view(np.uint64)[0]) == n
                assert int(buf[off + 8 : off + 16].view(np.uint64)[0]) == ExchangeTag(k).value
                got = buf[off + 16 : off + 16 + 4 * 5].view(np.int32)
                assert got.tolist() == counts_of(k, q)


@pytest.mark.parametrize(
    "tag,text",
    [
        (ExchangeTag(0), "step(layer 0)"),
        (ExchangeTag(3, slot=2), "step(layer 3, micro-batch slot 2)"),
        (ExchangeTag(1, grad=False), "step(layer 1, no grad)"),
        (ExchangeTag(2**24 - 1, 2**24 - 1, False), "step(layer 16777215, micro-batch slot 16777215, no grad)"),
    ],
)
def test_exchange_tags_round_trip_and_name_the_exchange(tag, text):
    assert str(tag) == text and ExchangeTag.decode(tag.value) == tag and ExchangeTag.describe(tag.value) == text
    assert (
        len({ExchangeTag(0).value, ExchangeTag(1).value, ExchangeTag(0, 1).value, ExchangeTag(0, grad=False).value, 0})
        == 5
    )
    assert ExchangeTag.describe(0) == "an exchange that names nothing"
    assert ExchangeTag.describe(0xFF) == "an unknown exchange (tag 0xff)"
    with pytest.raises(ValueError, match=r"layer must be an int in 0..16777215, got 16777216"):
        ExchangeTag(2**24)


def test_a_rank_out_of_step_makes_every_rank_raise_naming_both_sides():
    """Rank 1 runs layer 1 where ranks 0 and 2 run layer 0 (then the other way round): every rank
    reads every rank's record, so each raises PlanMismatchError naming what the others posted."""
    L = BoardLayout(world=3, num_experts=4)
    order = [[0, 1], [1, 0], [0, 1]]
    tags = lambda n, r: ExchangeTag(order[r][n]).value  # noqa: E731
    res = _exchange(
        _Boards(L),
        L,
        lambda n, r: [r] * 4,
        2,
        tag_of=tags,
        op_of=lambda n, r: str(ExchangeTag(order[r][n])),
        expect_errors=True,
    )
    tail = "; every rank must call the same collective operations in the same order"
    want = {
        0: "ultracomm: rank 0 step(layer 0) (expert loads): ranks called different operations (rank 1 posted "
        "step(layer 1) in load exchange 1)" + tail,
        1: "ultracomm: rank 1 step(layer 1) (expert loads): ranks called different operations (ranks [0, 2] "
        "posted step(layer 0) in load exchange 1)" + tail,
        2: "ultracomm: rank 2 step(layer 0) (expert loads): ranks called different operations (rank 1 posted "
        "step(layer 1) in load exchange 1)" + tail,
    }
    for r in range(3):
        assert type(res[0][r]) is PlanMismatchError and str(res[0][r]) == want[r]
        assert isinstance(res[0][r], PlanError)


def test_host_board_refuses_counts_the_int32_records_cannot_hold():
    L = BoardLayout(world=1, num_experts=3)
    board = LoadBoard(_Boards(L), 3, 0, 1, 1.0)
    with pytest.raises(ValueError) as err:
        board.gather(torch.tensor([1, 2**31, 0]))
    assert str(err.value) == (
        "ultracomm: expert counts must be in 0..2147483647 (int32 on the load board), got 0..2147483648"
    )
    with pytest.raises(ValueError, match=r"expert counts must be \[3\], got \[2\]"):
        board.gather(torch.tensor([1, 2]))
    assert board.seq == 0  # nothing posted


def _cuda():
    try:
        from ultracomm import _cuda
    except ImportError as e:
        pytest.skip(f"ultracomm._cuda not built ({e})")
    return _cuda


def _rank(**kw):
    d = dict(counts=0x1000, out=0x2000, status=0x3000, bases=0x4000, seq=0x5000, rank=0)
    d.update(kw)
    return d


@pytest.mark.parametrize(
    "kw,ranks,msg",
    [
        (
            dict(entries=1),
            [_rank()],
            "entries must be >= 2 (a record is rewritten only after its reader posted the next)",
        ),
        (
            dict(record_bytes=32),
            [_rank()],
            "record_bytes must be a multiple of 8 holding the flag, the tag and num_experts int32 counts (>= 36)",
        ),
        (dict(world=0), [_rank()], "world must be >= 1"),
        (dict(timeout_s=0.0), [_rank()], "timeout_s must be > 0"),
        ({}, [], "one launch runs 1 to 288 rank entries, got 0"),
        ({}, [_rank(rank=2)], "rank entry 0: rank 2 is out of range 0..1"),
        ({}, [_rank(), _rank()], "rank 0 appears twice in one launch"),
        ({}, [_rank(seq=0x5004)], "rank entry 0: 'seq' must be a 8-byte aligned device address"),
        ({}, [_rank(out=0)], "rank entry 0: 'out' must be a 4-byte aligned device address"),
        ({}, [{"counts": 0x1000}], "rank entry 0 lacks 'out'"),
    ],
)
def test_load_exchange_checks_its_arguments_before_launching(kw, ranks, msg):
    cuda = _cuda()
    args = dict(world=2, num_experts=5, entries=2, record_bytes=64, timeout_s=1.0, stream=0)
    args.update(kw)
    with pytest.raises(ValueError) as err:
        cuda.load_exchange(ranks, **args)
    assert str(err.value) == "ultracomm._cuda.load_exchange: " + msg
