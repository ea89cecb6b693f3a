"""The alpha-beta cost model of message transports, and the schedule choice it makes.

On a transport where every message has a fixed cost (``alpha``: posting, matching, a
context switch; gloo over TCP, NCCL point-to-point across nodes) besides its bytes
(``bytes / beta``), chunk streaming and relay hops are not free: ``n`` chunks of an edge pay
``n * alpha``, and each relay level adds one chunk's time and one ``alpha`` to the path.  So
the choice NCCL makes between its algorithms is made here too, per plan: among direct sends
(one message per member and edge) and relay trees with pipelined chunks, the schedule with
the smallest predicted time, where a rank's time is ``messages * alpha + bytes / beta`` on
its busiest link plus the pipeline fill of the tree (``(depth - 1) * (chunk / beta + alpha)``).

The model itself (:class:`AlphaBeta`, :data:`COSTS`, :func:`split_route`, ...) lives in the data
plane, :mod:`ultracomm.transports.costs`, and is re-exported here.  One place: :class:`~ultracomm.context.Context` uses :func:`choose_schedule` for the ``p2p``
transport (:data:`COSTS`, by process-group backend), and the simulator
(:func:`ultracomm.sim.model.schedule_for` with ``costs=``) uses the same function, so
simulated NCCL point-to-point figures follow the same choice.

The window transports (shared memory, NVLink) keep the builder's own model: their
per-chunk cost is a flag, microseconds below a chunk's transfer time.  What a window tier costs
per *operation* (``op_alpha_s``: its join, hand-offs and drain) decides the ``split``
transport's route on the CPU (:func:`split_route`): shared memory inside each domain with
messages across, or every edge a message where the bytes shared memory would keep off the
messages cannot pay for that fixed cost.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional

from .transports.costs import (
    COSTS,
    AlphaBeta,
    Route,
    align_chunk,
    best_chunk,
    costs_for_backend,
    predicted_s,
    split_chunk_bytes,
    split_route,
)

__all__ = [
    "AlphaBeta",
    "COSTS",
    "best_chunk",
    "costs_for_backend",
    "choose_schedule",
    "predicted_s",
    "Choice",
    "split_chunk_bytes",
    "split_route",
    "Route",
]


@dataclasses.dataclass(frozen=True)
class Choice:
    """What :func:`choose_schedule` picked: the schedule, its chunk and relay mode, and the
    predicted times of both operations (seconds, under the model)."""

    schedule: Any
    chunk_bytes: int
    relay_mode: str
    predicted_s: tuple[float, float]

    def describe(self) -> str:
        d = [self.schedule.stats(op)["depth"] for op in ("multicast", "reduce")]
        how = lambda depth: "direct" if depth <= 1 else f"relay depth {depth}"  # noqa: E731
        return (
            f"multicast {how(d[0])}, reduce {how(d[1])}, chunk {self.chunk_bytes} B "
            f"(predicted {self.predicted_s[0] * 1e3:.2f} / {self.predicted_s[1] * 1e3:.2f} ms)"
        )


def choose_schedule(
    plan: Any,
    weight_bytes: int,
    grad_bytes: int,
    costs: AlphaBeta,
    *,
    relay_mode: str = "auto",
    max_depth: int = 8,
    node_of: Optional[Any] = None,
    rank: Optional[int] = None,
) -> Choice:
    """The schedule of ``plan`` for a message transport with ``costs``.

    Candidates: direct sends with one chunk per slot (``relay_mode="off"``), and relay trees
    with the pipelined chunk of each depth the builder may pick (``relay_mode`` ``auto`` or
    ``force``); the one with the smallest sum of both operations' :func:`predicted_s` wins
    (ties: direct).  ``relay_mode="off"`` has only the direct candidate, ``"force"`` only
    relay trees.  Deterministic: every rank picks alike from the same plan.
    """
    from .schedule import build_schedule

    whole = align_chunk(max(int(weight_bytes), int(grad_bytes), 1))
    kw = dict(
        node_of=node_of,
        intra_bw=costs.beta_Bps,
        inter_bw=costs.beta_Bps,
        intra_latency_s=costs.alpha_s,
        inter_latency_s=costs.alpha_s,
        max_depth=max_depth,
        rank=rank,
    )
    cands: list[tuple[int, str]] = []
    if relay_mode != "force":
        cands.append((whole, "off"))
    if relay_mode != "off":
        for levels in (1, 2, 3):
            c = costs.pipeline_chunk(whole, levels)
            if (c, relay_mode) not in cands:
                cands.append((c, relay_mode))
    best: Optional[Choice] = None
    for chunk, mode in cands:
        s = build_schedule(plan, weight_bytes, grad_bytes, chunk_bytes=chunk, relay_mode=mode, **kw)
        t = (predicted_s(s, "multicast", costs), predicted_s(s, "reduce", costs))
        if best is None or sum(t) < sum(best.predicted_s) * (1 - 1e-9):
            best = Choice(s, chunk, mode, t)
    assert best is not None
    return best
