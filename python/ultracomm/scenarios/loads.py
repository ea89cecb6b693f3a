"""Synthetic router loads (``int64 [world, E]``, every row summing to ``tokens_per_rank * top_k``)
and their metrics; the package docstring lists the generators."""

from __future__ import annotations

import math
from typing import Sequence, Union

import numpy as np
import torch
from ..errors import InputError

__all__ = [
    "LoadLike",
    "expert_load",
    "imbalance",
    "zipf_load",
    "hot_rank_load",
    "rotating_hot_load",
    "rank_blocked_load",
]

LoadLike = Union[np.ndarray, torch.Tensor, Sequence]

# ----------------------------------------------------------------------------- helpers


def _check_int(name: str, v: object, lo: int = 1) -> int:
    if not isinstance(v, (int, np.integer)) or isinstance(v, bool) or v < lo:
        raise InputError(f"{name} must be an int >= {lo}, got {v!r}")
    return int(v)


def _check_sizes(world: int, num_experts: int, tokens_per_rank: int, top_k: int) -> None:
    _check_int("world", world)
    _check_int("num_experts", num_experts)
    _check_int("tokens_per_rank", tokens_per_rank, 0)
    _check_int("top_k", top_k)
    if top_k > num_experts:
        raise InputError(f"top_k = {top_k} exceeds num_experts = {num_experts}")


def _resolve_epr(world: int, num_experts: int, experts_per_rank: int | None) -> int:
    if experts_per_rank is None:
        if num_experts % world:
            raise InputError(
                f"num_experts = {num_experts} does not divide evenly over world = {world}; "
                "pass experts_per_rank= with world * experts_per_rank == num_experts"
            )
        return num_experts // world
    epr = _check_int("experts_per_rank", experts_per_rank)
    if epr * world != num_experts:
        raise InputError(
            f"experts_per_rank = {epr} with world = {world} gives {epr * world} experts, but "
            f"num_experts = {num_experts}"
        )
    return epr


def _check_target(target_imbalance: float) -> float:
    t = float(target_imbalance)
    if not math.isfinite(t) or t < 1.0:
        raise InputError(f"target_imbalance must be a finite number >= 1.0, got {target_imbalance!r}")
    return t


def _cap_probs(p: np.ndarray, cap: float | np.ndarray) -> np.ndarray:
    """Water-fill each row of ``p`` (``[E]`` or ``[rows, E]``, rows summing to 1) so that
    no entry exceeds ``cap`` (a scalar or one cap per row, ``cap * E >= 1``): capped
    entries are set to the cap and the excess is shared by the others in proportion to
    their values (evenly if they are all zero)."""
    one_d = p.ndim == 1
    p = np.atleast_2d(np.asarray(p, dtype=np.float64))
    p = p / p.sum(axis=1, keepdims=True)
    c = np.broadcast_to(np.asarray(cap, dtype=np.float64), (p.shape[0],))[:, None]
    capped = np.zeros(p.shape, dtype=bool)
    for _ in range(p.shape[1]):
        over = (p > c * (1 + 1e-12)) & ~capped
        if not over.any():
            break
        capped |= over
        free = ~capped
        rest = 1.0 - c[:, 0] * capped.sum(axis=1)
        fsum = np.where(free, p, 0.0).sum(axis=1)
        nfree = free.sum(axis=1)
        scale = np.divide(rest, fsum, out=np.zeros_like(rest), where=fsum > 0)
        even = np.divide(rest, nfree, out=np.zeros_like(rest), where=nfree > 0)
        scaled = np.where((fsum > 0)[:, None], p * scale[:, None], even[:, None])
        p = np.where(capped, c, scaled)
    return p[0] if one_d else p


def _apportion(p: np.ndarray, total: int, offsets: np.ndarray) -> np.ndarray:
    """Integer counts ``int64 [len(offsets), E]``, row ``r`` summing to ``total`` exactly.

    Systematic rounding: ``count[r, e] = floor(C[e+1]*total + u_r) - floor(C[e]*total +
    u_r)`` with ``C`` the cumulative distribution of ``p`` and ``u_r = offsets[r]`` in
    ``[0, 1)``; every count is ``floor`` or ``ceil`` of ``p[e] * total``, and the seeded
    offsets spread the rounding over the rows.
    """
    c = np.cumsum(p, dtype=np.float64)
    c = c / c[-1]
    c[-1] = 1.0
    edges = np.floor(c[None, :] * total + offsets[:, None]).astype(np.int64)
    edges = np.concatenate([np.zeros((offsets.size, 1), np.int64), edges], axis=1)
    return np.diff(edges, axis=1)


