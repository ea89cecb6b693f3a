"""Helpers of the copy_engine CPU tests: host-executor Contexts of a loopback domain (their
windows are host memory, so the copy_engine commands run on them with ``simulate``), every
rank's commands for a plan, host words per rank."""

from __future__ import annotations

import numpy as np
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member
from ultracomm.records import Op
from ultracomm.transports.copy_engine.plan import host_words, multicast_commands
from ultracomm.transports.host import op_digest

from conftest import expert_weights

LAYOUT = ExpertLayout((Member("fc1", (6, 17), torch.bfloat16), Member("fc2", (17, 3), torch.bfloat16)))


def host_contexts(world, epr, slots, mode, node_of=None):
    """``(contexts, each)``: host-transport Contexts with registered masters; ``each(fn)`` runs
    ``fn(ctx)`` on every rank, each in its thread."""

    def body(group):
        ctx = Context(
            group,
            LAYOUT,
            epr,
            slots,
            num_layers=1,
            transport="host",
            window="local",
            relay_mode=mode,
            node_of=node_of,
            chunk_bytes=128,
            tile_bytes=16,
            num_workers=2,
            timeout_s=30.0,
        )
        per = [expert_weights(LAYOUT, e) for e in range(ctx.rank * epr, (ctx.rank + 1) * epr)]
        ctx.register_masters(0, [torch.stack([p[m] for p in per]).contiguous() for m in range(2)], None)
        return ctx

    domain = LoopbackDomain(world)
    ctxs = domain.run(body)
    return ctxs, lambda fn: domain.run(lambda g: fn(ctxs[g.rank]))


def new_words(world: int) -> list[np.ndarray]:
    """Every rank's host words (started, done[...]), zeroed."""
    return [np.zeros(host_words(world), np.uint64) for _ in range(world)]


def rank_commands(ctx, plan, words: np.ndarray, digest: int | None = None):
    s = ctx.schedule_for(plan)
    return multicast_commands(
        ctx.rank,
        ctx.wlayout,
        ctx.window.peer_bases,
        s.tasks(Op.MULTICAST, ctx.rank),
        s.refs(Op.MULTICAST, ctx.rank),
        LAYOUT.weight_offsets,
        LAYOUT.weight_sizes,
        ctx._masters[0].weight_ptrs,
        plan.local_index_of.tolist(),
        plan.slot_src[ctx.rank].tolist(),
        op_digest(s.digest, Op.MULTICAST) if digest is None else digest,
        words.ctypes.data,
        s.tree(Op.MULTICAST)[0][ctx.rank].tolist(),
    )


def pools(ctxs) -> list[torch.Tensor]:
    """Every rank's slots and flags (window bytes below the ready flags: slots only)."""
    end = ctxs[0].wlayout["ready_off"]
    return [c.window.local[:end].clone() for c in ctxs]


def zero_slots(ctxs) -> None:
    end = ctxs[0].wlayout["ready_off"]
    for c in ctxs:
        c.window.local[:end].zero_()


def host_reference(ctxs, each, plan):
    """The host executor's slots for ``plan`` (every slot zeroed first), and the next free epoch."""
    zero_slots(ctxs)
    vids = each(lambda c: c.begin(0))
    each(lambda c: c.weight_sync(vids[c.rank], plan))
    want = pools(ctxs)
    each(lambda c: c.end(vids[c.rank]))
    zero_slots(ctxs)
    return want, max(c._queue.epoch for c in ctxs) + 1


def set_epoch(ctxs, epoch: int) -> None:
    """The host executor's next operation runs above a simulated epoch."""
    for c in ctxs:
        c._queue.epoch = epoch
