"""A Context's arguments checked and its configuration derived, before any rank agrees (local)."""

from __future__ import annotations

import logging
from typing import Any, Sequence

from .. import _core
from ..alpha_beta import COSTS, split_chunk_bytes
from ..dataplane import device_type, domains, select
from ..env import Config, check_window_layout
from ..errors import ConfigError, InputTypeError
from ..layout import ExpertLayout

__all__ = [
    "MAX_EXPERTS",
    "MAX_SLOTS",
    "MAX_LAYERS",
    "MAX_MICROBATCHES",
    "check_counts",
    "resolve_config",
    "resolve_node_of",
    "agreed_key",
    "split_window_layout",
    "window_layout",
    "choose",
]

log = logging.getLogger("ultracomm")

# bounds of the Context's counts: what the int32 task records and schedule builder hold
MAX_EXPERTS = 2**31 - 1
MAX_SLOTS = 100_000
MAX_LAYERS = 1 << 20
MAX_MICROBATCHES = 1 << 16


def check_counts(
    layout: Any, experts_per_rank: Any, slots_per_rank: Any, num_layers: Any, max_microbatches: Any, world: int
) -> None:
    """The layout and the counts a Context is made with (TypeError / ConfigError naming the bad one)."""
    if not isinstance(layout, ExpertLayout):
        raise InputTypeError(f"ultracomm: layout must be an ExpertLayout, got {type(layout).__name__}")
    for name, v, lo, hi in (
        ("experts_per_rank", experts_per_rank, 1, MAX_EXPERTS),
        ("slots_per_rank", slots_per_rank, 0, MAX_SLOTS),
        ("num_layers", num_layers, 1, MAX_LAYERS),
        ("max_microbatches", max_microbatches, 1, MAX_MICROBATCHES),
    ):
        if isinstance(v, bool) or not isinstance(v, int) or not lo <= v <= hi:
            raise ConfigError(f"ultracomm: {name} must be an int in [{lo}, {hi}], got {v!r}")
    if experts_per_rank * world > MAX_EXPERTS:
        raise ConfigError(
            f"ultracomm: experts_per_rank {experts_per_rank} x world {world} experts exceeds "
            f"{MAX_EXPERTS} (expert ids are int32)"
        )


def resolve_config(config: Config | None, transport: str | None, window: str | None, overrides: dict) -> Config:
    """``config`` (default: from the environment) with the keyword overrides applied; sets the
    library's log level from it."""
    cfg = config or Config.from_env()
    if not isinstance(cfg, Config):
        raise InputTypeError(f"ultracomm: config must be an ultracomm.env.Config, got {type(cfg).__name__}")
    if transport is not None:
        overrides["transport"] = transport
    if window is not None:
        overrides["window"] = window
    cfg = cfg.replace(**overrides) if overrides else cfg
    if not cfg.deterministic:
        # every transport built so far reduces in the schedule's fixed order; there is no
        # faster non-deterministic path to switch to, so say so instead of ignoring it
        log.warning("ultracomm: ULTRACOMM_DETERMINISTIC=0 has no effect: reductions are always ordered")
    log.setLevel(cfg.log_level.upper())
    return cfg


def resolve_node_of(node_of: Sequence[int] | None, world: int) -> list[int]:
    """The node of each rank (all 0: one node)."""
    if node_of is None:
        return [0] * world
    try:
        out = list(node_of)
    except TypeError:  # not iterable: said below
        out = None
    if (
        out is None
        or len(out) != world
        or any(isinstance(n, bool) or not isinstance(n, int) or not 0 <= n < world for n in out)
    ):
        raise ConfigError(
            f"ultracomm: node_of must list, for each of the {world} ranks, an int node "
            f"index in [0, {world}); got {node_of!r}"
        )
    return out


def agreed_key(
    config: Config,
    layout: ExpertLayout,
    experts_per_rank: int,
    slots_per_rank: int,
    num_layers: int,
    max_microbatches: int,
    node_of: Sequence[int],
    chosen: tuple | None,
) -> tuple:
    """What every rank's Context must agree on (``comm.require_same``): its shape and the
    configuration its schedules depend on; ``chosen``: ``(transport, window)`` when named."""
    return (
        repr(layout),
        experts_per_rank,
        slots_per_rank,
        num_layers,
        max_microbatches,
        list(node_of),
        config.chunk_bytes,
        config.relay_mode,
        config.max_depth,
        config.schedule_builder,
        config.intra_bw,
        config.inter_bw,
        config.plan_check,
        *(chosen or (config.transport, config.window)),
    )


def split_window_layout(wlayout: dict, config: Config, layout: ExpertLayout, slots_per_rank: int) -> dict:
    """The CPU ``split`` transport's window layout: chunks that cross domains are gloo messages,
    large enough to pay for one (:func:`ultracomm.alpha_beta.split_chunk_bytes`)."""
    chunk = split_chunk_bytes(
        config.chunk_bytes, config.tile_bytes, max(layout.weight_bytes, layout.grad_bytes), COSTS["gloo"]
    )
    return wlayout if chunk == wlayout["chunk_bytes"] else window_layout(slots_per_rank, layout, chunk)


def window_layout(slots_per_rank: int, layout: ExpertLayout, chunk_bytes: int) -> dict:
    """The window's regions (``_core.window_layout``: slots, flags, digests), checked."""
    out = _core.window_layout(slots_per_rank, layout.weight_bytes, layout.grad_bytes, chunk_bytes)
    check_window_layout(out)
    return out


def choose(config: Config, comm: Any, device: Any, views: Sequence[Any], named: Any) -> tuple:
    """Check every rank's memory-domain declaration, then for ``transport="auto"`` (or ``split``)
    pick from every rank's domain key (the same views on every rank: deterministic).  Returns
    ``(domain_of, transport choice or None, (transport class, window provider, CUDA device) or
    None when the transport was named)``."""
    dtype = device_type(config.transport, config.window, device)
    domains.check_domains(views, dtype)
    keys = [v.key for v in views]
    domain_of = domains.domain_of(keys)
    if named is not None:
        return domain_of, None, None
    choice = domains.choose_transport(dtype, keys, [v.host for v in views]) if config.transport == "auto" else None
    return domain_of, choice, select(config, comm, device, choice)
