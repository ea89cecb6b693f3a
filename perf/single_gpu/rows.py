"""Row (one measured line of a table) and the nccl-tests-like table of rows."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Sequence

from .constants import MiB


@dataclass
class Row:
    """One measured line of a table."""

    section: str
    case: str
    impl: str
    size: int
    time_s: Optional[float]
    payload: int
    traffic: int
    wrong: Optional[int]
    note: str = ""
    extra: dict = field(default_factory=dict)

    @property
    def algbw(self) -> Optional[float]:
        return self.payload / self.time_s if self.time_s else None

    @property
    def busbw(self) -> Optional[float]:
        return self.traffic / self.time_s if self.time_s else None

    @property
    def algbw_per_cta(self) -> Optional[float]:
        """algbw over the CTAs that moved it: ``ctas`` per sending rank x ``senders`` (a relay chain's
        D hops), for rows that ran on SMs."""
        ctas = self.extra.get("ctas")
        if not self.algbw or not ctas:
            return None
        return self.algbw / (ctas * self.extra.get("senders", 1))

    def to_dict(self) -> dict:
        return dict(
            section=self.section,
            case=self.case,
            impl=self.impl,
            size=self.size,
            time_s=self.time_s,
            payload_bytes=self.payload,
            traffic_bytes=self.traffic,
            algbw=self.algbw,
            busbw=self.busbw,
            algbw_per_cta=self.algbw_per_cta,
            wrong=self.wrong,
            note=self.note,
            **self.extra,
        )


def fmt_size(n: int) -> str:
    for unit, div in (("G", 1 << 30), ("M", MiB), ("K", 1 << 10)):
        if n >= div and n % div == 0:
            return f"{n // div}{unit}"
    return str(n)


def format_table(rows: Sequence[Row]) -> str:
    """nccl-tests-like columns: size, case, impl, time (us), algbw and busbw (GB/s), algbw per CTA
    (GB/s, rows that ran on SMs), #wrong, note."""
    hdr = ("size", "case", "impl", "time(us)", "algbw(GB/s)", "busbw(GB/s)", "GB/s/CTA", "#wrong", "note")
    lines = [hdr]
    for r in rows:
        per_cta = r.algbw_per_cta
        lines.append(
            (
                fmt_size(r.size),
                r.case,
                r.impl,
                "-" if r.time_s is None else f"{r.time_s * 1e6:.2f}",
                "-" if r.algbw is None else f"{r.algbw / 1e9:.1f}",
                "-" if r.busbw is None else f"{r.busbw / 1e9:.1f}",
                "-" if per_cta is None else f"{per_cta / 1e9:.1f}",
                "-" if r.wrong is None else str(r.wrong),
                r.note,
            )
        )
    widths = [max(len(x[i]) for x in lines) for i in range(len(hdr) - 1)]
    out = []
    for i, x in enumerate(lines):
        out.append(
            "  ".join(
                c.rjust(w) if i and j in (0, 3, 4, 5, 6, 7) else c.ljust(w)
                for j, (c, w) in enumerate(zip(x[:-1], widths))
            )
            + ("  " + x[-1] if x[-1] else "")
        )
        if i == 0:
            out.append("  ".join("-" * w for w in widths))
    return "\n".join(out)
