"""The relay section: chains of D = 1..4 hops, one chunk (fill) and a 64 MiB stream per chunk size."""

from __future__ import annotations

from .constants import MiB
from .loopback import one_expert
from .rows import Row, fmt_size


class RelaySection:
    """Gpu's relay section."""

    def run_relay(self) -> None:
        chunks = [32 << 10, 1 << 20, 4 << 20] if self.quick else [32 << 10, 128 << 10, 512 << 10, 1 << 20, 4 << 20]
        if self.tma_reason:
            self.mover_missing("relay", "chain", 0)
            return
        for chunk in chunks:
            for mode, size in (("fill", chunk), ("stream", 64 * MiB)):
                for depth in (1, 2, 3, 4):
                    if self.late("relay", f"D={depth} chunk={fmt_size(chunk)} {mode}"):
                        return
                    d = self.domain(
                        depth + 1,
                        one_expert(depth),
                        size,
                        self.torch.float32,
                        chunk_bytes=chunk,
                        relay_mode="force" if depth > 1 else "off",
                        max_depth=max(depth, 2),
                    )
                    try:
                        chain = d.is_chain(depth)
                        t, cpu, wrong = d.timed_multicast(self.timer)
                        ctas = d.ctas
                    finally:
                        d.close()
                    self.rows.append(
                        Row(
                            "relay",
                            f"D={depth} chunk={fmt_size(chunk)} {mode}",
                            "tile mover",
                            size,
                            t,
                            depth * size,
                            2 * depth * size,
                            wrong,
                            ", ".join(
                                x
                                for x in ("" if chain else "NOT a chain: excluded from the fit", cpu * "cpu-bound")
                                if x
                            ),
                            dict(mode=mode, depth=depth, chunk=chunk, chain=chain, ctas=ctas, senders=depth),
                        )
                    )
