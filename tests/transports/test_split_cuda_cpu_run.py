"""SplitCudaTransport's loopback path run end to end on the CPU: its own pointer tables, shadows,
spaces and merged side-stream sequence, with the kernel replaced by the host executor (one
thread per rank over the same pointer table the kernel would get) and the side stream by a
driver that executes each stream operation as it is enqueued (one FIFO stream).  The bytes --
replica weights, relays' partials, master grads -- must equal the host executor's over real
windows."""

from __future__ import annotations

import ctypes
import threading
import time
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from ultracomm import ReplicaPlan, _core
from ultracomm.records import Op
from ultracomm.schedule import build_schedule
from ultracomm.transports.host import HostTransport, Masters
from ultracomm.transports.split.cuda import SplitCudaTransport
from ultracomm.transports.split.cuda_gates import Gates, gate_args, run_gate_on_host
from ultracomm.transports.split.cuda_watchdog import SideWatchdog

from conftest import expert_weights, hot_slot_src, random_slot_src
from test_p2p import layout_of


TIMEOUT_S = 20.0


class NowDriver:
    """The side stream as the enqueuing thread itself: a wait blocks until the flag is there."""

    def __init__(self, timeout_s: float = 2 * TIMEOUT_S):
        self.timeout_s = timeout_s

    def bind(self, device):  # the enqueuing thread is the CPU: no context to make current
        pass

    def wait_value(self, stream, addr, value, equal=False):
        deadline = time.monotonic() + self.timeout_s
        while _core.load_acquire(addr) < value:
            assert time.monotonic() < deadline, f"side stream stuck waiting at {addr:#x} for {value}"
            time.sleep(0.0002)  # the interpreter threads raise it

    def write_value(self, stream, addr, value):
        _core.store_release(addr, value)

    def memcpy(self, dst, src, nbytes, stream):
        ctypes.memmove(dst, src, nbytes)

    def function(self, ptx, name):
        return 0xF00

    def launch(self, function, threads, stream, args):
        """A gate (cuda_gates): its waits block as wait_value's, then its writes (release)."""
        deadline = time.monotonic() + self.timeout_s

        def waiting():
            assert time.monotonic() < deadline, "side stream stuck in a gate"
            time.sleep(0.0002)

        run_gate_on_host(*gate_args(args), _core.load_acquire, _core.store_release, waiting)


class Runs:
    """Threads running host executors; their failures are kept (a thread's exception is not raised)."""

    def __init__(self):
        self.threads: list = []
        self.errors: list = []

    def start(self, fn, *args):
        def body():
            try:
                fn(*args)
            except BaseException as e:  # noqa: BLE001 - checked by the test
                self.errors.append(e)

        t = threading.Thread(target=body)
        t.start()
        self.threads.append(t)

    def join(self):
        for t in self.threads:
            t.join(60)
            assert not t.is_alive()
        self.threads.clear()
        assert not self.errors, self.errors


class HostKernel:
    """Stands in for TmaTransport: a "launch" runs each rank's host executor over the pointer
    table this transport holds (``_bases``: real windows in its domain, shadows elsewhere)."""

    def __init__(self, rank, window, wlayout, layout, runs):
        self.rank, self.window, self.wlayout, self.layout = rank, window, wlayout, layout
        self._bases, self.multicast_sms, self.reduce_sms = [], 1, 1
        self.runs = runs
        self._loopback = SimpleNamespace(launch=self._launch_all)

    def loopback_arena(self, masters, local_index_of):  # the real one allocates the domain's plan arena
        return self._loopback

    def _rank_args(self, op, schedule, masters, my_slots, local_index_of):
        bases = list(self._bases)

        def start(epoch):
            host = HostTransport(
                rank=self.rank,
                world=len(bases),
                window=self.window,
                wlayout=self.wlayout,
                layout=self.layout,
                num_workers=2,
                timeout_s=TIMEOUT_S,
                peer_bases=bases,
            )
            self.runs.start(host.run, op, schedule, epoch, masters, my_slots, local_index_of)

        return ("key", self.rank), start

    def _launch_all(self, deps, launcher):
        for d in deps:
            d.item[1](max(x.epoch for x in deps))


