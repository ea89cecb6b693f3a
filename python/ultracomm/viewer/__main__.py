"""``python -m ultracomm.viewer TRACE -o report.html``: see :mod:`ultracomm.viewer`."""

from __future__ import annotations

import argparse
import sys
from typing import Optional, Sequence

from ..profile import load_trace
from ..profile.trace_checks import check_options
from . import write_html


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m ultracomm.viewer",
        description="Write a self-contained HTML viewer of a load trace (works offline).",
    )
    ap.add_argument("trace", help="trace directory (ultracomm.profile) or a [steps, layers, E] .npy/.npz")
    ap.add_argument("-o", "--out", default="report.html", help="HTML file to write (default report.html)")
    ap.add_argument("--ep", type=int, default=None, help="EP ranks of a routing-statistics file")
    ap.add_argument(
        "--planner",
        default="auto",
        help="auto (recorded plans, quota for records without), recorded, none, or a planner "
        "(quota, taot, greedy, lpt, device) applied to the sampled records",
    )
    ap.add_argument("--domain", default=None, help="fabric for plans made here (default: one that holds the world)")
    ap.add_argument("--slots", type=int, default=2, help="replica slots per rank for plans made here")
    ap.add_argument(
        "--model", default=None, help="model preset for expert bytes (default: trace meta, else qwen3-235b-a22b)"
    )
    ap.add_argument("--title", default=None)
    ap.add_argument("--max-cells", type=int, default=1_000_000, help="heatmap cells over all layers")
    ap.add_argument("--max-detail", type=int, default=800, help="records sampled for the per-rank panels")
    ap.add_argument("--max-points", type=int, default=256, help="points per layer in the step series")
    ap.add_argument(
        "--screenshot",
        metavar="PNG",
        help="also write a full-page PNG (the system's Chromium, driven by Playwright; nothing is downloaded)",
    )
    a = ap.parse_args(argv)
    try:
        check_options(a)  # before the trace is read: bad options fail at once
        trace = load_trace(a.trace, loads=False, world=a.ep)
        size = write_html(
            trace,
            a.out,
            planner=a.planner,
            domain=a.domain,
            slots=a.slots,
            model=a.model,
            title=a.title,
            max_cells=a.max_cells,
            max_detail=a.max_detail,
            max_points=a.max_points,
        )
    except (ValueError, KeyError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"wrote {a.out} ({size / 1e6:.2f} MB): {len(trace)} records, layers {int(trace.layers[0])}.."
        f"{int(trace.layers[-1])}, steps {int(trace.steps[0])}..{int(trace.steps[-1])}"
    )
    if a.screenshot:
        from .browser import screenshot

        try:
            msgs = screenshot(a.out, a.screenshot)
        except RuntimeError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
        print(f"wrote {a.screenshot}" + (f"; the page reported: {'; '.join(msgs)}" if msgs else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
