"""``python -m ultracomm.profile show TRACE`` / ``import COUNTS.npy -o TRACE --world W``."""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional, Sequence

from .trace import import_routing_stats, load_trace, read_counts


def main(argv: Optional[Sequence[str]] = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m ultracomm.profile", description="Inspect or import load traces.")
    sub = ap.add_subparsers(dest="cmd", required=True)
    sh = sub.add_parser("show", help="summarise a trace")
    sh.add_argument("trace")
    sh.add_argument("--ep", type=int, default=None, help="EP ranks of a routing-statistics file")
    im = sub.add_parser("import", help="routing statistics [steps, layers, E] (.npy/.npz) -> trace directory")
    im.add_argument("counts")
    im.add_argument("-o", "--out", required=True)
    im.add_argument("--world", "--ep", type=int, required=True, dest="world", help="EP ranks")
    im.add_argument("--overwrite", action="store_true")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "show":
            tr = load_trace(a.trace, loads=False, world=a.ep)
            print(tr.summary())
        else:
            tr = import_routing_stats(
                read_counts(a.counts), a.out, a.world, meta={"source": os.path.abspath(a.counts)}, overwrite=a.overwrite
            )
            print(f"wrote {a.out}: " + tr.summary().splitlines()[0])
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
