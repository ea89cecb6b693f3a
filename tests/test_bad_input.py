"""Bad input gets a clear error at the call that introduced it, before anything moves: sizes
that would overflow, swapped registered tensors, stale vids, peer segment names that are not
ours, hostile /dev/shm entries."""

from __future__ import annotations

import os
import sys
import re
import time
import uuid

import numpy as np
import pytest
import torch

from ultracomm import (
    ConfigError,
    Context,
    ExpertLayout,
    InputError,
    LayoutError,
    LoopbackDomain,
    Member,
    PeerError,
    PlanError,
    RegistrationError,
    ReplicaPlan,
    _core,
)
from ultracomm.env import check_window_layout
from ultracomm.windows import host_shm

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from conftest import leftover_segments, shm_segments, window_bytes  # noqa: E402
from test_context import check_replicas, make_layout, masters_for  # noqa: E402

SWAP_PLAN = ReplicaPlan.make(np.array([[1], [0]], np.int32), experts_per_rank=1)


def _two_ranks(fn, **kw):
    layout = make_layout(4, 4)

    def body(group):
        with Context(group, layout, 1, 1, num_layers=1, timeout_s=30, **kw) as ctx:
            return fn(group, ctx, layout)

    return LoopbackDomain(2).run(body, timeout=120)


# ------------------------------------------------------------------ sizes


def test_chunk_that_would_overflow_the_chunk_count_is_rejected_in_the_context_call():
    with pytest.raises(ConfigError, match=r"chunk_bytes=18446744073709518848 is invalid: .*at most 1099511627776"):
        Context(
            LoopbackDomain(1).group(0),
            make_layout(4, 4),
            1,
            1,
            num_layers=1,
            chunk_bytes=2**64 - 32768,
            tile_bytes=32768,
        )


def test_window_layout_check_catches_chunks_that_do_not_cover_the_slot():
    good = _core.window_layout(2, 1000, 2000, 256)
    check_window_layout(good)
    for bad in ({**good, "weight_chunks": 0}, {**good, "grad_chunks": 7}):  # 7 * 256 < 2000
        with pytest.raises(ConfigError, match="chunks, which do not cover it"):
            check_window_layout(bad)
    with pytest.raises(ConfigError, match="weights region overruns"):
        check_window_layout({**good, "grads_off": good["weights_off"]})


@pytest.mark.parametrize(
    "shape, why",
    [
        ((3.7, 2), "shape must be a tuple of ints, got (3.7, 2)"),
        ((True, 2), "shape must be a tuple of ints"),
        ((1 << 39, 2), "at most 1099511627776 (1 TiB)"),
        ((1 << 62, 1 << 62), "at most 1099511627776 (1 TiB)"),
    ],
)
def test_member_shapes_are_exact_ints_within_the_window_arithmetic(shape, why):
    with pytest.raises(LayoutError) as ei:
        Member("fc1", shape, torch.bfloat16)
    assert why in str(ei.value)
    assert Member("fc1", (np.int64(3), 2), torch.bfloat16).shape == (3, 2)


def test_layout_too_large_in_total_is_rejected():
    big = Member("a", (1 << 37,), torch.float32)  # 512 GiB, and 512 GiB + 64 B: just over 1 TiB together
    with pytest.raises(LayoutError, match=r"at most 1099511627776 \(1 TiB\) each"):
        ExpertLayout((big, Member("b", ((1 << 37) + 16,), torch.float32)))


@pytest.mark.parametrize(
    "kw, why",
    [
        (dict(experts_per_rank=True), "experts_per_rank must be an int in [1, 2147483647], got True"),
        (dict(slots_per_rank=10**6), "slots_per_rank must be an int in [0, 100000], got 1000000"),
        (dict(num_layers=2.0), "num_layers must be an int in [1, 1048576], got 2.0"),
        (dict(node_of=[0, 5]), "node_of must list, for each of the 2 ranks, an int node index in [0, 2)"),
        (dict(node_of=[0, 0.5]), "node_of must list"),
        (dict(node_of=5), "node_of must list"),  # was a TypeError from list(5)
    ],
)
def test_context_arguments_out_of_range(kw, why):
    def body(group):  # only rank 0 passes the bad argument
        args = {**dict(experts_per_rank=1, slots_per_rank=1, num_layers=1), **({} if group.rank else kw)}
        with pytest.raises(PeerError if group.rank else ConfigError) as ei:
            Context(group, make_layout(4, 4), timeout_s=30, **args)
        return str(ei.value)

    msgs = LoopbackDomain(2).run(body)
    assert why in msgs[0] and why in msgs[1] and "ranks [0] failed" in msgs[1]  # rank 1 names rank 0's error


