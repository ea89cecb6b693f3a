"""Tests for ultracomm.layout: ExpertLayout byte layout, validation and registration checks."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ultracomm.errors import LayoutError, RegistrationError, UltracommError
from ultracomm.layout import ExpertLayout, Member


def test_swiglu_sizes():
    lay = ExpertLayout.swiglu(hidden=7168, moe_inter=2048)
    assert [m.name for m in lay.members] == ["fc1", "fc2"]
    assert lay.members[0].shape == (4096, 7168) and lay.members[1].shape == (7168, 2048)
    assert lay.members[0].dtype == torch.bfloat16 and lay.grad_dtype == torch.float32
    # FACTS.md: 3 * hidden * moe_inter * 2 bytes in bf16
    assert lay.weight_bytes == 3 * 7168 * 2048 * 2
    assert lay.grad_bytes == 3 * 7168 * 2048 * 4
    assert lay.weight_offsets == (0, 2 * 2048 * 7168 * 2)
    assert lay.numel(0) == lay.numel("fc1") == 4096 * 7168
    assert lay.index_of("fc2") == 1


def test_unaligned_members_are_padded_between_not_at_end():
    lay = ExpertLayout(
        (Member("a", (3,), torch.bfloat16), Member("b", (5,), torch.float32), Member("c", (1,), torch.int8)),
        grad_dtype=torch.float16,
    )
    assert lay.weight_sizes == (6, 20, 1)
    assert lay.weight_offsets == (0, 16, 48)
    assert lay.weight_bytes == 49 and lay.weight_stride == 64
    assert lay.grad_sizes == (6, 10, 2)
    assert lay.grad_offsets == (0, 16, 32)
    assert lay.grad_bytes == 34 and lay.grad_stride == 48
    lay64 = ExpertLayout(lay.members, align=64)
    assert lay64.weight_offsets == (0, 64, 128) and lay64.weight_bytes == 129


@settings(max_examples=100, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.lists(st.integers(1, 9), min_size=1, max_size=3),
            st.sampled_from([torch.float32, torch.bfloat16, torch.int8, torch.float64]),
        ),
        min_size=1,
        max_size=5,
    ),
    st.sampled_from([16, 32, 128]),
    st.sampled_from([torch.float32, torch.bfloat16, torch.float16]),
)
def test_offsets_properties(spec, align, gdt):
    members = tuple(Member(f"m{i}", tuple(s), dt) for i, (s, dt) in enumerate(spec))
    lay = ExpertLayout(members, gdt, align)
    for offs, sizes, total in (
        (lay.weight_offsets, lay.weight_sizes, lay.weight_bytes),
        (lay.grad_offsets, lay.grad_sizes, lay.grad_bytes),
    ):
        assert offs[0] == 0
        for i in range(1, len(offs)):
            assert offs[i] % align == 0
            assert offs[i - 1] + sizes[i - 1] <= offs[i] < offs[i - 1] + sizes[i - 1] + align
        assert total == offs[-1] + sizes[-1]
    gsz = torch.empty((), dtype=gdt).element_size()
    assert lay.grad_sizes == tuple(lay.numel(i) * gsz for i in range(len(members)))


@pytest.mark.parametrize(
    "make, msg",
    [
        (lambda: ExpertLayout(()), "needs at least one member"),
        (lambda: Member("a", (0, 4), torch.float32), "all dimensions positive"),
        (lambda: Member("a", (-1,), torch.float32), "all dimensions positive"),
        (lambda: Member("a", (), torch.float32), "at least one dimension"),
        (lambda: Member("", (1,), torch.float32), "non-empty str"),
        (lambda: Member("a", (1,), "bf16"), "must be a torch.dtype"),  # type: ignore[arg-type]
        (
            lambda: ExpertLayout((Member("a", (4,), torch.float32),), grad_dtype=torch.float64),
            "grad_dtype torch.float64 is not supported; use one of torch.float32, torch.bfloat16, torch.float16",
        ),
        (lambda: ExpertLayout((Member("a", (4,), torch.float32),), align=8), "power of two in [16, 2^20], got 8"),
        (lambda: ExpertLayout((Member("a", (4,), torch.float32),), align=48), "power of two in [16, 2^20], got 48"),
        (
            lambda: ExpertLayout((Member("a", (4,), torch.float32), Member("a", (2,), torch.float32))),
            "duplicate member names ['a']",
        ),
        (lambda: ExpertLayout(("a",)), "must be Member instances"),  # type: ignore[arg-type]
        (lambda: ExpertLayout.swiglu(16, 8).index_of("fc3"), "no member named 'fc3'"),
    ],
)
def test_layout_errors(make, msg):
    with pytest.raises(LayoutError) as ei:
        make()
    assert msg in str(ei.value)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, UltracommError)


def test_from_tensors():
    w = [torch.zeros(3, 8, 4, dtype=torch.bfloat16), torch.zeros(3, 4, 4, dtype=torch.bfloat16)]
    assert ExpertLayout.from_tensors(w) == ExpertLayout.swiglu(4, 4)
    with pytest.raises(LayoutError, match="1 names for 2"):
        ExpertLayout.from_tensors(w, names=["x"])


# ----------------------------------------------------------------------------- check_tensors

LAY = ExpertLayout.swiglu(hidden=8, moe_inter=4)  # fc1 [8, 8], fc2 [8, 4], bf16; grads fp32


def good(epr: int = 3):
    w = [torch.zeros(epr, 8, 8, dtype=torch.bfloat16), torch.zeros(epr, 8, 4, dtype=torch.bfloat16)]
    g = [torch.zeros(epr, 8, 8), torch.zeros(epr, 8, 4)]
    return w, g


def test_check_tensors_ok():
    w, g = good()
    LAY.check_tensors(w, g, 3)
    LAY.check_tensors(w, None, 3)
    w0, g0 = good(0)
    LAY.check_tensors(w0, g0, 0)


def _err(w, g, epr=3) -> str:
    with pytest.raises(RegistrationError) as ei:
        LAY.check_tensors(w, g, epr)
    return str(ei.value)


def test_check_tensors_count():
    w, g = good()
    assert "weights: expected one tensor per member ['fc1', 'fc2'] (2), got 1" in _err(w[:1], g)
    assert "grads: expected one tensor per member" in _err(w, g + g)
    assert "got a single tensor" in _err(w[0], g)


def test_check_tensors_shape():
    w, g = good()
    w[1] = torch.zeros(3, 4, 8, dtype=torch.bfloat16)
    msg = _err(w, g)
    assert "weights['fc2']: expected shape [3, 8, 4]" in msg and "got [3, 4, 8]" in msg
    w, g = good()
    assert "expected shape [2, 8, 8]" in _err(w, g, epr=2)


def test_check_tensors_dtype():
    w, g = good()
    w[0] = w[0].float()
    msg = _err(w, g)
    assert "weights['fc1']: expected dtype torch.bfloat16 (member dtype), got torch.float32" in msg
    w, g = good()
    g[1] = g[1].bfloat16()
    msg = _err(w, g)
    assert "grads['fc2']: expected dtype torch.float32 (grad_dtype of the layout), got torch.bfloat16" in msg


def test_check_tensors_contiguous():
    w, g = good()
    g[0] = torch.zeros(3, 8, 8).transpose(1, 2)
    msg = _err(w, g)
    assert "grads['fc1']: tensor is not contiguous" in msg and "call .contiguous()" in msg


def test_check_tensors_alignment():
    w, g = good()
    base = torch.zeros(3 * 8 * 4 + 1, dtype=torch.bfloat16)
    w[1] = base[1:].view(3, 8, 4)  # 2-byte offset
    msg = _err(w, g)
    assert "weights['fc2']: data_ptr 0x" in msg and "not aligned to 16 bytes" in msg


def test_check_tensors_device():
    w, g = good()
    g[1] = torch.zeros(3, 8, 4, device="meta")
    msg = _err(w, g)
    assert "grads['fc2']: on device meta, but weights['fc1'] is on cpu" in msg


def test_check_tensors_not_tensor():
    w, g = good()
    w[0] = 5
    assert "weights['fc1']: expected a stacked tensor or a list of 3 per-expert tensors, got int" in _err(w, g)
    w[0] = [[0.0]] * 3  # a per-expert list whose entries are not tensors
    assert "weights['fc1'][0]: expected a torch.Tensor, got list" in _err(w, g)
    assert "experts_per_rank must be a non-negative int" in _err(*good(), epr=-1)


def test_check_tensors_per_expert_lists():
    w, g = good()
    # Megatron keeps one parameter per expert; main_grad views into a bucket may sit anywhere
    bucket = torch.zeros(1 + 3 * 8 * 8)
    per_w = [w[0][i].clone() for i in range(3)]
    per_g = [bucket[1 + 64 * i : 1 + 64 * (i + 1)].view(8, 8) for i in range(3)]
    LAY.check_tensors([per_w, w[1]], [per_g, g[1]], 3)
    assert "weights['fc1']: a per-expert list needs experts_per_rank = 3 tensors, got 2" in _err([per_w[:2], w[1]], g)
    assert "grads['fc1'][1]: expected shape [8, 8], got [8, 4]" in _err(
        w, [[per_g[0], torch.zeros(8, 4), per_g[2]], g[1]]
    )
    assert "weights['fc1'][2]: expected dtype torch.bfloat16" in _err([per_w[:2] + [per_w[2].float()], w[1]], g)
    assert "grads['fc1'][0]: tensor is not contiguous" in _err(w, [[torch.zeros(8, 8).t()] + per_g[1:], g[1]])
