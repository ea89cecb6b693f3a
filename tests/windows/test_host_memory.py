"""Page-aligned host buffers (ultracomm.host_memory) and the buffers that use them: the
``private`` replica pool and the ``p2p`` transport's receive buffers."""

from __future__ import annotations

import gc

import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.host_memory import PAGE_BYTES, page_aligned_empty, page_aligned_zeros

from conftest import hot_slot_src


@pytest.mark.parametrize("nbytes", [1, 63, PAGE_BYTES - 1, PAGE_BYTES, PAGE_BYTES + 1, 3 << 20])
def test_page_aligned_buffers_start_a_page_and_have_the_asked_size(nbytes):
    for _ in range(3):  # whatever the allocator returns this time
        t = page_aligned_empty(nbytes)
        assert t.dtype == torch.uint8 and t.shape == (nbytes,) and t.is_contiguous()
        assert t.data_ptr() % PAGE_BYTES == 0
    z = page_aligned_zeros(nbytes)
    assert z.data_ptr() % PAGE_BYTES == 0 and int(z.count_nonzero()) == 0


def test_a_page_aligned_view_keeps_its_storage():
    t = page_aligned_zeros(2 * PAGE_BYTES)
    gc.collect()  # the over-allocated tensor it was cut from is gone; its storage is not
    t[-1] = 7
    assert int(t.sum()) == 7 and t.untyped_storage().nbytes() >= 2 * PAGE_BYTES


def test_empty_size_is_a_plain_empty_tensor():
    assert page_aligned_empty(0).numel() == 0


def test_the_private_pool_and_p2p_receive_buffers_start_on_a_page():
    """The pool the p2p transport receives multicasts into, and the buffers it receives reduce
    messages into, start on a page (the kernel's socket copies are faster there: perf/README 6b)."""
    world, epr, slots = 3, 2, 2
    layout = ExpertLayout((Member("w", (300,), torch.bfloat16),), grad_dtype=torch.float32)
    plan = ReplicaPlan.make(hot_slot_src(world, slots, epr, expert=1), experts_per_rank=epr)

    def body(group):
        with Context(
            group,
            layout,
            epr,
            slots,
            num_layers=1,
            transport="p2p",
            window="private",
            chunk_bytes=256,
            tile_bytes=16,
            timeout_s=30.0,
        ) as ctx:
            master = torch.zeros((epr, 300), dtype=torch.bfloat16)
            grad = torch.zeros((epr, 300), dtype=torch.float32)
            ctx.register_masters(0, [master], [grad])
            vid = ctx.begin(0)
            ctx.weight_sync(vid, plan)
            ctx.grad_reduce(vid)
            bufs = [b for p in ctx.transport._programs.values() for b in p.buffers.values()]
            return ctx.window.local.data_ptr() % PAGE_BYTES, [b.data_ptr() % PAGE_BYTES for b in bufs]

    res = LoopbackDomain(world).run(body)
    assert all(pool == 0 for pool, _ in res)
    got = [off for _, offs in res for off in offs]
    assert got and all(off == 0 for off in got)  # some rank received a reduce message; every buffer aligned
