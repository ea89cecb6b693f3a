"""Memory domains of a group, and what ``transport="auto"`` picks from them.

A *domain* is a set of ranks that can address each other's memory: CPU processes on one host
share POSIX shared memory (the ``host`` transport's windows); GPUs on one host reach each
other's memory through CUDA IPC / NVLink (the ``tma`` transport's windows), and GPUs on
several hosts of one multi-node NVLink fabric (NVL72-class racks) through the ``nvshmem``
window.  Ranks in different domains can only exchange messages (the ``p2p`` transport).

A rank's domain key, agreed by every rank when a Context is built (:func:`rank_domain`):

1. ``ULTRACOMM_DOMAIN`` (``Config.domain``) when set: one key for this process, or one key per
   rank of the Context's group (rank ``r`` takes entry ``r``; loopback domains and tests).
   For hosts that cannot be told apart, or several "nodes" on one machine.
2. A CUDA rank whose GPU completed its NVLink fabric registration (:mod:`ultracomm.cuda.fabric`):
   ``nvlink:<cluster uuid>/<clique id>``.
3. Otherwise the host's identity, ``hostname/boot id`` (two containers with one hostname on
   two machines differ in boot id); every rank of a loopback domain shares one.

``auto`` (``ULTRACOMM_TRANSPORT`` or ``transport=`` set to anything else is taken as given):

=====================================  ===========================  ==============================
ranks                                  CPU Context                  CUDA Context
=====================================  ===========================  ==============================
one domain on one host                 ``host``                     ``tma``
one domain over several hosts          (refused: no shared memory)  ``tma`` over ``nvshmem``
no two ranks share a domain            ``p2p`` (gloo)               ``p2p`` (NCCL)
mixed (some domains hold several)      ``split``: ``host`` inside   ``split``: ``tma`` inside a
                                       a domain, ``p2p`` across     domain, ``p2p`` (NCCL) across;
                                                                    ``p2p`` if a domain spans hosts
=====================================  ===========================  ==============================

``split`` (:mod:`ultracomm.transports.split`; on CUDA :mod:`ultracomm.transports.split.cuda`)
runs one schedule with the edges inside a domain on the host executor over shared memory (CUDA:
the persistent ``tma`` kernel over ``cuda_ipc``) and only the edges across domains as gloo
(CUDA: NCCL) messages, with the same bytes as every other executor.  :attr:`TransportChoice.edge_transport` says
which edges go where and :meth:`TransportChoice.edges` counts them for a schedule.  The choice
is logged once per Context.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Optional, Sequence

import numpy as np

from .. import wire
from ..env import domain_keys
from ..host_id import host_key
from ..cuda.fabric import FabricQuery, fabric_key, gpu_fabric_info
from ..records import Op
from ..errors import InputError

__all__ = [
    "host_key",
    "domain_of",
    "RankDomain",
    "rank_domain",
    "check_domains",
    "TransportChoice",
    "choose_transport",
    "split_edges",
]


def domain_of(keys: Sequence[str]) -> tuple[int, ...]:
    """Domain index of each rank, numbered in order of first appearance."""
    index: dict[str, int] = {}
    return tuple(index.setdefault(k, len(index)) for k in keys)


@wire.register  # travels between ranks through the store (wire keeps the registry, names no class)
@dataclasses.dataclass(frozen=True)
class RankDomain:
    """What one rank reports at setup: its ``ULTRACOMM_DOMAIN`` declaration (``""``: none), its
    host key and the domain key it ends up with (``source``: ``declared``, ``nvlink`` or ``host``)."""

    declared: str
    host: str
    key: str
    source: str


def rank_domain(
    declared: str, rank: int, world: int, device_type: str, device: Any = None, fabric: FabricQuery = gpu_fabric_info
) -> RankDomain:
    """Rank ``rank``'s domain (see the module docstring).  ``declared``: a parsed ``Config.domain``;
    ``device``: the CUDA device of a CUDA Context; ``fabric``: how to read its fabric registration
    (tests inject one).  Raises ``ValueError`` for a per-rank list whose length is not ``world``."""
    host = host_key()
    keys = domain_keys(declared)
    if len(keys) > 1:
        if len(keys) != world:
            raise InputError(
                f"ultracomm: ULTRACOMM_DOMAIN={declared!r} lists {len(keys)} domain keys but the "
                f"Context's group has {world} ranks; give one key per rank (rank r takes entry r), "
                "or a single key for this process"
            )
        return RankDomain(declared, host, keys[rank], "declared")
    if keys:
        return RankDomain(declared, host, keys[0], "declared")
    if device_type == "cuda":
        key = fabric_key(fabric(device))
        if key is not None:
            return RankDomain(declared, host, key, "nvlink")
    return RankDomain(declared, host, host, "host")


def check_domains(views: Sequence[RankDomain], device_type: str) -> None:
    """Every rank's :class:`RankDomain` (index = rank) is a coherent declaration, else ``ValueError``
    naming the ranks: a per-rank list must be the same on every rank, and on the CPU one domain
    cannot span hosts (shared memory does not reach across them)."""
    lists = {v.declared for v in views if "," in v.declared}
    if lists and len({v.declared for v in views}) > 1:
        by: dict[str, list[int]] = {}
        for r, v in enumerate(views):
            by.setdefault(v.declared or "(unset)", []).append(r)
        detail = "; ".join(f"ranks {rs}: {d!r}" for d, rs in by.items())
        raise InputError(
            f"ultracomm: ranks declare different ULTRACOMM_DOMAIN values ({detail}); a per-rank list "
            "must be the same on every rank"
        )
    if device_type != "cuda":
        hosts: dict[str, dict[str, list[int]]] = {}
        for r, v in enumerate(views):
            hosts.setdefault(v.key, {}).setdefault(v.host, []).append(r)
        for key, on in hosts.items():
            if len(on) > 1:
                detail = "; ".join(f"ranks {rs} on {h}" for h, rs in on.items())
                raise InputError(
                    f"ultracomm: memory domain {key!r} spans several hosts ({detail}), but CPU ranks "
                    "share memory only within one host; give ranks on different hosts different "
                    "ULTRACOMM_DOMAIN keys (or unset it)"
                )


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """What ``auto`` chose and why.  ``domain_of[r]``: rank ``r``'s domain; ``edge_transport``:
    the transport of the edges inside a domain (``intra``) and across domains (``cross``);
    ``split``: for mixed domains, how the edges are divided; ``window``: the window provider the
    domain needs (``nvshmem`` for a CUDA domain over several hosts), ``None`` for ``auto``'s usual."""

    transport: str
    domain_of: tuple[int, ...]
    reason: str
    split: Optional[str] = None
    edge_transport: dict = dataclasses.field(default_factory=dict)
    window: Optional[str] = None

    def describe(self) -> str:
        return f"transport auto -> {self.transport}: {self.reason}" + (f"; {self.split}" if self.split else "")

    def edges(self, schedule) -> dict[str, dict[str, int]]:
        """Per op, the schedule's tree edges by the transport that moves them, e.g.
        ``{"multicast": {"host": 3, "p2p": 1}, "reduce": {...}}``."""
        out = {}
        for op, n in split_edges(schedule, self.domain_of).items():
            per: dict[str, int] = {}
            for side in ("intra", "cross"):
                t = self.edge_transport.get(side, self.transport)
                per[t] = per.get(t, 0) + n[side]
            out[op] = per
        return out


