"""Activation recompute: which live step a forward recomputed inside a backward pass belongs to."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

from ..errors import UltracommError

if TYPE_CHECKING:  # pragma: no cover
    from .step import Step

__all__ = ["recompute_target"]


def _will_execute(node: Any) -> bool:
    """Whether the running backward pass will execute ``node``."""
    return node is not None and torch._C._will_engine_execute_node(node)


def _nearest_in_graph(start: Any, steps: list["Step"]) -> list["Step"]:
    """The step whose node a breadth-first walk from ``start`` (the node whose backward is
    running) meets first: the recompute belongs to the checkpointed region ``start`` is in."""
    want = {s._node(): s for s in steps}
    seen, frontier = set(), [start]
    while frontier:
        nxt = []
        for node in frontier:
            if node is None or node in seen:
                continue
            seen.add(node)
            if node in want:
                return [want[node]]
            nxt.extend(fn for fn, _ in node.next_functions)
        frontier = nxt
    return []


def recompute_target(live: list["Step"], layer: int, routing_map: torch.Tensor) -> "Step | None":
    """The live step whose forward this call recomputes (non-reentrant checkpointing), or
    None (a reentrant recompute: its first forward ran under no_grad and left no step).

    With several micro-batches of ``layer`` in flight the one being recomputed is the one
    whose graph the running backward pass executes -- not the oldest: pipeline schedules
    run backwards in any order (F0 F1 B1 B0)."""
    live = [s for s in live if s.layer == layer]
    if not live:
        return None
    hits = [s for s in live if _will_execute(s._node())]
    told = bool(hits)  # the running pass executes the candidates' nodes: a routing that matches none is an error
    if not hits:
        # a pass that runs no reduce (autograd.grad of an input with the graph retained, before the
        # weight pass): the steps whose guard it runs, or -- on a rank where the micro-batch's output
        # does not depend on the input asked for, not even that -- every step with a graph, by routing
        hits = [s for s in live if _will_execute(s._guard_node())]
        told = bool(hits)
        hits = hits or [s for s in live if s._node() is not None]
    # the routing first: a layer applied twice in one checkpointed block has two steps the
    # backward executes, and the recompute replays both calls in their order -- every rank
    # picks the same one this way (a restore it triggers is collective)
    same = [s for s in hits if torch.equal(s.routing_map, routing_map)]
    if not same:  # a step without replica weights/guard (no node): match by routing
        same = [s for s in live if s._node() is None and torch.equal(s.routing_map, routing_map)]
    if not same:
        if told:
            raise UltracommError(
                f"ultracomm: layer {layer}: the recomputed routing differs from the forward's; activation "
                "recompute needs a deterministic router (same inputs, same routing)"
            )
        return None
    if len(same) > 1:  # the same routing twice: the first not yet recomputed, nearest in the graph
        fresh = [s for s in same if not s._recomputed] or same
        same = _nearest_in_graph(torch._C._current_autograd_node(), fresh) or fresh
    target = same[0]
    target._recomputed = True
    return target