def windows(world, wl):
    locs = [torch.zeros(wl["total_bytes"], dtype=torch.uint8) for _ in range(world)]
    return locs, [int(t.data_ptr()) for t in locs]


def masters_of(layout, rank, epr, seed):
    per = [expert_weights(layout, e) for e in range(rank * epr, (rank + 1) * epr)]
    w = tuple(torch.stack([p[m] for p in per]).contiguous() for m in range(len(layout.members)))
    gen = torch.Generator().manual_seed(seed + rank)
    g = tuple(torch.randn((epr, *m.shape), generator=gen).to(layout.grad_dtype) for m in layout.members)
    return Masters.of(w, g, epr, layout.names), g


def fill_grads(loc, wl, rank, seed):
    gen = torch.Generator().manual_seed(seed * 31 + rank)
    n = wl["grad_stride"] * wl["slots"] // 4
    loc[wl["grads_off"] : wl["grads_off"] + 4 * n].view(torch.float32).copy_(torch.randn(n, generator=gen))


def run(world, plan, layout, epr, mode, node_of, dom, split: bool):
    wl = _core.window_layout(plan.slots_per_rank, layout.weight_bytes, layout.grad_bytes, 128)
    sched = build_schedule(
        plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=128, relay_mode=mode, node_of=node_of
    )
    locs, bases = windows(world, wl)
    ms = [masters_of(layout, r, epr, 5) for r in range(world)]
    slots = [plan.slot_src[r].tolist() for r in range(world)]
    lio = plan.local_index_of.tolist()
    for r in range(world):
        fill_grads(locs[r], wl, r, 7)
    runs = Runs()
    shared: dict = {}
    ts = []
    for r in range(world):
        win = SimpleNamespace(
            local=locs[r], peer_bases=list(bases), loopback=True, shared=shared, world=world, provider="fake"
        )
        if split:
            dog = SideWatchdog(r, TIMEOUT_S, lambda e: None, words=torch.zeros(5, dtype=torch.int64), autostart=False)
            ts.append(
                SplitCudaTransport(
                    comm=None,
                    rank=r,
                    world=world,
                    window=win,
                    wlayout=wl,
                    layout=layout,
                    num_workers=1,
                    timeout_s=TIMEOUT_S,
                    domain_of=dom,
                    tma=HostKernel(r, win, wl, layout, runs),
                    drv=NowDriver(),
                    side=SimpleNamespace(fork=lambda s: None, get=lambda: (0, None), close=lambda: None),
                    dog=dog,
                    gates=Gates(dog.gate_addrs(), alloc=lambda n: torch.zeros(n, dtype=torch.int64)),
                )
            )
        else:
            ts.append(
                HostTransport(
                    rank=r, world=world, window=win, wlayout=wl, layout=layout, num_workers=2, timeout_s=TIMEOUT_S
                )
            )
    out = []
    for epoch, op in ((1, Op.MULTICAST), (2, Op.REDUCE)):
        if split:
            for r in range(world):
                ts[r].run(op, sched, epoch, ms[r][0], slots[r], lio, "op", 1)
        else:
            for r in range(world):
                runs.start(ts[r].run, op, sched, epoch, ms[r][0], slots[r], lio)
        runs.join()
        out.append([loc[: wl["ready_off"]].clone() for loc in locs])
    out.append([torch.cat([g.reshape(-1).view(torch.uint8) for g in ms[r][1]]) for r in range(world)])
    if split:
        assert any(t.shadows.views for t in ts)  # chunks crossed domains
    return out


CASES = [  # world, domain index per rank, node_of, relay mode, grad dtype
    (4, (0, 0, 1, 1), [0, 0, 1, 1], "force", torch.float32),
    (4, (0, 0, 1, 1), [0, 0, 1, 1], "off", torch.bfloat16),
    (4, (0, 0, 0, 1), [0, 0, 0, 1], "force", torch.bfloat16),
]


