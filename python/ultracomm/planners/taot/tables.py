"""TAOT's topology terms: the transport cost between ranks and the per-domain tables built
from it (Sinkhorn kernel, topology preference, the auction's tie-broken bonus), cached per
domain and options."""

from __future__ import annotations

import weakref

import numpy as np

from ..base import Domain


def topology_cost(domain: Domain, lam: float = 3.0) -> np.ndarray:
    """float64 ``[world, world]``: 1 between ranks of one node, ``lam`` across nodes."""
    return np.where(domain.same_node, 1.0, float(lam))


# Per-domain tables that depend only on the topology and the options, built once per
# (domain, lam, eps, w_inter) instead of on every call; weak keys, so a dropped Domain
# drops its tables.
_TABLES: "weakref.WeakKeyDictionary[Domain, dict]" = weakref.WeakKeyDictionary()


def _tables(domain: Domain, lam: float, eps: float, w_inter: float) -> tuple[np.ndarray, ...]:
    """``(kernel, Brr, bid)``: the Sinkhorn kernel ``exp(-cost / eps)``, the topology
    preference ``B`` (1 intra, ``w_inter`` inter) and the auction's bonus ``B[r, q] -
    1e-9 * ((r - q) % world)`` of source ``r`` for a slot on rank ``q`` (the tie-break of
    :func:`lagrangian_auction`'s ``slot_rank``), all float64 ``[world, world]``."""
    per = _TABLES.get(domain)
    if per is None:
        per = _TABLES[domain] = {}
    key = (float(lam), float(eps), float(w_inter))
    t = per.get(key)
    if t is None:
        R = domain.world
        kernel = np.exp(-topology_cost(domain, lam) / eps)
        Brr = np.where(domain.same_node, 1.0, float(w_inter))
        bid = Brr - 1e-9 * ((np.arange(R)[:, None] - np.arange(R)[None, :]) % R)
        for a in (kernel, Brr, bid):
            a.setflags(write=False)
        if len(per) >= 8:  # a few option sets per domain at most
            per.pop(next(iter(per)))
        t = per[key] = (kernel, Brr, bid)
    return t
