"""The GPU split transport's control logic on the CPU (fakes for the kernel, the driver, NCCL and
the side stream): what run() enqueues, in which order, at which addresses; device shadows only
for the peers an op crosses to; the loopback domain's one merged sequence; bad inputs.
(The device runs are in test_split_cuda_gpu.py.)"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ultracomm import ExpertLayout, Member, PlanError, ReplicaPlan
from ultracomm.records import Op
from ultracomm.schedule import build_schedule
from ultracomm.transports.host import Masters
from ultracomm.transports.split.cuda import SplitCudaTransport
from ultracomm.transports.split.cuda_gates import Gates, gate_args, gated
from ultracomm.transports.split.cuda_shadow import NO_SHADOW, DeviceShadows
from ultracomm.transports.split.cuda_watchdog import DONE, PROGRESS, STARTED, SideWatchdog, progress_value
from ultracomm.transports.tma.loopback import LoopbackRunner
from ultracomm.transports.split.stream import COPY, OWN, loopback_sequence, stream_program

from test_gpu_paths_cpu import Bindings, assert_reached_cuda, real_cuda  # noqa: F401 - real_cuda is a fixture
from test_split_stream import DOM, WL, programs_2x2

PLAN = ReplicaPlan.make(np.array([[-1], [-1], [0], [0]], dtype=np.int32), experts_per_rank=1)
LAYOUT = ExpertLayout((Member("w", (64,), torch.float32),), grad_dtype=torch.float32)  # 256 B, as WL


def schedule(mode):
    return build_schedule(PLAN, 256, 256, chunk_bytes=128, relay_mode=mode, node_of=[0, 0, 1, 1])


class Log(list):
    pass


class FakeCuda:
    """The two things tma_loopback.LoopbackRunner takes from ultracomm._cuda."""

    def __init__(self, log):
        self.log = log

    def PlanArena(self, device, num_slots, **bounds):  # noqa: N802 - the binding's name
        return SimpleNamespace(device=device, num_slots=num_slots)

    def Runner(self, device):
        return SimpleNamespace(
            take_error=lambda: None,
            launch_slot=lambda arena, slot, op, ranks, epoch, ctas, stream, coop, reduce_path="hunk": self.log.append(
                ("launch_all", tuple(ranks) if ranks is not None else None, epoch, ctas, stream)
            ),
        )


class FakeTma:
    def __init__(self, log, rank, shared=None):
        self.log, self.rank = log, rank
        self._bases = []
        self.multicast_sms = self.reduce_sms = 4
        if shared is not None:  # one LoopbackRunner per loopback domain, as tma_loopback.runner_for keeps it
            self._loopback = shared.setdefault("runner", LoopbackRunner(FakeCuda(log), 4, 0, 5.0))

    def close(self):
        self.log.append(("tma_close", self.rank))

    def check_error(self):  # the kernel recorded nothing (loopback: the domain's runner says)
        if hasattr(self, "_loopback"):
            self._loopback.check_error(self.rank)

    def run(self, op, schedule, epoch, masters, my_slots, local_index_of, op_name, stream):
        self.log.append(("kernel", self.rank, int(op), epoch, stream, tuple(self._bases)))
        return True

    def _rank_args(self, op, schedule, masters, my_slots, local_index_of):
        return ("key", self.rank, int(op), schedule.digest), lambda: ("args", self.rank, int(op))

    def loopback_arena(self, masters, local_index_of):  # the real one allocates the domain's plan arena
        return self._loopback


class FakeDriver:
    def __init__(self, log):
        self.log = log

    def wait_value(self, stream, addr, value, equal=False):
        self.log.append(("wait", stream, addr, value))

    def write_value(self, stream, addr, value):
        self.log.append(("write", stream, addr, value))

    def memcpy(self, dst, src, nbytes, stream):
        self.log.append(("copy", stream, dst, src, nbytes))

    def function(self, ptx, name):
        assert name == "uc_ce_gate" and ".entry uc_ce_gate" in ptx
        return 0xF00

    def launch(self, function, threads, stream, args):
        """A gate (cuda_gates): logged as ("gate", stream, its wait flags, its write flags, epoch)."""
        desc, epoch, abort = gate_args(args)
        assert function == 0xF00 and threads == 256
        w = lambda at, n: list((ctypes.c_uint64 * n).from_address(at))  # noqa: E731
        n_wait, n_copy, n_write, _ = w(desc, 4)
        assert n_copy == 0 and desc % 16 == 0
        waits = [w(desc + 32 + 24 * i, 3) for i in range(n_wait)]
        writes = [w(desc + 32 + 24 * n_wait + 16 * i, 2) for i in range(n_write)]
        assert all(v == (1 << 64) - 1 and eq == 0 for _, v, eq in waits) and all(v == (1 << 64) - 1 for _, v in writes)
        # a gate waits or writes, not both; a wait gate's abort word is the watchdog's open, a write gate's its skip
        assert bool(waits) != bool(writes) and abort == self.abort[0 if writes else 1]
        self.log.append(("gate", stream, tuple(a for a, _, _ in waits), tuple(a for a, _ in writes), epoch))

    bound: tuple = ()
    abort = None

    def bind(self, device):  # not in the log: it orders nothing on a stream
        self.bound += (device,)


class FakeMessenger:
    def __init__(self, log):
        self.log = log

    def post(self, kind, buf, peer, side):
        self.log.append((kind, side, buf.data_ptr(), buf.numel(), peer))


class FakeSide:
    def __init__(self, log):
        self.log = log

    def get(self):
        return 77, "side77"

    def fork(self, caller):
        self.log.append(("fork", caller))

    def close(self):
        pass


def host_words(n):
    return torch.zeros(n, dtype=torch.int64)


def transport(rank, log, window, **kw):
    dog = SideWatchdog(rank, 5.0, lambda e: None, words=torch.zeros(5, dtype=torch.int64), autostart=False)
    drv = FakeDriver(log)
    drv.abort = dog.gate_addrs()
    return SplitCudaTransport(
        comm=None,
        rank=rank,
        world=4,
        window=window,
        wlayout=WL,
        layout=None,
        num_workers=1,
        timeout_s=5.0,
        domain_of=kw.pop("domain_of", DOM),
        tma=FakeTma(log, rank, getattr(window, "shared", None)),
        drv=drv,
        messenger=kw.pop("messenger", FakeMessenger(log)),
        side=FakeSide(log),
        dog=dog,
        gates=Gates(dog.gate_addrs(), alloc=host_words),
        **kw,
    )


def bracketed(t, caller, epoch, body):
    """What _bridged puts around the crossings: started, a progress word after each message, done,
    and the caller's join on done."""
    out = [("write", 77, t.dog.addr(STARTED), epoch)]
    k = 0
    for x in body:
        out.append(x)
        if x[0] in ("send", "recv", "copy"):
            k += 1
            out.append(("write", 77, t.dog.addr(PROGRESS), progress_value(epoch, k)))
    return out + [("write", 77, t.dog.addr(DONE), epoch), ("wait", caller, t.dog.addr(DONE), epoch)]


