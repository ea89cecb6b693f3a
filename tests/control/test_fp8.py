"""FP8 runtime copies (issue 37): the layout's FP8 and scale members, their bytes multicast
unconverted, gradients reduced only for the members that carry one; the quantizer."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, ReplicaPlan
from ultracomm.errors import LayoutError, RegistrationError
from ultracomm.fp8 import MX_BLOCK, dequantize, quantize, quantized_weight, scale_shape

E4M3, E5M2, E8M0 = torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e8m0fnu


# ------------------------------------------------------------------ layout
def test_fp8_swiglu_layout_halves_the_bytes_of_bf16():
    H, I = 256, 128
    bf16 = ExpertLayout.swiglu(H, I, torch.bfloat16)
    for scaling, sdtype, per in (("mxfp8", E8M0, MX_BLOCK), ("row", torch.float32, None)):
        lay = ExpertLayout.fp8_swiglu(H, I, scaling=scaling)
        assert lay.names == ("fc1", "fc1_scale", "fc2", "fc2_scale")
        fc1, s1, fc2, s2 = lay.members
        assert (fc1.dtype, fc1.shape, fc1.master_dtype, fc1.grad) == (E4M3, (2 * I, H), torch.bfloat16, True)
        assert (s1.dtype, s1.grad, s1.master_dtype) == (sdtype, False, None)
        assert s1.shape == ((2 * I, H // per) if per else (2 * I, 1))
        assert s2.shape == ((H, I // per) if per else (H, 1))
        fp8_bytes = lay.weight_sizes[0] + lay.weight_sizes[2]
        assert 2 * fp8_bytes == bf16.weight_sizes[0] + bf16.weight_sizes[1]
        # gradients: fp32 for fc1 and fc2 only; the scales have no bytes in a grad slot
        assert lay.grad_sizes == (2 * I * H * 4, 0, H * I * 4, 0)
        assert lay.grad_offsets[2] == 2 * I * H * 4 and lay.grad_bytes == 3 * I * H * 4
        assert lay.grad_members == (0, 2) and lay.fp8


@pytest.mark.parametrize(
    "member, match",
    [
        (lambda: Member("w", (4, 32), E4M3, master_dtype=torch.float64), "master_dtype .* must be one of"),
        (lambda: Member("s", (4, 1), torch.float32, grad=False, master_dtype=torch.float32), "has no master"),
        (lambda: Member("w", (4, 32), torch.bfloat16, master_dtype=torch.float32), "differs from its dtype"),
        (lambda: Member("w", (4, 32), torch.bfloat16, grad=1), "grad must be True or False"),
    ],
)
def test_member_errors(member, match):
    with pytest.raises(LayoutError, match=match):
        member()


def test_fp8_swiglu_needs_blocks_of_32():
    # an FP8 member without master_dtype is allowed (grads registered straight with a Context, as UltraEP's)
    assert Member("w", (4, 32), E4M3).grad_master_dtype is None
    assert Member("w", (4, 32), E4M3, master_dtype=torch.bfloat16).grad_master_dtype == torch.bfloat16
    with pytest.raises(LayoutError, match="multiple of 32"):
        ExpertLayout.fp8_swiglu(48, 16)
    with pytest.raises(LayoutError, match="scaling must be one of"):
        ExpertLayout.fp8_swiglu(64, 32, scaling="tensor")


# ------------------------------------------------------------------ quantizer
@pytest.mark.parametrize("fp8", [E4M3, E5M2])
@pytest.mark.parametrize("scaling", ["mxfp8", "row"])
def test_quantize_round_trip_within_fp8_precision(fp8, scaling):
    g = torch.Generator().manual_seed(3)
    w = torch.randn(16, 96, generator=g) * torch.logspace(-3, 3, 96)  # blocks of very different magnitude
    w[3, :32] = 0  # an all-zero block
    q, s = quantize(w.bfloat16(), fp8, scaling)
    sshape, sdtype = scale_shape(tuple(w.shape), scaling)
    assert q.dtype == fp8 and q.shape == w.shape and s.dtype == sdtype and tuple(s.shape) == sshape
    deq = dequantize(q, s)
    ref = w.bfloat16().float()
    fi = torch.finfo(fp8)
    mant = {E4M3: 3, E5M2: 2}[fp8]
    block = w.shape[1] // s.shape[1]
    scale = s.float().repeat_interleave(block, dim=1)
    # round to nearest: half an ulp of the value, or half the smallest subnormal step (times its scale)
    bound = torch.maximum(ref.abs() * 2.0 ** -(mant + 1), scale * fi.smallest_normal * 2.0 ** -(mant + 1))
    assert ((deq - ref).abs() <= bound * (1 + 1e-6)).all()
    assert (q.float().abs() <= fi.max).all() and torch.equal(deq[3, :32], torch.zeros(32))
    if scaling == "mxfp8":  # powers of two, each the smallest that fits its block
        blocks = ref.reshape(16, -1, block).abs().amax(-1)
        assert torch.equal(torch.exp2(torch.log2(s.float()).round()), s.float())
        nz = blocks > 0
        assert (blocks[nz] <= s.float()[nz] * fi.max).all() and (blocks[nz] > s.float()[nz] * fi.max / 2).all()


def test_quantized_weight_passes_its_gradient_straight_to_the_master():
    master = torch.randn(8, 64, dtype=torch.bfloat16, requires_grad=True)
    q, s = quantize(master)
    w = quantized_weight(master, q, s)
    assert w.dtype == torch.bfloat16 and torch.equal(w, dequantize(q, s).bfloat16())
    up = torch.randn(8, 64, dtype=torch.bfloat16)
    (w * up).sum().backward()
    assert torch.equal(master.grad, up)


def test_quantize_into_registered_tensors():
    w = torch.randn(4, 64)
    out = (torch.empty(4, 64, dtype=E4M3), torch.empty(4, 2, dtype=E8M0))
    q, s = quantize(w, out=out)
    assert q is out[0] and s is out[1]
    q2, s2 = quantize(w)
    assert torch.equal(q.view(torch.uint8), q2.view(torch.uint8)) and torch.equal(
        s.view(torch.uint8), s2.view(torch.uint8)
    )


# ------------------------------------------------------------------ Context: multicast and reduce
H, I, EPR, SLOTS = 64, 32, 2, 2


def _bytes(shape, dtype, seed):
    """Any bit pattern of ``dtype`` (NaNs and infinities included): bytes must move unconverted."""
    g = torch.Generator().manual_seed(seed)
    n = int(np.prod(shape)) * torch.empty((), dtype=dtype).element_size()
    return torch.randint(0, 256, (n,), generator=g, dtype=torch.uint8).view(dtype).reshape(shape)


def _fp8_masters(layout, rank, seed=0):
    weights = [
        torch.stack([_bytes(m.shape, m.dtype, 7919 * (rank * EPR + j) + 31 * i + seed) for j in range(EPR)])
        for i, m in enumerate(layout.members)
    ]
    grads = [torch.zeros((EPR, *m.shape)) if m.grad else None for m in layout.members]
    return weights, grads


def _replica_grads(layout, rank, slots):
    """Per member with a gradient, ``[slots, *shape]`` fp32 values (None for the scales)."""
    g = torch.Generator().manual_seed(40 + rank)
    return [torch.randn((slots, *m.shape), generator=g) if m.grad else None for m in layout.members]


@pytest.mark.parametrize("scaling", ["mxfp8", "row"])
def test_fp8_members_multicast_bit_exactly_and_reduce_like_plain_members(scaling):
    """Every byte of the FP8 weights and their scales reaches the replicas unchanged; the grads
    reduce into the masters bit-for-bit as those of a layout of plain fp32 members (same
    shapes, same grad offsets) do; the scale members have no grad bytes to move."""
    world = 4
    fp8 = ExpertLayout.fp8_swiglu(H, I, scaling=scaling)
    plain = ExpertLayout((Member("fc1", (2 * I, H), torch.float32), Member("fc2", (H, I), torch.float32)))
    assert [fp8.grad_offsets[i] for i in fp8.grad_members] == list(plain.grad_offsets)
    slot_src = np.array([[2, 5], [0, 6], [0, 3], [0, 1]], np.int32)  # expert 0 on three ranks: a relay tree
    plan = ReplicaPlan.make(slot_src, experts_per_rank=EPR)

    def body(group):
        out = {}
        for name, lay in (("fp8", fp8), ("plain", plain)):
            with Context(
                group,
                lay,
                EPR,
                SLOTS,
                num_layers=1,
                max_microbatches=1,
                relay_mode="force",
                chunk_bytes=4096,
                tile_bytes=1024,
                num_workers=2,
                timeout_s=60.0,
            ) as ctx:
                weights, grads = _fp8_masters(lay, ctx.rank)
                ctx.register_masters(0, weights, grads)
                vid = ctx.begin(0)
                ctx.weight_sync(vid, plan)
                got = [[ctx.replica_weights[m][s].clone() for m in range(len(lay.members))] for s in range(SLOTS)]
                assert [g is None for g in ctx.replica_grads] == [not m.grad for m in lay.members]
                rg = _replica_grads(fp8, ctx.rank, SLOTS)
                ctx.grad_reduce(vid, grads=[rg[i] for i in fp8.grad_members] if lay is plain else rg)
                out[name] = (got, [g.clone() for g in grads if g is not None])
        return out

    results = LoopbackDomain(world).run(body)
    for r, res in enumerate(results):
        got, _ = res["fp8"]
        for s, e in enumerate(slot_src[r].tolist()):
            if e < 0:
                continue
            want, _ = _fp8_masters(fp8, e // EPR)
            for m, mem in enumerate(fp8.members):
                assert got[s][m].dtype == mem.dtype
                assert torch.equal(got[s][m].view(torch.uint8), want[m][e % EPR].view(torch.uint8)), (
                    f"rank {r} slot {s} expert {e} member {mem.name}"
                )
        fp8_grads, plain_grads = res["fp8"][1], res["plain"][1]
        for a, b in zip(fp8_grads, plain_grads):
            assert torch.equal(a.view(torch.int32), b.view(torch.int32))
        # and they are the sums: each master row = its replicas' grads (fp32, any order within 1 ulp)
    want = [[torch.zeros(EPR, *fp8.members[m].shape) for m in fp8.grad_members] for _ in range(world)]
    for r in range(world):
        rg = _replica_grads(fp8, r, SLOTS)
        for s, e in enumerate(slot_src[r].tolist()):
            if e >= 0:
                for k, m in enumerate(fp8.grad_members):
                    want[e // EPR][k][e % EPR] += rg[m][s]
    for r in range(world):
        for a, b in zip(results[r]["fp8"][1], want[r]):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-6)


def test_fp8_registration_errors():
    lay = ExpertLayout.fp8_swiglu(H, I)

    def body(group):
        with Context(group, lay, EPR, SLOTS, num_layers=1, max_microbatches=1, timeout_s=30.0) as ctx:
            weights, grads = _fp8_masters(lay, ctx.rank)
            with pytest.raises(
                RegistrationError,
                match=r"grads\['fc1_scale'\]: member 'fc1_scale' carries no "
                r"gradient \(grad=False\); pass None",
            ):
                ctx.register_masters(0, weights, [grads[0], torch.zeros(EPR, 2 * I, 2), grads[2], None])
            with pytest.raises(RegistrationError, match=r"grads\['fc2'\]: member 'fc2' carries a gradient"):
                ctx.register_masters(0, weights, [grads[0], None, None, None])
            bad = list(weights)
            bad[1] = torch.zeros(EPR, 2 * I, 2, dtype=torch.uint8)
            with pytest.raises(RegistrationError, match=r"weights\['fc1_scale'\]: expected dtype torch.float8_e8m0fnu"):
                ctx.register_masters(0, bad, grads)
            ctx.register_masters(0, weights, grads)
            vid = ctx.begin(0)
            ctx.weight_sync(vid, ReplicaPlan.make(np.full((1, SLOTS), -1, np.int32), experts_per_rank=EPR))
            with pytest.raises(ValueError, match="None for a member without a gradient"):
                ctx.grad_reduce(vid, grads=[g for g in ctx.replica_grads if g is not None])
            ctx.end(vid)

    LoopbackDomain(1).run(body)
