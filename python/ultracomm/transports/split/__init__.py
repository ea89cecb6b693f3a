"""The ``split`` transport: one schedule, edges inside a memory domain on the host executor over
shared memory, edges across domains as ``torch.distributed`` messages (gloo).

For ranks spread over hosts where some hosts hold several ranks (``ultracomm.dataplane.domains``).  The
task interpreter runs unchanged over a pointer table in which a rank of another domain is
replaced by a *shadow* of its window (:mod:`.shadow`); a *bridge* (:mod:`.bridge`) moves the
chunks that cross domains (:mod:`.bridge_program`) between shadows and real windows and
raises the flags a remote writer would have raised.  So every intra-domain edge, relay and
reduction runs exactly as under the ``host`` transport, and the bytes -- weights, relays'
partials, master grads summed in the schedule's fp32 order -- are those of the host executor.

Window: ``host_shm`` mapping only this rank's domain (``local`` on loopback domains, where
every rank is reachable but ranks of other declared domains still go through shadows).
Messages: the Context's gloo group (or loopback mailboxes).  Only ranks with crossings in an
op exchange messages in it (a 16-byte header per peer when the op's plan changed, then one
message per crossing chunk).
CPU only: the GPU variant (tma inside a domain, NCCL across) is :mod:`.cuda`.

Route (per operation and schedule, ``ULTRACOMM_SPLIT_ROUTE``; ``auto`` asks
:func:`ultracomm.alpha_beta.split_route`).  Shared memory inside a domain pays a fixed cost per
operation -- the host executor's join, worker hand-offs and drain, beside the bridge -- which
the bytes it keeps off the messages must pay for.  Where they cannot (small experts), the
operation runs as the ``p2p`` transport would run it on one host: every edge a message, out of
and into the same buffers -- a multicast with the direct schedule of the same plan
(:func:`ultracomm.alpha_beta.choose_schedule` with relays off: copies, so the same bytes), a
reduction with this schedule where its tree is direct (a relay tree keeps the split route:
relays round their partials, so the bits follow the tree).  Both routes give the host
executor's bytes for the schedule (tests/transports/test_split.py runs both).  Ranks pick alike: the
route is a function of the schedule.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Sequence

import torch

from ... import _core
from ..costs import COSTS, Route, split_route
from ...errors import InputError, UltracommError
from ...records import Op
from .bridge import BridgeLanes, BridgeRun
from .bridge_direct import MAX_SEGMENTS, DirectBridge, DirectPlan, build_direct_plan
from .bridge_program import BridgeProgram, build_bridge_program
from ..base import DEFAULT_TILE_BYTES, Masters, Transport, op_digest
from ..host import HostTransport
from ..p2p import P2PTransport, with_evidence
from ..p2p.messengers import messenger_for
from ..p2p.waves import cached_program
from .shadow import Shadows

__all__ = ["SplitTransport"]

_CACHE = 128  # (schedule, op) bridge programs kept

#: crossings move between real buffers (:mod:`.bridge_direct`: no shadow copy of multicast chunks,
#: the calling thread moves what no task waits for).  False: the shadow protocol of :mod:`.bridge`
#: for every crossing -- the one the GPU split stream runs, simulated on the CPU by
#: tests/split_stream_sim.py.
DIRECT_CROSSINGS = True


#: how the messages route gets the direct schedule of a schedule's plan: ``fn(schedule, costs, rank)``,
#: registered by the control plane (:mod:`ultracomm.control.schedules`), which owns the builders --
#: the data plane does not import it (issue 36's layers)
_DIRECT_BUILDER = None


def register_direct_builder(fn) -> None:
    """Set the direct-schedule builder of the messages route (see ``_DIRECT_BUILDER``)."""
    global _DIRECT_BUILDER
    _DIRECT_BUILDER = fn


class SplitTransport(Transport):
    """Host executor inside each memory domain, p2p messages across (see the module docstring).

    Args (given by the Context): ``comm``, ``rank``, ``world``, ``window`` (``host_shm`` or
    ``local``), ``wlayout``, ``layout``, ``num_workers``, ``timeout_s``, ``jitter_us`` and
    ``domain_of`` (the agreed domain index of every rank).
    """

    name = "split"
    window_providers = ("host_shm", "local")
    options = frozenset({"comm", "num_workers", "jitter_us", "domain_of", "split_route", "tile_bytes"})
    names_by_evidence = True

    def __init__(
        self,
        *,
        comm: Any,
        rank: int,
        world: int,
        window,
        wlayout: dict,
        layout,
        num_workers: int,
        timeout_s: float,
        jitter_us: int = 0,
        domain_of: Sequence[int] | None = None,
        split_route: str = "auto",
        tile_bytes: int = DEFAULT_TILE_BYTES,
    ):
        if domain_of is None or len(domain_of) != world:
            raise InputError(
                f"ultracomm: transport 'split' needs domain_of, one memory domain per rank ({world}); got {domain_of!r}"
            )
        if split_route not in ("auto", "split", "messages"):
            raise InputError(
                f"ultracomm: transport 'split': split_route must be auto, split or messages; got {split_route!r}"
            )
        if window.local.device.type != "cpu":
            raise InputError(
                "ultracomm: SplitTransport runs on the CPU (host executor inside a domain); for a GPU "
                "window the split is ultracomm.transports.split.cuda.SplitCudaTransport (a Context "
                "with transport='split' on a CUDA device picks it)"
            )
        self.rank, self.world = rank, world
        #: the alpha-beta costs of the messages between domains (gloo): the Context builds this
        #: transport's trees with them (and host shared memory's inside a domain)
        self.message_costs = COSTS["gloo"]
        self.window, self.wlayout, self.layout = window, dict(wlayout), layout
        self.timeout_s = float(timeout_s)
        self.domain_of = tuple(int(d) for d in domain_of)
        for r, b in enumerate(window.peer_bases):
            if self.domain_of[r] == self.domain_of[rank] and not b:
                raise InputError(
                    f"ultracomm: transport 'split': rank {r} is in this rank's memory domain but the "
                    f"window does not reach it"
                )
        self.shadows = Shadows(rank, self.domain_of, wlayout["total_bytes"], wlayout["ready_off"])
        self.host = HostTransport(
            rank=rank,
            world=world,
            window=window,
            wlayout=wlayout,
            layout=layout,
            num_workers=num_workers,
            timeout_s=timeout_s,
            jitter_us=jitter_us,
            tile_bytes=tile_bytes,
            peer_bases=self.shadows.bases(window.peer_bases),
        )
        self.messenger = messenger_for(comm, world, torch.device("cpu")) if self.shadows.views else None
        #: the bridge's send and receive threads, kept for the transport's life (not started per op)
        self.lanes = BridgeLanes(f"ultracomm-bridge-r{rank}") if self.messenger is not None else None
        self._programs: dict[tuple[int, int], BridgeProgram] = {}
        self._direct: dict[tuple[int, int], DirectPlan] = {}
        self._members = {
            Op.MULTICAST: (list(layout.weight_offsets), list(layout.weight_sizes)),
            Op.REDUCE: (list(layout.grad_offsets), list(layout.grad_sizes)),
        }
        self.split_route = split_route
        #: the messages' alpha-beta costs of the route choice (kept apart from ``message_costs``, which
        #: tests clear to build the host executor's schedules)
        self.route_costs = COSTS["gloo"]
        #: the messages route: the p2p transport over this window's buffers and the same process group
        self.p2p = None
        if self.messenger is not None:
            self.p2p = P2PTransport(
                comm=comm, rank=rank, world=world, window=window, wlayout=wlayout, layout=layout, timeout_s=timeout_s
            )
            self.p2p.label = "split, messages route"
        self._routes: dict[tuple[int, int], Route] = {}
        self._direct_schedules: dict[int, object] = {}

    @property
    def witness(self):
        """The Context's :class:`ultracomm.blame.Witness` (shared by the host side and the messages route)."""
        return self.host.witness

    @witness.setter
    def witness(self, w) -> None:
        self.host.witness = w
        if self.p2p is not None:
            self.p2p.witness = w

    # ------------------------------------------------------------------ route
    def route(self, op: Op, schedule) -> Route:
        """This op's route for ``schedule`` (cached per schedule digest): the configured one, or
        under ``auto`` what :func:`ultracomm.alpha_beta.split_route` says.  With one domain
        (nothing crosses) the route is ``split``: the host executor alone."""
        op = Op(op)
        key = (schedule.digest, int(op))
        r = self._routes.get(key)
        if r is None:
            name = "multicast" if op == Op.MULTICAST else "reduce"
            r = split_route(schedule, name, self.domain_of, self.route_costs, COSTS["host_shm"])
            want = r.route if self.split_route == "auto" else self.split_route
            if self.p2p is None or (want == "messages" and op == Op.REDUCE and schedule.stats(name)["depth"] > 1):
                # nothing crosses (one domain); or a reduction's bits follow its tree (relays round their
                # partials), and messages along a relay tree would pay a message per hop: split it is
                want = "split"
            r = dataclasses.replace(r, route=want)
            if len(self._routes) >= 2 * _CACHE:
                self._routes.clear()
            self._routes[key] = r
        return r

    def message_schedule(self, op: Op, schedule):
        """What the messages route runs for ``op``: multicast the direct schedule (copies: the same
        bytes whatever the tree), reduce ``schedule`` itself (direct there: :meth:`route` keeps
        relay trees on the split route), so the sums are those of ``schedule``'s order."""
        return self.direct_schedule(schedule) if Op(op) == Op.MULTICAST else schedule

    def direct_schedule(self, schedule):
        """The direct schedule of ``schedule``'s plan, one chunk per slot, as the ``p2p`` transport
        chooses on one host (cached per digest)."""
        d = self._direct_schedules.get(schedule.digest)
        if d is None:
            if _DIRECT_BUILDER is None:
                raise UltracommError(
                    "ultracomm: transport 'split': no direct-schedule builder registered (the control "
                    "plane registers one: import ultracomm.control.schedules, as Context does)"
                )
            d = _DIRECT_BUILDER(schedule, dataclasses.replace(self.route_costs, shared=True), self.rank)
            if len(self._direct_schedules) >= _CACHE:
                self._direct_schedules.clear()
            self._direct_schedules[schedule.digest] = d
        return d

    def message_bytes(self, op: Op, schedule) -> int:
        """Bytes this rank sends as messages in ``op`` of ``schedule`` under its route."""
        op = Op(op)
        if self.route(op, schedule).route == "messages":
            return int(self.p2p.program(op, self.message_schedule(op, schedule)).bytes_sent)
        return int(self.program(op, schedule).bytes_sent)

    def program(self, op: Op, schedule) -> BridgeProgram:
        """This rank's (cached) crossings of ``op`` for ``schedule``."""
        slot_bytes = self.wlayout["weight_slot_bytes" if op == Op.MULTICAST else "grad_slot_bytes"]
        return cached_program(
            self._programs,
            schedule,
            op,
            self.world,
            lambda slot_src, home_of: build_bridge_program(
                op,
                schedule,
                self.rank,
                schedule.tasks(op, self.rank),
                schedule.refs(op, self.rank),
                slot_src,
                home_of,
                self.domain_of,
                self.wlayout["chunk_bytes"],
                slot_bytes,
            ),
            _CACHE,
        )

    def direct_plan(self, op: Op, schedule, prog: BridgeProgram) -> DirectPlan | None:
        """This rank's (cached) :class:`~.bridge_direct.DirectPlan` of ``op``, or None for the shadow
        protocol (``DIRECT_CROSSINGS`` off, or more members than direct tags allow)."""
        if not DIRECT_CROSSINGS or len(self._members[op][0]) > MAX_SEGMENTS:
            return None
        key = (schedule.digest, int(op))
        plan = self._direct.get(key)
        if plan is None:
            if len(self._direct) >= _CACHE:
                self._direct.clear()
            plan = self._direct[key] = build_direct_plan(
                prog,
                schedule,
                schedule.tasks(op, self.rank),
                schedule.refs(op, self.rank),
                self.domain_of,
                *self._members[op],
            )
        return plan

    def run(
        self,
        op: Op,
        schedule,
        epoch: int,
        masters: Masters,
        my_slots: Sequence[int],
        local_index_of: Sequence[int],
        op_name: str | None = None,
    ) -> None:
        """Run ``op`` of ``schedule`` for this rank at ``epoch``; blocks until done here (the
        interpreter drained and the bridge's messages completed)."""
        op = Op(op)
        name = op_name or ("weight_sync" if op == Op.MULTICAST else "grad_reduce")
        if self.route(op, schedule).route == "messages":  # every edge a message
            self.p2p.run(op, self.message_schedule(op, schedule), epoch, masters, my_slots, local_index_of, name)
            return
        prog = self.program(op, schedule)
        if not prog.peers:  # nothing crosses here in this op: the host executor alone
            self.host.run(op, schedule, epoch, masters, my_slots, local_index_of, name)
            return
        abort = torch.zeros(1, dtype=torch.int64)
        started = time.monotonic()
        args = (
            self.messenger,
            prog,
            epoch,
            op_digest(schedule.digest, op),
            self.window.local,
            self.window.peer_bases[self.rank],
            self.shadows,
            self.wlayout,
            abort,
            self.timeout_s,
            f"rank {self.rank} {name} (epoch {epoch}, transport split, bridge)",
        )
        direct = self.direct_plan(op, schedule, prog)
        lists = None
        if direct is None:
            bridge = BridgeRun(*args)
        else:
            mc = op == Op.MULTICAST
            bridge = DirectBridge(
                *args,
                plan=direct,
                members=masters.weights if mc else masters.grads,
                local_index_of=local_index_of,
                member_off=self._members[op][0],
            )
            lists, my_slots = (direct.tasks, direct.refs), direct.my_slots(my_slots)
        bridge.start(self.lanes)
        try:
            self.host.run(
                op, schedule, epoch, masters, my_slots, local_index_of, name, abort_word=abort.data_ptr(), lists=lists
            )
            if direct is not None:
                bridge.finish_early()
        except _core.AbortedError:
            pass  # the bridge failed first: its error is raised below
        except BaseException as e:  # the interpreter failed first: stop the bridge
            bridge.fail(e)
        finished = bridge.join()
        if bridge.error is not None:
            raise with_evidence(bridge.error, self.host.witness, epoch, name, started)
        if finished:  # the pages stay for the next op of this plan (shadow.py: Memory)
            self.shadows.settle(prog.peers, schedule.digest)
