"""One launch for all loopback ranks (ultracomm.cuda.loopback_launch): pairing by call order, any
arrival order, one thread or many, and the errors the completing rank raises."""

from __future__ import annotations

import threading
from types import SimpleNamespace

import pytest

from ultracomm.errors import UltracommError
from ultracomm.cuda.loopback_launch import Deposit, LoopbackLaunches, launches_for


def recorder():
    launched = []
    return launched, lambda deps: launched.append([(d.rank, d.op, d.epoch, d.item) for d in deps])


def test_one_thread_drives_every_rank():
    lb = LoopbackLaunches(3)
    launched, launch = recorder()
    assert [lb.deposit(Deposit(r, "mc", 1, 7, f"a{r}"), launch) for r in (2, 0)] == [False, False]
    assert launched == [] and lb.pending() == {0: [0, 2]}
    assert lb.deposit(Deposit(1, "mc", 1, 7, "a1"), launch) is True
    assert launched == [[(0, "mc", 1, "a0"), (1, "mc", 1, "a1"), (2, "mc", 1, "a2")]]  # rank order
    assert lb.pending() == {}


def test_calls_pair_by_order_not_by_arrival():
    lb = LoopbackLaunches(2)
    launched, launch = recorder()
    lb.deposit(Deposit(0, "mc", 1, 7), launch)
    lb.deposit(Deposit(0, "red", 2, 7), launch)  # rank 0 runs ahead by two operations
    assert launched == [] and lb.pending() == {0: [0], 1: [0]}
    assert lb.deposit(Deposit(1, "mc", 1, 7), launch) is True
    assert lb.deposit(Deposit(1, "red", 2, 7), launch) is True
    assert [[x[1] for x in one] for one in launched] == [["mc", "mc"], ["red", "red"]]


def test_threads_launch_each_set_exactly_once():
    world, ops = 4, 50
    lb = LoopbackLaunches(world)
    launched, launch = recorder()
    lock = threading.Lock()

    def safe(deps):
        with lock:
            launch(deps)

    def rank(r):
        for i in range(ops):
            lb.deposit(Deposit(r, i % 2, i + 1, 7, (r, i)), safe)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(launched) == ops
    for one in launched:
        i = one[0][3][1]
        assert one == [(r, i % 2, i + 1, (r, i)) for r in range(world)]
    assert sorted(one[0][3][1] for one in launched) == list(range(ops))


def test_different_operations_are_named():
    lb = LoopbackLaunches(2)
    _, launch = recorder()
    lb.deposit(Deposit(0, "weight_sync", 1, 7), launch)
    with pytest.raises(
        UltracommError,
        match=r"loopback launch 0: ranks called different operations \(rank 0: "
        r"'weight_sync'; rank 1: 'grad_reduce'\)",
    ):
        lb.deposit(Deposit(1, "grad_reduce", 1, 7), launch)


def test_different_streams_are_refused():
    lb = LoopbackLaunches(2)
    launched, launch = recorder()
    lb.deposit(Deposit(0, "mc", 1, 0x10), launch)
    with pytest.raises(UltracommError, match=r"different CUDA streams \(rank 0: 0x10; rank 1: 0x20\)"):
        lb.deposit(Deposit(1, "mc", 1, 0x20), launch)
    assert launched == []


def test_rank_out_of_range():
    with pytest.raises(ValueError, match="rank 2 is out of range for a loopback domain of 2"):
        LoopbackLaunches(2).deposit(Deposit(2, "mc", 1, 0), lambda deps: None)
    with pytest.raises(ValueError, match="needs world >= 1"):
        LoopbackLaunches(0)


def test_one_set_per_window_set():
    shared: dict = {}
    w = [
        SimpleNamespace(provider="cuda_local", loopback=True, shared=shared, world=2, peer_bases=[16, 32])
        for _ in range(2)
    ]
    other = SimpleNamespace(provider="cuda_local", loopback=True, shared=shared, world=2, peer_bases=[48, 64])
    assert launches_for(w[0]) is launches_for(w[1])
    assert launches_for(other) is not launches_for(w[0])
    with pytest.raises(ValueError, match="window 'local' is not a loopback window"):
        launches_for(SimpleNamespace(provider="local", peer_bases=[1]))
