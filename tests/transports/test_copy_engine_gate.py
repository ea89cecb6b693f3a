"""The copy_engine gates (issue 35): no internal-stream wait whose only releaser is a peer.

On simulated streams (host windows, a fake clock, ``plan.simulate`` running ``gate`` commands as
the gate kernel does): the gated programs move the host executor's bytes; a stalled rank, a dead
rank (never starts) and a peer on another plan each end with every stream of every survivor
drained (nothing left blocked, so a device-wide synchronize would return), a named error, and
nothing written into the rank that is not in the epoch with this plan.  Also: the gate kernel's
PTX is the current build of ``csrc/cuda/ce_gate.cuh`` and compiles without spills."""

from __future__ import annotations

import os
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch

from ultracomm import ReplicaPlan
from ultracomm.errors import PlanError, UltracommTimeout
from ultracomm.records import Op
from ultracomm.transports.copy_engine import gate as gate_mod
from ultracomm.transports.copy_engine.plan import MAIN, abort_addr, gate_commands, host_words, simulate, word_addr
from ultracomm.transports.copy_engine.watchdog import Watchdog, pending_for, read_host
from ultracomm.transports.host import op_digest

from conftest import hot_slot_src, random_slot_src
from copy_engine_sim import host_contexts, host_reference, new_words, pools, rank_commands, set_epoch

WORLD, EPR, SLOTS, TIMEOUT = 5, 2, 3, 30.0
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class Clock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


@pytest.fixture(scope="module", params=["force", "off"])
def domain(request):
    ctxs, each = host_contexts(WORLD, EPR, SLOTS, request.param)
    yield ctxs, each
    for c in ctxs:
        c.close()


def hot_plan():
    return ReplicaPlan.make(hot_slot_src(WORLD, SLOTS, EPR, expert=1), experts_per_rank=EPR)


def gated(c, plan, words, digest=None):
    return gate_commands(rank_commands(c, plan, words, digest), words.ctypes.data, host_words(WORLD))


def aborts(words):
    return [abort_addr(w.ctypes.data, WORLD) for w in words]


def test_gated_programs_have_no_bare_wait_and_move_the_host_bytes(domain):
    ctxs, each = domain
    for seed, plan in enumerate(
        [hot_plan()]
        + [
            ReplicaPlan.make(random_slot_src(np.random.default_rng(s), WORLD, SLOTS, EPR), experts_per_rank=EPR)
            for s in range(3)
        ]
    ):
        want, epoch = host_reference(ctxs, each, plan)
        words = new_words(WORLD)
        programs = [gated(c, plan, words[c.rank]) for c in ctxs]
        for prog in programs:
            # an internal stream's only commands: forked, gates, done writes (host words)
            assert all(x.kind in ("forked", "gate", "write") for x in prog if x.stream != MAIN)
            assert all(x.kind != "write" or x.what.startswith("done") for x in prog if x.stream != MAIN)
            for g in (x for x in prog if x.kind == "gate"):  # waits first, then what they guard
                kinds = [p.kind for p in g.parts]
                n = sum(k in ("wait", "wait_eq") for k in kinds)
                assert all(k in ("wait", "wait_eq") for k in kinds[:n]) and all(
                    k in ("copy", "write") for k in kinds[n:]
                )
        skipped: list = []
        assert simulate(programs, epoch, seed=seed, aborts=aborts(words), skipped=skipped) == []
        assert not skipped
        got = pools(ctxs)
        set_epoch(ctxs, epoch)
        for r in range(WORLD):
            assert torch.equal(got[r], want[r]), f"rank {r}"


def test_gate_descriptor_layout():
    from ultracomm.transports.copy_engine.plan import EPOCH, Cmd

    g = Cmd(
        "gate",
        0,
        parts=(
            Cmd("wait", 0, 0x100),
            Cmd("wait_eq", 0, 0x108, 77),
            Cmd("copy", 0, 0x200, src=0x300, nbytes=48),
            Cmd("write", 0, 0x400),
        ),
    )
    d = gate_mod.descriptor(g)
    assert d.tolist() == [2, 1, 1, 0, 0x100, 2**64 - 1, 0, 0x108, 77, 1, 0x200, 0x300, 48, 0x400, 2**64 - 1]
    words, at = gate_mod.pack([Cmd("forked", 0), g, g])
    assert at == {1: 0, 2: 16} and len(words) == 32  # entries padded to 16 bytes
    with pytest.raises(ValueError, match="only waits, copies and writes"):
        gate_mod.descriptor(Cmd("gate", 0, parts=(Cmd("fork", 0),)))
    assert EPOCH == -1


