"""A receiver's drain scans a slot's chunk flags with the whole group (interp.h first_below,
issue 34's "Drain" item), and waits only for a chunk not up yet, as a task waits.

tests/cpp/drain_check.cpp runs rank 0 through run_host with no task (join, then drain) while a
thread playing its parent raises the chunk flags of several slots in a shuffled order, many
small chunks per slot, pausing between flags; built with -fsanitize=thread.  The drain must
return only after the last flag (none below the epoch when it returns), the bytes delivered
must be exact, and ThreadSanitizer must order the receiver's reads (multicast) and writes
(reduce: the slot is free once consumed) after the parent's, flag by flag.  A chunk that never
arrives gives the error a wait per chunk gave: the same flag kind, expert, chunk, slot and
rank, within the timeout.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("g++")
pytestmark = pytest.mark.skipif(CXX is None, reason="needs g++ (the check is built by the test)")


def _compile(args: list[str]) -> None:
    r = subprocess.run(args, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(args)}\n{r.stderr[-4000:]}"


@pytest.fixture(scope="module")
def builds(tmp_path_factory) -> dict[str, Path]:
    """The check, clean and with host_flags.h's relaxed_acquire mutant (flags loaded relaxed:
    the scan's loads included; x86 hides it, ThreadSanitizer must not)."""
    out = tmp_path_factory.mktemp("drain_check")
    flags = ["-std=c++20", "-O1", "-g1", "-fsanitize=thread", "-pthread", "-Wall", "-Wextra", "-Werror"]
    flags += [f"-I{ROOT / 'include'}", f"-I{ROOT / 'csrc'}"]
    srcs = {
        "drain_check": ROOT / "tests/cpp/drain_check.cpp",
        "validate": ROOT / "csrc/host/validate_exec.cpp",
        "error_text": ROOT / "csrc/host/error_text.cpp",
    }
    variants = {"clean": [], "relaxed_acquire": ["-DULTRACOMM_MUTATE_RELAXED_ACQUIRE"]}
    jobs = [[CXX, *flags, "-c", str(s), "-o", str(out / f"{n}.o")] for n, s in srcs.items()]
    jobs += [
        [CXX, *flags, *defs, "-c", str(ROOT / "csrc/host/host_executor.cpp"), "-o", str(out / f"exec_{v}.o")]
        for v, defs in variants.items()
    ]
    with ThreadPoolExecutor(max_workers=2) as pool:
        list(pool.map(_compile, jobs))
    bins = {}
    for v in variants:
        bins[v] = out / f"drain_check_{v}"
        objs = [str(out / f"{n}.o") for n in srcs] + [str(out / f"exec_{v}.o")]
        _compile([CXX, "-fsanitize=thread", "-pthread", *objs, "-o", str(bins[v])])
    return bins


@pytest.fixture(scope="module")
def drain_check(builds) -> Path:
    return builds["clean"]


def run_check(exe: Path, *opts: str) -> tuple[subprocess.CompletedProcess, float]:
    env = dict(os.environ, TSAN_OPTIONS="halt_on_error=0 exitcode=66 report_signal_unsafe=0")
    t0 = time.monotonic()
    r = subprocess.run([str(exe), *map(str, opts)], capture_output=True, text=True, env=env, timeout=300)
    return r, time.monotonic() - t0


MOVERS = [("host", 1), ("block", 4), ("block", 7)]  # 7 threads: shares of unequal length


@pytest.mark.parametrize("mover,threads", MOVERS)
@pytest.mark.parametrize("op", ["mc", "reduce"])
def test_drain_returns_after_the_last_of_many_shuffled_flags(drain_check, mover, threads, op):
    """4 slots x 96 chunks of 64 B, raised in a shuffled order by two writers (one at once, one
    pausing), 3 epochs (the flags left at the last epoch must count as not arrived): the drain
    returns with every flag up, the bytes exact, and no race between the writers' chunk
    accesses and the receiver's."""
    r, _ = run_check(
        drain_check,
        "--mover",
        mover,
        "--threads",
        threads,
        "--op",
        op,
        "--slots",
        4,
        "--chunks",
        96,
        "--chunk-bytes",
        64,
        "--epochs",
        3,
        "--gap-us",
        50,
        "--seed",
        threads,
    )
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-3000:]
    assert r.returncode == 0 and r.stdout.count("OK drain:") == 3, r.stdout[-2000:]


