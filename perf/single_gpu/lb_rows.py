"""lb_prefetch's rows (issue 37, DeepEP's lb_prefetch_weights test shape): the mapping, the bytes each
impl moves, the row, and the device memory the section needs."""

from __future__ import annotations

from typing import Optional, Sequence

import numpy as np

from .constants import LB_COPIES, LB_EMPTY, LB_SEED
from .rows import Row, fmt_size
from .timing import graph_note


def lb_mapping(
    world: int, experts_per_rank: int, slots: int, empty: float = LB_EMPTY, seed: int = LB_SEED
) -> np.ndarray:
    """A DeepEP-style ``redundancy_mapping`` (int32 ``[world, slots]``, expert ids local to the domain,
    -1 empty), seeded: in every row exactly ``round(empty x slots)`` slots are empty (DeepEP's test
    draws each slot empty with that probability) and the others hold distinct experts (DeepEP's test
    draws with replacement) of other ranks (never the row's own: DeepEP forbids it), in random slots."""
    E = world * experts_per_rank
    n_empty = int(round(empty * slots))
    filled = slots - n_empty
    if not 0 <= n_empty <= slots or filled > E - experts_per_rank:
        raise ValueError(
            f"{slots} slots with {n_empty} empty: {filled} distinct remote experts needed, {E - experts_per_rank} exist"
        )
    rng = np.random.default_rng(seed)
    out = np.full((world, slots), -1, np.int32)
    for r in range(world):
        remote = np.concatenate([np.arange(0, r * experts_per_rank), np.arange((r + 1) * experts_per_rank, E)])
        out[r, rng.choice(slots, size=filled, replace=False)] = rng.choice(remote, size=filled, replace=False)
    return out


def lb_bytes(mapping: np.ndarray, experts_per_rank: int, member_bytes: Sequence[int]) -> dict:
    """What an lb_prefetch of ``mapping`` moves: ``per_expert`` (the members' bytes, B), ``filled``
    slots (F), ``distinct`` experts mapped (D), ``payload`` F x B (bytes written into slots),
    ``copy_traffic`` 2 F B (one copy per slot and tensor: each reads its source and writes),
    ``multicast_traffic`` (D + F) B (a direct multicast reads each mapped expert once and writes every
    slot, as the fanout rows count it), ``sent_per_rank`` (slots each home fills) and ``critical_bytes``
    (the busiest home's: DeepEP's test reports its rate)."""
    m = np.asarray(mapping)
    ids = m[m >= 0]
    B = int(sum(member_bytes))
    F, D = int(ids.size), int(np.unique(ids).size)
    sent = np.bincount(ids // experts_per_rank, minlength=m.shape[0]).astype(int).tolist()
    return dict(
        per_expert=B,
        filled=F,
        distinct=D,
        payload=F * B,
        copy_traffic=2 * F * B,
        multicast_traffic=(D + F) * B,
        sent_per_rank=sent,
        critical_bytes=max(sent, default=0) * B,
    )


def lb_members_text(members: Sequence[tuple]) -> str:
    """``64M float8_e4m3fn + 16K float32 + 4K float32``: the bytes of one expert, member by member."""
    return " + ".join(f"{fmt_size(n)} {dt}" for _, n, dt in members)


def lb_row(
    impl: str,
    mapping: np.ndarray,
    experts_per_rank: int,
    members: Sequence[tuple],
    time_s: Optional[float],
    wrong: Optional[int],
    note: str = "",
    extra: Optional[dict] = None,
    graph: Optional[tuple] = None,
) -> Row:
    """One lb_prefetch row: size B (one expert's members), payload F x B, traffic by the impl (copies
    2 F B, a multicast (D + F) B; see lb_bytes), a note saying which bytes are counted (and "graph
    replay" for ``graph=(per_graph, replays)`` rows), extra: the counts, timing, critical bytes."""
    b = lb_bytes(mapping, experts_per_rank, [n for _, n, _ in members])
    W, S = np.asarray(mapping).shape
    copies = impl == LB_COPIES
    counted = (
        f"payload {b['filled']} filled slots x {b['per_expert']} B ({lb_members_text(members)}); busbw counts "
        + (
            "2 x payload (each copy reads its home's tensor and writes the slot)"
            if copies
            else f"({b['distinct']} experts + {b['filled']} slots) x {b['per_expert']} B (each mapped expert read "
            "once, each slot written)"
        )
    )
    body = ", ".join(x for x in (note, counted) if x)
    if time_s is None and not note.startswith(("not measured", "FAILED")):
        body = "not measured: " + body
    x = dict(
        world=W,
        slots=S,
        experts=W * experts_per_rank,
        filled=b["filled"],
        distinct=b["distinct"],
        sent_per_rank=b["sent_per_rank"],
        critical_bytes=b["critical_bytes"],
        timing="eager",
    )
    if graph is not None:
        x.update(timing="graph", per_graph=graph[0], replays=graph[1])
        body = graph_note(graph[0], graph[1], body)
    x.update(extra or {})
    return Row(
        "lb_prefetch",
        lb_case(W, experts_per_rank, S),
        impl,
        b["per_expert"],
        time_s,
        b["payload"],
        b["copy_traffic"] if copies else b["multicast_traffic"],
        wrong if time_s is not None else None,
        body,
        x,
    )


def lb_case(world: int, experts_per_rank: int, slots: int) -> str:
    return f"EP{world} {world * experts_per_rank} experts x {slots} slots"


def lb_memory_bytes(world: int, experts_per_rank: int, slots: int, per_expert: int) -> int:
    """Device memory the lb_prefetch section needs at its peak: the masters (world x experts x B)
    and the adapter's pools (world x slots x B x 1.25: deepep_lb's byte pools keep a quarter more
    for the grad region), plus 1 GiB for plan arenas and the allocator's slack (the tile mover's
    windows, world x slots x B, are freed before the adapter's pools are made)."""
    return world * experts_per_rank * per_expert + world * slots * per_expert * 5 // 4 + (1 << 30)
