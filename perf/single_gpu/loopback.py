"""The one-GPU loopback domain the tile mover's rows run on (Loopback), and the references its rows are
checked against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from .constants import SENTINEL
from .timing import Timer

if TYPE_CHECKING:
    from .gpu import Gpu


def one_expert(n: int) -> np.ndarray:
    """``slot_src`` of world n+1: expert 0 (home rank 0) in slot 0 of ranks 1..n."""
    ss = np.full((n + 1, 1), -1, np.int32)
    ss[1:, 0] = 0
    return ss


def ordered_sum(torch, stacked):
    """fp32 sum of the rows in order (row 0 = the destination's old value), rounded once."""
    acc = stacked[0].float()
    for i in range(1, stacked.shape[0]):
        acc = acc + stacked[i].float()
    return acc.to(stacked.dtype)


class Loopback:
    """A one-GPU loopback domain of ``world`` ranks holding one expert of ``nbytes`` (weights and
    grads, slot 0), over the schedule ultracomm builds for the plan, run by
    ``ultracomm.cuda.loopback`` (``transport="tma"``: all ranks in ONE persistent launch; CTAs of
    each rank with a task in the op: ``multicast_sms`` / ``reduce_sms`` when given, else what a
    Context would use (``ultracomm.cuda.sm_budget``), capped so the whole grid is co-resident; a
    rank with no task gets one CTA (``CudaLoopback.launch_ctas``), so rank 0 of a pushed multicast
    or a pulled reduce may have every co-resident CTA but one per idle rank) or by one
    ``copy_engine`` transport per rank (multicast only; the rank completing each set enqueues every
    rank's commands, as in a Context)."""

    def __init__(
        self,
        gpu: Gpu,
        world: int,
        slot_src: np.ndarray,
        nbytes: int,
        grad_dtype,
        *,
        multicast_sms: int = 0,
        reduce_sms: int = 0,
        chunk_bytes: int = 1 << 20,
        relay_mode: str = "off",
        max_depth: int = 8,
        timeout_s: float = 10.0,
        transport: str = "tma",
        reduce_path: str = "hunk",
    ):
        torch, uc = gpu.torch, gpu.uc
        self.reduce_path = reduce_path  # the tma kernel's reduce path (REDUCE_IMPLS)
        from ultracomm import _core
        from ultracomm.records import Op
        from ultracomm.schedule import build_schedule

        self.gpu, self.torch, self.world = gpu, torch, world
        self.lb, self.ce, self.plans = None, [], {}
        n = nbytes // grad_dtype.itemsize
        if n * grad_dtype.itemsize != nbytes:
            raise ValueError(f"{nbytes} bytes is not a whole number of {grad_dtype} elements")
        self.glayout = (n, grad_dtype)
        # weights and grads are both nbytes: one member whose dtype is the grad dtype
        layout = uc.ExpertLayout((uc.Member("w", (n,), grad_dtype),), grad_dtype=grad_dtype)
        plan = uc.ReplicaPlan.make(slot_src, experts_per_rank=1)
        self.sched = build_schedule(
            plan,
            layout.weight_bytes,
            layout.grad_bytes,
            chunk_bytes=chunk_bytes,
            relay_mode=relay_mode,
            max_depth=max_depth,
        )
        self.wl = _core.window_layout(1, layout.weight_bytes, layout.grad_bytes, chunk_bytes)
        self.windows = [torch.zeros(self.wl["total_bytes"], dtype=torch.uint8, device=gpu.dev) for _ in range(world)]
        self.weights = [
            torch.randint(-8, 8, (n,), device=gpu.dev).to(grad_dtype)
            if r == 0
            else torch.zeros(n, dtype=grad_dtype, device=gpu.dev)
            for r in range(world)
        ]
        self.grads = [torch.zeros(n, dtype=grad_dtype, device=gpu.dev) for _ in range(world)]
        self.ops = {"multicast": Op.MULTICAST, "reduce": Op.REDUCE}
        self.epoch = 0  # the kernel runs max(requested, last + 1); copy_engine runs it as given
        if transport == "copy_engine":
            self._copy_engine(plan, layout, timeout_s)
            return
        from ultracomm.cuda.loopback import CudaLoopback
        from ultracomm.env import Config
        from ultracomm.cuda.sm_budget import choices_for_device

        cfg = Config()
        mc, rd = choices_for_device(multicast_sms, reduce_sms, cfg.intra_bw, gpu.info["sms"], gpu.info["name"])
        self.lb = CudaLoopback(world, self.wl, self.windows, timeout_s=timeout_s)
        slots = [plan.slot_src[r].tolist() for r in range(world)]
        lio = [plan.local_index_of.tolist()] * world
        self.plans = {}
        for op, masters, offs, sizes in (
            (Op.MULTICAST, self.weights, layout.weight_offsets, layout.weight_sizes),
            (Op.REDUCE, self.grads, layout.grad_offsets, layout.grad_sizes),
        ):
            self.plans[op] = self.lb.plan(
                op,
                tasks=[self.sched.tasks(op, r) for r in range(world)],
                refs=[self.sched.refs(op, r) for r in range(world)],
                member_off=list(offs),
                member_bytes=list(sizes),
                master_ptrs=[[m.data_ptr()] for m in masters],
                local_index_of=lio,
                my_slots=slots,
                grad_dtype=grad_dtype,
                slot_parent=[p.tolist() for p in self.sched.tree(op)[0]],
                digest=self.sched.digest,
            )
        # one launch runs every rank, all its CTAs co-resident (the launch is cooperative): ranks with
        # a task get ctas_per_rank, ranks without one, so the cap is what the whole grid leaves
        # (CudaLoopback.max_ctas_per_rank), not max_coresident // world
        cap_mc = max(1, self.lb.max_ctas_per_rank(self.plans[Op.MULTICAST]))
        cap_rd = max(1, self.lb.max_ctas_per_rank(self.plans[Op.REDUCE]))
        self.ctas, self.reduce_ctas = min(mc.sms, cap_mc), min(rd.sms, cap_rd)
        self.op_capped = {"multicast": self.ctas < mc.sms, "reduce": self.reduce_ctas < rd.sms}
        self.capped = any(self.op_capped.values())

    def launch_layout(self, op: str) -> list[int]:
        """CTAs of each rank in one launch of ``op`` (``CudaLoopback.launch_ctas``, the rule the launch
        applies); [] for the copy_engine transport."""
        if self.lb is None:
            return []
        return self.lb.launch_ctas(self.plans[self.ops[op]], self.ctas if op == "multicast" else self.reduce_ctas)

    def cta_note(self, op: str) -> tuple[str, int, int]:
        """(note, rank 0's CTAs, grid) of one launch of ``op``: "N CTAs/rank" when every rank has a
        task, else "N CTAs on rank 0, 1 per idle rank" (or on each rank with a task); the
        co-residency cap when it lowered the count; the grid when it exceeds the SMs (a loopback
        grid larger than the SM count runs the shared, shallower TMA ring)."""
        ctas = self.launch_layout(op)
        grid = sum(ctas)
        busy = [r for r in range(self.world) if len(self.sched.tasks(self.ops[op], r))]
        n = self.ctas if op == "multicast" else self.reduce_ctas
        if len(busy) == self.world:
            note = f"{n} CTAs/rank"
        elif busy == [0]:
            note = f"{n} CTAs on rank 0, 1 per idle rank"
        else:
            note = f"{n} CTAs on each of {len(busy)} ranks with tasks, 1 per idle rank"
        if self.op_capped[op]:
            note += " (co-residency cap)"
        sms = self.gpu.info.get("sms")
        if self.world > 1 and sms and grid > sms and self.lb.runner.mover == "tma":
            note += f", grid {grid} > {sms} SMs: shared ring"
        return note, (ctas[0] if ctas else 0), grid

    def _copy_engine(self, plan, layout, timeout_s: float) -> None:
        """One CopyEngineTransport per rank over cuda_local-like windows (every rank's window on
        this GPU, one dict shared by the domain) and each rank's masters (its weights)."""
        from types import SimpleNamespace

        from ultracomm.transports.copy_engine import CopyEngineTransport
        from ultracomm.transports.host import Masters

        shared: dict = {}
        bases = [w.data_ptr() for w in self.windows]
        n = self.glayout[0]
        self.ctas = self.reduce_ctas = 0
        self.capped, self.op_capped = False, {"multicast": False, "reduce": False}
        self.slots = [plan.slot_src[r].tolist() for r in range(self.world)]
        self.lio = plan.local_index_of.tolist()
        self.masters = [Masters.of((self.weights[r].view(1, n),), None, 1, ["w"]) for r in range(self.world)]
        for r in range(self.world):
            win = SimpleNamespace(
                provider="cuda_local",
                rank=r,
                world=self.world,
                local=self.windows[r],
                peer_bases=bases,
                loopback=True,
                shared=shared,
            )
            self.ce.append(
                CopyEngineTransport(
                    rank=r, world=self.world, window=win, wlayout=self.wl, layout=layout, timeout_s=timeout_s
                )
            )

    def slot(self, r: int, region: str):
        """Rank r's slot 0 in the weights or grads region of its window (a view)."""
        off = self.wl["weights_off"] if region == "weights" else self.wl["grads_off"]
        n, dt = self.glayout
        return self.windows[r][off : off + n * dt.itemsize].view(dt)

    def run(self, op: str) -> None:
        self.epoch += 1
        o = self.ops[op]
        if self.ce:
            if op != "multicast":
                raise ValueError("the bench runs copy_engine's multicast only (its reduce is the tma kernel)")
            stream = self.torch.cuda.current_stream(self.gpu.dev).cuda_stream
            for r, t in enumerate(self.ce):  # the last rank's call enqueues the whole set
                t.run(o, self.sched, self.epoch, self.masters[r], self.slots[r], self.lio, "weight_sync", stream=stream)
            return
        self.lb.launch(
            self.plans[o],
            self.epoch,
            ctas_per_rank=self.ctas if op == "multicast" else self.reduce_ctas,
            op_name="weight_sync" if op == "multicast" else "grad_reduce",
            reduce_path=self.reduce_path,
        )

    def num_tasks(self, op: str) -> int:
        """Tasks of one ``op`` over every rank's schedule (a 1 -> 1 direct copy: one per chunk)."""
        return sum(len(self.sched.tasks(self.ops[op], r)) for r in range(self.world))

    def check(self) -> None:
        self.torch.cuda.current_stream(self.gpu.dev).synchronize()
        for t in self.ce:
            t.check_error()
        if self.lb is not None:
            self.lb.check_error()

    def timed_multicast(self, timer: Timer) -> tuple[float, bool, int]:
        """(seconds per multicast, cpu-bound, #wrong of the first and the last one)."""
        self.fill_replicas(SENTINEL)
        self.run("multicast")
        w0 = self.multicast_wrong()
        self.fill_replicas(SENTINEL)
        t, cpu = timer(lambda: self.run("multicast"))
        return t, cpu, w0 + self.multicast_wrong()

    def fill_replicas(self, value: int) -> None:
        for r in range(1, self.world):
            self.slot(r, "weights").view(self.torch.uint8).fill_(value)

    def multicast_wrong(self) -> int:
        self.check()
        return sum(self.gpu.wrong_bytes(self.slot(r, "weights"), self.weights[0]) for r in range(1, self.world))

    def seed_grads(self):
        """Fresh master and replica grads; returns the expected master grad (ordered fp32 sum)."""
        torch = self.torch
        self.check()
        n, dt = self.glayout
        rows = [torch.randn(n, device=self.gpu.dev).to(dt) for _ in range(self.world)]
        self.grads[0].copy_(rows[0])
        for r in range(1, self.world):
            self.slot(r, "grads").copy_(rows[r])
        return ordered_sum(torch, torch.stack(rows))

    def reduce_wrong(self, want) -> int:
        self.check()
        return self.gpu.wrong_bytes(self.grads[0], want) // want.element_size()

    def is_chain(self, depth: int) -> bool:
        pr, _, dep = self.sched.tree("multicast")
        return [int(x) for x in pr[:, 0]] == [-1, *range(depth)] and int(dep.max()) == depth

    def close(self) -> None:
        ce, self.ce = self.ce, []
        for t in ce:
            t.quiesce()  # every copy_engine operation in flight ends, done or failed
        if any(t.abandoned_streams() for t in ce):
            # internal streams stay blocked on flags and may still copy into these windows: no
            # device-wide synchronize, no cudaFree (it synchronises the device) from now on
            self.gpu.poisoned = "a copy_engine operation failed earlier and left its streams blocked"
            self.gpu.kept.append(self.windows)
            for t in ce:
                t.close()
            return
        self.torch.cuda.synchronize()
        for t in ce:
            t.close()
        self.plans, self.windows, self.lb = {}, [], None
        self.torch.cuda.empty_cache()