@pytest.mark.parametrize("which", ["hot", "random"])
@pytest.mark.parametrize("world,dom,node_of,mode,grad_dtype", CASES)
def test_the_cuda_splits_loopback_path_gives_the_host_executors_bytes(which, world, dom, node_of, mode, grad_dtype):
    layout, epr, slots = layout_of(grad_dtype), 2, 3
    src = (
        hot_slot_src(world, slots, epr, expert=1)
        if which == "hot"
        else random_slot_src(np.random.default_rng(world + len(mode)), world, slots, epr, 0.9)
    )
    plan = ReplicaPlan.make(src, experts_per_rank=epr)
    want = run(world, plan, layout, epr, mode, node_of, dom, split=False)
    got = run(world, plan, layout, epr, mode, node_of, dom, split=True)
    for i, (a, b) in enumerate(zip(want, got)):
        for r in range(world):
            assert torch.equal(a[r], b[r]), f"step {i} rank {r} differs"


def test_release_check_takes_the_one_record_a_loopback_launch_hands_every_rank():
    """test_split_cuda_gpu's failure check on what its worker reports after a stall: a loopback launch
    keeps ONE kernel error record (its first CTA to fail: rank 2's or rank 3's) and every rank's
    check_error raises that one, after the side-stream watchdog's timeout recorded before it.  Each
    receiver must pass whichever of the two failed first (rank 3 raising rank 2's words, and back)."""
    import importlib.util
    import os

    from test_split_cuda_gpu import check_release
    from ultracomm.blame import Witness, process_identity
    from ultracomm.cuda.stream_ordered import StreamOrdered
    from ultracomm.cuda.support import make_error_record
    from ultracomm.transports.tma.loopback import LoopbackRunner, raiser

    spec = importlib.util.spec_from_file_location(
        "release_common", os.path.join(os.path.dirname(__file__), "..", "mp", "release_common.py")
    )
    common = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(common)
    from ultracomm.transports.copy_engine.plan import FLAG_ARRIVAL as arrival  # a receiver waits for rank 0's chunk

    for failed in (2, 3):
        rec = make_error_record(
            1, failed, int(Op.MULTICAST), 2, flag_kind=arrival, expert=0, chunk=0, slot=0, peer=0, observed=1
        )

        class Runner:
            def __init__(self, device, rec=rec):
                self.recs = [rec]

            def take_error(self):
                return self.recs.pop() if self.recs else None

        lb = LoopbackRunner(SimpleNamespace(Runner=Runner), 4, 0, 2.0)
        lb._names[2] = "weight_sync"
        dog = _core.TimeoutError(
            "ultracomm: rank 2 weight_sync (epoch 2, transport split, side stream) timed out after 2 s waiting "
            "for a message from rank 0"
        )
        lb.record_failure(raiser(dog), None)  # the watchdog's, on its thread, before anyone checks
        # what the worker reports: each rank's Context's check (StreamOrdered, its witness: every rank is
        # this one process, no heartbeat in a CUDA window), naming ranks by evidence (issue 35)
        errors = []
        for r in range(4):
            wit = Witness(None, r, 4, timeout_s=2.0)
            wit.processes = [process_identity()] * 4
            errors.append(
                StreamOrdered(
                    SimpleNamespace(check_error=lambda r=r: lb.check_error(r)), None, lambda e: None, r, wit
                ).check()
            )
        assert len({str(e.__cause__) for e in errors}) == 1 and f"rank {failed} weight_sync" in str(errors[0])
        out = dict(
            common.describe(errors[0]),
            errors=[common.describe(e) for e in errors],
            late_s=0.002,
            synced=True,
            sync_s=0.01,
            later_work=True,
            released=[True, False, False, False],
            closed=True,
        )
        check_release("stall", out)
