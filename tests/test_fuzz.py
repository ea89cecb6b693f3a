"""Property-based fuzz of configuration and plan inputs: a clear error before anything moves, or
the correct result -- never a hang, a crash, an unclear error or a silently wrong byte.

Bounded to a few hundred examples (about 10 s together on a loaded 2-core machine); every
Context runs with a short timeout so that a hang would surface as a failure, not a stall.
"""

from __future__ import annotations

import os
import sys

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from ultracomm import (
    Config,
    ConfigError,
    Context,
    ExpertLayout,
    LayoutError,
    LoopbackDomain,
    Member,
    PlanError,
    ReplicaPlan,
    UltracommError,
    UltracommTimeout,
)
from ultracomm.env import MAX_CHUNK_BYTES, VARIABLES
from ultracomm.schedule import build_schedule

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import expected_master_grads, random_slot_src  # noqa: E402
from test_context import check_replicas, masters_for  # noqa: E402


def fuzz(n: int) -> settings:
    return settings(max_examples=n, deadline=None, suppress_health_check=[HealthCheck.too_slow], derandomize=True)


_NUMBERS = st.one_of(
    st.integers(-5, 70000).map(str),
    st.sampled_from(
        [
            str(2**31),
            str(2**32),
            str(2**63),
            str(2**64 - 32768),
            str(2**64),
            "99999999999",
            "1e300",
            "inf",
            "nan",
            "-0",
            "0x10",
            "1.5",
            " 8 ",
            "",
            "16K",
            "1M",
            "1025G",
            "4G",
            "32KiB",
            "1e9",
            "370G",
            "true",
            "off",
            "force",
            "host",
            "local",
            "auto",
            "garbage",
        ]
    ),
)


def assert_clear(e: BaseException) -> None:
    """An ultracomm error (or a ValueError/TypeError of ours) with a message, not a pybind dump or a timeout."""
    assert isinstance(e, (UltracommError, ValueError, TypeError)), repr(e)
    assert not isinstance(e, UltracommTimeout), f"a timeout where a clear error was due: {e}"
    text = str(e)
    assert text and "incompatible function arguments" not in text and "Invoked with" not in text, text


@fuzz(300)
@given(env=st.dictionaries(st.sampled_from([v.env for v in VARIABLES]), _NUMBERS, max_size=6))
def test_config_from_env_is_valid_or_a_config_error(env):
    try:
        cfg = Config.from_env(env)
    except ConfigError as e:
        assert any(name in str(e) for name in env) or "tile_bytes" in str(e), str(e)
        return
    # every accepted value is within what the executors' integer types and arithmetic hold
    assert 1 <= cfg.num_workers <= 1024 and 0 <= cfg.multicast_sms <= 4096 and 0 <= cfg.reduce_sms <= 4096  # 0: auto
    assert 16 <= cfg.tile_bytes <= cfg.chunk_bytes <= MAX_CHUNK_BYTES and cfg.chunk_bytes % cfg.tile_bytes == 0
    assert 1 <= cfg.max_depth <= 65535 and 0 <= cfg.jitter_us <= 1_000_000 and 0 < cfg.timeout_s <= 1e8


@st.composite
def cases(draw):
    world = draw(st.integers(1, 3))
    epr = draw(st.integers(1, 2))
    slots = draw(st.integers(0, 3))
    shapes = draw(st.lists(st.lists(st.integers(1, 24), min_size=1, max_size=2), min_size=1, max_size=2))
    if draw(st.integers(0, 7)) == 5:  # now and then a dimension no layout may have
        shapes[0][0] = draw(st.sampled_from([0, -1, 3.7, True, 1 << 41]))
    dtype = draw(st.sampled_from([torch.bfloat16, torch.float32, torch.float16, torch.int8]))
    chunk = draw(st.sampled_from([16, 32, 48, 64, 256, 1 << 20] * 3 + [8, 0, 100, 2**64 - 32768, MAX_CHUNK_BYTES + 16]))
    tile = draw(st.sampled_from([16, 32, 64]))
    relay = draw(st.sampled_from(["off", "auto", "force"]))
    if draw(st.integers(0, 3)) != 2:  # mostly a valid plan, possibly for another world or slot count
        pw, ps = world + draw(st.sampled_from([0, 0, 0, 1])), slots + draw(st.sampled_from([0, 0, 0, 1]))
        slot_src = random_slot_src(
            np.random.default_rng(draw(st.integers(0, 2**16))), pw, ps, epr, draw(st.sampled_from([0.5, 1.0]))
        )
    else:  # anything: out of range, own home, duplicates, huge, unsigned
        values = st.one_of(st.integers(-3, world * epr + 2), st.sampled_from([2**31, 2**64 - 1, -(2**40)]))
        rows = draw(st.lists(st.lists(values, min_size=slots, max_size=slots), min_size=world, max_size=world))
        slot_src = rows if draw(st.booleans()) else np.array(rows, dtype=object)
        if draw(st.booleans()) and all(0 <= v < 2**64 for row in rows for v in row):
            slot_src = np.array(rows, dtype=np.uint64)
    return world, epr, slots, shapes, dtype, chunk, tile, relay, slot_src


