"""The reduce sections: home grad += k replica grads through both of the tile mover's reduce paths
beside torch.sum, and the reduce CTA sweep."""

from __future__ import annotations

from typing import Optional

from .constants import REDUCE_IMPLS, MiB
from .loopback import one_expert, ordered_sum
from .rows import Row


class ReduceSections:
    """Gpu's reduce and reduce_sweep sections."""

    def run_reduce(self) -> None:
        torch = self.torch
        size_elems = (16 * MiB) if self.quick else (64 * MiB)  # elements of the output
        cases = [(k, dt) for dt in ("fp32", "bf16", "fp16") for k in (2, 4, 8)]
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        for k, name in cases + [(2, "fp32-1cta")]:
            dt = dtypes[name.split("-")[0]]
            n = size_elems // dt.itemsize if name != "fp32-1cta" else 4 * MiB // 4
            nbytes = n * dt.itemsize
            case = f"k={k} {name}"
            if self.late("reduce", case):
                return
            if name != "fp32-1cta":
                stacked = torch.randn((k + 1, n), device=self.dev).to(dt)
                out = torch.empty(n, dtype=dt, device=self.dev)
                want = ordered_sum(torch, stacked)
                torch.sum(stacked, dim=0, out=out)
                w0 = self.wrong_bytes(out, want) // dt.itemsize
                t, cpu = self.timer(lambda: torch.sum(stacked, dim=0, out=out))
                self.rows.append(
                    Row(
                        "reduce",
                        case,
                        "torch.sum",
                        nbytes,
                        t,
                        nbytes,
                        (k + 2) * nbytes,
                        w0 + self.wrong_bytes(out, want) // dt.itemsize,
                        "informational #wrong: torch's order" + (", cpu-bound" if cpu else ""),
                        dict(k=k, dtype=name),
                    )
                )
                del stacked, out, want
            for path in REDUCE_IMPLS:
                row = self.reduce_row("reduce", case, k, dt, nbytes, name, 1 if name == "fp32-1cta" else 0, path)
                self.rows.append(row)

    def staged_reason(self) -> Optional[str]:
        """Why the tile mover's TMA-staged reduce cannot run here (None: it can): sm_90+ only."""
        cc = tuple(int(x) for x in str(self.info.get("cc", "0.0")).split("."))
        return None if cc >= (9, 0) else f"reduce_path='tma' needs sm_90+ (bulk copies); this GPU is sm_{cc[0]}{cc[1]}"

    def reduce_row(
        self, section: str, case: str, k: int, dt, nbytes: int, name: str, ctas: int, path: str = "hunk"
    ) -> Row:
        """The tile mover's row of one reduce case through reduce path ``path`` (impl REDUCE_IMPLS[path]),
        or the row saying why it was not measured; a staged row's note compares it with the hunk row
        of the same section, case and size measured before it."""
        why = self.tma_reason or (self.staged_reason() if path == "tma" else None)
        if why:
            return Row(section, case, REDUCE_IMPLS[path], nbytes, None, 0, 0, None, f"not measured: {why}")
        row = self.mover_reduce(case, k, dt, nbytes, name, ctas, path)
        row.section = section
        hunk = [r for r in self.rows if (r.section, r.case, r.size, r.impl) == (section, case, nbytes, "tile mover")]
        if path != "hunk" and hunk and hunk[-1].algbw and row.algbw:
            row.extra["vs_hunk"] = row.algbw / hunk[-1].algbw
            row.note += f", {100 * row.extra['vs_hunk']:.1f}% of tile mover's rate"
        return row

    def reduce_sweep_cases(self) -> list[tuple[int, str, int]]:
        """reduce_sweep's (k, dtype, CTAs), in the order they run: each case at the device's SM count
        first (the all-SM rows issue 34's "reduce with every SM vs torch.sum" reads: rank 0 holds
        every task of the pulled reduce, the k idle ranks one CTA each, so the grid is SMs + k and
        runs the shared TMA ring; first, so a bench cut short by its budget still has them), then
        each case at 1..32 CTAs."""
        cases = ((2, "fp32"), (8, "bf16"), (8, "fp16"))
        ctas = [1, 2, 4, 8, 16, 32] if self.quick else [1, 2, 4, 8, 12, 16, 23, 32]
        sms = self.info.get("sms")
        first = [(k, name, int(sms)) for k, name in cases] if sms and int(sms) not in ctas else []
        return first + [(k, name, c) for k, name in cases for c in ctas]

    def run_reduce_sweep(self) -> None:
        """Reduce CTA sweep (issue 34): one rank's reduce at the device's SM count and at 1..32 CTAs
        (reduce_sweep_cases), k=2 fp32 and k=8 fp16/bf16 (64 MiB of output, as the reduce section's
        torch.sum rows; 16 MiB with --quick), each row with its traffic per CTA ((k + 2) x S / time /
        CTAs: the per-SM rate the SM budget needs)."""
        torch = self.torch
        size = (16 * MiB) if self.quick else (64 * MiB)
        dtypes = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
        for k, name, ctas in self.reduce_sweep_cases():
            case = f"k={k} {name} {ctas} CTAs"
            if self.late("reduce_sweep", case):
                return
            for path in REDUCE_IMPLS:  # each CTA count through both reduce paths, hunk first
                row = self.reduce_row("reduce_sweep", case, k, dtypes[name], size, name, ctas, path)
                used = row.extra.get("ctas") or ctas
                if row.busbw:
                    row.extra["per_cta_busbw"] = row.busbw / used
                    row.note += f", {row.busbw / used / 1e9:.1f} GB/s per CTA"
                self.rows.append(row)

    def mover_reduce(self, case: str, k: int, dt, nbytes: int, name: str, ctas: int, path: str = "hunk") -> Row:
        cfg = dict(reduce_sms=ctas) if ctas else {}
        d = self.domain(k + 1, one_expert(k), nbytes, dt, relay_mode="off", reduce_path=path, **cfg)
        try:
            d.run("multicast")  # the plan's first operation; the reduce reads the replicas' grads
            want = d.seed_grads()
            d.run("reduce")
            w0 = d.reduce_wrong(want)
            t, cpu = self.timer(lambda: d.run("reduce"))
            d.check()
            want = d.seed_grads()  # the timed runs accumulated: check one more from a fresh state
            d.run("reduce")
            wrong = w0 + d.reduce_wrong(want)
            note, used, grid = d.cta_note("reduce")
        finally:
            d.close()
        return Row(
            "reduce",
            case,
            REDUCE_IMPLS[path],
            nbytes,
            t,
            nbytes,
            (k + 2) * nbytes,
            wrong,
            note + (", cpu-bound" if cpu else ""),
            dict(k=k, dtype=name, ctas=used, reduce_path=path, grid=grid),
        )
