"""The split transport's bridge per op: two lane threads kept for the transport's life (none
started per op), a header with a peer only when the op's plan changed, receives posted before
the interpreter starts -- and the same bytes as before (exact weights, exact sums)."""

from __future__ import annotations

import threading

import numpy as np
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.transports.split.bridge_program import HEADER_TAG

EPR, SLOTS = 2, 2
LAYOUT = ExpertLayout((Member("a", (33,), torch.float32), Member("b", (7, 5), torch.float32)))


def _plans():
    # 4 ranks, domains a,a,b,b; every rank holds experts of the other domain (crossings both ways)
    p1 = ReplicaPlan.make(np.array([[4, 6], [5, 7], [0, 2], [1, 3]], np.int32), experts_per_rank=EPR)
    p2 = ReplicaPlan.make(np.array([[6, 4], [7, -1], [2, 1], [0, -1]], np.int32), experts_per_rank=EPR)
    return p1, p2


def test_headers_only_when_the_plan_changes_and_bytes_stay_exact():
    p1, p2 = _plans()

    def body(group):
        r = group.rank
        ctx = Context(
            group,
            LAYOUT,
            EPR,
            SLOTS,
            num_layers=1,
            transport="split",
            window="local",
            domain="a,a,b,b",
            timeout_s=30.0,
            split_route="split",
        )  # the bridge's route (small experts: auto sends messages)
        headers: list[int] = []
        real = ctx.transport.messenger.exchange

        def spy(ops):
            headers.extend(1 for kind, _, _, tag in ops if tag == HEADER_TAG and kind == "send")
            return real(ops)

        ctx.transport.messenger.exchange = spy
        ws = [
            torch.stack(
                [
                    torch.arange(m.numel, dtype=torch.float32).reshape(m.shape) + 100 * (r * EPR + i) + j
                    for i in range(EPR)
                ]
            )
            for j, m in enumerate(LAYOUT.members)
        ]
        gs = [torch.zeros_like(w) for w in ws]
        ctx.register_masters(0, ws, gs)
        lanes_before = {t.name for t in threading.enumerate() if t.name.startswith(f"ultracomm-bridge-r{r}-")}
        counts, out = [], []
        for plan in (p1, p1, p2):
            n0 = len(headers)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            counts.append(len(headers) - n0)
            out.append([w.clone() for w in ctx.replica_weights])
            ctx.restore(vid)
            counts.append(len(headers) - n0 - counts[-1])
            for g in ctx.replica_grads:
                g.fill_(0.25 * (r + 1))
            n1 = len(headers)
            ctx.grad_reduce(vid)
            counts.append(len(headers) - n1)
            out.append([g.clone() for g in gs])
            for g in gs:
                g.zero_()
        lanes_after = {t.name for t in threading.enumerate() if t.name.startswith(f"ultracomm-bridge-r{r}-")}
        ctx.close()
        return counts, out, lanes_before, lanes_after

    res = LoopbackDomain(4).run(body, timeout=120)
    for r, (counts, out, before, after) in enumerate(res):
        assert before == after == {f"ultracomm-bridge-r{r}-send", f"ultracomm-bridge-r{r}-recv"}
        # (weight_sync, restore, grad_reduce) x plans p1, p1 again, p2: headers on a new digest only.
        assert counts[0] > 0 and counts[1] == 0 and counts[2] > 0, counts
        assert counts[3:6] == [0, 0, 0], counts
        assert counts[6] > 0 and counts[7] == 0, counts
        for k, plan in enumerate((p1, p1, p2)):
            weights, grads = out[2 * k], out[2 * k + 1]
            for s, e in enumerate(plan.slot_src[r].tolist()):
                if e < 0:
                    continue
                for j, m in enumerate(LAYOUT.members):
                    want = torch.arange(m.numel, dtype=torch.float32).reshape(m.shape) + 100 * e + j
                    assert torch.equal(weights[j][s], want), (r, k, s, j)
            # each replica of expert e on rank q added 0.25 * (q + 1): exact in fp32
            for i in range(EPR):
                e = r * EPR + i
                want = sum(0.25 * (q + 1) for q in range(4) for x in plan.slot_src[q].tolist() if x == e)
                for j in range(len(LAYOUT.members)):
                    assert torch.equal(grads[j][i], torch.full_like(grads[j][i], want)), (r, k, i, j)


