"""How a :class:`~ultracomm.context.Context` comes to be: its arguments checked, every rank's
configuration and memory domain agreed, the window opened and the transport attached over it
(each step agreed: if any rank fails one, every rank raises).  Context.__init__ calls
:func:`construct`; nothing here is called again after setup."""

from __future__ import annotations

import weakref
from typing import Any, Sequence

from .blame import Witness, process_identity
from .comm import as_comm, require_same
from .control import plans, setup
from .control.microbatches import MicroBatches
from .control.schedules import Schedules
from .cuda import stream_ordered
from .dataplane import device_type, domains, is_stream_ordered, select, slot_views, transport_kwargs
from .dataplane.queue import OpQueue, release
from .env import Config
from .layout import ExpertLayout
from .profile import profile_for_context
from .transports.base import Masters
from .windows import open_window
from .work import OrderedRunner

__all__ = ["construct"]


def construct(
    ctx: Any,
    group: Any,
    layout: ExpertLayout,
    experts_per_rank: int,
    slots_per_rank: int,
    num_layers: int,
    max_microbatches: int,
    transport: str | None,
    window: str | None,
    device: Any,
    node_of: Sequence[int] | None,
    config: Config | None,
    profile: Any,
    overrides: dict,
) -> None:
    """Context.__init__: check, agree with every rank, open the window, attach the transport."""
    ctx._runner: OrderedRunner | None = None  # set last: a half-built Context has nothing to close
    comm = as_comm(group)  # a bad group fails here, on this rank: there is nothing to agree over
    ctx.rank, ctx.world = comm.rank, comm.world
    error: Exception | None = None
    try:
        configure(
            ctx,
            comm,
            layout,
            experts_per_rank,
            slots_per_rank,
            num_layers,
            max_microbatches,
            transport,
            window,
            device,
            node_of,
            config,
            overrides,
            profile,
        )
    except Exception as e:  # noqa: BLE001 - every rank learns of it in the first agreement
        error = e
    # the agreed timeout bounds the first agreement too; a rank that failed before it had a
    # configuration waits the default (its peers still learn of its error at once)
    cfg = getattr(ctx, "config", None) or (config if isinstance(config, Config) else Config())
    timeout_s = cfg.timeout_s
    ctx.comm = comm.with_timeout(timeout_s)
    # blame by evidence (ultracomm.blame): this Context's failures published, its peers' state read
    ctx._witness = ctx.comm.witness = Witness(ctx.comm, ctx.rank, ctx.world, timeout_s)

    def local_check() -> tuple:
        if error is not None:
            raise error
        chosen = (ctx._transport_cls.name, ctx._provider) if ctx._transport_cls else None
        where = domains.rank_domain(
            ctx.config.domain, ctx.rank, ctx.world, device_type(ctx.config.transport, ctx.config.window, device), device
        )
        key = setup.agreed_key(
            ctx.config, layout, experts_per_rank, slots_per_rank, num_layers, max_microbatches, ctx.node_of, chosen
        )
        return key, where, process_identity()

    views = ctx.comm.agree(local_check, op="Context setup", what="configuration")
    require_same([v[0] for v in views], "Context configuration")
    ctx._witness.processes = [v[2] for v in views]  # a peer's process on this host is evidence (ultracomm.blame)
    # every rank's memory domain decides auto (and what split does); ultracomm.dataplane.domains
    ctx.comm.agree(
        lambda: choose(ctx, [v[1] for v in views], device),
        op="Context setup",
        what="memory domains and transport choice",
    )
    reach = None
    if ctx._transport_cls.name == "split":  # shared memory reaches this rank's domain only
        reach = [d == ctx.domain_of[ctx.rank] for d in ctx.domain_of]
        if ctx._cuda_dev is None:  # chunks that cross domains are gloo messages: large enough to pay
            ctx.wlayout = setup.split_window_layout(ctx.wlayout, ctx.config, layout, slots_per_rank)
    ctx.window = open_window(
        ctx._provider, ctx.comm, ctx.wlayout["total_bytes"], op="Context setup", device=ctx._cuda_dev, reach=reach
    )
    ctx._witness.attach_window(ctx.window, ctx.wlayout)
    try:
        ctx.comm.agree(lambda: attach(ctx), op="Context setup", what="transport and buffers")
    except BaseException:
        ctx._witness.detach()
        ctx.window.close()
        raise
    ctx._masters: list[Masters | None] = [None] * num_layers
    ctx._schedules = Schedules(
        rank=ctx.rank,
        num_experts=ctx.num_experts,
        experts_per_rank=experts_per_rank,
        layout=layout,
        chunk_bytes=ctx.wlayout["chunk_bytes"],
        node_of=ctx.node_of,
        domain_of=ctx.domain_of,
        transport=ctx.transport,
        config=ctx.config,
    )
    epr = ctx.experts_per_rank  # local_index_of of the fixed-home model (resident plans)
    ctx._home_local_index = [e % epr if e // epr == ctx.rank else -1 for e in range(ctx.num_experts)]
    if ctx.transport.build_on_device:
        ctx._schedules.device_inputs(ctx.window.local.device)
    ctx._queue.runner = ctx._runner = OrderedRunner(f"ultracomm-rank{ctx.rank}")
    # a Context dropped without close() still stops its thread and unmaps its window; neither
    # the runner (idle) nor the queue holds a reference to the Context, so dropping it frees it
    queue = ctx._queue
    ctx._witness.epoch_fn = lambda: queue.epoch
    ctx._finalizer = weakref.finalize(ctx, release, ctx._runner, ctx.window, ctx._streams, ctx._witness)


def configure(
    ctx: Any,
    comm: Any,
    layout: ExpertLayout,
    experts_per_rank: int,
    slots_per_rank: int,
    num_layers: int,
    max_microbatches: int,
    transport: str | None,
    window: str | None,
    device: Any,
    node_of: Sequence[int] | None,
    config: Config | None,
    overrides: dict,
    profile: Any = None,
) -> None:
    """Check the arguments and derive configuration and window layout (local, nothing moves)."""
    setup.check_counts(layout, experts_per_rank, slots_per_rank, num_layers, max_microbatches, ctx.world)
    ctx.config = setup.resolve_config(config, transport, window, overrides)
    ctx.layout, ctx.experts_per_rank, ctx.slots_per_rank = layout, experts_per_rank, slots_per_rank
    ctx.num_experts = experts_per_rank * ctx.world
    ctx.num_layers, ctx.max_microbatches = num_layers, max_microbatches
    ctx.node_of = setup.resolve_node_of(node_of, ctx.world)
    #: what ``transport="auto"`` chose and why (:class:`ultracomm.dataplane.domains.TransportChoice`); ``None``
    #: when the transport was named
    ctx.transport_choice: domains.TransportChoice | None = None
    ctx._transport_cls = None
    #: memory domain index of every rank (:mod:`ultracomm.dataplane.domains`), agreed at setup
    ctx.domain_of: tuple[int, ...] = ()
    if ctx.config.transport not in ("auto", "split"):
        ctx._transport_cls, ctx._provider, ctx._cuda_dev = select(ctx.config, comm, device)
    else:  # chosen after the first agreement; contradictions in the arguments still fail here
        device_type(ctx.config.transport, ctx.config.window, device)
    ctx.wlayout = setup.window_layout(slots_per_rank, layout, ctx.config.chunk_bytes)
    #: the recorder of plans, schedule stats and op times (:mod:`ultracomm.profile`), or None
    ctx.profiler = profile_for_context(profile, ctx)


def choose(ctx: Any, views: Sequence[domains.RankDomain], device: Any) -> None:
    """Check every rank's domain declaration, then for ``transport="auto"`` pick from every
    rank's domain key (the same views on every rank: deterministic)."""
    ctx.domain_of, choice, picked = setup.choose(ctx.config, ctx.comm, device, views, ctx._transport_cls)
    if picked is not None:
        ctx.transport_choice = choice
        ctx._transport_cls, ctx._provider, ctx._cuda_dev = picked


def attach(ctx: Any) -> None:
    """Build the transport and the replica views over the window (every rank agrees it worked)."""
    kw = transport_kwargs(
        ctx._transport_cls,
        ctx.config,
        ctx._cuda_dev,
        rank=ctx.rank,
        world=ctx.world,
        window=ctx.window,
        wlayout=ctx.wlayout,
        layout=ctx.layout,
        comm=ctx.comm,
        domain_of=ctx.domain_of,
        experts_per_rank=ctx.experts_per_rank,
        plan_slots=ctx.num_layers * ctx.max_microbatches,
    )
    #: CTAs per rank the GPU transport was given (``{}`` for the host transport)
    ctx.sm_counts = {k: kw[f"{k}_sms"] for k in ("multicast", "reduce") if f"{k}_sms" in kw}
    ctx.transport = ctx._transport_cls(**kw)
    if ctx.transport.names_by_evidence:  # host, p2p, split: their timeouts name ranks by evidence
        ctx.transport.witness = ctx._witness
    ctx._vids = vids = MicroBatches(ctx.num_layers, ctx.max_microbatches)
    # transports with a plan arena take the vid's slot: restore / grad_reduce reuse its plan
    slot_of = (lambda mb: vids.slot(mb.vid)) if ctx.transport.takes_slot else (lambda mb: None)
    ctx._queue = OpQueue(ctx.transport, ctx.rank, None, ctx._witness, ctx.profiler, slot_of)
    if is_stream_ordered(ctx.transport):  # the finaliser holds the streams: they must not hold the Context
        ctx._queue.streams = stream_ordered.StreamOrdered(
            ctx.transport, stream_ordered.streams_for(ctx._cuda_dev), ctx._queue.fail, ctx.rank, ctx._witness
        )
    ctx._streams: stream_ordered.StreamOrdered | None = ctx._queue.streams
    #: ranks check that they run the same plan through the digests in their windows, not a
    #: collective per weight_sync (:func:`ultracomm.control.plans.window_check`)
    ctx.window_plan_check = plans.window_check(ctx.config.plan_check, ctx.transport)
    ctx.replica_weights = slot_views(
        ctx.window,
        ctx.layout,
        ctx.slots_per_rank,
        ctx.wlayout["weights_off"],
        ctx.wlayout["weight_stride"],
        ctx.layout.weight_offsets,
        [m.dtype for m in ctx.layout.members],
    )
    #: per member ``[slots_per_rank, *shape]`` grad views; None for a member without a gradient
    ctx.replica_grads = slot_views(
        ctx.window,
        ctx.layout,
        ctx.slots_per_rank,
        ctx.wlayout["grads_off"],
        ctx.wlayout["grad_stride"],
        ctx.layout.grad_offsets,
        [ctx.layout.grad_dtype if m.grad else None for m in ctx.layout.members],
    )
