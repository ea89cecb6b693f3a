"""Contract tests: UltraEP's own behaviour, as read in its source, held by the adapter.

Upstream: github.com/Dots-Infra/UltraEP, v1.0.0 = commit 94cab099b44fffa99a82fea99e7c12d89cf65e4f.
Each test names the file it encodes.  Ranks are threads of a loopback domain.
"""

from __future__ import annotations

import pytest
import torch

from ultracomm import LoopbackDomain
from ultracomm.integrations import ultraep as ultra_ep

FC1, FC2 = 8, 4


def _manager(group, M=1, R=1, **kw):
    kw.setdefault("weight_data_dtype", torch.float32)
    return ultra_ep.Manager(group, 1, M, R, expert_fc1_numel=FC1, expert_fc2_numel=FC2, timeout_s=20, **kw)


def _register(m, layer=1):
    """Rank r's masters: expert weights r+1 (fc1) and -(r+1) (fc2), fp32 zero grads."""
    M, r = m.num_local_master_experts, m.rank
    grads = [[torch.zeros(FC1) for _ in range(M)], [torch.zeros(FC2) for _ in range(M)]]
    m.construct_local_master_ptr_pool(
        layer,
        [torch.full((FC1,), r + 1.0) for _ in range(M)],
        [torch.full((FC2,), -(r + 1.0)) for _ in range(M)],
        *grads,
    )
    return grads


# world 2, one master and one redundant slot per rank; every token goes to expert 0 (home rank 0):
# rank 0 routes 6, rank 1 routes 2.  Expert 0 gets a replica in rank 1's slot (physical id 3).
HOT = {0: [[0, -1]] * 6, 1: [[0, -1], [0, 5]]}  # -1 and 5 (>= E) are padding: not counted, not rewritten


def test_version_and_init_runtime():
    """``ultra_ep/__init__.py``: ``__version__ = "1.0.0"``; ``ultra_ep/runtime.py``: ``init_runtime(group)``
    returns the NVLink domain size (here: the ranks sharing this host's memory domain)."""
    assert ultra_ep.__version__ == "1.0.0"
    assert LoopbackDomain(3).run(lambda g: ultra_ep.init_runtime(g)) == [3, 3, 3]


def test_init_runtime_cache_does_not_outlive_its_group(monkeypatch):
    """init_runtime caches per group object; a size cached for a freed group must not answer for a
    new group that got its id (ids are reused): that rank would skip the exchange its peers wait in
    (seen in CI: ranks 1 and 2 timed out waiting for rank 0).  The reuse is forced here: rank 0's
    group finds an entry under its id that belongs to another object."""

    class Stranger:
        pass

    def body(g):
        if g.rank == 0:
            other = Stranger()
            ultra_ep._remember_size(other, 7)
            entry = ultra_ep._runtime_sizes.pop(id(other))
            ultra_ep._runtime_sizes[id(g)] = entry  # as if `other` had lived at g's address
        return ultra_ep.init_runtime(g)

    monkeypatch.setenv("ULTRACOMM_TIMEOUT_S", "5")  # with the bug, ranks 1 and 2 time out waiting for rank 0
    assert LoopbackDomain(3).run(body, timeout=30) == [3, 3, 3]


def test_init_runtime_cache_entry_goes_with_its_group():
    class Group:
        pass

    g = Group()
    ultra_ep._remember_size(g, 5)
    assert ultra_ep._cached_size(g) == 5
    key = id(g)
    del g
    assert key not in ultra_ep._runtime_sizes
    o = object()  # not weak-referenceable: held while cached, so its id stays its own
    ultra_ep._remember_size(o, 4)
    assert ultra_ep._cached_size(o) == 4 and ultra_ep._cached_size(object()) is None
    del ultra_ep._runtime_sizes[id(o)]


def test_grad_dtype_must_be_fp32():
    """``ultra_ep/manager.py`` ``Manager.__init__``: ``check_dtype`` raises TypeError for a
    non-dtype, then ``ValueError("UltraEP currently supports only fp32 gradients")``."""

    def body(group):
        with pytest.raises(ValueError, match=r"^UltraEP currently supports only fp32 gradients$"):
            _manager(group, grad_dtype=torch.bfloat16)
        with pytest.raises(TypeError, match=r"^grad_dtype must be a torch.dtype, got str$"):
            _manager(group, grad_dtype="float32")
        return True

    assert LoopbackDomain(2).run(body) == [True, True]