def run_failure(domain, lost, digests=None, started=True):
    """Every rank but ``lost`` runs gated programs under watchdogs (``lost`` runs none: stalled or
    dead; with ``digests`` the rank of another plan runs its own); the watchdogs poll as time passes.
    Returns (contexts, pools before, after, errors by rank, skipped gates, blocked, epoch, words)."""
    ctxs, each = domain
    plan = hot_plan()
    _, epoch = host_reference(ctxs, each, plan)
    before = pools(ctxs)
    words = new_words(WORLD)
    digests = digests or {}
    programs = [
        [] if (r == lost and not digests) else gated(c, plan, words[r], digests.get(r)) for r, c in enumerate(ctxs)
    ]
    clock = Clock()
    dogs = {}
    for c in ctxs:
        if c.rank == lost and not digests:
            continue
        d = Watchdog(c.rank, TIMEOUT, read_host, clock=clock, check_s=1.0)
        dg = digests.get(c.rank, op_digest(c.schedule_for(plan).digest, Op.MULTICAST))
        ungated = rank_commands(c, plan, words[c.rank], digests.get(c.rank))
        d.add(
            pending_for(
                ungated,
                epoch,
                dg,
                "weight_sync",
                c.wlayout,
                c.window.peer_bases,
                word_addr(words[c.rank].ctypes.data, None),
                abort_addr(words[c.rank].ctypes.data, WORLD),
            )
        )
        dogs[c.rank] = d
    end = clock.t + 3 * TIMEOUT
    t0 = clock.t

    def on_stall(stuck):
        for d in dogs.values():
            d.poll()
        clock.t += TIMEOUT / 3
        for d in dogs.values():
            d.poll()
        return clock.t <= end

    skipped: list = []
    blocked = simulate(programs, epoch, seed=3, on_stall=on_stall, aborts=aborts(words), skipped=skipped)
    set_epoch(ctxs, epoch)
    errors = {r: d.take_error() for r, d in dogs.items()}
    return ctxs, before, pools(ctxs), errors, skipped, blocked, epoch, words, clock.t - t0


@pytest.mark.parametrize("lost", [3, 0])  # 0: the hot expert's home rank (every copy starts there)
def test_stalled_or_dead_rank_every_survivor_stream_drains(domain, lost):
    ctxs, before, after, errors, skipped, blocked, epoch, words, took = run_failure(domain, lost)
    assert blocked == []  # every stream of every survivor finished: nothing waits for the lost rank
    assert torch.equal(after[lost], before[lost])  # nothing reached the lost rank's window
    failed = {r: e for r, e in errors.items() if e is not None}
    assert failed and all(isinstance(e, UltracommTimeout) for e in failed.values())
    assert took >= TIMEOUT
    assert skipped and {r for r, _ in skipped} <= set(failed)  # only failed ranks' gates skipped
    # among them the gates that would have copied into the lost rank had a peer released them
    assert any(p.peer == lost for _, g in skipped for p in g.parts if p.kind in ("wait", "wait_eq"))
    for r in failed:  # abort word set, joins released
        assert read_host([abort_addr(words[r].ctypes.data, WORLD)]) == [1]
    for r in set(range(WORLD)) - set(failed) - {lost}:  # a rank that did finish holds the plan's bytes
        assert read_host([abort_addr(words[r].ctypes.data, WORLD)]) == [0]


