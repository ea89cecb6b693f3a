"""Contract tests of ultracomm.integrations.deepep_lb: DeepEP's ``lb_`` calls, restated.

Upstream read (not imported, not copied): deepseek-ai/DeepEP V2.5 -- ``tests/ep/test_reduce_grads.py``
and the kernels ``deep_ep/include/deep_ep/impls/ep/prefetch_weights.cuh`` / ``reduce_grads.cuh`` at
def865146e95, ``tests/ep/test_prefetch_weights.py`` at 1a1ffbac, the kernels' task table
(``deep_ep/include/deep_ep/layout/ep/eplb.cuh``) at 855fa9de, ``deep_ep/buffers/ep.py``
(``EPBuffer.lb_*``) at 13b3abaa and ``csrc/buffers/ep.hpp``'s checks (see the module's docstring).
What those files fix, restated here as the oracle (:func:`expected_slots`, :func:`expected_grads`):

* prefetch: after the call, slot ``c`` of rank ``r`` holds, byte for byte, the home tensors of
  expert ``mapping[r, c]`` (owner ``e // num_local_experts``, row ``e % num_local_experts``), for
  every tensor passed; a ``-1`` slot and every tensor not passed keep what they held (DeepEP's
  test fills a sentinel and checks it survives).  An expert in two slots of one rank fills both
  (the kernel makes one task per mapping entry; DeepEP's random mappings draw with replacement).
* reduce: ``expert_grads[l]`` gains the sum of every slot, on every rank, that holds expert
  ``rank * num_local_experts + l``; the redundant gradients are not modified; calls accumulate.
  DeepEP's test uses small integers so that its atomic adds' order cannot show; here the order is
  fixed, so random fp32 values are also checked bit for bit against a direct Context run.
"""

from __future__ import annotations

from unittest import mock

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, ReplicaPlan
from ultracomm.errors import ConfigError, PlanError, PlanMismatchError
from ultracomm.integrations import deepep_lb
from ultracomm.integrations.deepep_lb import BufferAllocator, LBBuffer, lb_prefetch_weights, lb_reduce_grads
from ultracomm.layout import Member

SENTINEL = 0xA5
# (bytes per expert, destination dtype, source dtype) of each tensor an expert pushes: fp8 weights, a
# 32-bit scale table (int32 at home, received into a float32 pool: bytes, no conversion), bf16 scales
PAYLOADS = [
    (1024, torch.float8_e4m3fn, torch.float8_e4m3fn),
    (96, torch.float32, torch.int32),
    (64, torch.bfloat16, torch.bfloat16),
]


# ---------------------------------------------------------------- DeepEP's behaviour, restated
def blob(expert: int, nbytes: int, payload: int) -> torch.Tensor:
    """Bytes unique to (expert, payload): a ramp shifted by a key, so a wrong source differs everywhere."""
    key = expert * len(PAYLOADS) + payload
    return ((torch.arange(nbytes, dtype=torch.int64) * 7 + key * 13) % 251).to(torch.uint8)


def home_tensors(rank: int, num_local: int, payloads=PAYLOADS) -> list[torch.Tensor]:
    """This rank's ``expert_weights``: each ``[num_local, ...]`` in the source dtype."""
    out = []
    for p, (nbytes, _, src_dtype) in enumerate(payloads):
        rows = torch.stack([blob(rank * num_local + l, nbytes, p) for l in range(num_local)])
        out.append(rows.view(src_dtype))
    return out


