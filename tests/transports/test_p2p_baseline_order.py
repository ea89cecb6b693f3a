"""relay_gloo against the bench's naive point-to-point (perf/README.md 6b, issue 21): where the
alpha-beta choice on one host is direct with one chunk per slot, every rank's p2p program posts
exactly the messages of ``ultracomm.tools.bench.TorchBaselines`` (p2p_weights / p2p_grads), in
the same order -- sends by destination rank, then receives by source rank, each in slot order --
so the two methods differ in the Python around the messages, not in what gloo is asked to do."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from ultracomm import ExpertLayout, Member
from ultracomm.alpha_beta import choose_schedule, costs_for_backend
from ultracomm.records import Op
from ultracomm.tools.bench import TorchBaselines, make_plan
from ultracomm.transports.p2p.waves import build_program


def _baseline(plan, rank, epr):
    """The (kind, peer, expert) sequence TorchBaselines posts on ``rank`` (weights; grads reverse it)."""
    base = TorchBaselines(plan, rank, epr, 1)
    src, home = plan.slot_src.tolist(), plan.home_of.tolist()
    sends = [("send", d, e) for d in range(plan.world) if d != rank for e in src[d] if e >= 0 and home[e] == rank]
    recvs = [("recv", h, src[rank][s]) for h, ss in enumerate(base.recv_slots) for s in ss]
    assert [len(r) for r in base.send_rows] == [
        sum(1 for e in src[d] if e >= 0 and home[e] == rank) for d in range(plan.world)
    ]
    return sends, recvs


@pytest.mark.parametrize("world,workload", [(4, "zipf:1.5"), (4, "zipf:3"), (8, "zipf:2"), (8, "zipf:3")])
def test_direct_one_chunk_programs_post_the_baselines_messages_in_its_order(world, workload):
    epr, slots, n = 8, 2, 1 << 19  # 1 MiB of bf16 weights per expert, the bench's smallest size
    layout = ExpertLayout((Member("w", (n,), torch.bfloat16),), grad_dtype=torch.float32)
    plan, _ = make_plan(workload, world, slots, epr, top_k=2)
    # as Context chooses for transport p2p on one host: gloo's costs, one shared medium
    costs = dataclasses.replace(costs_for_backend("gloo"), shared=True)
    choice = choose_schedule(plan, layout.weight_bytes, layout.grad_bytes, costs)
    sched = choice.schedule
    for op in ("multicast", "reduce"):  # direct, one chunk per slot (the bench's "choice" column)
        st = sched.stats(op)
        assert (st["depth"], st["chunks"]) == (1, 1), (op, st["depth"], st["chunks"])
    slot_src = plan.slot_src.numpy().astype(np.int64)
    home_of = plan.home_of.numpy().astype(np.int64)
    for rank in range(world):
        sends, recvs = _baseline(plan, rank, epr)
        for op, nbytes, mo, mb in (
            (Op.MULTICAST, layout.weight_bytes, layout.weight_offsets, layout.weight_sizes),
            (Op.REDUCE, layout.grad_bytes, layout.grad_offsets, layout.grad_sizes),
        ):
            prog = build_program(
                op,
                sched,
                rank,
                sched.tasks(op, rank),
                sched.refs(op, rank),
                slot_src,
                home_of,
                choice.chunk_bytes,
                nbytes,
                mo,
                mb,
            )
            # every message in the first wave (a reduce's sums run in a later wave of no messages)
            assert all(not w.sends and not w.recvs for w in prog.waves[1:])
            wave = prog.waves[0] if prog.waves else None
            got = (
                (
                    [("send", x.msg.dst, x.msg.expert) for x in wave.sends]
                    + [("recv", m.src, m.expert) for m in wave.recvs]
                )
                if wave
                else []
            )
            if op == Op.MULTICAST:
                want = sends + recvs
            else:  # p2p_grads: each replica's grad back to its home, then the homes' receives, same orders
                want = [("send", h, e) for _, h, e in recvs] + [("recv", d, e) for _, d, e in sends]
            assert got == want, (op, rank)
            # whole slots: one message per replica, of the slot's bytes
            assert all(m.lo == 0 and m.hi == nbytes for m in (wave.recvs if wave else []))