@pytest.mark.parametrize(
    "slot_src, why",
    [
        (
            np.array([[2**64 - 1], [0]], np.uint64),
            "slot_src has values outside the int32 range (largest 18446744073709551615)",
        ),
        ([[2**64 - 1], [0]], "slot_src has values outside the int32 range"),
        (torch.tensor([[2**40], [0]]), "slot_src has values outside the int32 range"),
    ],
)
def test_plan_values_that_would_wrap_are_rejected(slot_src, why):
    with pytest.raises(PlanError) as ei:
        ReplicaPlan.make(slot_src, experts_per_rank=1)
    assert why in str(ei.value)


# ------------------------------------------------------------------ registration and vids


def test_weights_only_registration_syncs_and_refuses_grad_reduce():
    def fn(group, ctx, layout):
        weights, _ = masters_for(layout, ctx.rank, 1)
        ctx.register_masters(0, weights, None)
        vid = ctx.begin(0)
        ctx.weight_sync(vid, SWAP_PLAN)
        check_replicas(ctx, SWAP_PLAN)
        with pytest.raises(RegistrationError, match="layer 0 was registered without grads"):
            ctx.grad_reduce(vid)
        ctx.end(vid)
        return True

    assert _two_ranks(fn) == [True, True]


@pytest.mark.parametrize("swap", ["data", "set_", "resize", "grad"])
def test_swapped_registered_tensor_is_named_before_the_op(swap):
    def fn(group, ctx, layout):
        weights, grads = masters_for(layout, ctx.rank, 1)
        ctx.register_masters(0, weights, grads)
        vid = ctx.begin(0)
        ctx.weight_sync(vid, SWAP_PLAN)
        if group.rank == 1:
            if swap == "data":
                weights[1].data = weights[1].clone()
            elif swap == "set_":
                weights[1].set_(torch.zeros_like(weights[1]))
            elif swap == "resize":
                weights[1].untyped_storage().resize_(0)
            else:
                grads[0].data = grads[0].clone()
        before = window_bytes(ctx)
        member = "grads['fc1']" if swap == "grad" else "weights['fc2']"
        if group.rank == 1:
            with pytest.raises(
                RegistrationError, match=rf"layer 0: registered tensor {re.escape(member)} no longer has"
            ):
                ctx.grad_reduce(vid) if swap == "grad" else ctx.weight_sync(vid, SWAP_PLAN)
        elif swap != "grad":  # the plan agreement tells rank 0 at once
            with pytest.raises(ValueError, match=r"ranks \[1\] rejected their plan .*registered tensor"):
                ctx.weight_sync(vid, SWAP_PLAN)
        assert torch.equal(window_bytes(ctx), before)
        return True

    assert _two_ranks(fn, plan_check="agree") == [True, True]


def test_stale_vid_is_rejected_after_its_slot_is_reused():
    def fn(group, ctx, layout):
        ctx.register_masters(0, *masters_for(layout, ctx.rank, 1))
        old = ctx.begin(0)
        ctx.end(old)
        new = ctx.begin(0)  # the same micro-batch slot, a new vid
        assert new != old
        with pytest.raises(ValueError, match=rf"vid {old} is not in flight: it was released"):
            ctx.weight_sync(old, SWAP_PLAN)
        with pytest.raises(ValueError, match=r"vid 12345 is not in flight: it was never returned by begin"):
            ctx.end(12345)
        ctx.weight_sync(new, SWAP_PLAN)
        check_replicas(ctx, SWAP_PLAN)
        ctx.end(new)
        return True

    assert _two_ranks(fn) == [True, True]


def test_register_masters_rejects_non_sequences():
    def fn(group, ctx, layout):
        weights, _ = masters_for(layout, ctx.rank, 1)
        with pytest.raises(RegistrationError, match=r"grads must be None or a list \(one entry per member"):
            ctx.register_masters(0, weights, 5)
        with pytest.raises(RegistrationError, match=r"weights must be a list \(one entry per member"):
            ctx.register_masters(0, None)
        return True

    assert _two_ranks(fn) == [True, True]


