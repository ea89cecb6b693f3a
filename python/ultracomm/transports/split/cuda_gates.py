"""The GPU ``split`` side stream's flag waits and flag writes as releasable gate kernels (issue 35).

A ``cuStreamWaitValue64`` on a flag that only a kernel or a peer raises cannot be cancelled: when
the flag never comes (the kernel timed out, the peer died) the side stream stays blocked for good
and any device-wide synchronize after the failure hangs.  So the side stream's WAIT_GE and WRITE
records (:mod:`.stream`) run as launches of ``copy_engine``'s gate kernel
(``csrc/cuda/ce_gate.cuh``, :mod:`..copy_engine.gate`: one CTA, JIT-compiled from embedded PTX):
a run of waits is one *wait gate*, a run of writes one *write gate* (never both: see below).  A
wait gate spins on its flags (relaxed system-scope loads, its abort word every 64 spins) and
leaves once they are there or its abort word (:data:`.cuda_watchdog.OPEN`) is set; a write gate
writes its flags (after a system-scope fence) unless its abort word
(:data:`.cuda_watchdog.SKIP`) is set.  The side watchdog sets ``skip``, then aborts the NCCL
group, then sets ``open`` (:meth:`.cuda_watchdog.SideWatchdog.release`): a receive the abort
releases is followed by a write gate that writes nothing (no flag claims a chunk that did not
arrive), and a send behind a released wait finds its communicator aborted (it moves nothing).
Two words because the two orders conflict; so waits and writes are never one gate.  Messages
(NCCL SEND / RECV, the loopback's COPY) stay where they were, between the gates; a loopback copy
is local (stale bytes into a slot of a failed operation, its flag write skipped).

The writes keep their release semantics: ``cuStreamWriteValue64``'s default flags put a memory
barrier before the write; the gate's ``fence.acq_rel.sys`` before its stores does the same for
what earlier work on the stream wrote.

Descriptors (:func:`..copy_engine.gate.descriptor`'s format, no copies) live in pinned host
memory, one table per (stream program, addresses), cached; a table dropped from the cache is
kept until no op is in flight (:meth:`Gates.collect`), as a queued gate still reads it.  SMs: a
gate needs one CTA beside the persistent kernel (NCCL's reserve off a loopback domain; a
loopback domain leaves :data:`GATE_SM_RESERVE` SMs free).
"""

from __future__ import annotations

import ctypes
from typing import Any, Callable, Optional, Sequence

import numpy as np
import torch

from ..copy_engine.gate import KERNEL, PTX, THREADS
from .stream import WAIT_GE, WRITE, StreamOp
from ...errors import InputError

__all__ = ["GATE_SM_RESERVE", "Gates", "gated", "table_words", "gate_args", "run_gate_on_host"]

GATE_SM_RESERVE = 2  # SMs a loopback domain's kernel leaves free for the side stream's gates
_EPOCH_WORD = (1 << 64) - 1  # the kernel's kEpoch: "the launch's epoch"
_CACHE = 256


def gated(ops: Sequence[StreamOp], addr_of: Callable[[StreamOp], int]) -> list[tuple]:
    """``ops`` as the side stream runs them: ``("gate", waits, writes)`` (flag addresses, in order;
    one of the two empty) for each run of WAIT_GE or of WRITE records, ``("op", op)`` for each
    message, in stream order."""
    out: list[tuple] = []
    waits: list[int] = []
    writes: list[int] = []

    def flush() -> None:
        if waits or writes:
            out.append(("gate", tuple(waits), tuple(writes)))
            waits.clear()
            writes.clear()

    for op in ops:
        if op.kind == WAIT_GE:
            if writes:  # a wait gate and a write gate have different abort words
                flush()
            waits.append(addr_of(op))
        elif op.kind == WRITE:
            if waits:
                flush()
            writes.append(addr_of(op))
        else:
            flush()
            out.append(("op", op))
    flush()
    return out


def table_words(steps: Sequence[tuple]) -> tuple[np.ndarray, list[int]]:
    """Every gate's descriptor of ``steps`` (:func:`gated`) in one uint64 array (each at a 16-byte
    aligned word offset) and each gate's offset, in order."""
    words: list[int] = []
    at: list[int] = []
    for s in steps:
        if s[0] != "gate":
            continue
        at.append(len(words))
        waits, writes = s[1], s[2]
        words += [len(waits), 0, len(writes), 0]
        for a in waits:
            words += [a, _EPOCH_WORD, 0]  # GEQ epoch (cyclic compare, as cuStreamWaitValue64's GEQ)
        for a in writes:
            words += [a, _EPOCH_WORD]
        if len(words) % 2:
            words.append(0)
    return np.array(words, dtype=np.uint64), at


