"""The lb_prefetch section (issue 37): DeepEP's lb_prefetch_weights test shape, DeepEP's copies beside
the tile mover's multicast of one 3-member layout and the deepep_lb adapter's own calls."""

from __future__ import annotations

import traceback
from typing import Callable, Optional, Sequence

import numpy as np

from .constants import (
    LB_ADAPTER,
    LB_COPIES,
    LB_EMPTY,
    LB_MEMBERS,
    LB_MULTICAST,
    LB_PER_GRAPH,
    LB_REPLAYS,
    LB_SEED,
    LB_SHAPE,
    SENTINEL,
)
from .lb_domain import LBDomain, lb_fill, lb_wrong
from .lb_rows import lb_case, lb_mapping, lb_memory_bytes, lb_row


class LbPrefetchSection:
    """Gpu's lb_prefetch section."""

    def free_bytes(self) -> int:
        return int(self.torch.cuda.mem_get_info(self.dev)[0])

    def sync(self) -> None:
        """Wait for this device's current stream (not the device: see Timer)."""
        if self.dev.type == "cuda":
            self.torch.cuda.current_stream(self.dev).synchronize()

    def run_lb_prefetch(
        self,
        shape: tuple = LB_SHAPE,
        members: Sequence[tuple] = LB_MEMBERS,
        empty: float = LB_EMPTY,
        seed: int = LB_SEED,
    ) -> None:
        """DeepEP's ``lb_prefetch_weights`` at its test's shape (LB_SHAPE, LB_MEMBERS: 8 ranks in
        loopback, 64 experts, 8 redundant slots per rank, 64 MiB fp8 weights + 16 KiB + 4 KiB fp32
        scales per expert, 25% empty slots, a seeded random mapping (lb_mapping): no expert twice on
        a rank, none on its home), every rank's masters and slots on this GPU.  Rows, same bytes and
        dtypes, timed the same way (CUDA events around back-to-back operations, median of trials):
          - ``copy_ per (slot, tensor)``: DeepEP's way, a direct push from each home, one
            ``Tensor.copy_`` (a cudaMemcpyAsync D2D) per filled slot and tensor;
          - ``tile mover, 3-member layout``: ultracomm's multicast of one ExpertLayout of the three
            members (grad=False) through build_schedule and CudaLoopback, every rank in one launch,
            relay off (LBDomain: Loopback generalised to several experts per rank and members);
          - both again inside a replayed CUDA graph (note "graph replay", timing=graph);
          - ``deepep_lb.LBBuffer``: the adapter's own calls, ``lb_prefetch_weights`` of each rank
            in turn from this thread (its pools: one Context each, tma over cuda_local windows, the
            last rank's call launches a pool's domain), the mapping a CPU tensor; eager only.
        #wrong: bytes of a filled slot (all three tensors) that differ from its expert's, and of an
        empty slot that differ from the sentinel, after the first operation and after the timed
        ones (destinations refilled with the sentinel before each).  Skipped, with a note, when the
        device has less free memory than lb_memory_bytes."""
        torch = self.torch
        W, epr, S = shape
        mapping = lb_mapping(W, epr, S, empty, seed)
        per_expert = sum(n for _, n, _ in members)
        need, free = lb_memory_bytes(W, epr, S, per_expert), self.free_bytes()
        if free < need:
            why = f"not measured: needs {need / 2**30:.1f} GiB of device memory, {free / 2**30:.1f} GiB free"
            for impl in (LB_COPIES, LB_MULTICAST, LB_ADAPTER):
                self.rows.append(lb_row(impl, mapping, epr, members, None, None, why))
            return
        dtypes = [getattr(torch, dt) for _, _, dt in members]
        layout = self.uc.ExpertLayout(
            tuple(
                self.uc.Member(name, (n // dt.itemsize,), dt, grad=False) for (name, n, _), dt in zip(members, dtypes)
            )
        )
        gen = torch.Generator(device=self.dev).manual_seed(seed)
        masters = [
            [
                torch.randint(0, 256, (epr, n), dtype=torch.uint8, device=self.dev, generator=gen).view(dt)
                for (_, n, _), dt in zip(members, dtypes)
            ]
            for _ in range(W)
        ]
        d = LBDomain(torch, self.dev, layout, masters, mapping, epr)
        try:
            pairs = d.copy_pairs()

            def copies():
                for dst, src in pairs:
                    dst.copy_(src)

            def copies_rows():
                t, cpu, wrong = self.lb_timed(copies, d.slot, masters, mapping, epr)
                self.rows.append(
                    lb_row(
                        LB_COPIES,
                        mapping,
                        epr,
                        members,
                        t,
                        wrong,
                        f"{len(pairs)} copies" + (", cpu-bound" if cpu else ""),
                    )
                )
                t, wrong = self.lb_timed_graph(copies, d.slot, masters, mapping, epr)
                self.rows.append(
                    lb_row(
                        LB_COPIES,
                        mapping,
                        epr,
                        members,
                        t,
                        wrong,
                        f"{len(pairs)} copies",
                        graph=(LB_PER_GRAPH, LB_REPLAYS),
                    )
                )

            def multicast_rows():
                if self.tma_reason:
                    self.rows.append(
                        lb_row(LB_MULTICAST, mapping, epr, members, None, None, f"not measured: {self.tma_reason}")
                    )
                    return
                d.setup_cuda(self)
                what = f"{d.cta_note()}, {W} ranks in one launch, relay off"
                t, cpu, wrong = self.lb_timed(d.run, d.slot, masters, mapping, epr, d.check)
                self.rows.append(
                    lb_row(
                        LB_MULTICAST,
                        mapping,
                        epr,
                        members,
                        t,
                        wrong,
                        what + (", cpu-bound" if cpu else ""),
                        dict(ctas=d.ctas, senders=W),
                    )
                )
                t, wrong = self.lb_timed_graph(d.run, d.slot, masters, mapping, epr, d.check)
                self.rows.append(
                    lb_row(
                        LB_MULTICAST,
                        mapping,
                        epr,
                        members,
                        t,
                        wrong,
                        what,
                        dict(ctas=d.ctas, senders=W),
                        graph=(LB_PER_GRAPH, LB_REPLAYS),
                    )
                )

            self.lb_try(LB_COPIES, mapping, epr, members, copies_rows)
            self.lb_try(LB_MULTICAST, mapping, epr, members, multicast_rows)
        finally:
            d.close()
            self.free_cache()
        if self.tma_reason:
            self.rows.append(lb_row(LB_ADAPTER, mapping, epr, members, None, None, f"not measured: {self.tma_reason}"))
        else:
            self.lb_try(LB_ADAPTER, mapping, epr, members, lambda: self.lb_adapter(masters, mapping, epr, members))
        masters.clear()  # the last references to the masters' 4 GiB
        self.free_cache()

    def free_cache(self) -> None:
        if self.dev.type == "cuda" and not self.poisoned:
            self.sync()
            self.torch.cuda.empty_cache()

    def lb_try(
        self, impl: str, mapping: np.ndarray, epr: int, members: Sequence[tuple], fn: Callable[[], None]
    ) -> None:
        """One lb_prefetch measurement; a failure becomes its row (FAILED: ...) and an error."""
        if self.late("lb_prefetch", f"{lb_case(mapping.shape[0], epr, mapping.shape[1])} {impl}"):
            return
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - the other rows still run; the error is reported
            self.errors.append(f"lb_prefetch {impl}: {type(e).__name__}: {e}")
            self.rows.append(lb_row(impl, mapping, epr, members, None, None, f"FAILED: {type(e).__name__}: {e}"))
            traceback.print_exc()

    def lb_wrong(
        self, slot: Callable, masters: list, mapping: np.ndarray, epr: int, check: Optional[Callable[[], None]] = None
    ) -> int:
        self.sync()
        if check is not None:
            check()
        return lb_wrong(self.torch, slot, masters, mapping, epr)

    def lb_timed(
        self,
        fn: Callable[[], None],
        slot: Callable,
        masters: list,
        mapping: np.ndarray,
        epr: int,
        check: Optional[Callable[[], None]] = None,
    ) -> tuple[float, bool, int]:
        """(seconds per operation, cpu-bound, #wrong of the first and of the timed operations)."""
        lb_fill(self.torch, slot, mapping, len(masters[0]), SENTINEL)
        fn()
        w0 = self.lb_wrong(slot, masters, mapping, epr, check)
        lb_fill(self.torch, slot, mapping, len(masters[0]), SENTINEL)
        t, cpu = self.timer(fn)
        return t, cpu, w0 + self.lb_wrong(slot, masters, mapping, epr, check)

    def lb_timed_graph(
        self,
        fn: Callable[[], None],
        slot: Callable,
        masters: list,
        mapping: np.ndarray,
        epr: int,
        check: Optional[Callable[[], None]] = None,
    ) -> tuple[float, int]:
        """(device seconds per operation inside a replayed graph, #wrong after the replays: the
        destinations are refilled with the sentinel between the capture and the first replay)."""
        t = self.timer.graph(
            fn, LB_PER_GRAPH, LB_REPLAYS, prepare=lambda: lb_fill(self.torch, slot, mapping, len(masters[0]), SENTINEL)
        )
        return t, self.lb_wrong(slot, masters, mapping, epr, check)

    def lb_adapter(self, masters: list, mapping: np.ndarray, epr: int, members: Sequence[tuple]) -> None:
        """The deepep_lb adapter's row: an LBBuffer per rank (made in the ranks' threads: making one
        is collective), its pools planned as DeepEP's test plans them (one per tensor), then every
        rank's lb_prefetch_weights in turn from this thread."""
        torch = self.torch
        from ultracomm import LoopbackDomain
        from ultracomm.integrations import deepep_lb

        W, S = mapping.shape
        opts = dict(device=str(self.dev), transport="tma", window="cuda_local", relay_mode="off", timeout_s=10.0)

        def make(group):
            plan = deepep_lb.BufferAllocator()
            pools = [plan.allocate((S, *t.shape[1:]), t.dtype) for t in masters[group.rank]]
            return deepep_lb.LBBuffer(group, plan, epr, **opts), pools

        made = LoopbackDomain(W).run(make)
        lbs, pools = [m[0] for m in made], [m[1] for m in made]
        del made
        try:
            table = torch.as_tensor(mapping, dtype=torch.int32)  # on the host: no device-to-host copy per call

            def prefetch():
                for r in range(W):
                    lbs[r].lb_prefetch_weights(pools[r], masters[r], table)

            def slot(r, c, m):
                return pools[r][m][c]

            def check():  # a kernel's recorded failure (a timeout naming rank and expert) raises here
                for lb in lbs:
                    for p in lb.pools:
                        p.ctx.synchronize()

            t, cpu, wrong = self.lb_timed(prefetch, slot, masters, mapping, epr, check)
            sms = lbs[0].lb_get_theoretical_num_sms()
            self.rows.append(
                lb_row(
                    LB_ADAPTER,
                    mapping,
                    epr,
                    members,
                    t,
                    wrong,
                    f"the adapter's API: {W} ranks' lb_prefetch_weights from one thread, "
                    f"{len(members)} pools (a launch each), {sms} CTAs/rank, relay off"
                    + (", cpu-bound" if cpu else ""),
                    dict(ctas=sms, senders=W),
                )
            )
        finally:
            pools.clear()
            for lb in lbs:
                lb.destroy()