def _spread(rng: np.random.Generator, rows: int, amount: int, cols: int) -> np.ndarray:
    """int64 ``[rows, cols]``: ``amount`` split evenly over ``cols`` in every row; the
    remainder goes one each to a random (seeded) set of columns per row."""
    base, rem = divmod(amount, cols)
    out = np.full((rows, cols), base, dtype=np.int64)
    if rem:
        order = np.argsort(rng.random((rows, cols)), axis=1)
        extra = np.zeros((rows, cols), dtype=np.int64)
        np.put_along_axis(extra, order[:, :rem], 1, axis=1)
        out += extra
    return out


def _as_load(load: LoadLike, name: str = "load") -> np.ndarray:
    if isinstance(load, torch.Tensor):
        load = load.detach().cpu().numpy()
    a = np.asarray(load)
    if a.dtype.kind not in "iuf" or a.dtype == np.bool_:
        raise InputError(f"{name} must hold numbers, got dtype {a.dtype}")
    if a.ndim not in (1, 2):
        raise InputError(f"{name} must be [world, E] or [E], got shape {tuple(a.shape)}")
    if a.size and (a < 0).any():
        raise InputError(f"{name} has negative entries")
    return a


def _expert_load_f(load: LoadLike, num_experts: int | None = None) -> np.ndarray:
    a = _as_load(load)
    L = (a.sum(axis=0) if a.ndim == 2 else a).astype(np.float64)
    if num_experts is not None and L.size != num_experts:
        raise InputError(f"load covers {L.size} experts, expected {num_experts}")
    return L


# ----------------------------------------------------------------------------- metrics


def expert_load(load: LoadLike) -> np.ndarray:
    """int64 ``[E]``: tokens each expert receives (``load [world, E]`` summed over
    senders)."""
    a = _as_load(load)
    if a.ndim != 2:
        raise InputError(f"load must be [world, E], got shape {tuple(a.shape)}")
    return a.sum(axis=0).astype(np.int64)


def imbalance(load: LoadLike, experts_per_rank: int) -> float:
    """Max:mean of the per-home-rank received load.

    Args:
        load: ``[world, E]`` (or ``[E]`` expert loads).
        experts_per_rank: experts homed per rank; expert ``e`` lives on
            ``e // experts_per_rank``.

    Returns:
        ``max_r R_r / mean_r R_r`` with ``R_r`` the tokens received by rank ``r``'s home
        experts; 1.0 for an all-zero load.
    """
    L = _expert_load_f(load)
    epr = _check_int("experts_per_rank", experts_per_rank)
    if L.size % epr:
        raise InputError(f"{L.size} experts do not split into ranks of {epr}")
    R = L.reshape(-1, epr).sum(axis=1)
    m = R.mean()
    return float(R.max() / m) if m > 0 else 1.0


# ----------------------------------------------------------------------------- generators


def _zipf_probs(s: float, s_expert: float, rank_pos: np.ndarray, expert_pos: np.ndarray, top_k: int) -> np.ndarray:
    """Two-level Zipf distribution over experts (``[E]``, rank-major): home rank ``r``
    weighs ``(rank_pos[r] + 1) ** -s``, and its ``j``-th expert takes a share of that
    proportional to ``(expert_pos[r, j] + 1) ** -s_expert``.

    Capped hierarchically so that no expert exceeds ``1 / top_k``: a rank's share is
    capped at ``experts_per_rank / top_k`` (the excess goes to the other ranks), then an
    expert's share within its rank at ``(1 / top_k) / rank share`` (the excess goes to the
    rank's other experts, so capping never moves load off a rank)."""
    epr = expert_pos.shape[1]
    lr = -s * np.log1p(rank_pos.astype(np.float64))
    wr = np.exp(lr - lr.max())
    if epr < top_k:
        wr = _cap_probs(wr / wr.sum(), epr / top_k)
    wr = wr / wr.sum()
    le = -s_expert * np.log1p(expert_pos.astype(np.float64))
    we = np.exp(le - le.max(axis=1, keepdims=True))
    we /= we.sum(axis=1, keepdims=True)
    inner_cap = np.divide(1.0 / top_k, wr, out=np.full_like(wr, np.inf), where=wr > 0)
    we = _cap_probs(we, np.maximum(inner_cap, 1.0 / epr))
    return (wr[:, None] * we).ravel()