def test_grad_reduce_zeroes_the_placed_replica_grads():
    """``csrc/kernels/grad_reduce.cu``: both reduce kernels ``memset_zero_tile`` every replica
    region they read (the placed replicas, ``l2p[e, 1:count]``), so a host that adds wgrads
    with ``+=`` (UltraEP README's hooks never zero) gets 1.0 per iteration, 2.0 after two --
    not 3.0 -- and a placement outlives ``grad_reduce``: a second reduce of the same layer id
    adds only what was written since (``ultra_ep/manager.py`` ``grad_reduce`` keeps no state)."""

    def body(group):
        m = _manager(group, explicitly_destroy=True)
        grads = _register(m)
        topk = torch.tensor(HOT[m.rank])
        seen = []
        for it in range(2):
            vid = m.allocate_microbatch_slot(1)
            m.update_placement_sparse(vid, topk)
            m.weight_sync(vid, async_finish=True).current_stream_wait()
            filled = [k for k in range(1) if int(m.physical_to_logical_map[vid, m.rank * 2 + 1 + k]) >= 0]
            for k in filled:  # the backward's wgrad, accumulated
                m.local_replica_fc1_grad_buffer[k] += 1.0
                m.local_replica_fc2_grad_buffer[k] += 1.0
            group.barrier()
            m.grad_reduce(vid, async_finish=True).current_stream_wait()
            seen.append(float(grads[0][0][0]))
            assert not m.local_replica_fc1_grad_buffer.any() and not m.local_replica_fc2_grad_buffer.any()
        # the placement is still there: reduce the same layer id again
        for k in filled:
            m.local_replica_fc2_grad_buffer[k] += 0.5
        group.barrier()
        m.grad_reduce(vid)
        seen.append(float(grads[1][0][0]))
        m.destroy()
        return seen

    # expert 0's master on rank 0: 1.0, then 2.0, then fc2 = 2.0 + 0.5; rank 1's master got nothing
    assert LoopbackDomain(2).run(body) == [[1.0, 2.0, 2.5], [0.0, 0.0, 0.0]]


def test_quota_prefixes_and_reroute_sparse():
    """``csrc/kernels/placement.cu`` (``quota_placement_solve_kernel``): ``quota_prefix[e, j]`` =
    inclusive prefix of ``quota[e, :]`` over the instances (~l.1326); ``rank_quota_prefix[e, j]`` =
    inclusive prefix of this rank's tokens per instance, locality first: each instance's host
    rank fills it from its own tokens, the rest of a rank's tokens spread over the remote
    capacity (~l.1440-1480); both 0 past the instance count (``init_master_placement`` memsets).
    ``csrc/kernels/load_compute.cu``: ``update_placement_sparse`` counts ids in ``[0, E)`` only.
    ``csrc/kernels/reroute.cu`` (``sparse_quota_reroute_kernel``): in place, the ``j``-th entry
    of expert ``e`` goes to ``l2p[e, i]``, ``i`` = number of prefixes ``<= j`` (clamped to
    count - 1); ids outside ``[0, E)`` stay.

    Worked by hand: expert 0 has 8 tokens (6 on rank 0, 2 on rank 1), two instances (master on
    rank 0, physical 0; replica on rank 1, physical 3), quota [4, 4]: rank 0 fills its master
    with 4 and sends 2 to the replica, rank 1 keeps its 2 local."""

    def body(group):
        m = _manager(group)
        _register(m)
        vid = m.allocate_microbatch_slot(1)
        topk = torch.tensor(HOT[m.rank])
        m.update_placement_sparse(vid, topk)
        out = [
            m.physical_to_logical_map[vid].tolist(),
            m.logical_to_physical_map[vid].tolist(),
            m.logical_replica_counts[vid].tolist(),
            m.get_quota_tensor(vid).tolist(),
            m.get_quota_prefix_tensor(vid).tolist(),
            m.get_rank_quota_prefix_tensor(vid).tolist(),
        ]
        dense_rmap = torch.zeros(topk.shape[0], 2, dtype=torch.bool)
        for t, row in enumerate(topk.tolist()):
            for e in row:
                if 0 <= e < 2:
                    dense_rmap[t, e] = True
        assert m.reroute_sparse(vid, topk) is None  # in place
        _, emap = m.reroute(vid, dense_rmap.float(), dense_rmap)
        m.ctx.close()
        return out, topk.tolist(), [row.nonzero().flatten().tolist() for row in emap]

    (p0, t0, d0), (p1, t1, d1) = LoopbackDomain(2).run(body)
    p2l, l2p, counts, quota, qprefix = [[0, -1, 1, 0], [[0, 3], [2, -1]], [2, 1], [[4, 4], [0, 0]], [[4, 8], [0, 0]]]
    assert p0[:5] == p1[:5] == [p2l, l2p, counts, quota, qprefix]
    assert p0[5] == [[4, 6], [0, 0]] and p1[5] == [[0, 2], [0, 0]]
    assert t0 == [[0, -1]] * 4 + [[3, -1]] * 2 and t1 == [[3, -1], [3, 5]]
    # the dense reroute sends each token to the same physical expert
    assert d0 == [[0]] * 4 + [[3]] * 2 and d1 == [[3], [3]]