@pytest.mark.slow
@fuzz(150)
@given(case=cases())
def test_context_inputs_give_a_clear_error_or_exact_bytes(case):
    world, epr, slots, shapes, dtype, chunk, tile, relay, slot_src = case
    try:
        layout = ExpertLayout(tuple(Member(f"m{i}", tuple(s), dtype) for i, s in enumerate(shapes)))
        plan = ReplicaPlan.make(slot_src, experts_per_rank=epr)
    except (LayoutError, PlanError) as e:
        event(f"rejected: {type(e).__name__}")
        assert_clear(e)
        return
    # the reduction's expected result, when the plan fits this Context
    want = None
    if (plan.world, plan.slots_per_rank) == (world, slots) and slots and chunk in (16, 32, 48, 64, 256, 1 << 20):
        full = build_schedule(plan, layout.weight_bytes, layout.grad_bytes, chunk_bytes=chunk, relay_mode=relay)
        gen = torch.Generator().manual_seed(11)
        init_master = [[torch.randn((epr, *m.shape), generator=gen) for m in layout.members] for _ in range(world)]
        init_replica = [[torch.randn((slots, *m.shape), generator=gen) for m in layout.members] for _ in range(world)]
        want = expected_master_grads(full, layout, plan, init_master, init_replica)

    def body(group):
        r = group.rank
        try:
            ctx = Context(
                group,
                layout,
                epr,
                slots,
                num_layers=1,
                chunk_bytes=chunk,
                tile_bytes=tile,
                relay_mode=relay,
                timeout_s=20.0,
                num_workers=2,
            )
        except Exception as e:  # noqa: BLE001 - checked below
            return "setup", e
        with ctx:
            weights, grads = masters_for(layout, r, epr)
            ctx.register_masters(0, weights, grads)
            vid = ctx.begin(0)
            # the slots, not the whole window: under the window plan check (the default) a rank that
            # refuses its plan publishes the rejection in its flags, so that its peers fail at once
            slots_of = lambda: [t.clone() for t in (*ctx.replica_weights, *ctx.replica_grads)]  # noqa: E731
            before = slots_of()
            try:
                ctx.weight_sync(vid, plan)
            except Exception as e:  # noqa: BLE001 - checked below
                assert all(torch.equal(a, b) for a, b in zip(slots_of(), before)), "bytes moved before the error"
                return "plan", e
            check_replicas(ctx, plan)  # every replica byte exact
            if want is not None:
                for m in range(len(layout.members)):
                    grads[m].copy_(init_master[r][m])
                    ctx.replica_grads[m].copy_(init_replica[r][m])
                group.barrier()
                ctx.grad_reduce(vid)
                for m in range(len(layout.members)):
                    assert torch.equal(grads[m], want[r][m]), f"rank {r} member {m}: not the ordered fp32 sum"
            else:
                ctx.end(vid)
            return "ok", None

    results = LoopbackDomain(world).run(body, timeout=120)
    event(f"{results[0][0]}{' + reduce' if want is not None and results[0][0] == 'ok' else ''}")
    assert len({kind for kind, _ in results}) == 1, results  # every rank ends the same way
    for _, e in results:
        if e is not None:
            assert_clear(e)
    if results[0][0] == "ok":  # only a plan that fits the Context and a valid chunk may succeed
        assert (plan.world, plan.slots_per_rank) == (world, slots)