def _pinned(n: int) -> torch.Tensor:
    return torch.zeros(max(1, n), dtype=torch.int64, pin_memory=True)


class Gates:
    """One side stream's gate tables and launches.  ``abort_addrs``: (write gates' abort word, wait
    gates' abort word): the side watchdog's ``SKIP`` and ``OPEN`` words; ``alloc(n)``: ``n`` int64
    words the device can read (pinned host memory; tests: a plain tensor)."""

    def __init__(self, abort_addrs: tuple[int, int], alloc: Callable[[int], torch.Tensor] = _pinned):
        self.skip_addr, self.open_addr = (int(a) for a in abort_addrs)
        self.alloc = alloc
        self._cache: dict[tuple, tuple] = {}  # key -> (ops, table, steps with descriptor addresses)
        self._retired: list = []

    def steps(self, ops: Sequence[StreamOp], addr_of: Callable[[StreamOp], int]) -> list[tuple]:
        """``("gate", descriptor address, its abort word)`` / ``("op", op)`` of ``ops`` (cached per
        ops and addresses)."""
        addrs = tuple(addr_of(o) if o.kind in (WAIT_GE, WRITE) else 0 for o in ops)
        key = (id(ops), addrs)
        hit = self._cache.get(key)
        if hit is not None and hit[0] is ops:
            return hit[2]
        # gated() asks for the address of every WAIT_GE / WRITE once, in stream order
        it = iter([a for o, a in zip(ops, addrs) if o.kind in (WAIT_GE, WRITE)])
        plain = gated(ops, lambda o: next(it))
        words, at = table_words(plain)
        table = self.alloc(len(words))
        if len(words):
            table.numpy().view(np.uint64)[: len(words)] = words
        base = int(table.data_ptr())
        offsets = iter(at)
        steps = [
            ("gate", base + 8 * next(offsets), self.open_addr if s[1] else self.skip_addr) if s[0] == "gate" else s
            for s in plain
        ]
        if len(self._cache) >= _CACHE:
            self._retired += self._cache.values()
            self._cache.clear()
        self._cache[key] = (ops, table, steps)
        return steps

    def collect(self, idle: bool) -> None:
        """Free tables dropped from the cache once ``idle`` (no op of the side stream in flight,
        none failed: no queued gate reads them)."""
        if idle:
            self._retired.clear()

    def launch(self, drv: Any, stream: int, step: tuple, epoch: int) -> None:
        """One gate (``step``: ``("gate", descriptor, abort word)`` of :meth:`steps`) at ``epoch`` on ``stream``."""
        drv.launch(
            drv.function(PTX, KERNEL),
            THREADS,
            stream,
            [ctypes.c_void_p(step[1]), ctypes.c_uint64(int(epoch)), ctypes.c_void_p(step[2])],
        )

    def held(self) -> int:
        """Tables held (cached and retired)."""
        return len(self._cache) + len(self._retired)


def gate_args(args: Sequence[Any]) -> tuple[int, int, int]:
    """(descriptor, epoch, abort word) of a gate launch's ctypes arguments (fake drivers in tests)."""
    return int(args[0].value or 0), int(args[1].value), int(args[2].value or 0)


def run_gate_on_host(
    desc: int,
    epoch: int,
    abort_word: int,
    read: Callable[[int], int],
    write: Callable[[int, int], None],
    waiting: Optional[Callable[[], None]] = None,
) -> bool:
    """What the gate kernel does, on host memory (CPU tests): wait for each flag ``>= epoch`` (cyclic)
    unless the abort word is set, then write each flag = epoch; False (nothing written) if aborted.
    ``waiting()``: called between polls of a flag not yet there (a test's bound or pause)."""
    w = lambda at, n: list((ctypes.c_uint64 * n).from_address(at))  # noqa: E731
    n_wait, n_copy, n_write, _ = w(desc, 4)
    if n_copy:
        raise InputError("ultracomm split: a side-stream gate holds no copies")
    if read(abort_word):  # as the kernel: the abort word at entry, then while waiting
        return False
    at = desc + 32
    value = lambda v: epoch if v == _EPOCH_WORD else v  # noqa: E731
    for addr, v, _eq in (w(at + 24 * i, 3) for i in range(n_wait)):
        while ((read(addr) - value(v)) & ((1 << 64) - 1)) >= (1 << 63):
            if read(abort_word):
                return False
            if waiting is not None:
                waiting()
    at += 24 * n_wait
    for addr, v in (w(at + 16 * i, 2) for i in range(n_write)):
        write(addr, value(v))
    return True
