"""Megatron MoE ECHO's offloading planner, ``gen_offloading_plan``, restated from upstream.

Upstream (read, not copied):

* ``balanced_moe`` (default): Victarry/Megatron-LM, BalancedMoELayer branch,
  ``megatron/core/transformer/moe/offloading_planner.py`` at commit 0bd925e4 (what
  ``balanced_moe_layer.py`` at ae807d3f calls).
* ``pr2368``: NVIDIA/Megatron-LM PR #2368 head a2b16b87, the same file (Triton kernels).

Both compute, from every rank's token counts ``[R, E]`` (``R`` EP ranks, ``M = E / R`` home
experts and ``K`` spare slots per rank):

1. per rank, how many tokens spill over the mean rank load ``avg = total // R``: the rank's
   experts sorted by count ascending, ``cumsum - avg`` clamped at 0, differenced -- the
   largest experts spill; every rank below ``avg`` has ``avg - load`` spare capacity;
2. an ``[E, R*K]`` count matrix (global spare ``j`` = rank ``j // K``, slot ``j % K``) by
   ``assignment_algorithm``:

   * ``one_shot_greedy``: spillovers (descending) laid end to end against capacities
     (descending); each rank's ``K`` largest overlaps fill its slots, largest in slot 0;
     with ``threshold_multiplier > 0``, spare columns that no rank above
     ``avg * (1 + threshold_multiplier)`` needs are dropped (upstream's
     ``reclaim_spare_experts``).  ``balanced_moe`` multiplies capacities by ``K``.
   * ``approx_bin_packing`` (``K`` = 1 only): ``balanced_moe``: each expert (descending)
     fills ranks (descending capacity) until placed, then each spare keeps its largest
     home; ``pr2368``: the bucketed queue of its Triton kernel -- each rank (descending
     capacity) takes the head of the highest non-empty bucket (buckets of width
     ``avg // 7`` below ``avg``; ``>= avg`` first), and a remainder goes to the tail of
     its new bucket.
3. a per-source-rank split of each spare's tokens: first in proportion to the source
   ranks' tokens of that expert (float32, floored), then what the floors left, from the
   lowest source rank up;
4. this rank's map: for each spare column in order, the next of this rank's tokens of its
   home expert (token order) move there; the rest stay home.  Columns are then put in
   the order Megatron's token dispatcher reads: per rank its ``M`` home experts then its
   ``K`` spares (column ``c`` is rank ``c // (M+K)``, local slot ``c % (M+K)``).

Where upstream leaves an order open this uses the natural one: sorts are stable (ties
keep the lower index; upstream's ``torch.sort``/``topk`` do not promise an order for ties),
and ``pr2368``'s bucket width is at least 1 (upstream divides by zero when ``avg < 7``).
Rerouted probs: ``balanced_moe`` keeps ``probs_routing`` where nothing moved (so
unrouted entries keep whatever they held); ``pr2368`` multiplies by the new map.

``assignment_algorithm`` may also name an ultracomm planner (``quota``, ``taot``,
``greedy``, ``lpt``); it then decides slots and per-source token counts itself, and the
output has the same shapes and column order.
"""

from __future__ import annotations

import math
from typing import Any, Union

import numpy as np
import torch

from ..moe.reroute import RerouteTable, reroute
from ..planners import PLANNERS, Domain, get_planner
from ..errors import InputError

__all__ = ["gen_offloading_plan", "ALGORITHMS", "UPSTREAMS", "effective_column"]

ALGORITHMS = ("approx_bin_packing", "one_shot_greedy")
UPSTREAMS = {
    "balanced_moe": "Victarry/Megatron-LM@0bd925e4 (BalancedMoELayer branch)",
    "pr2368": "NVIDIA/Megatron-LM@a2b16b87 (PR #2368)",
}
_NUM_BUCKETS = 8  # pr2368's approx_bin_packing default


def _err(msg: str) -> InputError:
    return InputError(f"ultracomm: gen_offloading_plan: {msg}")


