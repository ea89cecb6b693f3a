"""Memory domains of a group, and what ``transport="auto"`` picks from them.

A *domain* is a set of ranks that can address each other's memory: CPU processes on one host
share POSIX shared memory (the ``host`` transport's windows); GPUs on one host reach each
other's memory through CUDA IPC / NVLink (the ``tma`` transport's windows).  Ranks in
different domains can only exchange messages (the ``p2p`` transport).  A rank's domain key
is its host's identity, ``hostname/boot id`` (two containers with one hostname on two
machines differ in boot id); every rank of a loopback domain is in one domain.

``auto`` (``ULTRACOMM_TRANSPORT`` or ``transport=`` set to anything else is taken as given):

=====================================  ===========================  ==========================
ranks                                  CPU Context                  CUDA Context
=====================================  ===========================  ==========================
one domain                             ``host``                     ``tma``
no two ranks share a domain            ``p2p`` (gloo)               ``p2p`` (NCCL)
mixed (some domains hold several)      ``p2p`` for every edge       ``p2p`` for every edge
=====================================  ===========================  ==========================

Mixed domains: the edges inside a domain could run on ``host``/``tma`` and only the edges
across domains need ``p2p`` (:func:`split_edges` counts them for a schedule).  The executor
that splits one schedule's edges between two transports is not built: every edge runs on
``p2p``, which gives the same bytes (every executor does) but does not use the shared memory
inside a domain.  The choice and this statement are logged once per Context.
"""
from __future__ import annotations

import dataclasses
import socket
from typing import Sequence

import numpy as np

from .records import Op

__all__ = ["host_key", "domain_of", "TransportChoice", "choose_transport", "split_edges"]


def host_key() -> str:
    """This process's shared-memory domain: ``hostname/boot id``."""
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            boot = f.read().strip()
    except OSError:
        boot = "?"
    return f"{socket.gethostname()}/{boot}"


def domain_of(keys: Sequence[str]) -> tuple[int, ...]:
    """Domain index of each rank, numbered in order of first appearance."""
    index: dict[str, int] = {}
    return tuple(index.setdefault(k, len(index)) for k in keys)


@dataclasses.dataclass(frozen=True)
class TransportChoice:
    """What ``auto`` chose and why.  ``domain_of[r]``: rank ``r``'s domain; ``split``: for
    mixed domains, which edges could go where and what runs instead."""

    transport: str
    domain_of: tuple[int, ...]
    reason: str
    split: str | None = None

    def describe(self) -> str:
        return f"transport auto -> {self.transport}: {self.reason}" + (f"; {self.split}" if self.split else "")


def choose_transport(device_type: str, keys: Sequence[str]) -> TransportChoice:
    """``auto``'s transport for a ``device_type`` (``cpu``/``cuda``) Context whose ranks have
    domain keys ``keys`` (one per rank; see :func:`host_key`)."""
    dom = domain_of(keys)
    local, memory = ("tma", "GPU peer-access") if device_type == "cuda" else ("host", "shared-memory")
    sizes = np.bincount(np.asarray(dom, dtype=np.int64)).tolist()
    n = len(sizes)
    if n == 1:
        return TransportChoice(local, dom, f"all {len(dom)} ranks share one {memory} domain (host)")
    if max(sizes) == 1:
        return TransportChoice("p2p", dom, f"no two of the {len(dom)} ranks share a {memory} domain (host)")
    return TransportChoice(
        "p2p", dom, f"the ranks span {n} {memory} domains (hosts) of {sizes} ranks",
        split=(f"edges inside a domain could run on {local} and only edges across domains need p2p, but the "
               "executor that splits one schedule between two transports is not built: every edge runs on p2p "
               f"(same results; set ULTRACOMM_TRANSPORT={local} if every rank can in fact reach every other's memory)"))


def split_edges(schedule, domain_of: Sequence[int]) -> dict[str, dict[str, int]]:
    """Per op, the schedule's tree edges (one per filled replica slot: parent -> slot) inside one
    domain (``intra``) and across domains (``cross``): what a split executor would give the
    window transport and ``p2p``."""
    dom = np.asarray(domain_of, dtype=np.int64)
    out = {}
    for op in (Op.MULTICAST, Op.REDUCE):
        pr, _, depth = (np.asarray(a) for a in schedule.tree(op))
        ranks = np.arange(pr.shape[0])[:, None].repeat(pr.shape[1], axis=1)
        filled = depth > 0
        cross = filled & (dom[np.clip(pr, 0, None)] != dom[ranks])
        out[op.name.lower()] = {"intra": int((filled & ~cross).sum()), "cross": int(cross.sum())}
    return out