def test_reroute_backend_and_topk_checks():
    """``ultra_ep/manager.py`` ``reroute``: ``backend != "cuda"`` raises
    ``ValueError("Only backend='cuda' is supported; CPU reroute has been removed")``;
    ``csrc/ultra_ep.cpp``: sparse calls take int64 ``[T, K]`` ids."""

    def body(group):
        m = _manager(group)
        _register(m)
        vid = m.allocate_microbatch_slot(1)
        m.update_placement_sparse(vid, torch.tensor(HOT[m.rank]))
        rmap = torch.ones(2, 2, dtype=torch.bool)
        with pytest.raises(ValueError, match=r"^Only backend='cuda' is supported; CPU reroute has been removed$"):
            m.reroute(vid, rmap.float(), rmap, backend="cpu")
        with pytest.raises(
            ValueError,
            match=r"reroute_sparse: topk_ids must be an int64 \[tokens, top_k\] tensor, "
            r"got torch.int32 \[2, 1\]",
        ):
            m.reroute_sparse(vid, torch.zeros(2, 1, dtype=torch.int32))
        m.ctx.close()
        return True

    assert LoopbackDomain(2).run(body) == [True, True]


def test_settings_and_event_handle():
    """``ultra_ep/manager.py``: ``set_weight_sync_plan_mode`` accepts direct / adaptive /
    adaptive_relay / force_relay (case and ``_`` ignored) and raises ``ValueError("plan_mode must
    be one of: direct, adaptive_relay, force_relay")``; ``set_grad_reduce_deterministic``;
    ``ultra_ep/event.py``: ``EventHandle(event, extra_tensors)``."""

    def body(group):
        m = _manager(group)
        modes = []
        for mode in ("Force_Relay", "direct", "adaptive_relay"):
            m.set_weight_sync_plan_mode(mode)
            modes.append(m.ctx.config.relay_mode)
        with pytest.raises(ValueError, match=r"^plan_mode must be one of: direct, adaptive_relay, force_relay$"):
            m.set_weight_sync_plan_mode("tree")
        m.set_grad_reduce_deterministic(False)
        assert m.grad_reduce_deterministic is False
        with pytest.raises(
            RuntimeError,
            match=r"get_comm_stream\(\) has no CUDA stream to return: .* 'host' is not "
            r"stream-ordered",
        ):
            m.get_comm_stream()
        m.ctx.close()
        return modes

    assert LoopbackDomain(2).run(body) == [["force", "off", "auto"]] * 2
    t = torch.zeros(1)
    h = ultra_ep.EventHandle(None, extra_tensors=(t,))
    assert h.extra_tensors[0] is t
    h.current_stream_wait()