def effective_column(
    num_experts: int, num_ep_ranks: int, spares_per_rank: int, expert: int | None = None, spare: int | None = None
) -> int:
    """Column of home ``expert`` or global spare ``spare`` (rank ``spare // K``) in Megatron's
    per-rank order: rank ``r``'s columns are ``r*(M+K) .. r*(M+K)+M+K-1``, homes first."""
    M, K = num_experts // num_ep_ranks, spares_per_rank
    if expert is not None:
        return (expert // M) * (M + K) + expert % M
    return (spare // K) * (M + K) + M + spare % K


# ----------------------------------------------------------------------------- checks


def _as_int(x: Any, name: str, lo: int, hi: int | None, what: str) -> int:
    if isinstance(x, torch.Tensor):
        if x.numel() != 1 or x.dtype.is_floating_point or x.dtype.is_complex or x.dtype == torch.bool:
            raise _err(f"{name} must be {what}, got a {x.dtype} tensor of shape {list(x.shape)}")
        x = int(x.item())
    if isinstance(x, bool) or not isinstance(x, (int, np.integer)) or x < lo or (hi is not None and x > hi):
        raise _err(f"{name} must be {what}, got {x!r}")
    return int(x)


def _check(
    map_token_to_expert,
    probs_routing,
    counts,
    ep_rank,
    num_ep_ranks,
    K,
    threshold_multiplier,
    dtype_index,
    assignment_algorithm,
    upstream,
):
    """Every argument checked before anything is computed; returns ``(counts int64 [R, E],
    rank, R, K, threshold)``."""
    m = map_token_to_expert
    if not isinstance(m, torch.Tensor) or m.dtype != torch.bool or m.ndim != 2:
        got = f"{m.dtype} {list(m.shape)}" if isinstance(m, torch.Tensor) else type(m).__name__
        raise _err(f"map_token_to_expert must be a bool [tokens, experts] tensor, got {got}")
    T, E = m.shape
    p = probs_routing
    if not isinstance(p, torch.Tensor) or not p.dtype.is_floating_point or tuple(p.shape) != (T, E):
        got = f"{p.dtype} {list(p.shape)}" if isinstance(p, torch.Tensor) else type(p).__name__
        raise _err(f"probs_routing must be a floating-point tensor shaped like map_token_to_expert {[T, E]}, got {got}")
    R = _as_int(num_ep_ranks, "num_ep_ranks", 1, None, "a positive int (the EP group's size)")
    if E % R:
        raise _err(
            f"num_ep_ranks={R} does not divide the {E} experts of map_token_to_expert; every EP rank "
            "homes the same number of experts"
        )
    rank = _as_int(ep_rank, "ep_rank", 0, R - 1, f"an int in 0..{R - 1} (this rank's index in the EP group)")
    K = _as_int(K, "num_spare_experts_per_ep_rank", 1, None, "a positive int")
    if (
        isinstance(threshold_multiplier, bool)
        or not isinstance(threshold_multiplier, (int, float))
        or not math.isfinite(threshold_multiplier)
    ):
        raise _err(f"threshold_multiplier must be a finite number (<= 0: off), got {threshold_multiplier!r}")
    if (
        not isinstance(dtype_index, torch.dtype)
        or dtype_index.is_floating_point
        or dtype_index.is_complex
        or dtype_index == torch.bool
    ):
        raise _err(f"dtype_index must be an integer torch dtype (torch.int32 or torch.int64), got {dtype_index!r}")
    if upstream not in UPSTREAMS:
        raise _err(f"upstream must be one of {sorted(UPSTREAMS)}, got {upstream!r}")
    if assignment_algorithm not in ALGORITHMS and assignment_algorithm not in PLANNERS:
        raise _err(
            f"assignment_algorithm must be 'approx_bin_packing' or 'one_shot_greedy' (Megatron's) or an "
            f"ultracomm planner ({', '.join(sorted(PLANNERS))}), got {assignment_algorithm!r}"
        )
    if assignment_algorithm == "approx_bin_packing" and K != 1:
        raise _err(
            f"assignment_algorithm='approx_bin_packing' supports num_spare_experts_per_ep_rank=1 only (as "
            f"upstream), got {K}; use 'one_shot_greedy' or an ultracomm planner"
        )
    c = counts
    if not isinstance(c, torch.Tensor) or tuple(c.shape) != (R, E):
        got = list(c.shape) if isinstance(c, torch.Tensor) else type(c).__name__
        raise _err(
            f"count_tokens_per_expert_from_ep_rank must be a [num_ep_ranks, experts] = {[R, E]} tensor, got {got}"
        )
    if c.dtype == torch.bool or c.dtype.is_complex:
        raise _err(f"count_tokens_per_expert_from_ep_rank must hold token counts (an integer tensor), got {c.dtype}")
    c = c.detach().cpu()
    if c.dtype.is_floating_point:
        bad = (~torch.isfinite(c)) | (c != torch.floor(c))
        if bool(bad.any()):
            r, e = (int(i) for i in bad.nonzero()[0])
            raise _err(
                f"count_tokens_per_expert_from_ep_rank must hold whole token counts; entry [{r}, {e}] is "
                f"{float(c[r, e])!r}"
            )
        if bool((c.abs() >= 2.0**53).any()):
            raise _err("count_tokens_per_expert_from_ep_rank has a count of 2**53 or more; pass an integer tensor")
    c = c.to(torch.int64)
    if bool((c < 0).any()):
        r, e = (int(i) for i in (c < 0).nonzero()[0])
        raise _err(f"count_tokens_per_expert_from_ep_rank must be >= 0; entry [{r}, {e}] is {int(c[r, e])}")
    limit = torch.iinfo(dtype_index).max
    if int(c.sum()) > limit:
        raise _err(
            f"count_tokens_per_expert_from_ep_rank totals {int(c.sum())} tokens, more than dtype_index="
            f"{dtype_index} holds ({limit}); pass dtype_index=torch.int64"
        )
    mine = m.sum(0).cpu().to(torch.int64)
    if not torch.equal(mine, c[rank]):
        e = int((mine != c[rank]).nonzero()[0])
        raise _err(
            f"row ep_rank={rank} of count_tokens_per_expert_from_ep_rank says {int(c[rank, e])} tokens for "
            f"expert {e}, but map_token_to_expert routes {int(mine[e])} of this rank's tokens to it; pass "
            "every rank's map_token_to_expert.sum(0), gathered over the EP group in rank order"
        )
    return c.numpy(), rank, R, K, float(threshold_multiplier)


# ----------------------------------------------------------------------------- steps 1-2


def _stable_desc(x: np.ndarray) -> np.ndarray:
    """Indices sorting ``x`` descending, ties by ascending index."""
    return np.argsort(-x, kind="stable")


def _spillover(counts: np.ndarray, R: int, K: int, upstream: str) -> tuple[np.ndarray, np.ndarray, int]:
    """``(spill [E], capacity [R], avg)``: step 1."""
    per_expert = counts.sum(0)
    local = per_expert.reshape(R, -1)
    rank_load = local.sum(1)
    avg = int(rank_load.sum()) // R
    cap = np.maximum(avg - rank_load, 0)
    if upstream == "balanced_moe":
        cap = cap * K
    order = np.argsort(local, axis=1, kind="stable")  # ascending: the largest spill
    over = np.maximum(np.cumsum(np.take_along_axis(local, order, 1), axis=1) - avg, 0)
    spill_sorted = np.diff(over, axis=1, prepend=0)
    spill = np.empty_like(local)
    np.put_along_axis(spill, order, spill_sorted, 1)
    return spill.reshape(-1), cap, avg


def _interval_overlap(chunks: np.ndarray, buckets: np.ndarray) -> np.ndarray:
    """``[len(chunks), len(buckets)]``: overlap of chunk and bucket intervals laid end to end."""
    ce, be = np.cumsum(chunks), np.cumsum(buckets)
    lo = np.maximum((ce - chunks)[:, None], (be - buckets)[None, :])
    return np.maximum(np.minimum(ce[:, None], be[None, :]) - lo, 0)


def _one_shot_greedy(counts: np.ndarray, R: int, K: int, threshold: float, upstream: str) -> np.ndarray:
    spill, cap, avg = _spillover(counts, R, K, upstream)
    E = spill.shape[0]
    si, ci = _stable_desc(spill), _stable_desc(cap)
    over = _interval_overlap(spill[si], cap[ci])  # [E sorted, R sorted]
    out = np.zeros((E, R * K), np.int64)
    for b in range(R):
        top = _stable_desc(over[:, b])[:K]  # the bucket's K largest chunks, largest in slot 0
        for j, row in enumerate(top):
            out[si[row], ci[b] * K + j] = over[row, b]
    if threshold > 0:
        out = _reclaim(counts, avg, out, threshold, R)
    return out


def _reclaim(counts: np.ndarray, avg: int, assign: np.ndarray, threshold: float, R: int) -> np.ndarray:
    """Upstream's ``reclaim_spare_experts``: per home rank, the smallest offloads that fit under
    ``avg * (1 + threshold)`` are undone; a spare column survives if any rank keeps it."""
    E, S = assign.shape
    rank_load = counts.sum(0).reshape(R, -1).sum(1)
    after = rank_load - assign.sum(1).reshape(R, -1).sum(1)
    # float32, as upstream: an int32 scalar times a Python float is a float32 tensor
    room = np.float32(avg) + np.float32(threshold) * np.float32(avg) - after.astype(np.float32)
    per_rank = assign.reshape(R, E // R, S).sum(1)
    order = np.argsort(per_rank, axis=1, kind="stable")
    csum = np.cumsum(np.take_along_axis(per_rank, order, 1), axis=1)
    safe = (csum <= room[:, None]).sum(1)  # searchsorted(side="right") on a sorted row
    keep_sorted = np.arange(S)[None, :] >= safe[:, None]
    keep = np.zeros_like(keep_sorted)
    np.put_along_axis(keep, order, keep_sorted, 1)
    return np.where(keep.any(0)[None, :], assign, 0)


def _approx_bin_packing(counts: np.ndarray, R: int, upstream: str) -> np.ndarray:
    spill, cap, avg = _spillover(counts, R, 1, upstream)
    E = spill.shape[0]
    si, ci = _stable_desc(spill), _stable_desc(cap)
    s, c = spill[si].copy(), cap[ci].copy()
    out_sorted = np.zeros((E, R), np.int64)
    if upstream == "balanced_moe":
        for i in range(E):  # each expert fills ranks in order, several experts per rank allowed
            for j in range(R):
                if s[i] <= 0:
                    break
                put = min(s[i], c[j])
                if put > 0:
                    out_sorted[i, j], s[i], c[j] = put, s[i] - put, c[j] - put
    else:
        out_sorted = _bucket_queue(s, c, avg)
    out = np.zeros((E, R), np.int64)
    out[np.ix_(si, ci)] = out_sorted
    if upstream == "balanced_moe":  # _select_unique_home_per_spare: each spare keeps its largest home
        best = out.argmax(0)
        vals = out[best, np.arange(R)]
        out = np.zeros_like(out)
        live = vals > 0
        out[best[live], np.arange(R)[live]] = vals[live]
    return out


def _bucket_queue(spill: np.ndarray, cap: np.ndarray, avg: int) -> np.ndarray:
    """pr2368's ``approx_bin_packing_kernel`` on sorted inputs: one expert per rank."""
    nb = _NUM_BUCKETS
    width = max(1, avg // (nb - 1))

    def bucket(v: int) -> int:
        return 0 if v >= avg else min(max((avg - v) // width + 1, 0), nb - 1)

    queues: list[list[int]] = [[] for _ in range(nb)]
    for i, v in enumerate(spill.tolist()):
        if v > 0:
            queues[bucket(v)].append(i)
    heads = [0] * nb
    remaining = spill.copy()
    out = np.zeros((spill.shape[0], cap.shape[0]), np.int64)
    current = 0
    for j, room in enumerate(cap.tolist()):
        if room <= 0:
            break
        found = -1
        for b in range(current, nb):
            if heads[b] < len(queues[b]):
                cand = queues[b][heads[b]]
                heads[b] += 1
                if remaining[cand] > 0:
                    found, current = cand, b
                    break
            else:
                current = b + 1
        if found < 0:
            break
        put = min(int(remaining[found]), room)
        out[found, j] = put
        remaining[found] -= put
        if remaining[found] > 0:
            queues[bucket(int(remaining[found]))].append(found)
    return out


# ----------------------------------------------------------------------------- step 3


def _split_by_source(counts: np.ndarray, assign: np.ndarray) -> np.ndarray:
    """int64 ``[R, S]``: tokens each source rank sends to each spare (upstream's breadth-first
    then depth-first allocation)."""
    R, E = counts.shape
    S = assign.shape[1]
    f = counts.astype(np.float32)
    a = assign.astype(np.float32)
    cols = np.arange(S)
    sup = a.argmax(0)  # the spare's home expert (first row on ties, as torch.argmax)
    active = (a > 0).any(0)
    rel = f[:, sup]  # [R, S]
    den = rel.sum(0, dtype=np.float32)
    with np.errstate(divide="ignore", invalid="ignore"):
        share = np.where(den > 0, rel / den, np.float32(0)).astype(np.float32)
    first = np.floor(share * a[sup, cols]).astype(np.int64) * active  # float32 product, then floor
    left = counts.copy()
    np.add.at(left.T, sup, -first.T)  # each source's tokens of the home expert not yet placed
    room = assign.copy()
    room[sup, cols] -= first.sum(0)
    # depth-first: per expert, its sources (rank order) laid against its spares (column order)
    second = np.zeros((R, S), np.int64)
    for e in np.flatnonzero(room.sum(1) > 0):
        second += _interval_overlap(left[:, e], room[e])
    return first + second


# ----------------------------------------------------------------------------- step 4


def _reroute(
    map_token_to_expert: torch.Tensor,
    probs: torch.Tensor,
    to_spare: np.ndarray,
    sup: np.ndarray,
    R: int,
    K: int,
    upstream: str,
) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's rerouted map and probs in Megatron's column order: for each spare column in
    order, the next ``to_spare[j]`` tokens of its home (token order) move; the rest stay home."""
    E = map_token_to_expert.shape[1]
    M = E // R
    S = R * K
    per_expert: list[list[tuple[int, int]]] = [[] for _ in range(E)]
    for j in range(S):
        if sup[j] >= 0 and to_spare[j] > 0:
            per_expert[sup[j]].append((int(to_spare[j]), effective_column(E, R, K, spare=j)))
    inst = 1 + max(len(x) for x in per_expert)
    bounds = np.full((E, inst), np.iinfo(np.int64).max, np.int64)
    columns = np.empty((E, inst), np.int64)
    for e, moves in enumerate(per_expert):
        home = effective_column(E, R, K, expert=e)
        columns[e, :] = home
        acc = 0
        for i, (n, col) in enumerate(moves):  # spares first, home last: upstream moves the first tokens
            acc += n
            bounds[e, i], columns[e, i] = acc, col
    table = RerouteTable(torch.from_numpy(bounds), torch.from_numpy(columns), R * (M + K))
    return _finish_probs(map_token_to_expert, probs, table, R, K, upstream)


def _finish_probs(
    map_token_to_expert: torch.Tensor, probs: torch.Tensor, table: RerouteTable, R: int, K: int, upstream: str
) -> tuple[torch.Tensor, torch.Tensor]:
    rmap, rprobs = reroute(map_token_to_expert, probs, table)
    if upstream == "balanced_moe":  # probs where no token was routed stay, in their home column
        E = map_token_to_expert.shape[1]
        home_cols = torch.tensor([effective_column(E, R, K, expert=e) for e in range(E)], device=rprobs.device)
        rest = probs.masked_fill(map_token_to_expert, 0)
        rprobs = rprobs.index_add(1, home_cols, rest)
    return rmap, rprobs


# ----------------------------------------------------------------------------- entry


def gen_offloading_plan(
    map_token_to_expert: torch.Tensor,
    probs_routing: torch.Tensor,
    count_tokens_per_expert_from_ep_rank: torch.Tensor,
    ep_rank: Union[torch.Tensor, int],
    num_ep_ranks: int,
    num_spare_experts_per_ep_rank: int = 1,
    threshold_multiplier: float = 0.0,
    dtype_index: torch.dtype = torch.int32,
    assignment_algorithm: str = "approx_bin_packing",
    *,
    upstream: str = "balanced_moe",
    **planner_options: Any,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Megatron MoE ECHO's planner (same arguments, keywords and defaults as upstream).

    Args:
        map_token_to_expert: bool ``[T, E]``, this EP rank's routing.
        probs_routing: ``[T, E]`` routing probs (differentiable).
        count_tokens_per_expert_from_ep_rank: ``[num_ep_ranks, E]`` every rank's
            ``map_token_to_expert.sum(0)`` in rank order (whole numbers; row ``ep_rank`` must
            match ``map_token_to_expert``).
        ep_rank: this rank, ``0 <= ep_rank < num_ep_ranks`` (int or one-element tensor).
        num_ep_ranks: EP size; must divide ``E``.
        num_spare_experts_per_ep_rank: ``K``, spare slots per rank.
        threshold_multiplier: ``one_shot_greedy`` only (as upstream): > 0 drops spares the
            ranks above ``avg * (1 + threshold_multiplier)`` do not need.
        dtype_index: upstream's count dtype; here the totals must fit in it.
        assignment_algorithm: ``approx_bin_packing`` (default, ``K`` = 1), ``one_shot_greedy``
            or an ultracomm planner (``planner_options`` go to it).
        upstream: ``balanced_moe`` or ``pr2368`` (see the module docstring).

    Returns:
        ``(rerouting_map bool [T, R*(M+K)], rerouted_probs [T, R*(M+K)],
        expert_offloading_map bool [E, R*K])`` on ``map_token_to_expert``'s device; the first
        two in Megatron's per-rank column order (homes then spares).

    Raises:
        ValueError naming the argument, before anything is computed.
    """
    counts, rank, R, K, threshold = _check(
        map_token_to_expert,
        probs_routing,
        count_tokens_per_expert_from_ep_rank,
        ep_rank,
        num_ep_ranks,
        num_spare_experts_per_ep_rank,
        threshold_multiplier,
        dtype_index,
        assignment_algorithm,
        upstream,
    )
    E = counts.shape[1]
    dev = map_token_to_expert.device
    if assignment_algorithm in PLANNERS:
        result = get_planner(assignment_algorithm)(counts, Domain.flat(R, E // R), K, **planner_options)
        table = RerouteTable.from_result(result, rank, "physical")  # physical = Megatron's per-rank order
        rmap, rprobs = _finish_probs(map_token_to_expert, probs_routing, table, R, K, upstream)
        return rmap, rprobs, result.plan.to_echo_map().to(dev)
    if planner_options:
        raise _err(f"unexpected keyword arguments {sorted(planner_options)} (only ultracomm planners take options)")
    if assignment_algorithm == "one_shot_greedy":
        assign = _one_shot_greedy(counts, R, K, threshold, upstream)
    else:
        assign = _approx_bin_packing(counts, R, upstream)
    offload = assign > 0
    to_spare = _split_by_source(counts, assign)
    sup = np.where(offload.any(0), offload.argmax(0), -1)
    rmap, rprobs = _reroute(map_token_to_expert, probs_routing, to_spare[rank], sup, R, K, upstream)
    return rmap, rprobs, torch.from_numpy(offload).to(dev)