def random_mapping(
    rng: np.random.Generator, world: int, slots: int, num_local: int, empty_ratio: float = 0.25, dups: bool = True
) -> torch.Tensor:
    """DeepEP's ``make_redundancy_mapping('random')``: each entry a remote expert, drawn with
    replacement from the others' experts (shifted past the row's own block), ``-1`` with
    probability ``empty_ratio``.  ``dups=False`` redraws rows until no expert repeats in a row."""
    table = np.empty((world, slots), np.int64)
    for r in range(world):
        while True:
            row = rng.integers(0, (world - 1) * num_local, slots)
            row += (row >= r * num_local) * num_local
            row[rng.random(slots) < empty_ratio] = -1
            held = row[row >= 0]
            if dups or len(set(held.tolist())) == len(held):
                break
        table[r] = row
    assert not ((table >= 0) & (table // num_local == np.arange(world)[:, None])).any()
    return torch.from_numpy(table).to(torch.int32)


def expected_slots(mapping: torch.Tensor, rank: int, num_local: int, payload: int, before: torch.Tensor):
    """What the pool of ``payload`` holds on ``rank`` after a prefetch (as bytes ``[slots, nbytes]``)."""
    out = before.clone()
    for c, e in enumerate(mapping[rank].tolist()):
        if e >= 0:
            out[c] = blob(e, out.shape[1], payload)
    return out


def expected_grads(
    mapping: torch.Tensor, rank: int, num_local: int, seed: torch.Tensor, redundant: list[torch.Tensor]
) -> torch.Tensor:
    """``expert_grads`` after one reduce: its seed plus every matching slot of every rank."""
    out = seed.clone().double()
    for r, row in enumerate(mapping.tolist()):
        for c, e in enumerate(row):
            if e >= 0 and e // num_local == rank:
                out[e % num_local] += redundant[r][c].double()
    return out


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1).view(torch.uint8)


# ---------------------------------------------------------------- harness
def make_buffer(group, slots: int, num_local: int, payloads=PAYLOADS, hidden: int | None = None, **options):
    plan = BufferAllocator()
    pools = [
        plan.allocate((slots, nbytes // torch.empty((), dtype=dt).element_size()), dt) for nbytes, dt, _ in payloads
    ]
    grads = plan.allocate((slots, hidden), torch.float32) if hidden else None
    options.setdefault("timeout_s", 20)
    return LBBuffer(group, plan, num_local, **options), pools, grads


def grad_values(rank: int, shape, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * salt + rank)
    return torch.randn(shape, generator=g)


# ---------------------------------------------------------------- prefetch
@pytest.mark.parametrize("seed", range(4))
def test_prefetch_random_mappings(seed):
    """DeepEP's correctness loop: random mappings with -1 slots and same-rank duplicates, every
    payload (fp8 weights and scales), sentinel-filled pools; the same pools reused round after
    round, alternating flat tensors and ``unflatten`` views and ``previous_event=capture()``."""
    rng = np.random.default_rng(seed)
    world = [2, 3, 4, 5][seed]
    slots, num_local = int(rng.integers(2, 6)), int(rng.integers(1, 4))
    mappings = [random_mapping(rng, world, slots, num_local) for _ in range(3)]

    def body(group):
        r = group.rank
        buf, pools, _ = make_buffer(group, slots, num_local, relay_mode="force" if seed % 2 else "auto")
        src = home_tensors(r, num_local)
        try:
            for k, m in enumerate(mappings):
                for p in pools:
                    as_bytes(p).fill_(SENTINEL)
                before = [as_bytes(p).clone() for p in pools]
                dst = [p.unflatten(1, (2, -1)) for p in pools] if k % 2 else pools
                sources = [s.unflatten(1, (-1, 2)) for s in src] if k % 2 else src
                ev = buf.lb_prefetch_weights(
                    dst, sources, m, num_sms=0, previous_event=buf.capture() if k % 2 else None
                )
                ev.wait()
                for p, (pool, b) in enumerate(zip(pools, before)):
                    assert torch.equal(as_bytes(pool), expected_slots(m, r, num_local, p, b)), (k, p)
        finally:
            buf.destroy()

    LoopbackDomain(world).run(body)


def test_prefetch_subset_leaves_other_pools():
    """DeepEP's ``with_sf=False`` rounds: only the weights are passed; the scale pools keep the sentinel."""
    m = torch.tensor([[2, 2, -1], [0, 5, 4], [1, -1, 3]], dtype=torch.int32)

    def body(group):
        buf, pools, _ = make_buffer(group, 3, 2)
        try:
            for p in pools:
                as_bytes(p).fill_(SENTINEL)
            before = [as_bytes(p).clone() for p in pools]
            lb_prefetch_weights(pools[0], home_tensors(group.rank, 2)[0], m).wait()  # one tensor, not a list
            assert torch.equal(as_bytes(pools[0]), expected_slots(m, group.rank, 2, 0, before[0]))
            assert all(torch.equal(as_bytes(p), b) for p, b in zip(pools[1:], before[1:]))
        finally:
            buf.destroy()

    LoopbackDomain(3).run(body)


def test_duplicates_and_a_hot_expert():
    """One expert in every slot of a rank, and in some slot of every other rank: served, every
    slot filled; with relays forced the home sends it less than once per replica rank."""
    world, num_local, slots = 5, 2, 3
    m = torch.tensor([[-1, -1, -1], [0, 0, 0], [0, 3, 0], [0, -1, -1], [2, 0, 1]], dtype=torch.int32)

    def body(group):
        buf, pools, _ = make_buffer(group, slots, num_local, relay_mode="force")
        try:
            for p in pools:
                as_bytes(p).fill_(SENTINEL)
            before = [as_bytes(p).clone() for p in pools]
            buf.lb_prefetch_weights(pools, home_tensors(group.rank, num_local), m).wait()
            for p, (pool, b) in enumerate(zip(pools, before)):
                assert torch.equal(as_bytes(pool), expected_slots(m, group.rank, num_local, p, b))
            plan, dups = buf._plan(m.numpy().astype(np.int64))
            stats = buf.pools[0].ctx.schedule_for(plan).stats()
            return dups, stats["multicast"]["egress"][0], stats["multicast"]["depth"]
        finally:
            buf.destroy()

    out = LoopbackDomain(world).run(body)
    assert [d for d, _, _ in out] == [[], [(0, 1), (0, 2)], [(0, 2)], [], []]
    egress, depth = out[0][1], out[0][2]
    assert depth >= 2 and egress < 4 * PAYLOADS[0][0]  # 4 ranks want expert 0; it leaves rank 0 fewer times


def test_prefetch_bit_equal_to_a_direct_context_run():
    """A duplicate-free mapping through the adapter and the same plan through ``Context.weight_sync``
    (one member per tensor): the same bytes in every slot."""
    rng = np.random.default_rng(7)
    world, slots, num_local = 4, 4, 3
    m = random_mapping(rng, world, slots, num_local, dups=False)

    def body(group):
        r = group.rank
        src = home_tensors(r, num_local)
        buf, pools, _ = make_buffer(group, slots, num_local, relay_mode="force")
        try:
            buf.lb_prefetch_weights(pools, src, m).wait()
            got = [as_bytes(p).clone() for p in pools]
        finally:
            buf.destroy()
        want = []
        for (nbytes, dt, _), s in zip(PAYLOADS, src):
            ctx = Context(
                group,
                ExpertLayout((Member("w", (nbytes,), torch.uint8),)),
                num_local,
                slots,
                1,
                timeout_s=20,
                relay_mode="force",
            )
            try:
                ctx.register_masters(0, [s.reshape(num_local, -1).view(torch.uint8).contiguous()], None)
                vid = ctx.begin(0)
                ctx.weight_sync(vid, ReplicaPlan.make(m, experts_per_rank=num_local))
                ctx.end(vid)
                want.append(ctx.replica_weights[0].clone())
            finally:
                ctx.close()
        filled = [c for c, e in enumerate(m[r].tolist()) if e >= 0]
        return all(torch.equal(g[filled], w[filled]) for g, w in zip(got, want))

    assert LoopbackDomain(world).run(body) == [True] * world


# ---------------------------------------------------------------- reduce
@pytest.mark.parametrize("seed", range(3))
def test_reduce_random_mappings(seed):
    """DeepEP's reduce loop: small-integer grads (exact in any order), random mappings with -1
    slots and duplicates; ``expert_grads`` gains every replica's gradient, the redundant grads are
    unchanged, and a second call adds the same again (no clearing, no overwriting)."""
    rng = np.random.default_rng(20 + seed)
    world = [3, 4, 5][seed]
    slots, num_local, hidden = int(rng.integers(2, 6)), int(rng.integers(1, 4)), 24
    m = random_mapping(rng, world, slots, num_local)

    def body(group):
        r = group.rank
        buf, _, grads = make_buffer(group, slots, num_local, hidden=hidden, relay_mode="force" if seed != 1 else "off")
        try:
            red = [
                torch.arange(slots * hidden, dtype=torch.float32).view(slots, hidden) % 97 - 40 + 100 * q
                for q in range(world)
            ]
            grads.copy_(red[r])
            seed_g = torch.arange(num_local * hidden, dtype=torch.float32).view(num_local, hidden) % 13 - 6
            expert_grads = seed_g.clone()
            with buf.lb_reduce_grads(grads, expert_grads, m, previous_event=buf.capture()):
                pass
            once = expected_grads(m, r, num_local, seed_g, red)
            assert torch.equal(expert_grads.double(), once)
            assert torch.equal(grads, red[r])  # not cleared, not pre-reduced into
            lb_reduce_grads(grads, expert_grads, m).wait()  # found through the pool
            assert torch.equal(expert_grads.double(), 2 * once - seed_g.double())
        finally:
            buf.destroy()

    LoopbackDomain(world).run(body)


def test_reduce_deterministic_and_equal_to_a_direct_context_run():
    """Random fp32 grads, a hot expert (relays pre-reduce): the adapter's result is bit-equal to
    ``Context.grad_reduce`` with the same plan, and to itself when run again."""
    world, num_local, slots, hidden = 5, 2, 2, 40
    m = torch.tensor([[2, 4], [0, 9], [0, 1], [0, 8], [0, 3]], dtype=torch.int32)

    def body(group):
        r = group.rank
        red = grad_values(r, (slots, hidden), salt=1)
        seed_g = grad_values(r, (num_local, hidden), salt=2)
        buf, _, grads = make_buffer(group, slots, num_local, hidden=hidden, relay_mode="force")
        runs = []
        try:
            for _ in range(2):
                grads.copy_(red)
                eg = seed_g.clone()
                buf.lb_reduce_grads(grads, eg, m).wait()
                runs.append(eg)
        finally:
            buf.destroy()
        ctx = Context(
            group,
            ExpertLayout((Member("g", (hidden,), torch.float32),)),
            num_local,
            slots,
            1,
            timeout_s=20,
            relay_mode="force",
        )
        try:
            direct = seed_g.clone()
            ctx.register_masters(0, [torch.zeros(num_local, hidden)], [direct])
            vid = ctx.begin(0)
            ctx.weight_sync(vid, ReplicaPlan.make(m, experts_per_rank=num_local))
            ctx.grad_reduce(vid, grads=[red])
        finally:
            ctx.close()
        return runs, direct

    for r, (runs, direct) in enumerate(LoopbackDomain(world).run(body)):
        assert torch.equal(runs[0], runs[1]), r
        assert torch.equal(runs[0], direct), r


def test_reduce_duplicates_presummed_in_slot_order():
    """Expert 0 in both slots of rank 1: its home gets ``(slot0 + slot1)`` of rank 1 plus the others."""
    m = torch.tensor([[-1, -1], [0, 0], [0, -1]], dtype=torch.int32)

    def body(group):
        r = group.rank
        red = grad_values(r, (2, 8), salt=3)
        buf, _, grads = make_buffer(group, 2, 1, hidden=8, relay_mode="off")
        try:
            grads.copy_(red)
            eg = torch.zeros(1, 8)
            buf.lb_reduce_grads(grads, eg, m).wait()
            return red, eg
        finally:
            buf.destroy()

    out = LoopbackDomain(3).run(body)
    (_, eg0), (red1, _), (red2, _) = out
    assert torch.equal(eg0[0], torch.zeros(8) + (red1[0] + red1[1]) + red2[0])  # fp32, in the schedule's order


# ---------------------------------------------------------------- refused: where DeepEP's behaviour is undefined
def test_undefined_mappings_and_bad_arguments_raise():
    def body(group):
        r = group.rank
        buf, pools, grads = make_buffer(group, 2, 2, hidden=8)
        src = home_tensors(r, 2)
        try:
            for bad, msg in (
                ([[2, -2], [0, 1]], r"redundancy_mapping\[0, 1\] = -2: expert ids are local"),
                ([[2, 4], [0, 1]], r"redundancy_mapping\[0, 1\] = 4: .*in \[0, 4\)"),
                ([[1, 2], [0, 1]], r"redundancy_mapping\[0, 0\] = 1 is rank 0's own expert"),
            ):
                with pytest.raises(PlanError, match=msg):
                    buf.lb_prefetch_weights(pools, src, torch.tensor(bad, dtype=torch.int32))
                with pytest.raises(PlanError, match=msg):
                    buf.lb_reduce_grads(grads, torch.zeros(2, 8), torch.tensor(bad, dtype=torch.int32))
            ok = torch.tensor([[2, -1], [0, 1]], dtype=torch.int32)
            with pytest.raises(ValueError, match=r"int32 \[num_nvlink_ranks=2, num_redundant_experts\]"):
                buf.lb_prefetch_weights(pools, src, ok.long())
            with pytest.raises(ValueError, match=r"int32 \[num_nvlink_ranks=2"):
                buf.lb_prefetch_weights(pools, src, ok[:1])
            with pytest.raises(ValueError, match=r"has 2 slots; redundancy_mapping has 3 columns"):
                buf.lb_prefetch_weights(pools, src, torch.tensor([[2, -1, 3], [0, 1, 1]], dtype=torch.int32))
            with pytest.raises(ValueError, match=r"expert_weights\[0\] has 512 bytes per expert, its destination 1024"):
                buf.lb_prefetch_weights(pools[0], src[0][:, :512], ok)
            with pytest.raises(ValueError, match=r"expected \[num_local_experts=2, \.\.\.\]"):
                buf.lb_prefetch_weights(pools[0], src[0][:1], ok)
            with pytest.raises(ValueError, match="is not a redundant pool of this LBBuffer"):
                buf.lb_prefetch_weights(torch.empty_like(pools[0]), src[0], ok)
            with pytest.raises(ValueError, match="is not a redundant pool of this LBBuffer"):
                buf.lb_prefetch_weights(pools[0][:1], src[0], ok)
            with pytest.raises(ValueError, match="2 redundant_expert_weights and 1 expert_weights"):
                buf.lb_prefetch_weights(pools[:2], src[:1], ok)
            with pytest.raises(ValueError, match="nonempty sequence of tensors"):
                buf.lb_prefetch_weights([], [], ok)
            with pytest.raises(ValueError, match="num_sms must be 0"):
                buf.lb_prefetch_weights(pools, src, ok, num_sms=-2)
            with pytest.raises(ValueError, match="must be a 2-D float32 tensor, got torch.bfloat16"):
                buf.lb_reduce_grads(grads, torch.zeros(2, 8, dtype=torch.bfloat16), ok)
            with pytest.raises(ValueError, match=r"must be a float32 \[num_redundant_experts, hidden\] pool"):
                buf.lb_reduce_grads(pools[0].view(torch.float32), torch.zeros(2, 256), ok)  # a uint8 pool
            with pytest.raises(ValueError, match=r"expert_grads must be a contiguous float32 \[2, 8\]"):
                buf.lb_reduce_grads(grads, torch.zeros(3, 8), ok)
            with pytest.raises(ValueError, match="not a redundant pool of any live LBBuffer"):
                lb_reduce_grads(torch.zeros(2, 8), torch.zeros(2, 8), ok)
            # a one-GPU loopback domain launches every rank's share at the last call: duplicate slots
            # (whose copy_ would be queued before that launch) are refused there, before anything moves
            ctx = buf._pool_of(pools[0], "p").ctx
            with (
                mock.patch.object(ctx.transport, "stream_ordered", True, create=True),
                mock.patch.object(ctx.window, "loopback", True, create=True),
                mock.patch.object(ctx.window, "provider", "cuda_local"),
            ):
                dup = torch.tensor([[2, 2], [0, 1]], dtype=torch.int32)
                if r == 0:
                    with pytest.raises(ValueError, match=r"slots 0 and 1 of rank 0; on a one-GPU loopback domain"):
                        buf.lb_prefetch_weights(pools, src, dup)
                else:  # this rank holds no duplicate: nothing to refuse (it would then wait for rank 0)
                    assert buf._plan(dup.numpy().astype(np.int64))[1] == []
            # nothing was broken by the refusals: a valid call still runs on every rank
            buf.lb_prefetch_weights(pools, src, ok).wait()
            return as_bytes(pools[0])[0].equal(blob(2, 1024, 0)) if r == 0 else True
        finally:
            buf.destroy()

    assert LoopbackDomain(2).run(body) == [True, True]


def test_mapping_that_differs_across_ranks_raises_everywhere():
    def body(group):
        buf, pools, _ = make_buffer(group, 2, 2)
        try:
            m = torch.tensor([[2, -1], [0, 1 if group.rank == 0 else -1]], dtype=torch.int32)
            with pytest.raises(PlanMismatchError):
                buf.lb_prefetch_weights(pools, home_tensors(group.rank, 2), m)
        finally:
            buf.destroy()
        buf, _, grads = make_buffer(group, 2, 2, hidden=8)
        try:
            with pytest.raises(PlanMismatchError):
                buf.lb_reduce_grads(grads, torch.zeros(2, 8), m)
        finally:
            buf.destroy()

    LoopbackDomain(2).run(body)


def test_buffer_construction():
    group = object()  # refused before any collective
    with pytest.raises(ConfigError, match="needs a BufferAllocator plan"):
        LBBuffer(group, 1 << 20, 2)
    with pytest.raises(ValueError, match="holds no tensors"):
        LBBuffer(group, BufferAllocator(), 2)
    plan = BufferAllocator()
    plan.allocate((2, 16), torch.float32)
    with pytest.raises(ValueError, match="num_local_experts must be a positive int"):
        LBBuffer(group, plan, 0)

    def body(g):  # the planned placeholders become the pools (views of the windows), as in DeepEP
        plan = BufferAllocator()
        a = plan.allocate((3, 64), torch.float32)
        b = plan.allocate((3, 2, 8), torch.bfloat16)
        buf = LBBuffer(g, plan, 1, timeout_s=20)
        try:
            with pytest.raises(ValueError, match="cannot change"):
                plan.allocate((1, 1), torch.uint8)
            return (
                a.device.type,
                tuple(a.shape),
                a.dtype,
                a.is_contiguous(),
                tuple(b.shape),
                b.dtype,
                buf.num_nvlink_ranks,
                buf.lb_get_theoretical_num_sms(),
                isinstance(buf.capture(), deepep_lb.EventOverlap),
            )
        finally:
            buf.destroy()

    assert (
        LoopbackDomain(2).run(body)
        == [("cpu", (3, 64), torch.float32, True, (3, 2, 8), torch.bfloat16, 2, 0, True)] * 2
    )
