"""What a message costs: the alpha-beta model of message transports and shared memory's tiers.

A message has a fixed cost (``alpha``: posting, matching, a context switch; gloo over TCP, NCCL
point-to-point across nodes) besides its bytes (``bytes / beta``); a window tier has a fixed cost
per *operation* (``op_alpha_s``: its join, hand-offs and drain).  The transports that send
messages read their costs here (``p2p`` by backend, the CPU ``split`` for its route:
:func:`split_route`); the control plane chooses schedules with them
(:func:`ultracomm.alpha_beta.choose_schedule`).
"""

from __future__ import annotations

import collections
import dataclasses
import math
from typing import Any, Optional, Sequence
from ..errors import InputError

__all__ = [
    "AlphaBeta",
    "COSTS",
    "best_chunk",
    "costs_for_backend",
    "predicted_s",
    "split_chunk_bytes",
    "split_route",
    "Route",
    "align_chunk",
]


@dataclasses.dataclass(frozen=True)
class AlphaBeta:
    """Per-message cost ``alpha_s`` (seconds) and per-rank link bandwidth ``beta_Bps``
    (bytes/s, each direction); ``source`` says where the figures come from.

    ``shared``: every rank's messages cross one medium of ``beta_Bps`` in all (ranks on one
    host: TCP loopback is the host's cores and memory), so a link's time is all the bytes
    moved, not the busiest rank's, and a relay can only add its hop."""

    alpha_s: float
    beta_Bps: float
    source: str = ""
    shared: bool = False
    #: fixed cost of one operation on this path per rank of a memory domain that takes part,
    #: besides its messages or chunks (a window transport's join, worker hand-offs and drain):
    #: what running a domain's edges on this tier adds to an operation (:func:`split_route`)
    op_alpha_s: float = 0.0

    def __post_init__(self) -> None:
        if not (self.alpha_s >= 0 and math.isfinite(self.alpha_s)):
            raise InputError(f"ultracomm: alpha_s must be a finite number >= 0, got {self.alpha_s!r}")
        if not (self.beta_Bps > 0 and math.isfinite(self.beta_Bps)):
            raise InputError(f"ultracomm: beta_Bps must be a positive finite number, got {self.beta_Bps!r}")
        if not (self.op_alpha_s >= 0 and math.isfinite(self.op_alpha_s)):
            raise InputError(f"ultracomm: op_alpha_s must be a finite number >= 0, got {self.op_alpha_s!r}")

    def pipeline_chunk(self, nbytes: int, levels: int = 1) -> int:
        """The chunk that minimises ``ceil(nbytes / c) * alpha + levels * (c / beta + alpha)``
        (the busiest link's message costs against the fill of ``levels`` relay levels), over
        whole numbers of chunks (:func:`best_chunk`): one chunk where a second message costs more
        than the fill it saves.  At least 64 KiB, at most ``nbytes`` (rounded up to 16 bytes)."""
        return best_chunk(nbytes, self, ((self, levels),))


