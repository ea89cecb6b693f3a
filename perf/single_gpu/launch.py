"""The latency sections: the launch floor (an empty kernel, a persistent launch with no task; eager and
graph-replayed) and the flag round trip between two CTAs."""

from __future__ import annotations

import numpy as np

from .constants import LAUNCH_PER_GRAPH, LAUNCH_REPLAYS
from .rows import Row
from .timing import graph_note


class LaunchSections:
    """Gpu's launch and flag sections."""

    def run_launch(self) -> None:
        """The launch floor two ways: Python calls timed by events (the host's enqueue rate, flagged
        cpu-bound) and LAUNCH_PER_GRAPH launches captured in one CUDA graph, replayed (device time per
        launch, graph-node gaps included): an empty kernel, and the persistent kernel with no tasks."""
        torch = self.torch
        launch_empty, why = self.binding("launch_empty")
        gnote = graph_note(LAUNCH_PER_GRAPH, LAUNCH_REPLAYS)
        gextra = dict(timing="graph", per_graph=LAUNCH_PER_GRAPH, replays=LAUNCH_REPLAYS)
        if launch_empty is None:
            self.rows.append(Row("launch", "floor", "empty kernel", 0, None, 0, 0, None, f"not measured: {why}"))
        else:
            t, cpu = self.timer(lambda: launch_empty(self.stream()), reps=200)
            self.rows.append(
                Row(
                    "launch",
                    "floor",
                    "empty kernel",
                    0,
                    t,
                    0,
                    0,
                    0,
                    "cpu-bound (launch rate)" if cpu else "",
                    dict(timing="eager"),
                )
            )
            t = self.timer.graph(lambda: launch_empty(self.stream()), LAUNCH_PER_GRAPH, LAUNCH_REPLAYS)
            self.rows.append(Row("launch", "floor", "empty kernel", 0, t, 0, 0, 0, gnote, gextra))
        if self.tma_reason:
            self.mover_missing("launch", "no tasks", 0)
            return
        d = self.domain(1, np.full((1, 1), -1, np.int32), 1024, torch.float32)
        try:
            t, cpu = self.timer(lambda: d.run("multicast"), reps=200)
            d.check()
            self.rows.append(
                Row(
                    "launch",
                    "no tasks",
                    "tile mover",
                    0,
                    t,
                    0,
                    0,
                    0,
                    "persistent launch, world 1, one CTA (no task)" + (", cpu-bound" if cpu else ""),
                    dict(timing="eager"),
                )
            )
            t = self.timer.graph(lambda: d.run("multicast"), LAUNCH_PER_GRAPH, LAUNCH_REPLAYS)
            d.check()
            self.rows.append(
                Row(
                    "launch",
                    "no tasks",
                    "tile mover",
                    0,
                    t,
                    0,
                    0,
                    0,
                    graph_note(LAUNCH_PER_GRAPH, LAUNCH_REPLAYS, "persistent launch, world 1, one CTA (no task)"),
                    gextra,
                )
            )
        finally:
            d.close()

    def run_flag(self) -> None:
        torch = self.torch
        pingpong, why = self.binding("flag_pingpong")
        if pingpong is None:
            self.rows.append(Row("flag", "rtt", "release/acquire", 0, None, 0, 0, None, f"not measured: {why}"))
            return
        iters = 2000 if self.quick else 20000
        flags = torch.zeros(64, dtype=torch.int64, device=self.dev)  # ping at [0], pong at [32]: 256 B apart
        out = torch.zeros(2, dtype=torch.int64, device=self.dev)
        base = 0
        pingpong(flags.data_ptr(), flags.data_ptr() + 256, base, iters, int(5e9), out.data_ptr(), self.stream())
        torch.cuda.synchronize()
        ns, failed = (int(x) for x in out.tolist())
        wrong = int(failed != 0) + int(int(flags[0]) != base + iters) + int(int(flags[32]) != base + iters)
        self.rows.append(
            Row(
                "flag",
                "rtt",
                "release/acquire",
                8,
                ns / 1e9 / iters,
                0,
                0,
                wrong,
                f"{iters} round trips between 2 CTAs" + (f"; timed out at {failed}" if failed else ""),
            )
        )
