"""The block-imitating mover (run_host(mover="block")): T threads per worker with a barrier,
as a CUDA block runs the interpreter.  Real schedules (ultracomm.schedule.build_schedule:
direct, relay auto, relay force; fp32/bf16/fp16; with jitter; several worlds) must give the
same bytes as the host mover, bit for bit, and both must match the references."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm.records import Op
from ultracomm.tools.reference import reference_reduce
from ultracomm.schedule import build_schedule

from test_host_executor import ESIZE, FILL, Cluster, _random_plan, check_multicast, ok


def _snapshot(cl: Cluster, op: Op) -> torch.Tensor:
    """Every byte an op writes: the slots of all windows (flags excluded) and the masters."""
    data = [w[: cl.L["ready_off"]].clone() for w in cl.win]
    src = cl.masters if op == Op.MULTICAST else cl.master_grads
    data += [t.view(torch.uint8).clone() for e in sorted(src) for t in src[e]]
    return torch.cat(data)


def _run_both(cl: Cluster, op: Op, tasks, refs, my, parent, reset, **kw) -> dict[str, torch.Tensor]:
    out = {}
    for mover, extra in (("host", {}), ("block", {"threads_per_worker": 3}), ("block", {"threads_per_worker": 1})):
        reset()
        ok(
            cl.run(
                op,
                tasks,
                refs,
                my,
                mover=mover,
                per_rank=lambda r: {"slot_parent": [int(p) for p in parent[r]]},
                **extra,
                **kw,
            )
        )
        out[f"{mover}{extra.get('threads_per_worker', '')}"] = _snapshot(cl, op)
    return out


@pytest.mark.parametrize(
    "seed,world,relay_mode,dtype",
    [
        (0, 4, "force", torch.float32),
        (1, 5, "auto", torch.bfloat16),
        (2, 6, "force", torch.float16),
        (3, 3, "off", torch.float32),
        (4, 7, "auto", torch.float16),
        (5, 8, "force", torch.bfloat16),
    ],
    ids=lambda x: str(x).replace("torch.", ""),
)
def test_block_mover_equals_host_mover_bit_for_bit(seed, world, relay_mode, dtype):
    rng = np.random.default_rng(100 + seed)
    slots, experts = int(rng.integers(2, 4)), 2 * world
    plan = _random_plan(world, slots, experts, rng)
    cl = Cluster(
        world,
        slots,
        [701, 90, 13],
        [k * ESIZE[dtype] for k in (175, 45, 6)],
        chunk=128,
        num_experts=experts,
        home_of=[int(h) for h in plan.home_of],
        grad_dtype=dtype,
        seed=seed,
    )
    sch = build_schedule(plan, cl.wsb, cl.gsb, chunk_bytes=cl.chunk, relay_mode=relay_mode)
    my = plan.slot_src.tolist()
    jitter = dict(jitter_us=40, jitter_seed=seed, num_workers=2)

    # multicast: fresh master bytes, then the same run through each mover
    tasks = [sch.tasks(Op.MULTICAST, r) for r in range(world)]
    refs = [sch.refs(Op.MULTICAST, r) for r in range(world)]

    def reset_mc():
        for w in cl.win:
            w[: cl.L["ready_off"]] = FILL

    snaps = _run_both(cl, Op.MULTICAST, tasks, refs, my, sch.tree(Op.MULTICAST)[0], reset_mc, **jitter)
    check_multicast(cl, my)  # the last run (block, 1 thread) against the reference
    assert torch.equal(snaps["host"], snaps["block3"]) and torch.equal(snaps["host"], snaps["block1"])

    # reduce: the same initial grads for each mover; bits against each other and the reference
    init, master_init = cl.random_replica_grads(my, seed)

    def reset_red():
        for r in range(world):
            for s in range(slots):
                cl.grad_slot(r, s).copy_(init[r][s])
        for e, ms in master_init.items():
            for t, t0 in zip(cl.master_grads[e], ms):
                t.copy_(t0)

    tasks = [sch.tasks(Op.REDUCE, r) for r in range(world)]
    refs = [sch.refs(Op.REDUCE, r) for r in range(world)]
    snaps = _run_both(cl, Op.REDUCE, tasks, refs, my, sch.tree(Op.REDUCE)[0], reset_red, **jitter)
    assert torch.equal(snaps["host"], snaps["block3"]) and torch.equal(snaps["host"], snaps["block1"])
    _, want = reference_reduce(tasks, refs, init, master_init, cl.g_off, cl.g_bytes, dtype)
    ib = torch.int32 if dtype == torch.float32 else torch.int16
    for e in range(experts):
        for got, exp in zip(cl.master_grads[e], want[e]):
            gb, wb = got.view(ib), exp.view(ib)
            nan = torch.isnan(got.float()) & torch.isnan(exp.float())  # NaN + NaN may keep either payload
            assert torch.equal(gb[~nan], wb[~nan]), e


def test_block_mover_timeout_and_validation_match_host():
    """The block mover raises the host mover's exact timeout text, and the same ValueErrors."""
    from test_host_executor import _timeout_message  # noqa: PLC0415

    for op in (Op.MULTICAST, Op.REDUCE):
        host = _timeout_message(op)
        block = _timeout_message(op, mover="block", threads_per_worker=4)
        assert host == block, (host, block)
    cl = Cluster(2, 1, [256], chunk=256)
    from ultracomm import _core  # noqa: PLC0415

    base = cl.args(
        Op.MULTICAST, 0, [np.zeros(0, dtype=np.uint8)] * 2, [np.zeros(0, dtype=np.uint8)] * 2, [[-1], [-1]], 1
    )
    for bad, match in (
        ({"mover": "warp"}, "mover must be 'host' or 'block'"),
        ({"mover": "block", "threads_per_worker": 0}, "threads_per_worker must be in 1..64"),
    ):
        with pytest.raises(ValueError, match=match):
            _core.run_host(**{**base, **bad})