def zipf_load(
    world: int,
    num_experts: int,
    tokens_per_rank: int,
    top_k: int,
    target_imbalance: float,
    seed: int,
    experts_per_rank: int | None = None,
    expert_exponent: float = 1.0,
) -> np.ndarray:
    """Two-level Zipf load hitting a target max:mean per-home-rank imbalance.

    Home rank ``r`` gets weight ``(pi[r] + 1) ** -s`` where ``pi = rng.permutation(world)``
    (so the hottest rank is the one with ``pi[r] == 0``, the next ``pi[r] == 1``, ...); within
    each rank, its experts' shares follow Zipf with exponent ``expert_exponent * s`` over a
    per-rank random order (``rng.permuted`` of ``0..experts_per_rank-1``, row by row).
    An expert's probability is capped at ``1 / top_k`` (a token picks ``top_k`` distinct
    experts, so a rank sends an expert at most ``tokens_per_rank`` tokens), first at the
    rank level, then within the rank (see :func:`_zipf_probs`).  Each rank's
    ``tokens_per_rank * top_k`` assignments are apportioned with :func:`_apportion` using
    seeded offsets; every sender uses the same distribution.

    The exponent ``s >= 0`` is found by bisection on the *integer* load so that
    :func:`imbalance` is within ~0.1% of ``target_imbalance`` (within ~1% whenever the
    rounding allows it, i.e. for realistic token counts).  The random draws (``rng =
    np.random.default_rng(seed)``: rank permutation, expert orders, rounding offsets, in
    that order) do not depend on ``s``.

    Args:
        world, num_experts, tokens_per_rank, top_k: sizes; ``num_experts`` must equal
            ``world * experts_per_rank``.
        target_imbalance: wanted max:mean, >= 1.0 (typically 1.0-4.0).
        seed: RNG seed.
        experts_per_rank: default ``num_experts // world``.
        expert_exponent: within-rank exponent as a multiple of the rank-level one, >= 0
            (0: a rank's experts share its load evenly).

    Returns:
        int64 ``[world, num_experts]``, each row summing to ``tokens_per_rank * top_k``.

    Raises:
        ValueError: bad sizes, or a target above what the sizes allow.
    """
    _check_sizes(world, num_experts, tokens_per_rank, top_k)
    epr = _resolve_epr(world, num_experts, experts_per_rank)
    t = _check_target(target_imbalance)
    xe = float(expert_exponent)
    if not math.isfinite(xe) or xe < 0:
        raise InputError(f"expert_exponent must be a finite number >= 0, got {expert_exponent!r}")
    rng = np.random.default_rng(seed)
    rank_pos = rng.permutation(world)
    expert_pos = rng.permuted(np.tile(np.arange(epr), (world, 1)), axis=1)
    offsets = rng.random(world)
    total = tokens_per_rank * top_k

    def load_at(s: float) -> np.ndarray:
        return _apportion(_zipf_probs(s, xe * s, rank_pos, expert_pos, top_k), total, offsets)

    def imb(load: np.ndarray) -> float:
        return imbalance(load, epr)

    if total == 0 or world == 1:
        return load_at(0.0)
    return _fit_exponent(
        load_at,
        lambda ld: imbalance(ld, epr),
        t,
        f"world = {world}, experts_per_rank = {epr}, top_k = {top_k}",
        "each rank can send an expert at most tokens_per_rank tokens",
    )


def _fit_exponent(load_at, imb, t: float, sizes: str, why: str) -> np.ndarray:
    """The load ``load_at(s)`` whose ``imb`` is closest to ``t`` (within 0.1 % when the
    integer rounding allows), found by doubling ``s`` from 1 and then bisecting on
    ``[0, s]``; ``load_at`` must grow more skewed with ``s``.  ValueError naming ``sizes``
    and ``why`` when even ``s = 64`` stays below ``t``."""
    lo_load = load_at(0.0)
    if t <= 1.0:
        return lo_load
    s_hi = 1.0
    hi_load = load_at(s_hi)
    while imb(hi_load) < t and s_hi < 64.0:
        s_hi *= 2.0
        hi_load = load_at(s_hi)
    if imb(hi_load) < t * (1 - 1e-3):
        raise InputError(
            f"target_imbalance {t} is not reachable with {sizes}: the most skewed load "
            f"reaches {imb(hi_load):.3f} ({why})"
        )
    s_lo, best, best_err = 0.0, hi_load, abs(imb(hi_load) / t - 1)
    for _ in range(80):
        mid = 0.5 * (s_lo + s_hi)
        ld = load_at(mid)
        v = imb(ld)
        err = abs(v / t - 1)
        if err < best_err:
            best, best_err = ld, err
        if err < 1e-3:
            break
        if v < t:
            s_lo = mid
        else:
            s_hi = mid
    return best


