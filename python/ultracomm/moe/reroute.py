"""Token rerouting: send each source rank's tokens of a hot expert to its replicas by the
planner's integer quotas.

A planner (``ultracomm.planners``) says how many tokens source rank ``s`` sends to each
replica slot (``PlannerResult.slot_moves[s]``); every other token of ``s`` stays with the
expert's home copy.  :class:`RerouteTable` turns that into two small ``[E, I]`` tables for
one source rank and one column layout, and :func:`reroute` applies them to the rank's
``routing_map``/``probs`` on their own device, without a host round trip.

Which tokens move: for expert ``e``, the rank's tokens routed to ``e`` in token order; the
first ``home`` of them stay home, the next go to ``e``'s replicas in instance order
(sorted by rank, then slot: the planners' instance order), each taking its quota.

Column layouts of the rerouted ``[T, P]`` map:

==========  ===============================  =========================================
layout      P                                column of home expert e / replica (r, k)
==========  ===============================  =========================================
``echo``    ``E + world * K``                ``e`` / ``E + r * K + k`` (Megatron MoE ECHO:
                                             home experts, then global spare slots)
``physical`` ``world * (epr + K)``           ``home(e) * (epr + K) + local(e)`` /
                                             ``r * (epr + K) + epr + k`` (UltraEP: per rank
                                             its masters, then its redundant slots)
==========  ===============================  =========================================
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from ..planners.base import PlannerResult, instance_index
from ..errors import InputError

__all__ = ["LAYOUTS", "RerouteTable", "reroute", "num_columns"]

LAYOUTS = ("echo", "physical")


def num_columns(layout: str, num_experts: int, world: int, slots_per_rank: int) -> int:
    """``P``, the columns of a rerouted map in ``layout``."""
    if layout == "echo":
        return num_experts + world * slots_per_rank
    if layout == "physical":
        return world * (num_experts // world + slots_per_rank)
    raise InputError(f"ultracomm: reroute layout must be one of {LAYOUTS}, got {layout!r}")


@dataclass(frozen=True)
class RerouteTable:
    """One source rank's token split for one plan, in one column layout (CPU tensors).

    Attributes:
        bounds: int64 ``[E, I]``: cumulative token counts over expert ``e``'s instances
            (home first); a token whose rank among ``e``'s routed tokens is ``j`` goes to
            the first instance with ``bounds[e, i] > j``.
        columns: int64 ``[E, I]``: the rerouted map's column of each instance (unused
            instances repeat the home column; their bound never selects them).
        num_columns: ``P``.
    """

    bounds: torch.Tensor
    columns: torch.Tensor
    num_columns: int

    @classmethod
    def from_result(cls, result: PlannerResult, rank: int, layout: str = "echo") -> "RerouteTable":
        """The table for source rank ``rank`` of a planner result."""
        dom = result.domain
        W, E, epr = dom.world, dom.num_experts, dom.experts_per_rank
        slot_src = np.asarray(result.slot_src)
        K = slot_src.shape[1]
        P = num_columns(layout, E, W, K)
        inst_rank, slot_inst = instance_index(slot_src, dom)
        I = inst_rank.shape[1]
        counts = np.zeros((E, I), np.int64)
        columns = np.empty((E, I), np.int64)
        home = dom.home_of
        experts = np.arange(E)
        columns[:, :] = (experts if layout == "echo" else home * (epr + K) + experts % epr)[:, None]
        filled = slot_src >= 0
        rr, kk = np.nonzero(filled)
        ex = slot_src[filled].astype(np.int64)
        inst = slot_inst[filled]
        counts[ex, inst] = np.asarray(result.slot_moves)[rank, rr, kk]
        columns[ex, inst] = E + rr * K + kk if layout == "echo" else rr * (epr + K) + epr + kk
        counts[:, 0] = np.asarray(result.load)[rank] - counts[:, 1:].sum(1)
        if counts.size and counts.min() < 0:  # pragma: no cover - a planner bug
            raise AssertionError("ultracomm: planner moved more tokens than the source rank has")
        return cls(torch.from_numpy(np.cumsum(counts, axis=1)), torch.from_numpy(columns), P)

    @classmethod
    def from_plan(
        cls,
        loads: torch.Tensor,
        slot_src: torch.Tensor,
        slot_quota: torch.Tensor,
        rank: int,
        experts_per_rank: int,
        layout: str = "echo",
        out: "dict | None" = None,
    ) -> "RerouteTable":
        """The table for source rank ``rank`` computed where the plan is, by the device reroute
        (``include/ultracomm/impl/token_split.h``: the same split as the planners').

        Args:
            loads: int32 ``[world, E]`` gathered token counts.
            slot_src: int32 ``[world, slots]``; slot_quota: int64 ``[world, slots]`` (a
                device planner's output, e.g. ``planners.device.plan_on_gpu``).
            rank: this source rank; experts_per_rank: fixes each expert's home.
            layout: ``echo`` or ``physical``.
            out: buffers of an earlier call with the same shapes (CUDA: reused, no allocation), or
                an empty dict that this call fills with the buffers it allocates.

        On CUDA tensors the table is computed by a kernel on the current stream (no host sync,
        capturable); on CPU tensors by the host build of the same code.  ``bounds`` /
        ``columns`` are ``[E, world]`` (padded: unused instances never selected).
        """
        if layout not in LAYOUTS:
            raise InputError(f"ultracomm: reroute layout must be one of {LAYOUTS}, got {layout!r}")
        W, K = slot_src.shape
        E = W * experts_per_rank
        for name, t, dt, shape in (
            ("loads", loads, torch.int32, (W, E)),
            ("slot_src", slot_src, torch.int32, (W, K)),
            ("slot_quota", slot_quota, torch.int64, (W, K)),
        ):
            if t.dtype != dt or tuple(t.shape) != shape or t.device != slot_src.device:
                raise InputError(
                    f"ultracomm: {name} must be {dt} {list(shape)} on {slot_src.device}, got "
                    f"{t.dtype} {list(t.shape)} on {t.device}"
                )
        P = num_columns(layout, E, W, K)
        lay = LAYOUTS.index(layout)
        if slot_src.device.type != "cuda":
            from .. import _core

            b, c = _core.reroute_table(loads.numpy(), slot_src.numpy(), slot_quota.numpy(), experts_per_rank, rank, lay)
            return cls(torch.from_numpy(b), torch.from_numpy(c), P)
        from ..cuda import support as cuda_support

        dev = slot_src.device
        cuda = cuda_support.cuda_runtime(dev.index, "the device reroute")
        if not out:  # none, or an empty dict to fill (the caller keeps it for the next call)
            out = {} if out is None else out
            out.update(
                bounds=torch.empty((E, W), dtype=torch.int64, device=dev),
                columns=torch.empty((E, W), dtype=torch.int64, device=dev),
                scratch=torch.empty(cuda.reroute_scratch_bytes(W, E) // 8, dtype=torch.int64, device=dev),
            )
        args = [t.contiguous() for t in (loads, slot_src, slot_quota)]
        cuda.reroute_table(
            args[0].data_ptr(),
            args[1].data_ptr(),
            args[2].data_ptr(),
            out["scratch"].data_ptr(),
            out["bounds"].data_ptr(),
            out["columns"].data_ptr(),
            W,
            experts_per_rank,
            K,
            rank,
            lay,
            torch.cuda.current_stream(dev).cuda_stream,
        )
        return cls(out["bounds"], out["columns"], P)

    def to(self, device: torch.device) -> "RerouteTable":
        return RerouteTable(
            self.bounds.to(device, non_blocking=True), self.columns.to(device, non_blocking=True), self.num_columns
        )


def reroute(
    routing_map: torch.Tensor, probs: torch.Tensor | None, table: RerouteTable
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Apply ``table`` to this rank's routing.

    Args:
        routing_map: bool ``[T, E]``, this rank's tokens (any device).
        probs: float ``[T, E]`` or ``None``; differentiable (the backward gathers the
            rerouted probs' gradient back to the expert columns).
        table: from :meth:`RerouteTable.from_result` for this rank (moved to the device
            of ``routing_map``).

    Returns:
        ``(map, probs)``: bool ``[T, P]`` and ``[T, P]`` in ``probs.dtype`` (``None`` when
        ``probs`` is); every routed (token, expert) lands in exactly one column, with its
        prob; unrouted entries are False / 0.
    """
    if routing_map.dtype != torch.bool or routing_map.ndim != 2:
        raise InputError(
            f"ultracomm: routing_map must be a bool [tokens, experts] tensor, got "
            f"{routing_map.dtype} {list(routing_map.shape)}"
        )
    T, E = routing_map.shape
    if table.bounds.shape[0] != E:
        raise InputError(f"ultracomm: routing_map has {E} expert columns, the plan has {table.bounds.shape[0]} experts")
    if probs is not None and tuple(probs.shape) != (T, E):
        raise InputError(f"ultracomm: probs must have the routing map's shape {[T, E]}, got {list(probs.shape)}")
    dev = routing_map.device
    bounds, columns = table.bounds.to(dev), table.columns.to(dev)
    # rank of each routed token among the rank's tokens of its expert (0-based, token order)
    order = torch.cumsum(routing_map, dim=0, dtype=torch.int64) - 1
    inst = torch.searchsorted(bounds, order.t().contiguous(), right=True).clamp_(max=bounds.shape[1] - 1)
    col = columns.gather(1, inst).t()
    col = torch.where(routing_map, col, columns[:, 0].unsqueeze(0))  # unrouted: home column (unique per row)
    out_map = torch.zeros((T, table.num_columns), dtype=torch.bool, device=dev).scatter_(1, col, routing_map)
    if probs is None:
        return out_map, None
    src = probs.masked_fill(~routing_map, 0)
    out_probs = torch.zeros((T, table.num_columns), dtype=probs.dtype, device=dev).scatter(1, col, src)
    return out_map, out_probs