def test_bad_arguments_are_ultracomm_errors_and_leave_the_context_usable():
    """Each of these escaped as a builtin (ValueError, TypeError, AttributeError, a C++-side
    ValueError without prefix); grads on the meta device passed the check and failed in the
    operation queue, breaking the Context for good (the peer then timed out)."""

    def fn(group, ctx, layout):
        ctx.register_masters(0, *masters_for(layout, ctx.rank, 1))
        vid = ctx.begin(0)
        ctx.weight_sync(vid, SWAP_PLAN)
        before = window_bytes(ctx)
        if group.rank == 0:
            with pytest.raises(InputError, match=r"^ultracomm: layer -1 is out of range 0\.\.0$"):
                ctx.begin(-1)
            with pytest.raises(InputError, match=r"^ultracomm: vid 'x' is not in flight; get one from begin"):
                ctx.restore("x")
            with pytest.raises(PlanError, match=r"^ultracomm: plan must be a ReplicaPlan, got str"):
                ctx.schedule_for("x")
            three = ReplicaPlan.make(np.array([[1], [0], [-1]], np.int32), experts_per_rank=1)
            with pytest.raises(PlanError, match=r"^ultracomm: plan is for world 3, .*this Context has world 2"):
                ctx.schedule_for(three)
            with pytest.raises(PlanError, match=r"^ultracomm: set_plan takes a ReplicaPlan, got ndarray"):
                ctx.set_plan(vid, np.array([[1], [0]]))
            rg = ctx.replica_grads
            for grads, why in (
                (5, "grads must be a list of one .* tensor per member .*; got int"),
                ([g.double() for g in rg], r"grads must be one .* torch.float32 tensor per member"),
                ([g.to("meta") for g in rg], r"grads\[0\] is on meta, but the replica grad slots .* are on cpu"),
            ):
                with pytest.raises(InputError, match="^ultracomm: " + why):
                    ctx.grad_reduce(vid, grads=grads, release=False)
            assert torch.equal(window_bytes(ctx), before)
        ctx.grad_reduce(vid)  # the Context still works
        return True

    assert _two_ranks(fn) == [True, True]


def test_registered_grads_that_overlap_are_refused():
    """grad_reduce adds into the master grads: a grad aliasing another grad took two members'
    reductions into one memory, silently."""

    def fn(group, ctx, layout):
        weights, grads = masters_for(layout, ctx.rank, 1)
        aliased = grads[0].view(-1)[: grads[1].numel()].view(grads[1].shape)
        with pytest.raises(RegistrationError, match=r"^ultracomm: grads\['fc2'\] overlaps grads\['fc1'\] in memory"):
            ctx.register_masters(0, weights, [grads[0], aliased])
        per_expert = [[grads[0][0]], [grads[1][0]]]  # per-expert lists are checked the same way
        per_expert[1][0] = grads[0][0].view(-1)[:4]
        with pytest.raises(RegistrationError, match=r"grads\['fc2'\]\[0\] overlaps grads\['fc1'\]\[0\]"):
            ctx.register_masters(0, weights, per_expert)
        return True

    assert _two_ranks(fn) == [True, True]


def test_plan_inputs_on_the_meta_device_and_messages_carry_the_prefix():
    with pytest.raises(PlanError, match=r"^ultracomm: slot_src is a meta tensor \(it holds no values\)"):
        ReplicaPlan.make(torch.zeros(2, 1, dtype=torch.int32, device="meta"), experts_per_rank=1)
    with pytest.raises(PlanError, match=r"^ultracomm: map_home_expert_to_spare is a meta tensor"):
        ReplicaPlan.from_echo_map(torch.zeros(2, 2, dtype=torch.bool, device="meta"), world=2)
    with pytest.raises(PlanError, match=r"^ultracomm: slot_src\[0, 0\] = 99 is out of range"):
        ReplicaPlan.make(np.array([[99], [0]]), experts_per_rank=1)


# ------------------------------------------------------------------ host_shm names and /dev/shm