def rank_blocked_load(
    world: int,
    num_experts: int,
    tokens_per_rank: int,
    top_k: int,
    target_imbalance: float,
    seed: int,
    experts_per_rank: int | None = None,
) -> np.ndarray:
    """Rank-blocked skew: each token routes all of its ``top_k`` experts into the
    experts of one home rank (its *block*), so a rank's experts are popular together.

    Block ``b`` is drawn with weight ``(pi[b] + 1) ** -s``, ``pi =
    rng.permutation(world)`` (``pi[b] == 0`` is the hottest rank); ``s >= 0`` is bisected
    so that :func:`imbalance` hits ``target_imbalance`` (like :func:`zipf_load`).  Each
    sender's ``tokens_per_rank`` tokens are apportioned over the blocks with
    :func:`_apportion` (seeded offsets).  A token of block ``b`` sends one assignment to
    every expert of ranks ``b, b+1, ..`` (cyclically) for the first ``top_k //
    experts_per_rank`` ranks and ``top_k % experts_per_rank`` assignments to the experts
    of the next rank, spread evenly (remainders one each to experts chosen at random per
    sender and block).  With ``top_k <= experts_per_rank`` a block is one rank and the
    per-rank load follows the block weights exactly: one rank can be up to ``world``
    times the mean, every expert of a rank carries the same load (within 1 per sender),
    and a hot rank can only shed load by splitting many equally hot experts -- the load
    on which a slot-by-slot greedy runs out of slots first.

    ``rng = np.random.default_rng(seed)`` draws, in this order: the rank permutation,
    the rounding offsets, then the remainder experts; none depends on ``s``.

    Args:
        world, num_experts, tokens_per_rank, top_k: sizes; ``num_experts`` must equal
            ``world * experts_per_rank``.
        target_imbalance: wanted max:mean per-home-rank load, >= 1.0.
        seed: RNG seed.
        experts_per_rank: default ``num_experts // world``.

    Returns:
        int64 ``[world, num_experts]``, each row summing to ``tokens_per_rank * top_k``;
        a sender never sends an expert more than ``tokens_per_rank`` tokens.

    Raises:
        ValueError: bad sizes, or a target above what the sizes allow.
    """
    _check_sizes(world, num_experts, tokens_per_rank, top_k)
    epr = _resolve_epr(world, num_experts, experts_per_rank)
    t = _check_target(target_imbalance)
    rng = np.random.default_rng(seed)
    rank_pos = rng.permutation(world)
    offsets = rng.random(world)
    full, part = divmod(top_k, epr)  # whole ranks per token, then experts of the next
    pick = np.argsort(rng.random((world, world, epr)), axis=2)  # [sender, block, order]
    ranks = np.arange(world)

    def load_at(s: float) -> np.ndarray:
        lw = -s * np.log1p(rank_pos.astype(np.float64))
        w = np.exp(lw - lw.max())
        n = _apportion(w / w.sum(), tokens_per_rank, offsets)  # [sender, block] tokens
        load = np.zeros((world, world, epr), np.int64)  # [sender, home rank, expert]
        for i in range(full):
            load[:, (ranks + i) % world, :] += n[:, :, None]
        if part:
            base, rem = np.divmod(n * part, epr)  # per (sender, block)
            extra = pick < rem[:, :, None]  # rem experts get one more, seeded choice
            load[:, (ranks + full) % world, :] += base[:, :, None] + extra
        return load.reshape(world, num_experts)

    if tokens_per_rank == 0 or world == 1:
        return load_at(0.0)
    return _fit_exponent(
        load_at,
        lambda ld: imbalance(ld, epr),
        t,
        f"world = {world}, experts_per_rank = {epr}, top_k = {top_k}",
        "one rank takes every token at most",
    )