def best_chunk(
    nbytes: int, link: AlphaBeta, fill: Sequence[tuple[AlphaBeta, int]], granule: int = 16, min_chunk: int = 1 << 16
) -> int:
    """The chunk (a multiple of ``granule``) of an ``nbytes`` slot that minimises the model's time
    ``m * link.alpha + nbytes / link.beta + sum(levels * (c / beta + alpha) for (beta, alpha), levels in fill)``,
    ``m = ceil(nbytes / c)`` messages over the busiest link and each further level of the path
    (``fill``: its costs and how many such levels) adding one chunk's time.  The time is convex in
    the number of chunks ``k``, so the whole numbers around the continuous optimum
    ``sqrt(nbytes * sum(levels / beta) / link.alpha)`` and ``k = 1`` are the candidates; ties go to
    fewer chunks.  At least ``min_chunk`` (unless the slot is smaller), at most the slot."""
    n = int(nbytes)
    if n <= 0:
        return 1
    g = max(1, int(granule))
    whole = -(-n // g) * g
    lo = min(whole, -(-int(min_chunk) // g) * g)
    inv_beta = sum(levels / f.beta_Bps for f, levels in fill)
    k_star = math.sqrt(n * inv_beta / link.alpha_s) if link.alpha_s > 0 else float(n)
    kmax = max(1, -(-n // lo))
    ks = {1, kmax} | {min(kmax, max(1, int(k_star) + d)) for d in (-1, 0, 1, 2)}
    best = None
    for k in sorted(ks):
        c = min(whole, max(lo, -(-(-(-n // k)) // g) * g))
        m = -(-n // c)
        t = m * link.alpha_s + n / link.beta_Bps + sum(levels * (c / f.beta_Bps + f.alpha_s) for f, levels in fill)
        if best is None or t < best[0] * (1 - 1e-12):
            best = (t, c)
    assert best is not None
    return best[1]


#: Measured or sourced figures per process-group backend (what the ``p2p`` transport runs on).
COSTS: dict[str, AlphaBeta] = {
    # perf/README.md section 6: gloo over TCP loopback on the 2-core CI machine, 4 ranks: a
    # one-way message of 1 KiB took 0.3-2 ms (scheduling on shared cores), 8 MiB ran at
    # 1.5-1.7 GB/s.  The larger alpha is the conservative one: it only makes chunks larger.
    # perf/README.md section 6: the host executor over POSIX shared memory moved 4.5-9 GB/s
    # (algbw) on the same machine; a chunk's flag and a worker's wake-up, ~20 us (estimate).
    # op_alpha_s: relay_split against p2p_gloo on that machine (perf/README.md section 6b, "route"):
    # with 4 KiB experts (fixed costs only) split took ~1 ms more per op than p2p_gloo at 4 ranks,
    # and split lost where the bytes it keeps off gloo take less than ~2.5 ms to send at 4 ranks (2 per
    # domain) and ~5 ms at 8 (4 per domain) -- about twice that for a reduction: its host executor's
    # join and hand-offs, on more ranks than cores, run beside the messages instead of under them.
    "host_shm": AlphaBeta(
        20e-6, 6e9, "measured: host executor over shared memory, 2-core CPU machine", op_alpha_s=1.25e-3
    ),
    "gloo": AlphaBeta(1e-3, 1.6e9, "measured: gloo TCP loopback, 2-core CPU machine (perf/README.md section 6)"),
    # NCCL point-to-point across nodes: 400 Gb/s RDMA NICs achieve ~50 GB/s per GPU (FACTS.md);
    # per message ~10 us of launch and protocol (an estimate, not measured here).
    "nccl": AlphaBeta(10e-6, 50e9, "estimate: RDMA 50 GB/s per GPU (FACTS.md), 10 us per message"),
}


def align_chunk(nbytes: float) -> int:
    """Round up to the builder's chunk granularity (16 bytes)."""
    return max(16, -(-int(math.ceil(nbytes)) // 16) * 16)


def split_chunk_bytes(
    chunk_bytes: int,
    tile_bytes: int,
    slot_bytes: int,
    costs: AlphaBeta,
    inside: Optional[AlphaBeta] = None,
    inside_levels: int = 2,
) -> int:
    """The window chunk of a ``split`` transport on the CPU (:func:`best_chunk`, in whole tiles):
    a crossing moves one chunk per message over ``costs`` (one crossing per path: a remote
    domain's gateway hangs from the home's domain), then up to ``inside_levels`` relay levels
    inside a domain over ``inside`` (host shared memory) each add one chunk's time.  So a slot
    whose crossing cannot pay for a second message is one chunk (2 MiB over gloo), a large one a
    few.  A larger configured ``chunk_bytes`` is kept."""
    inside = COSTS["host_shm"] if inside is None else inside
    want = best_chunk(slot_bytes, costs, ((inside, inside_levels),), granule=tile_bytes)
    return max(int(chunk_bytes), int(want))


def costs_for_backend(backend: str) -> AlphaBeta:
    """:data:`COSTS` of a process-group backend name (``"gloo"``, ``"nccl"``, ``"cpu:gloo,cuda:nccl"``)."""
    b = str(backend).lower()
    for name, cost in COSTS.items():
        if name in b:
            return cost
    return COSTS["gloo"]


def predicted_s(schedule: Any, op: str, costs: AlphaBeta) -> float:
    """The model's time of ``op`` (``"multicast"`` / ``"reduce"``) of ``schedule``: on the
    busiest link (all links, when ``costs.shared``), one message per chunk of each replica it
    carries; plus the fill."""
    st = schedule.stats(op)
    nbytes, chunks = int(st["bytes"]), max(1, int(st["chunks"]))
    if nbytes == 0 or st["max_link_bytes"] == 0:
        return 0.0
    units = (sum(st["egress"]) if costs.shared else st["max_link_bytes"]) / nbytes
    chunk = nbytes / chunks
    link = units * (nbytes / costs.beta_Bps + chunks * costs.alpha_s)
    return link + max(0, int(st["depth"]) - 1) * (chunk / costs.beta_Bps + costs.alpha_s)


@dataclasses.dataclass(frozen=True)
class Route:
    """What :func:`split_route` picked for one operation of a ``split`` schedule: ``"split"``
    (shared memory inside each domain, messages across) or ``"messages"`` (every edge a message,
    the direct schedule), with the model's inputs."""

    route: str
    saved_bytes: int  # bytes that shared memory keeps off the messages under the split route
    saved_s: float  # their time over the messages' link
    fixed_s: float  # what the shared-memory tier adds to the operation

    def describe(self) -> str:
        return (
            f"{self.route} ({self.saved_bytes} B kept off messages = {self.saved_s * 1e3:.2f} ms vs "
            f"{self.fixed_s * 1e3:.2f} ms fixed cost of shared memory)"
        )


def split_route(
    schedule: Any,
    op: str,
    domain_of: Sequence[int],
    messages: Optional[AlphaBeta] = None,
    inside: Optional[AlphaBeta] = None,
) -> Route:
    """The route of ``op`` (``"multicast"`` / ``"reduce"``) of a ``split`` transport's
    ``schedule`` (built with the domains as nodes).

    Under the split route the edges inside a domain run on shared memory and only the crossings
    are messages; the shared-memory tier costs ``inside.op_alpha_s`` per rank of the largest
    domain, once per operation -- twice for a reduction, whose edges are two hand-offs each.
    Every edge a message (the direct schedule, as the ``p2p`` transport runs on one host) costs
    no such thing but sends the inside edges' bytes too, at
    ``messages.beta_Bps``.  So: ``"messages"`` when those bytes take less time than the fixed
    cost -- small experts, where a relay cannot pay for itself -- else ``"split"``.  Ties: split.
    Deterministic from the schedule (every rank picks alike)."""
    messages = COSTS["gloo"] if messages is None else messages
    inside = COSTS["host_shm"] if inside is None else inside
    st = schedule.stats(op)
    total, cross = ("egress", "inter_egress") if op == "multicast" else ("ingress", "inter_ingress")
    saved = int(sum(st[total]) - sum(st[cross]))
    per_domain = collections.Counter(int(d) for d in domain_of)
    # a reduction's edge inside a domain is two hand-offs (the child's grad_ready, the parent's
    # consumed) where a multicast edge is one (arrival)
    fixed = inside.op_alpha_s * max(per_domain.values(), default=1) * (2 if op == "reduce" else 1)
    saved_s = saved / messages.beta_Bps
    return Route("messages" if saved_s < fixed else "split", saved, saved_s, fixed)
