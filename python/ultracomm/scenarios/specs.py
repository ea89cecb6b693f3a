"""Workload specs of the command lines (``"zipf:1.5"``, ``"hot:0.7"``, ...): :func:`make_workload`."""

from __future__ import annotations

import math

import numpy as np

from .loads import hot_rank_load, rank_blocked_load, rotating_hot_load, zipf_load
from .models import ModelSpec
from ..errors import InputError

__all__ = ["WORKLOAD_FORMS", "WORKLOADS", "make_workload"]

#: Accepted workload spec forms (for help texts and error messages).
WORKLOAD_FORMS: tuple[str, ...] = (
    "uniform",
    "zipf:<target max:mean >= 1, e.g. 1.5>",
    "blocked:<target max:mean >= 1, e.g. 3>",
    "hot:<fraction in [0,1]>[:<hot experts>]",
    "rotating[:<step>[:<num_hot>[:<skew>]]]",
)

#: Usual workload specs for CLIs -> description.
WORKLOADS: dict[str, str] = {
    "uniform": "every rank spreads its assignments evenly over all experts",
    "zipf:1.5": "two-level Zipf, max:mean rank load 1.5",
    "zipf:2": "two-level Zipf, max:mean rank load 2",
    "zipf:3": "two-level Zipf, max:mean rank load 3",
    "zipf:4": "two-level Zipf, max:mean rank load 4",
    "blocked:3": "each token's experts on one rank (rank-blocked), max:mean rank load 3",
    "hot:0.3": "30% of assignments to rank 0's experts (LLEP), rest even",
    "hot:0.5": "50% of assignments to rank 0's experts (LLEP), rest even",
    "hot:0.7": "70% of assignments to rank 0's experts (LLEP), rest even",
    "hot:0.9": "90% of assignments to rank 0's experts (LLEP), rest even",
    "rotating": "micro-batch 0 of a rotating hot set (top_k hot experts, 8x as likely)",
}

_ROTATING_SKEW = 8.0


def _bad_spec(spec: object, why: str) -> InputError:
    return InputError(
        f"bad workload spec {spec!r}: {why}; accepted forms: {', '.join(WORKLOAD_FORMS)} (e.g. {', '.join(WORKLOADS)})"
    )


def make_workload(spec: str, world: int, model: ModelSpec, tokens_per_rank: int = 8192, seed: int = 0) -> np.ndarray:
    """The load ``int64 [world, model.num_experts]`` described by ``spec``.

    Forms (see :data:`WORKLOAD_FORMS`): ``uniform``; ``zipf:T`` (:func:`zipf_load` with
    target T); ``blocked:T`` (:func:`rank_blocked_load` with target T); ``hot:F`` /
    ``hot:F:N`` (:func:`hot_rank_load` on rank 0, all its experts or the first N); ``rotating[:step[:num_hot[:skew]]]`` (:func:`rotating_hot_load`,
    defaults step 0, num_hot = ``model.top_k``, skew 8).  Experts are homed
    ``num_experts // world`` per rank.

    Raises:
        ValueError: a malformed spec (naming the accepted forms), or sizes that do not fit.
    """
    if not isinstance(spec, str) or not spec.strip():
        raise _bad_spec(spec, "expected a non-empty string")
    if not isinstance(model, ModelSpec):
        raise InputError(f"model must be a ModelSpec (see get_model), got {type(model).__name__}")
    epr = model.experts_per_rank(world)
    E, k = model.num_experts, model.top_k
    kind, *args = spec.strip().lower().split(":")

    def num(s: str, cast: type) -> float | int:
        try:
            v = cast(s)
        except ValueError:
            raise _bad_spec(spec, f"{s!r} is not a valid {cast.__name__}") from None
        if isinstance(v, float) and not math.isfinite(v):
            raise _bad_spec(spec, f"{s!r} is not finite")
        return v

    if kind == "uniform":
        if args:
            raise _bad_spec(spec, "'uniform' takes no arguments")
        return zipf_load(world, E, tokens_per_rank, k, 1.0, seed, epr)
    if kind in ("zipf", "blocked"):
        if len(args) != 1:
            raise _bad_spec(spec, f"'{kind}' takes one argument, the target imbalance")
        t = num(args[0], float)
        if t < 1.0:
            raise _bad_spec(spec, f"the target imbalance {t} must be >= 1")
        gen = zipf_load if kind == "zipf" else rank_blocked_load
        return gen(world, E, tokens_per_rank, k, t, seed, epr)
    if kind == "hot":
        if len(args) not in (1, 2):
            raise _bad_spec(spec, "'hot' takes a fraction and optionally a hot-expert count")
        f = num(args[0], float)
        if not 0.0 <= f <= 1.0:
            raise _bad_spec(spec, f"the fraction {f} must be in [0, 1]")
        n = int(num(args[1], int)) if len(args) == 2 else None
        if n is not None and not 1 <= n <= epr:
            raise _bad_spec(spec, f"the hot-expert count {n} must be in 1..{epr}")
        return hot_rank_load(world, E, tokens_per_rank, k, f, seed, 0, n, epr)
    if kind == "rotating":
        if len(args) > 3:
            raise _bad_spec(spec, "'rotating' takes at most step, num_hot and skew")
        step = int(num(args[0], int)) if len(args) > 0 else 0
        nh = int(num(args[1], int)) if len(args) > 1 else k
        sk = float(num(args[2], float)) if len(args) > 2 else _ROTATING_SKEW
        if step < 0 or not 1 <= nh <= E or sk <= 0:
            raise _bad_spec(spec, f"need step >= 0, 1 <= num_hot <= {E} and skew > 0")
        return rotating_hot_load(world, E, tokens_per_rank, k, step, nh, sk, seed)
    raise _bad_spec(spec, f"unknown kind {kind!r}")