def choose_transport(device_type: str, keys: Sequence[str], hosts: Optional[Sequence[str]] = None) -> TransportChoice:
    """``auto``'s transport for a ``device_type`` (``cpu``/``cuda``) Context whose ranks have
    domain keys ``keys`` and host keys ``hosts`` (default: the domain keys), one per rank."""
    dom = domain_of(keys)
    hosts = list(keys) if hosts is None else list(hosts)
    local, memory = ("tma", "GPU peer-access") if device_type == "cuda" else ("host", "shared-memory")
    sizes = np.bincount(np.asarray(dom, dtype=np.int64)).tolist()
    n, world = len(sizes), len(dom)
    if n == 1:
        if len(set(hosts)) > 1:  # only CUDA gets here (check_domains refuses it on the CPU)
            return TransportChoice(
                local,
                dom,
                f"all {world} ranks share one {memory} domain over {len(set(hosts))} "
                "hosts (multi-node NVLink): window nvshmem, since CUDA IPC handles do not reach "
                "across hosts",
                edge_transport={"intra": local},
                window="nvshmem",
            )
        return TransportChoice(
            local, dom, f"all {world} ranks share one {memory} domain (host)", edge_transport={"intra": local}
        )
    if max(sizes) == 1:
        return TransportChoice(
            "p2p", dom, f"no two of the {world} ranks share a {memory} domain", edge_transport={"cross": "p2p"}
        )
    spread = f"the ranks span {n} {memory} domains of {sizes} ranks"
    if device_type == "cuda":
        by: dict[int, set] = {}
        for d, h in zip(dom, hosts):
            by.setdefault(d, set()).add(h)
        wide = sorted(d for d, hs in by.items() if len(hs) > 1)
        if wide:  # a multi-node NVLink domain beside others: its window would be nvshmem, which split lacks
            return TransportChoice(
                "p2p",
                dom,
                spread,
                edge_transport={"intra": "p2p", "cross": "p2p"},
                split=(
                    f"domains {wide} span several hosts (multi-node NVLink), and the GPU split maps a domain "
                    "with cuda_ipc, which does not reach across hosts: every edge runs on p2p (same results)"
                ),
            )
        return TransportChoice(
            "split",
            dom,
            spread,
            edge_transport={"intra": "tma", "cross": "p2p"},
            split=(
                "edges inside a domain run on tma (the persistent kernel over cuda_ipc windows) and edges across "
                "domains on p2p (NCCL on a side stream, through device shadows)"
            ),
        )
    return TransportChoice(
        "split",
        dom,
        spread,
        edge_transport={"intra": "host", "cross": "p2p"},
        split=(
            "edges inside a domain run on host (shared-memory windows) and edges across domains on p2p (gloo "
            "messages through shadow windows and a bridge)"
        ),
    )


def split_edges(schedule, domain_of: Sequence[int]) -> dict[str, dict[str, int]]:
    """Per op, the schedule's tree edges (one per filled replica slot: parent -> slot) inside one
    domain (``intra``) and across domains (``cross``)."""
    dom = np.asarray(domain_of, dtype=np.int64)
    out = {}
    for op in (Op.MULTICAST, Op.REDUCE):
        pr, _, depth = (np.asarray(a) for a in schedule.tree(op))
        ranks = np.arange(pr.shape[0])[:, None].repeat(pr.shape[1], axis=1)
        filled = depth > 0
        cross = filled & (dom[np.clip(pr, 0, None)] != dom[ranks])
        out[op.name.lower()] = {"intra": int((filled & ~cross).sum()), "cross": int(cross.sum())}
    return out