def test_direct_plans_cover_every_path_of_the_bit_exact_cases():
    """The cases test_split.py runs byte for byte against the host executor (same plans, same chunk
    as its crossing count) move crossings by every path of transports/split/bridge_direct.py: early sends (masters,
    leaf grads), lane sends (relays), early receives (leaf slots, hidden from the interpreter) and
    lane receives (relay slots, reduce sources)."""
    from ultracomm.dataplane import domains
    from ultracomm.records import Op
    from ultracomm.schedule import build_schedule
    from ultracomm.transports.split.bridge_direct import build_direct_plan
    from ultracomm.transports.split.bridge_program import build_bridge_program

    from conftest import hot_slot_src, random_slot_src
    from test_split import CASES, layout_of

    seen = {op: {"early_sends": 0, "lane_sends": 0, "early_recvs": 0, "lane_recvs": 0} for op in Op}
    for world, domain, node_of, mode, grad_dtype in CASES:
        layout, epr, slots = layout_of(grad_dtype), 2, 3
        rng = np.random.default_rng(world * 13 + len(mode))
        plans = [ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr)] + [
            ReplicaPlan.make(random_slot_src(rng, world, slots, epr, 0.9), experts_per_rank=epr) for _ in range(2)
        ]
        dom = domains.domain_of(domain.split(","))
        for plan in plans:
            sched = build_schedule(
                plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=128, relay_mode=mode, node_of=node_of
            )
            for op, nbytes, mo, mb in (
                (Op.MULTICAST, layout.weight_bytes, layout.weight_offsets, layout.weight_sizes),
                (Op.REDUCE, layout.grad_bytes, layout.grad_offsets, layout.grad_sizes),
            ):
                for r in range(world):
                    tasks, refs = sched.tasks(op, r), sched.refs(op, r)
                    prog = build_bridge_program(
                        op, sched, r, tasks, refs, plan.slot_src.numpy(), plan.home_of.numpy(), dom, 128, nbytes
                    )
                    d = build_direct_plan(prog, sched, tasks, refs, dom, list(mo), list(mb))
                    for k in seen[op]:
                        seen[op][k] += len(getattr(d, k))
                    # every crossing is moved by exactly one path; segments lie inside its chunk
                    assert sorted(p.x.tag * 64 + p.x.dst for p in d.early_sends + d.lane_sends) == sorted(
                        x.tag * 64 + x.dst for x in prog.sends
                    )
                    assert sorted(p.x.tag * 64 + p.x.src for p in d.early_recvs + d.lane_recvs) == sorted(
                        x.tag * 64 + x.src for x in prog.recvs
                    )
                    for p in d.early_sends + d.lane_sends + d.early_recvs + d.lane_recvs:
                        assert p.segs and all(p.x.lo <= lo < hi <= p.x.hi for _, lo, hi in p.segs)
                    if op == Op.MULTICAST:  # the interpreter keeps only refs inside the domain
                        assert all(dom[int(x["rank"])] == dom[r] for x in d.refs)
                        assert {p.x.slot for p in d.early_recvs} == set(d.hidden)
                    else:
                        assert d.tasks is tasks and {p.x.slot for p in d.early_sends} == set(d.hidden)
    assert all(seen[Op.MULTICAST].values()), seen
    assert seen[Op.REDUCE]["early_sends"] and seen[Op.REDUCE]["lane_sends"] and seen[Op.REDUCE]["lane_recvs"], seen
    assert seen[Op.REDUCE]["early_recvs"] == 0
