"""The copy sections: 1 -> 1 copies (tile mover, cudaMemcpyAsync, torch), 1 -> N fan-out, the tile
mover's CTA sweep, and the copy_engine transport on the same domains."""

from __future__ import annotations

from typing import Optional, Sequence

from .constants import FANOUT_BYTES, MiB
from .loopback import one_expert
from .rows import Row, fmt_size


def copy_engine_row(
    case: str,
    n: int,
    size: int,
    time_s: Optional[float],
    wrong: Optional[int],
    note: str = "",
    tile: Optional[Row] = None,
) -> Row:
    """The copy_engine row of a 1 -> n multicast of ``size`` bytes: payload nS, traffic 2nS (each
    destination's copy reads the source); since issue 35 its copies run in gate kernels, one CTA
    per destination stream (n SMs at most), not on copy engines; ``tile``: the tile mover's row
    of the same case and size, whose rate it is compared to."""
    row = Row(
        "copy_engine",
        case,
        "copy engine",
        size,
        time_s,
        n * size,
        2 * n * size,
        wrong,
        ", ".join(x for x in ("" if time_s is None else f"{n} CTA{'s' * (n > 1)} (gate kernels)", note) if x),
        dict(sms=n, destinations=n),
    )
    if tile is not None and tile.algbw and row.algbw:
        row.note += f", {100 * row.algbw / tile.algbw:.1f}% of tile mover"
        row.extra["vs_tile_mover"] = row.algbw / tile.algbw
    return row


def tile_row(rows: Sequence[Row], n: int, size: int) -> Optional[Row]:
    """The tile mover's measured row of a 1 -> n multicast of ``size`` bytes (copy or fanout)."""
    section = "copy" if n == 1 else "fanout"
    got = [
        r
        for r in rows
        if r.section == section and r.impl == "tile mover" and r.case == f"1->{n}" and r.size == size and r.time_s
    ]
    return got[0] if got else None


class CopySections:
    """Gpu's copy, fanout, sweep and copy_engine sections."""

    def run_copy(self) -> None:
        torch = self.torch
        for size in self.copy_sizes():
            if self.late("copy", fmt_size(size)):
                return
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.dev)
            dst = torch.empty_like(src)
            if self.cudart is not None:
                self.rows.append(
                    self.baseline_copies(
                        "copy", "1->1", "cudaMemcpyAsync", src, [dst], lambda: self.memcpy(dst, src, size)
                    )
                )
            else:
                self.rows.append(
                    Row(
                        "copy", "1->1", "cudaMemcpyAsync", size, None, 0, 0, None, f"not measured: {self.cudart_reason}"
                    )
                )
            self.rows.append(self.baseline_copies("copy", "1->1", "torch copy_", src, [dst], lambda: dst.copy_(src)))
            if self.tma_reason:
                self.mover_missing("copy", "1->1", size)
                continue
            self.rows.append(self.mover_multicast("copy", "1->1", 1, size))

    def copy_sizes(self) -> list[int]:
        return [MiB, 16 * MiB, 256 * MiB] if self.quick else [MiB, 4 * MiB, 16 * MiB, 64 * MiB, 256 * MiB, 1 << 30]

    def mover_multicast(self, section: str, case: str, n: int, size: int, **cfg) -> Row:
        """Home rank 0 multicasts one expert of ``size`` bytes into ``n`` replicas (direct)."""
        d = self.domain(n + 1, one_expert(n), size, self.torch.float32, relay_mode="off", **cfg)
        try:
            t, cpu, wrong = d.timed_multicast(self.timer)
            (note, ctas, grid), tasks, chunk = d.cta_note("multicast"), d.num_tasks("multicast"), d.sched.chunk_bytes
        finally:
            d.close()
        return Row(
            section,
            case,
            "tile mover",
            size,
            t,
            n * size,
            (1 + n) * size,
            wrong,
            note + (", cpu-bound" if cpu else ""),
            dict(ctas=ctas, tasks=tasks, chunk=chunk, grid=grid),
        )

    def run_fanout(self) -> None:
        torch = self.torch
        size = FANOUT_BYTES
        for n in (2, 4, 8):
            if self.late("fanout", f"1->{n}"):
                return
            if self.cudart is not None:
                src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.dev)
                dsts = [torch.empty_like(src) for _ in range(n)]

                def copies():
                    for d in dsts:
                        self.memcpy(d, src, size)

                self.rows.append(self.baseline_copies("fanout", f"1->{n}", f"{n} x cudaMemcpyAsync", src, dsts, copies))
                del src, dsts
            if self.tma_reason:
                self.mover_missing("fanout", f"1->{n}", size)
            else:
                self.rows.append(self.mover_multicast("fanout", f"1->{n}", n, size))

    def run_sweep(self) -> None:
        torch = self.torch
        size = 256 * MiB
        if self.cudart is not None:
            src = torch.randint(0, 256, (size,), dtype=torch.uint8, device=self.dev)
            dst = torch.empty_like(src)
            self.rows.append(
                self.baseline_copies(
                    "sweep",
                    "1->1",
                    "cudaMemcpyAsync",
                    src,
                    [dst],
                    lambda: self.memcpy(dst, src, size),
                    "reference for the fractions",
                )
            )
            del src, dst
        ref = self.rows[-1].algbw if self.cudart is not None else None
        for ctas in (1, 2, 4, 8, 16, 32) if self.quick else (1, 2, 4, 6, 8, 12, 16, 24, 32):
            if self.late("sweep", f"{ctas} CTAs"):
                return
            if self.tma_reason:
                self.mover_missing("sweep", f"{ctas} CTAs", size)
                continue
            row = self.mover_multicast("sweep", f"{ctas} CTAs", 1, size, multicast_sms=ctas)
            if ref and row.algbw:
                row.note += f", {100 * row.algbw / ref:.1f}% of cudaMemcpyAsync"
                row.extra["fraction"] = row.algbw / ref
            self.rows.append(row)

    def run_copy_engine(self) -> None:
        cases = [(1, size) for size in self.copy_sizes()] + [(n, FANOUT_BYTES) for n in (2, 4, 8)]
        for n, size in cases:
            if self.ce_reason:
                self.rows.append(copy_engine_row(f"1->{n}", n, size, None, None, f"not measured: {self.ce_reason}"))
                continue
            if self.late("copy_engine", f"1->{n} {fmt_size(size)}", reserve=False):
                return
            d = self.domain(n + 1, one_expert(n), size, self.torch.float32, relay_mode="off", transport="copy_engine")
            try:
                t, cpu, wrong = d.timed_multicast(self.timer)
            finally:
                d.close()
            self.rows.append(
                copy_engine_row(f"1->{n}", n, size, t, wrong, "cpu-bound" if cpu else "", tile_row(self.rows, n, size))
            )
