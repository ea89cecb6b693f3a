"""The schedule of a plan under a Context's configuration, built by the builder the call
names and cached by plan digest (this rank's lists)."""

from __future__ import annotations

import collections
import dataclasses
import logging
from typing import Any, Sequence

import numpy as np
import torch

from ..alpha_beta import COSTS, choose_schedule
from ..transports.split import register_direct_builder
from ..env import Config
from ..layout import ExpertLayout
from ..plan import ReplicaPlan
from ..resident_plan import DeviceSchedule, ResidentPlan
from ..schedule import build_schedule
from ..schedule_base import ScheduleBase
from ..schedule_portable import build_schedule_portable, hop_bytes

__all__ = ["Schedules", "CACHED", "direct_schedule"]

log = logging.getLogger("ultracomm")

CACHED = 64  # distinct plans whose schedules are kept


class Schedules:
    """Schedules of one Context: ``get(plan)`` builds (or finds) the host schedule, ``device(plan)``
    the inputs of a resident plan's build on the GPU.

    ``transport``: its ``message_costs`` (read at each build: a message transport chunks and shapes
    trees by them) and whether it is ``split`` (shared memory inside a domain, messages between
    domains).  ``config`` may be replaced (``Context.set_relay_mode``); call ``clear()``."""

    def __init__(
        self,
        *,
        rank: int,
        num_experts: int,
        experts_per_rank: int,
        layout: ExpertLayout,
        chunk_bytes: int,
        node_of: Sequence[int],
        domain_of: Sequence[int],
        transport: Any,
        config: Config,
    ):
        self.rank, self.num_experts, self.experts_per_rank = rank, num_experts, experts_per_rank
        self.layout, self.chunk_bytes = layout, chunk_bytes
        self.node_of, self.domain_of = list(node_of), tuple(domain_of)
        self.transport, self.split, self.config = transport, transport.name == "split", config
        self._cache: collections.OrderedDict[bytes, ScheduleBase] = collections.OrderedDict()
        self._device_inputs: dict = {}  # device -> (home_of, node_of) tensors of resident plans' builds

    def clear(self) -> None:
        self._cache.clear()

    def cached(self) -> list[ScheduleBase]:
        """The schedules kept, oldest first."""
        return list(self._cache.values())

    def get(self, plan: ReplicaPlan, key: bytes | None = None, builder: str | None = None) -> ScheduleBase:
        """The (cached) schedule of ``plan``.  ``key``: ``plan.digest()`` if the caller has it.
        ``builder``: ``portable`` builds with the device control plane's builder whatever
        ``schedule_builder`` says (a resident plan on the host path); default the configuration's."""
        key = plan.digest() if key is None else key
        builder = builder or self.config.schedule_builder
        if builder != self.config.schedule_builder:
            key = key + builder.encode()
        sched = self._cache.get(key)
        if sched is not None:
            self._cache.move_to_end(key)
            return sched
        sched = self._build(plan, builder)
        self._cache[key] = sched
        if log.isEnabledFor(logging.DEBUG):
            st = sched.stats()
            log.debug(
                "rank %d: schedule %016x built: multicast depth %d max egress %d B (lower bound %d B); "
                "reduce depth %d max ingress %d B (lower bound %d B)",
                self.rank,
                sched.digest,
                st["multicast"]["depth"],
                st["multicast"]["max_egress"],
                st["multicast"]["lower_bound_bytes"],
                st["reduce"]["depth"],
                st["reduce"]["max_ingress"],
                st["reduce"]["lower_bound_bytes"],
            )
        if len(self._cache) > CACHED:
            self._cache.popitem(last=False)
        return sched

    def _build(self, plan: ReplicaPlan, builder: str) -> ScheduleBase:
        c, lay = self.config, self.layout
        costs = self.transport.message_costs
        if costs is not None and not self.split:  # a message transport: chunk and tree by its alpha-beta model
            if len(set(self.domain_of)) == 1:  # one host: every rank's messages share its cores
                costs = dataclasses.replace(costs, shared=True)
            return choose_schedule(
                plan,
                lay.weight_bytes,
                lay.grad_bytes,
                costs,
                relay_mode=c.relay_mode,
                max_depth=c.max_depth,
                node_of=self.node_of,
                rank=self.rank,
            ).schedule
        inter = {}
        if self.split and costs is not None:  # shared memory inside a domain, messages between domains
            shm = COSTS["host_shm"]
            inter = dict(
                intra_bw=shm.beta_Bps,
                intra_latency_s=shm.alpha_s,
                inter_bw=costs.beta_Bps,
                inter_latency_s=costs.alpha_s,
            )
        if builder == "portable":  # the device control plane's builder (sched_build.h)
            # its own tree choice: relay "off" means direct (depth 1); "force" is not honoured
            return build_schedule_portable(
                plan,
                lay.weight_bytes,
                lay.grad_bytes,
                rank=self.rank,
                node_of=self.node_of,
                chunk_bytes=self.chunk_bytes,
                max_depth=1 if c.relay_mode == "off" else c.max_depth,
                intra_bw=inter.get("intra_bw", c.intra_bw),
                **({"intra_latency_s": inter["intra_latency_s"]} if inter else {}),
            )
        return build_schedule(
            plan,
            lay.weight_bytes,
            lay.grad_bytes,
            node_of=self.node_of,
            chunk_bytes=self.chunk_bytes,
            relay_mode=c.relay_mode,
            max_depth=c.max_depth,
            rank=self.rank,
            **{"intra_bw": c.intra_bw, "inter_bw": c.inter_bw, **inter},
        )

    def device(self, plan: ResidentPlan) -> DeviceSchedule:
        """The device build's inputs for ``plan`` (fixed-home experts, this Context's chunking,
        depth limit and cost model; the same numbers ``get`` gives the portable host build)."""
        home, nodes = self.device_inputs(plan.slot_src.device)
        c = self.config
        return DeviceSchedule(
            plan,
            home,
            nodes,
            self.rank,
            self.num_experts,
            1 if c.relay_mode == "off" else c.max_depth,
            self.layout.weight_bytes,
            self.layout.grad_bytes,
            self.chunk_bytes,
            hop_bytes(c.intra_bw),
        )

    def device_inputs(self, dev: torch.device) -> tuple:
        """``(home_of, node_of)`` int32 tensors on ``dev`` for the device builds (made at setup for
        the window's GPU: never first inside a CUDA graph capture, where they would not exist yet)."""
        fixed = self._device_inputs.get(dev)
        if fixed is None:
            home = torch.arange(self.num_experts, dtype=torch.int32, device=dev) // self.experts_per_rank
            nodes = None if len(set(self.node_of)) == 1 else torch.tensor(self.node_of, dtype=torch.int32, device=dev)
            fixed = self._device_inputs[dev] = (home, nodes)
        return fixed


def direct_schedule(schedule: ScheduleBase, costs: Any, rank: int) -> ScheduleBase:
    """The direct schedule (one message per member and edge, relays off) of ``schedule``'s plan
    under ``costs``, as the ``p2p`` transport chooses on one host: what the CPU ``split``
    transport's messages route multicasts."""
    inp = schedule.inputs()
    plan = ReplicaPlan.make(
        np.asarray(inp["slot_src"], dtype=np.int32).reshape(int(inp["world"]), -1),
        home_of=np.asarray(inp["home_of"], dtype=np.int32),
    )
    return choose_schedule(
        plan, int(inp["weight_bytes"]), int(inp["grad_bytes"]), costs, relay_mode="off", rank=rank
    ).schedule


register_direct_builder(direct_schedule)