def window_of(rank, bases=None, **kw):
    local = torch.zeros(WL["total_bytes"], dtype=torch.uint8)
    if bases is None:
        bases = [4096 * (r + 1) if DOM[r] == DOM[rank] else 0 for r in range(4)]
        bases[rank] = local.data_ptr()
    return SimpleNamespace(local=local, peer_bases=bases, provider="fake", world=4, **kw)


def expected(ops, epoch, own, shadows):
    addr = {OWN: own}
    addr.update({q: t.data_ptr() for q, t in shadows.items()})
    out = []
    for s in gated(ops, lambda o: addr[o.ref.shadow] + o.ref.off):  # the grouping: test_gates_group_*
        if s[0] == "gate":
            out.append(("gate", 77, s[1], s[2], epoch))
        else:
            o = s[1]
            out.append((o.kind, "side77", addr[o.ref.shadow] + o.ref.off, o.nbytes, o.peer))
    return out


@pytest.mark.parametrize("mode", ["force", "off"])
@pytest.mark.parametrize("op", [Op.MULTICAST, Op.REDUCE])
def test_run_enqueues_fork_kernel_crossings_join_in_order(mode, op):
    log = Log()
    win = window_of(0)
    t = transport(0, log, win)
    assert t.run(op, schedule(mode), 3, None, [-1], [0], "weight_sync", 5) is True
    peers = programs_2x2(mode, op)[0].peers
    assert sorted(t.shadows.views) == list(peers)  # shadows only for the peers this op crosses to
    assert all(v.numel() == WL["total_bytes"] and not v.any() for v in t.shadows.views.values())
    table = (win.local.data_ptr(), 8192) + tuple(
        t.shadows.views[q].data_ptr() if q in peers else NO_SHADOW for q in (2, 3)
    )
    ops = stream_program(programs_2x2(mode, op)[0], WL)
    assert log == [("fork", 5), ("kernel", 0, int(op), 3, 5, table)] + bracketed(
        t, 5, 3, expected(ops, 3, win.local.data_ptr(), t.shadows.views)
    )
    assert t.dog.pending() == 1