def hot_rank_load(
    world: int,
    num_experts: int,
    tokens_per_rank: int,
    top_k: int,
    fraction: float,
    seed: int,
    hot_rank: int = 0,
    hot_experts: int | None = None,
    experts_per_rank: int | None = None,
    rest_over_all: bool = False,
) -> np.ndarray:
    """LLEP-style skew: ``fraction`` of every rank's assignments go to hot experts on
    ``hot_rank``; the rest are spread evenly.

    Each rank sends ``round(fraction * tokens_per_rank * top_k)`` assignments split evenly
    over the hot experts -- all experts homed on ``hot_rank``, or the first ``hot_experts``
    of them -- and the rest evenly over the other experts (``rest_over_all=True``: over all
    experts, hot ones included, so the hot experts receive a little more than
    ``fraction``).  Remainders of the even splits go one each to experts chosen at random
    per sender (``np.random.default_rng(seed)``).

    Note: like LLEP's construction this does not cap a sender's load on one expert at
    ``tokens_per_rank`` (``fraction * top_k > hot experts`` exceeds it).

    Returns:
        int64 ``[world, num_experts]``, each row summing to ``tokens_per_rank * top_k``.
    """
    _check_sizes(world, num_experts, tokens_per_rank, top_k)
    epr = _resolve_epr(world, num_experts, experts_per_rank)
    f = float(fraction)
    if not 0.0 <= f <= 1.0:
        raise InputError(f"fraction must be in [0, 1], got {fraction!r}")
    if not isinstance(hot_rank, (int, np.integer)) or not 0 <= hot_rank < world:
        raise InputError(f"hot_rank must be in 0..{world - 1}, got {hot_rank!r}")
    nh = epr if hot_experts is None else _check_int("hot_experts", hot_experts)
    if nh > epr:
        raise InputError(f"hot_experts = {nh} exceeds the {epr} experts homed on rank {hot_rank}")
    hot = np.arange(hot_rank * epr, hot_rank * epr + nh)
    cold = np.setdiff1d(np.arange(num_experts), hot)
    rest_cols = np.arange(num_experts) if rest_over_all else cold
    total = tokens_per_rank * top_k
    n_hot = int(round(f * total))
    n_rest = total - n_hot
    if n_rest and rest_cols.size == 0:
        raise InputError(
            "every expert is hot, so the non-hot share has nowhere to go; use fraction=1.0, "
            "fewer hot_experts or rest_over_all=True"
        )
    rng = np.random.default_rng(seed)
    load = np.zeros((world, num_experts), dtype=np.int64)
    load[:, hot] += _spread(rng, world, n_hot, nh)
    if n_rest:
        load[:, rest_cols] += _spread(rng, world, n_rest, rest_cols.size)
    return load


def rotating_hot_load(
    world: int, num_experts: int, tokens_per_rank: int, top_k: int, step: int, num_hot: int, skew: float, seed: int
) -> np.ndarray:
    """One micro-batch of a sequence in which the hot experts rotate.

    ``order = np.random.default_rng(seed).permutation(num_experts)`` fixes a tour of the
    experts; at micro-batch ``step`` the hot set is ``order[(step * num_hot + i) %
    num_experts]`` for ``i < num_hot`` (consecutive steps have disjoint hot sets while
    ``2 * num_hot <= num_experts``; the tour repeats every ``num_experts / gcd`` steps).
    A hot expert is ``skew`` times as likely as a cold one (capped at ``1 / top_k``);
    rounding offsets come from ``np.random.default_rng([seed, step])``.

    Returns:
        int64 ``[world, num_experts]``, each row summing to ``tokens_per_rank * top_k``.
    """
    _check_sizes(world, num_experts, tokens_per_rank, top_k)
    step = _check_int("step", step, 0)
    num_hot = _check_int("num_hot", num_hot)
    if num_hot > num_experts:
        raise InputError(f"num_hot = {num_hot} exceeds num_experts = {num_experts}")
    k = float(skew)
    if not math.isfinite(k) or k <= 0:
        raise InputError(f"skew must be a positive finite number, got {skew!r}")
    order = np.random.default_rng(seed).permutation(num_experts)
    hot = order[(step * num_hot + np.arange(num_hot)) % num_experts]
    w = np.ones(num_experts, dtype=np.float64)
    w[hot] = k
    p = _cap_probs(w / w.sum(), 1.0 / top_k)
    offsets = np.random.default_rng([int(seed), step]).random(world)
    return _apportion(p, tokens_per_rank * top_k, offsets)