def test_peer_on_another_plan_every_stream_drains_and_nothing_reaches_it(domain):
    other = 2
    ctxs, before, after, errors, skipped, blocked, epoch, words, took = run_failure(
        domain, other, digests={other: 0x5EED}
    )
    assert blocked == []
    failed = {r: e for r, e in errors.items() if e is not None}
    assert any(isinstance(e, PlanError) for e in failed.values())
    assert took < TIMEOUT  # found by the digest check, before the timeout
    # the gates whose equality wait on its digest never passed were released and skipped: nothing
    # reached the rank on another plan
    assert any(p.kind == "wait_eq" and p.peer == other for _, g in skipped for p in g.parts)
    end = ctxs[0].wlayout["ready_off"]
    assert torch.equal(after[other][:end], before[other][:end])


@pytest.mark.skipif(shutil.which("nvcc") is None or shutil.which("ptxas") is None, reason="needs nvcc and ptxas")
def test_gate_kernel_ptx_is_current_and_compiles_without_spills(tmp_path):
    src = os.path.join(ROOT, "csrc", "cuda", "ce_gate.cuh")
    out = tmp_path / "gate.ptx"
    subprocess.run(gate_mod.NVCC + [src, "-o", str(out)], check=True, capture_output=True)
    strip = lambda t: "\n".join(
        l
        for l in t.splitlines()
        if not l.startswith("// Compiler Build ID")
        and not l.startswith("// Cuda compilation tools")
        and not l.startswith("// Based on")
    )
    assert strip(out.read_text()) == strip(gate_mod.PTX), "regenerate gate.PTX from csrc/cuda/ce_gate.cuh (gate.NVCC)"
    assert ".entry uc_ce_gate" in gate_mod.PTX
    assert "ld.global.nc" not in gate_mod.PTX  # peers' bytes: never the non-coherent path
    assert "ld.relaxed.sys" in gate_mod.PTX and "fence.acq_rel.sys" in gate_mod.PTX
    for arch in ("sm_80", "sm_90", "sm_100"):  # what the driver JIT-compiles it for on those GPUs
        info = subprocess.run(
            ["ptxas", f"-arch={arch}", "-v", str(out), "-o", str(tmp_path / "gate.cubin")],
            check=True,
            capture_output=True,
            text=True,
        ).stderr
        assert re.search(r"0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads", info), (arch, info)


def test_driver_loads_the_gate_once_per_context_and_passes_its_arguments():
    """Driver.function / Driver.launch marshal as cuModuleLoadData / cuLaunchKernel expect (a fake libcuda)."""
    import ctypes

    from ultracomm.cuda.driver import SIGNATURES, Driver

    calls = []

    class Fn:
        def __init__(self, sym):
            self.sym, self.argtypes, self.restype = sym, None, None

        def __call__(self, *args):
            calls.append((self.sym, args))
            if self.sym == "cuCtxGetCurrent":
                ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = 0xC0
            elif self.sym in ("cuModuleLoadData", "cuModuleGetFunction"):
                ctypes.cast(args[0], ctypes.POINTER(ctypes.c_void_p))[0] = 0xAB if "Load" in self.sym else 0xF0
            elif self.sym == "cuLaunchKernel":
                params = ctypes.cast(args[9], ctypes.POINTER(ctypes.c_void_p))
                calls[-1] = (self.sym, args[:9] + ([ctypes.c_uint64.from_address(params[i]).value for i in range(3)],))
            return 0

    class Lib:
        def __getattr__(self, sym):
            if sym.startswith("_"):
                raise AttributeError(sym)
            f = Fn(sym)
            setattr(self, sym, f)
            return f

    drv = Driver(Lib())
    assert set(drv.symbols) == set(SIGNATURES)
    f = drv.function(gate_mod.PTX, gate_mod.KERNEL)
    assert f == 0xF0 and drv.function(gate_mod.PTX, gate_mod.KERNEL) == f  # loaded once per context
    assert sum(s == "cuModuleLoadData" for s, _ in calls) == 1
    drv.launch(f, gate_mod.THREADS, 0x5, [ctypes.c_void_p(0x1000), ctypes.c_uint64(7), ctypes.c_void_p(0x2000)])
    sym, args = calls[-1]
    assert sym == "cuLaunchKernel" and args[1:9] == (1, 1, 1, gate_mod.THREADS, 1, 1, 0, 0x5)
    assert args[9] == [0x1000, 7, 0x2000]