def test_an_op_that_crosses_nothing_is_the_kernel_alone():
    log = Log()
    t = transport(1, log, window_of(1))
    t.run(Op.MULTICAST, schedule("force"), 4, None, [-1], [0], "weight_sync", 9)
    assert log == [("kernel", 1, 0, 4, 9, (4096, t.window.local.data_ptr(), NO_SHADOW, NO_SHADOW))]
    assert t.shadows.views == {}


def test_loopback_ranks_deposit_and_the_last_enqueues_one_merged_sequence():
    log = Log()
    shared: dict = {}
    bases = [1000, 2000, 3000, 4000]
    wins = [window_of(r, bases=list(bases), loopback=True, shared=shared) for r in range(4)]
    ts = [transport(r, log, wins[r]) for r in range(4)]
    sched = schedule("force")
    for r in range(3):
        assert ts[r].run(Op.REDUCE, sched, 6, None, [-1], [0], "grad_reduce", 11) is False
        assert log == []  # nothing enqueued before every rank deposited
    assert ts[3].run(Op.REDUCE, sched, 6, None, [-1], [0], "grad_reduce", 11) is True
    seq = loopback_sequence([p for p in programs_2x2("force", Op.REDUCE) if p.peers], WL)
    assert [o.kind for o in seq].count(COPY) == 2 * 2 + 2  # both headers' two words, two chunks

    def addr(rank, ref):
        t = ts[rank]
        return (wins[rank].local.data_ptr() if ref.shadow == OWN else t.shadows.views[ref.shadow].data_ptr()) + ref.off

    want = []
    for s in gated(seq, lambda o: addr(o.rank, o.ref)):
        if s[0] == "gate":
            want.append(("gate", 77, s[1], s[2], 6))
        else:
            o = s[1]
            want.append(("copy", 77, addr(o.rank, o.ref), addr(o.peer, o.src), o.nbytes))
    plan = tuple(("args", r, 1) for r in range(4))
    assert log == [("fork", 11), ("launch_all", plan, 6, 4, 11)] + bracketed(ts[3], 11, 6, want)
    assert sorted(ts[0].shadows.views) == [2] and sorted(ts[2].shadows.views) == [0] and not ts[1].shadows.views


def test_loopback_ranks_on_different_plans_all_raise_the_kernels_plan_error_before_anything_moves():
    log = Log()
    shared: dict = {}
    wins = [window_of(r, bases=[1000, 2000, 3000, 4000], loopback=True, shared=shared) for r in range(4)]
    ts = [transport(r, log, wins[r]) for r in range(4)]
    a, b = schedule("force"), schedule("off")
    for r in range(3):
        assert ts[r].run(Op.MULTICAST, b if r == 2 else a, 8, None, [-1], [0], "weight_sync", 11) is False
    with pytest.raises(PlanError, match=r"rank 3 weight_sync .*rank 2 runs a different plan for this operation"):
        ts[3].run(Op.MULTICAST, a, 8, None, [-1], [0], "weight_sync", 11)
    assert log == []  # nothing enqueued
    for r in range(3):
        with pytest.raises(PlanError, match=f"rank {r} weight_sync .*rank {0 if r == 2 else 2} runs a different plan"):
            ts[r].check_error()
        ts[r].check_error()  # raised once
    ts[3].check_error()  # the launcher's own run() raised it