def _timeout_message(op: str, expert: int, chunk: int, slot: int, timeout: str = "0.3") -> str:
    """The message a drain that waited chunk by chunk raised (csrc/host/error_text.cpp)."""
    if op == "mc":
        head, what = "weight_sync (multicast)", f"deliver expert {expert} chunk {chunk} into slot {slot} (arrival flag)"
    else:
        head, what = "grad_reduce (reduce)", f"consume expert {expert} chunk {chunk} of slot {slot} (consumed flag)"
    return f"ultracomm: rank 0 {head} epoch 1 timed out after {timeout} s waiting for rank 1 to {what}"


@pytest.mark.parametrize("mover,threads", MOVERS)
@pytest.mark.parametrize(
    "op,missing,want",
    [
        ("mc", ["1:70", "2:3", "1:71"], (1, 70, 1)),  # the first missing chunk of the first slot with one
        ("reduce", ["0:40", "0:5", "3:0"], (0, 5, 0)),
        ("mc", ["3:95"], (3, 95, 3)),  # the very last flag
    ],
)
def test_a_chunk_that_never_arrives_gives_the_wait_error(drain_check, mover, threads, op, missing, want):
    expert, chunk, slot = want
    opts = ["--mover", mover, "--threads", threads, "--op", op, "--slots", 4, "--chunks", 96, "--epochs", 1]
    for m in missing:
        opts += ["--missing", m]
    r, dt = run_check(drain_check, *opts, "--gap-us", 0, "--timeout-ms", 300)
    assert "ThreadSanitizer" not in r.stderr, r.stderr[-3000:]
    m = re.search(r"^ERROR (.*) \[(\w+)\] after", r.stdout, re.M)
    assert m and r.returncode == 1, r.stdout[-2000:]
    assert m.group(2) == "timeout" and m.group(1) == _timeout_message(op, expert, chunk, slot), m.group(1)
    assert 0.3 <= dt < 10, dt  # one wait's timeout, then failed promptly


@pytest.mark.parametrize("mover,threads", MOVERS)
def test_a_parent_that_never_joins_is_named(drain_check, mover, threads):
    r, _ = run_check(
        drain_check, "--mover", mover, "--threads", threads, "--parent-absent", "--epochs", 1, "--timeout-ms", 200
    )
    m = re.search(r"^ERROR (.*) \[timeout\] after", r.stdout, re.M)
    assert m and "ThreadSanitizer" not in r.stderr, (r.stdout[-2000:], r.stderr[-2000:])
    assert m.group(1) == _timeout_message("mc", 0, 0, 0, "0.2") + (
        "; rank 1 has not started this operation (its ready flag is at epoch 0): it is likely the stalled or dead rank"
    ), m.group(1)


@pytest.mark.parametrize("mover,threads", MOVERS)
@pytest.mark.parametrize("op", ["mc", "reduce"])
def test_mutant_relaxed_acquire_races_after_the_drain(builds, mover, threads, op):
    """Flags loaded relaxed: the drain still returns after the last flag (x86), but nothing
    orders the writers' chunk accesses before the receiver's: ThreadSanitizer reports it."""
    r, _ = run_check(
        builds["relaxed_acquire"],
        *("--mover", mover, "--threads", threads, "--op", op, "--slots", 4, "--chunks", 96, "--epochs", 2),
        *("--gap-us", 50, "--writers", 3),
    )
    assert "WARNING: ThreadSanitizer: data race" in r.stderr and r.returncode != 0, (r.stdout[-1000:], r.stderr[-1000:])