@pytest.mark.skipif(not os.path.isdir(host_shm.SHM_DIR), reason="needs /dev/shm")
@pytest.mark.parametrize("bad", ["../../tmp/ultracomm-escape", "ultracomm-1-0123456789ab-r0", "", None, 7])
def test_peer_segment_names_that_ultracomm_did_not_generate_are_rejected(monkeypatch, tmp_path, bad):
    target = tmp_path / "victim"
    target.write_bytes(b"keep")
    real = host_shm.segment_name

    def named(rank):  # rank 1 sends `bad` (for rank 1, "...-r0" is the wrong rank)
        if rank != 1:
            return real(rank)
        return str(target) if bad == "../../tmp/ultracomm-escape" else bad

    monkeypatch.setattr(host_shm, "segment_name", named)
    before = shm_segments()

    def body(group):
        with pytest.raises((ValueError, PeerError), match=r"sent host_shm segment name .* refusing to open it"):
            Context(group, make_layout(4, 4), 1, 1, num_layers=1, window="host_shm", timeout_s=30)
        return True

    assert LoopbackDomain(2).run(body, timeout=60) == [True, True]
    assert target.read_bytes() == b"keep"
    assert not leftover_segments(before, {os.getpid()})


def test_sweep_skips_what_it_does_not_own_or_cannot_parse(tmp_path):
    dead = 2**22 + 12345  # above Linux's pid_max: no such process
    old = time.time() - 3600
    entries = {
        "stale": tmp_path / f"ultracomm-{dead}-0123456789ab-r0",  # removed
        "huge_pid": tmp_path / "ultracomm-9999999999-0123456789ab-r0",  # > 2^31: skipped, no OverflowError
        "too_many_digits": tmp_path / f"ultracomm-{'9' * 30}-0123456789ab-r0",
        "directory": tmp_path / f"ultracomm-{dead}-0123456789ac-r0",
        "symlink": tmp_path / f"ultracomm-{dead}-0123456789ad-r0",
        "other_user": tmp_path / f"ultracomm-{dead}-0123456789ae-r0",
        "not_ours": tmp_path / "ultracomm-x",
    }
    for key, path in entries.items():
        if key == "directory":
            path.mkdir()
            (path / "inside").write_bytes(b"x")
        elif key == "symlink":
            (tmp_path / "link-target").write_bytes(b"x")
            path.symlink_to(tmp_path / "link-target")
        else:
            path.write_bytes(b"x")
        os.utime(path, (old, old), follow_symlinks=False)
    other_uid = os.getuid() + 1
    try:
        os.chown(entries["other_user"], other_uid, -1)
    except PermissionError:  # not root: the file is ours; that case is covered by the uid check below
        other_uid = None
    removed = host_shm.sweep_stale_segments(str(tmp_path))
    assert removed == [entries["stale"].name]
    kept = [k for k, p in entries.items() if os.path.lexists(p)]
    expect = ["huge_pid", "too_many_digits", "directory", "symlink", "not_ours"]
    if other_uid is not None:
        expect.insert(4, "other_user")
    assert kept == expect


@pytest.mark.skipif(not os.path.isdir(host_shm.SHM_DIR), reason="needs /dev/shm")
def test_hostile_dev_shm_entries_do_not_stop_host_shm_contexts():
    old = time.time() - 3600
    tag = uuid.uuid4().hex[:12]
    paths = [
        os.path.join(host_shm.SHM_DIR, f"ultracomm-9999999999-{tag}-r0"),
        os.path.join(host_shm.SHM_DIR, f"ultracomm-{2**22 + 7}-{tag}-r1"),
    ]
    os.mkdir(paths[1])  # a directory with a well-formed, stale name
    try:
        with open(paths[0], "wb") as f:
            f.write(b"x")
        for p in paths:
            os.utime(p, (old, old))
        before = shm_segments()

        def body(group):
            with Context(group, make_layout(4, 4), 1, 1, num_layers=1, window="host_shm", timeout_s=30) as ctx:
                ctx.register_masters(0, *masters_for(make_layout(4, 4), ctx.rank, 1))
                vid = ctx.begin(0)
                ctx.weight_sync(vid, SWAP_PLAN)
                check_replicas(ctx, SWAP_PLAN)
                ctx.end(vid)
            return True

        assert LoopbackDomain(2).run(body, timeout=60) == [True, True]
        assert not leftover_segments(before, {os.getpid()})
        assert os.path.exists(paths[0]) and os.path.isdir(paths[1])  # not ours to remove
    finally:
        if os.path.exists(paths[0]):
            os.unlink(paths[0])
        os.rmdir(paths[1])