def test_bad_inputs_are_refused_with_what_to_do():
    log = Log()
    with pytest.raises(ValueError, match=r"needs domain_of, one memory domain per rank \(4\); got \[0, 1\]"):
        transport(0, log, window_of(0), domain_of=[0, 1])
    bases = [1, 0, 0, 0]  # rank 1 shares rank 0's domain but the window does not reach it
    with pytest.raises(ValueError, match="rank 1 is in this rank's memory domain but the window does not reach it"):
        transport(0, log, window_of(0, bases=bases))
    sh = DeviceShadows(0, DOM, 64, "cpu")
    with pytest.raises(ValueError, match="rank 1 shares rank 0's memory domain; it gets no shadow"):
        sh.ensure([1])
    assert sh.ensure([2]) and not sh.ensure([2]) and sh.bytes_held() == 64
    assert sh.bases([10, 11, 12, 13]) == [10, 11, sh.views[2].data_ptr(), NO_SHADOW]


@pytest.mark.parametrize("loopback", [False, True])
def test_the_pointer_tables_pass_the_real_bindings_plan_checks(real_cuda, monkeypatch, loopback):
    """With the real ``_cuda`` binding (no device: it fails at its first CUDA call, which comes
    before its plan validation), every rank's plan arguments convert; the pointer tables -- shadows
    and NO_SHADOW for other domains -- hold no null or misaligned base, which csrc/host/validate_exec.cpp
    would refuse on a device."""
    from ultracomm.transports.split import cuda as split_cuda_mod
    from ultracomm.transports import tma as tma_mod

    monkeypatch.setattr(tma_mod, "cuda_runtime", lambda device, what="": Bindings(real_cuda))
    monkeypatch.setattr(
        split_cuda_mod,
        "DeviceShadows",
        lambda *a: DeviceShadows(*a[:3], "cpu", alloc=lambda n, dev: torch.zeros(n, dtype=torch.uint8)),
    )
    shared: dict = {}
    ts = []
    for r in range(4):
        win = SimpleNamespace(
            provider="cuda_local" if loopback else "cuda_ipc",
            world=4,
            loopback=loopback,
            shared=shared,
            local=SimpleNamespace(device=torch.device("cuda", 0)),
            peer_bases=[0x7000_0000_0000 + (i << 32) if loopback or DOM[i] == DOM[r] else 0 for i in range(4)],
        )
        log = Log()
        ts.append(
            SplitCudaTransport(
                comm=None,
                rank=r,
                world=4,
                window=win,
                wlayout=WL,
                layout=LAYOUT,
                num_workers=1,
                timeout_s=2.0,
                multicast_sms=2,
                reduce_sms=2,
                domain_of=DOM,
                drv=FakeDriver(log),
                messenger=FakeMessenger(log),
                side=FakeSide(log),
                dog=SideWatchdog(r, 2.0, log.append, words=torch.zeros(5, dtype=torch.int64), autostart=False),
            )
        )
    assert [t.tma.multicast_sms for t in ts] == [2] * 4  # below the NCCL reserve's cap (132 - 16 SMs)
    w = (torch.zeros((1, 64), dtype=torch.float32),)
    masters = Masters.of(w, w, 1, ["w"])
    for op in (Op.MULTICAST, Op.REDUCE):
        with pytest.raises(RuntimeError) as ei:
            for t in ts:  # a loopback set reaches the binding at its last rank
                t.run(
                    op,
                    schedule("force"),
                    1,
                    masters,
                    PLAN.slot_src[t.rank].tolist(),
                    PLAN.local_index_of.tolist(),
                    "x",
                    0,
                )
        assert_reached_cuda(ei)
    assert ts[0].tma._bases[2] == ts[0].shadows.views[2].data_ptr() and ts[0].tma._bases[3] == NO_SHADOW
    assert all(b != 0 and b % 8 == 0 for t in ts for b in t.tma._bases)