def test_joined_buffers_raise_when_fc1_leaves_a_gap():
    """``ultra_ep/manager.py``: ``local_replica_{weight,grad}_buffer`` are ``[R, fc1 + fc2]``; ultracomm
    starts fc2 at the next 16-byte boundary, so with an unaligned fc1 there is no such view:
    a clear error instead of ``None``."""

    def body(group):
        m = ultra_ep.Manager(group, 1, 1, 2, expert_fc1_numel=6, expert_fc2_numel=4, timeout_s=20)
        with pytest.raises(
            ValueError,
            match=r"local_replica_weight_buffer .* expert_fc1_numel \* 2 bytes .* use "
            r"local_replica_fc1_weight_buffer and local_replica_fc2_weight_buffer",
        ):
            m.local_replica_weight_buffer
        with pytest.raises(ValueError, match=r"local_replica_grad_buffer .* expert_fc1_numel \* 4 bytes"):
            m.local_replica_grad_buffer
        m.ctx.close()
        inference = ultra_ep.Manager(
            group, 1, 1, 2, expert_fc1_numel=8, expert_fc2_numel=4, is_train=False, timeout_s=20
        )
        assert inference.local_replica_grad_buffer is None and inference.local_replica_fc1_grad_buffer is None
        assert inference.local_replica_weight_buffer.shape == (2, 12)
        inference.ctx.close()
        return True

    assert LoopbackDomain(2).run(body) == [True, True]


def test_fp8_weights_and_scales_are_multicast():
    """``ultra_ep/manager.py`` / ``csrc/ultra_ep.cpp``: with ``expert_fc{1,2}_weight_scale_numel``
    the replicas get their scales too: ``local_replica_fc{1,2}_weight_scale_buffer`` ``[R, numel]``
    in ``weight_scale_dtype`` and ``local_replica_weight_scale_buffer_raw`` uint8 ``[R, stride]``
    (fc1's scales, fc2's at the next 16-byte boundary, stride rounded up to 16: 12 B + 8 B ->
    32); without scales they are ``[R, 0]``; scales are required when the numels are non-zero."""
    fp8 = torch.float8_e4m3fn

    def body(group):
        r = group.rank
        m = ultra_ep.Manager(
            group,
            1,
            1,
            1,
            expert_fc1_numel=32,
            expert_fc2_numel=16,
            weight_data_dtype=fp8,
            expert_fc1_weight_scale_numel=3,
            expert_fc2_weight_scale_numel=2,
            timeout_s=20,
        )
        assert m.local_replica_fc1_weight_scale_buffer.shape == (1, 3)
        assert m.local_replica_fc2_weight_scale_buffer.dtype == torch.float32
        assert m.local_replica_weight_scale_buffer_raw.shape == (1, 32)
        w1, w2 = [torch.full((32,), r + 1.0).to(fp8)], [torch.full((16,), -(r + 1.0)).to(fp8)]
        s1, s2 = [torch.tensor([0.5, 0.25, r + 2.0])], [torch.tensor([r + 4.0, 8.0])]
        g = [[torch.zeros(32)], [torch.zeros(16)]]
        with pytest.raises(ValueError, match=r"weight scale tensors are required when scale numel is non-zero"):
            m.construct_local_master_ptr_pool(1, w1, w2, *g)
        m.construct_local_master_ptr_pool(1, w1, w2, *g, s1, s2)
        vid = m.allocate_microbatch_slot(1)
        m.update_placement_sparse(vid, torch.tensor(HOT[r]))
        m.weight_sync(vid)
        out = None
        if r == 1:  # holds expert 0's replica (rank 0's masters)
            raw = m.local_replica_weight_scale_buffer_raw[0]
            out = (
                m.local_replica_fc1_weight_buffer[0].float().tolist(),
                m.local_replica_fc2_weight_buffer[0].float().tolist(),
                m.local_replica_fc1_weight_scale_buffer[0].tolist(),
                m.local_replica_fc2_weight_scale_buffer[0].tolist(),
                raw[:12].view(torch.float32).tolist(),
                raw[16:24].view(torch.float32).tolist(),
            )
        m.ctx.close()
        plain = ultra_ep.Manager(group, 1, 1, 1, expert_fc1_numel=32, expert_fc2_numel=16, timeout_s=20)
        assert plain.local_replica_fc1_weight_scale_buffer.shape == (1, 0)
        assert plain.local_replica_weight_scale_buffer_raw.shape == (1, 0)
        plain.ctx.close()
        return out

    _, got = LoopbackDomain(2).run(body)
    assert got == ([1.0] * 32, [-1.0] * 16, [0.5, 0.25, 2.0], [4.0, 8.0], [0.5, 0.25, 2.0], [4.0, 8.0])
