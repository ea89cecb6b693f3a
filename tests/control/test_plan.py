"""Tests for ultracomm.plan: ReplicaPlan validation, identity and converters."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from ultracomm.errors import PlanError, UltracommError
from ultracomm.plan import Move, ReplicaPlan, moves_from_phy2log, plan_from_phy2log

# ----------------------------------------------------------------------------- basics


def small_plan() -> ReplicaPlan:
    # world 4, 2 experts per rank (E = 8), 2 slots per rank
    return ReplicaPlan.make([[4, -1], [0, 6], [-1, -1], [1, 2]], num_experts=8)


def test_make_basic_properties():
    p = small_plan()
    assert p.world == 4 and p.slots_per_rank == 2 and p.num_experts == 8
    assert p.experts_per_rank == 2
    assert p.slot_src.dtype == torch.int32 and p.home_of.dtype == torch.int32
    assert p.slot_src.is_contiguous() and p.slot_src.device.type == "cpu"
    assert p.home_of.tolist() == [0, 0, 1, 1, 2, 2, 3, 3]
    assert p.replicas_of(4) == [(0, 0)]
    assert p.replicas_of(3) == []
    assert p.num_replicas.tolist() == [1, 1, 1, 0, 1, 0, 1, 0]
    assert p.num_replicas.dtype == torch.int32
    assert p.local_index_of.tolist() == [0, 1, 0, 1, 0, 1, 0, 1]
    assert not p.is_empty
    assert p.experts_homed_on(2) == [4, 5]


def test_make_copies_inputs():
    src = torch.tensor([[2, -1], [0, -1]], dtype=torch.int32)
    p = ReplicaPlan.make(src, num_experts=4)
    src[0, 0] = 3
    assert p.slot_src[0, 0].item() == 2


@pytest.mark.parametrize(
    "src",
    [
        [[2, -1], [0, -1]],
        np.array([[2, -1], [0, -1]], dtype=np.int64),
        np.array([[2, -1], [0, -1]], dtype=np.int16),
        torch.tensor([[2, -1], [0, -1]], dtype=torch.int64),
    ],
)
def test_make_accepts_lists_arrays_tensors(src):
    p = ReplicaPlan.make(src, num_experts=4)
    assert p.slot_src.tolist() == [[2, -1], [0, -1]]


def test_make_infers_num_experts():
    assert ReplicaPlan.make([[-1], [-1]], experts_per_rank=3).num_experts == 6
    assert ReplicaPlan.make([[-1], [-1]], home_of=[1, 0, 0]).num_experts == 3


def test_custom_home_of_uneven():
    p = ReplicaPlan.make([[1], [0]], home_of=[0, 1, 1])
    assert p.experts_per_rank is None
    assert p.local_index_of.tolist() == [0, 0, 1]
    assert p.replicas_of(1) == [(0, 0)]


def test_empty_plan():
    p = ReplicaPlan.make(np.full((4, 3), -1), num_experts=8)
    assert p.is_empty and p.num_replicas.sum() == 0
    z = ReplicaPlan.make(torch.zeros(4, 0, dtype=torch.int32), num_experts=8)
    assert z.is_empty and z.slots_per_rank == 0
    assert z.to_echo_map().shape == (8, 0)
    assert ReplicaPlan.empty(4, 3, 8) == p
    assert ReplicaPlan.make([[], []], num_experts=2).slots_per_rank == 0


@pytest.mark.parametrize(
    "args, message",
    [
        ((-1, 1, 4), "ReplicaPlan.empty: world must be an int >= 1, got -1"),  # was numpy's ValueError
        ((True, 1, 4), "ReplicaPlan.empty: world must be an int >= 1, got True"),
        ((2, -1, 4), "ReplicaPlan.empty: slots_per_rank must be an int >= 0, got -1"),
    ],
)
def test_empty_refuses_bad_sizes(args, message):
    with pytest.raises(PlanError) as err:
        ReplicaPlan.empty(*args)
    assert str(err.value) == "ultracomm: " + message


@pytest.mark.parametrize("rank", [2, -1, 1.0])
def test_experts_homed_on_refuses_a_rank_outside_the_world(rank):
    """Before: ``[]`` (no expert is homed on a rank that does not exist), which hid a wrong rank."""
    p = ReplicaPlan.empty(2, 1, 4)
    assert p.experts_homed_on(1) == [2, 3]
    with pytest.raises(PlanError, match=rf"^ultracomm: rank {rank!r} is out of range 0\.\.1 \(world 2\)$"):
        p.experts_homed_on(rank)


def test_direct_constructor_validates():
    with pytest.raises(PlanError, match="must have dtype torch.int32"):
        ReplicaPlan(torch.zeros(2, 1, dtype=torch.int64), torch.zeros(2, dtype=torch.int32))
    with pytest.raises(PlanError, match="must be a torch.Tensor"):
        ReplicaPlan([[1]], torch.zeros(2, dtype=torch.int32))  # type: ignore[arg-type]
    with pytest.raises(PlanError, match="contiguous"):
        ReplicaPlan(torch.full((2, 4), -1, dtype=torch.int32)[:, ::2], torch.zeros(2, dtype=torch.int32))


# ----------------------------------------------------------------------------- errors


@pytest.mark.parametrize(
    "kwargs, msg",
    [
        (
            dict(slot_src=[[-1, -1]] * 3 + [[-1, 300]], num_experts=256),
            "slot_src[3, 1] = 300 is out of range: experts are 0..255 (-1 marks an empty slot)",
        ),
        (dict(slot_src=[[-2]] * 2, num_experts=4), "slot_src[0, 0] = -2 is out of range"),
        (
            dict(slot_src=[[-1], [-1], [17], [-1]], num_experts=32),
            "expert 17 is replicated onto its own home rank 2 (slot_src[2, 0]); replicas must live on other ranks",
        ),
        (dict(slot_src=[[-1, -1]] * 4 + [[5, 5]], num_experts=10), "expert 5 appears twice on rank 4 (slots 0 and 1)"),
        (dict(slot_src=[[2.0, -1.0], [0.0, -1.0]], num_experts=4), "slot_src must hold integers, got dtype float64"),
        (
            dict(slot_src=torch.tensor([[2.0, -1.0]]), num_experts=4),
            "slot_src must hold integers, got dtype torch.float32",
        ),
        (
            dict(slot_src=torch.tensor([[True]]), num_experts=4),
            "slot_src must hold integer expert ids, got a torch.bool tensor",
        ),
        (dict(slot_src=[1, 2, 3], num_experts=4), "slot_src must be 2-D [world, slots_per_rank]"),
        (dict(slot_src=np.zeros((0, 2), np.int32), num_experts=4), "needs world >= 1"),
        (dict(slot_src=[[-1], [-1]], home_of=[0, 2]), "home_of[1] = 2 is out of range: ranks are 0..1"),
        (dict(slot_src=[[-1], [-1]], home_of=[0, -1]), "home_of[1] = -1 is out of range"),
        (dict(slot_src=[[-1], [-1]], num_experts=3, home_of=[0, 1]), "home_of has 2 entries but num_experts = 3"),
        (dict(slot_src=[[-1], [-1]], home_of=[[0, 1]]), "home_of must be 1-D [E]"),
        (
            dict(slot_src=[[-1], [-1]], home_of=[0, 0, 0, 1], experts_per_rank=2),
            "rank 0 is home to 3 experts, but experts_per_rank = 2",
        ),
        (dict(slot_src=[[-1], [-1]], num_experts=5), "num_experts = 5 does not divide evenly over world = 2 ranks"),
        (
            dict(slot_src=[[-1], [-1]], num_experts=6, experts_per_rank=2),
            "each rank must host exactly experts_per_rank experts",
        ),
        (dict(slot_src=[[-1], [-1]]), "cannot infer the number of experts"),
        (dict(slot_src=[[-1], [-1]], num_experts=0), "num_experts must be a positive int"),
        (dict(slot_src=[[-1], [-1]], num_experts=2, experts_per_rank=0), "experts_per_rank must be"),
        (dict(slot_src=[[2**40]], num_experts=2), "outside the int32 range"),
    ],
)
def test_validation_errors(kwargs, msg):
    with pytest.raises(PlanError) as ei:
        ReplicaPlan.make(**kwargs)
    assert msg in str(ei.value)
    assert isinstance(ei.value, ValueError) and isinstance(ei.value, UltracommError)


def test_replicas_of_out_of_range():
    with pytest.raises(PlanError, match="expert 8 is out of range"):
        small_plan().replicas_of(8)


# ----------------------------------------------------------------------------- identity


def test_eq_hash_digest():
    a, b = small_plan(), small_plan()
    assert a == b and hash(a) == hash(b) and a.digest() == b.digest()
    assert len(a.digest()) == 32
    c = ReplicaPlan.make([[4, -1], [0, 7], [-1, -1], [1, 2]], num_experts=8)
    assert a != c and a.digest() != c.digest()
    # same bytes, different shape -> different digest
    d = ReplicaPlan.make([[-1, -1]], num_experts=2)
    e = ReplicaPlan.make([[-1], [-1]], num_experts=2)
    assert d != e and d.digest() != e.digest()
    # different homes
    f = ReplicaPlan.make([[-1], [-1]], home_of=[0, 1])
    g = ReplicaPlan.make([[-1], [-1]], home_of=[1, 0])
    assert f != g and f.digest() != g.digest()
    assert a != "plan"


@st.composite
def plans(draw, max_world: int = 6, max_slots: int = 4, max_epr: int = 4):
    world = draw(st.integers(1, max_world))
    epr = draw(st.integers(1, max_epr))
    spr = draw(st.integers(0, max_slots))
    E = world * epr
    src = np.full((world, spr), -1, dtype=np.int32)
    for r in range(world):
        candidates = [e for e in range(E) if e // epr != r]
        k = draw(st.integers(0, min(spr, len(candidates))))
        chosen = draw(st.permutations(candidates))[:k]
        cols = draw(st.permutations(range(spr)))[:k]
        for e, j in zip(chosen, cols):
            src[r, j] = e
    return ReplicaPlan.make(src, num_experts=E)


@settings(max_examples=150, deadline=None)
@given(plans(), st.data())
def test_digest_changes_with_one_entry(p, data):
    if p.slots_per_rank == 0:
        return
    r = data.draw(st.integers(0, p.world - 1))
    j = data.draw(st.integers(0, p.slots_per_rank - 1))
    src = p.slot_src.clone()
    src[r, j] = -1 if src[r, j] >= 0 else 0
    q = ReplicaPlan(src, p.home_of.clone()) if _valid(src, p) else None
    if q is not None:
        assert q != p and q.digest() != p.digest()


def _valid(src: torch.Tensor, p: ReplicaPlan) -> bool:
    try:
        ReplicaPlan(src, p.home_of.clone())
        return True
    except PlanError:
        return False


# ----------------------------------------------------------------------------- ECHO


def test_echo_map_hand_example():
    # E = 4, world = 2, S_global = 4 -> 2 slots per rank
    m = torch.zeros(4, 4, dtype=torch.bool)
    m[3, 0] = True  # expert 3 (home 1) -> rank 0 slot 0
    m[0, 3] = True  # expert 0 (home 0) -> rank 1 slot 1
    p = ReplicaPlan.from_echo_map(m, world=2)
    assert p.slot_src.tolist() == [[3, -1], [-1, 0]]
    assert torch.equal(p.to_echo_map(), m)
    assert ReplicaPlan.from_echo_map(m.int().numpy(), world=2) == p


def test_echo_map_errors():
    m = torch.zeros(4, 4, dtype=torch.bool)
    m[2, 1] = m[3, 1] = True
    with pytest.raises(
        PlanError, match=r"column 1 .*\(rank 0, slot 1\) is True for experts \[2, 3\]; a replica slot holds one expert"
    ):
        ReplicaPlan.from_echo_map(m, world=2)
    with pytest.raises(PlanError, match="S_global = 3 columns, which does not divide by world = 2"):
        ReplicaPlan.from_echo_map(torch.zeros(4, 3, dtype=torch.bool), world=2)
    with pytest.raises(PlanError, match="must hold integers, got dtype torch.float32"):
        ReplicaPlan.from_echo_map(torch.zeros(4, 4), world=2)
    with pytest.raises(PlanError, match="booleans"):
        ReplicaPlan.from_echo_map(np.full((4, 4), 2), world=2)
    with pytest.raises(PlanError, match="2-D"):
        ReplicaPlan.from_echo_map(torch.zeros(4, dtype=torch.bool), world=2)
    m = torch.zeros(4, 4, dtype=torch.bool)
    m[0, 0] = True  # expert 0 onto rank 0: its home
    with pytest.raises(PlanError, match="own home rank 0"):
        ReplicaPlan.from_echo_map(m, world=2)


@settings(max_examples=200, deadline=None)
@given(plans())
def test_round_trips(p):
    echo = p.to_echo_map()
    assert echo.dtype == torch.bool and echo.shape == (p.num_experts, p.world * p.slots_per_rank)
    assert ReplicaPlan.from_echo_map(echo, p.world) == p
    etc = p.to_experts_to_copy()
    assert etc.dtype == torch.int32 and etc.shape == (p.world, p.slots_per_rank)
    q = ReplicaPlan.from_experts_to_copy(etc, p.num_experts)
    assert q == p and q.digest() == p.digest()
    etc[...] = -1  # a copy: the plan is unchanged
    assert q == p
    assert int(p.num_replicas.sum()) == int((p.slot_src >= 0).sum()) == int(echo.sum())


# ----------------------------------------------------------------------------- EPLB


def test_moves_hand_examples():
    # world 2, 3 physical slots per rank
    old = [0, 1, 2, 3, 4, 5]
    new = [0, 1, 3, 3, 4, 0]
    assert moves_from_phy2log(old, new, world=2) == [
        Move(expert=3, src_rank=1, src_phys=3, dst_rank=0, dst_phys=2),
        Move(expert=0, src_rank=0, src_phys=0, dst_rank=1, dst_phys=5),
    ]
    # an expert that no old slot held cannot be moved
    old = [0, 1, 2, 3, 1, 5]
    new = [0, 1, 2, 3, 4, 1]
    with pytest.raises(PlanError, match=r"physical slot 4 \(rank 1\) needs expert 4, which no physical slot holds"):
        moves_from_phy2log(old, new, world=2)
    old = [0, 1, 2, 3, 1, 5]
    new = [0, 1, 2, 3, 5, 1]
    # prefer the same rank (local copy) over lower-numbered rank 0, which also holds 1
    assert moves_from_phy2log(old, new, world=2) == [
        Move(expert=5, src_rank=1, src_phys=5, dst_rank=1, dst_phys=4),
        Move(expert=1, src_rank=1, src_phys=4, dst_rank=1, dst_phys=5),
    ]
    # lowest holder rank among remote holders; lowest phys slot on it
    old = [7, 0, 7, 7, 1, 2, 7, 3]  # world 4, ppr 2
    new = [7, 0, 7, 7, 1, 2, 3, 7]
    assert moves_from_phy2log(old, new, world=4) == [
        Move(expert=3, src_rank=3, src_phys=7, dst_rank=3, dst_phys=6),
        Move(expert=7, src_rank=3, src_phys=6, dst_rank=3, dst_phys=7),
    ]
    old = [7, 0, 1, 7, 2, 3, 4, 5]
    new = [7, 0, 1, 7, 2, 3, 7, 5]
    assert moves_from_phy2log(old, new, world=4) == [Move(expert=7, src_rank=0, src_phys=0, dst_rank=3, dst_phys=6)]
    # slot becoming unused needs no move
    assert moves_from_phy2log([0, 1], [0, -1], world=1) == []
    # identical maps
    assert moves_from_phy2log([0, 1, 2, 3], [0, 1, 2, 3], world=2) == []


def test_moves_layers():
    old = torch.tensor([[0, 1, 2, 3], [0, 1, 2, 3]])
    new = torch.tensor([[0, 1, 2, 3], [1, 1, 2, 3]])
    out = moves_from_phy2log(old, new, world=2)
    assert out == [[], [Move(1, 0, 1, 0, 0)]]
    new[1, 3] = 9
    with pytest.raises(PlanError, match="layer 1: physical slot 3"):
        moves_from_phy2log(old, new, world=2)


def test_moves_errors():
    with pytest.raises(PlanError, match="same P"):
        moves_from_phy2log([0, 1], [0, 1, 2], world=1)
    with pytest.raises(PlanError, match="P = 3 physical slots, which does not divide by world = 2"):
        moves_from_phy2log([0, 1, 2], [0, 1, 2], world=2)
    with pytest.raises(PlanError, match=r"new_phy2log\[1\] = -5"):
        moves_from_phy2log([0, 1], [0, -5], world=1)
    with pytest.raises(PlanError, match="must hold integers"):
        moves_from_phy2log([0.0, 1.0], [0, 1], world=1)
    with pytest.raises(PlanError, match=r"\[P\] or \[layers, P\]"):
        moves_from_phy2log(np.zeros((1, 1, 2), int), np.zeros((1, 1, 2), int), world=1)


def apply_moves(old: np.ndarray, moves: list[Move]) -> np.ndarray:
    out = old.copy()
    for m in moves:
        assert old[m.src_phys] == m.expert  # reads OLD contents
        out[m.dst_phys] = old[m.src_phys]
    return out


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_moves_apply_to_new_map(data):
    world = data.draw(st.integers(1, 5))
    ppr = data.draw(st.integers(1, 4))
    E = data.draw(st.integers(1, world * ppr))
    P = world * ppr
    old = np.array(data.draw(st.lists(st.integers(-1, E - 1), min_size=P, max_size=P)))
    present = sorted({int(e) for e in old if e >= 0})
    new = np.array(data.draw(st.lists(st.sampled_from(present + [-1]), min_size=P, max_size=P)))
    moves = moves_from_phy2log(old, new, world)
    applied = apply_moves(old, moves)
    keep = new >= 0
    assert (applied[keep] == new[keep]).all()
    for m in moves:
        assert m.dst_rank == m.dst_phys // ppr and m.src_rank == m.src_phys // ppr
        holders = {p // ppr for p in range(P) if old[p] == m.expert}
        assert m.src_rank == (m.dst_rank if m.dst_rank in holders else min(holders))
        assert m.src_phys == min(p for p in range(P) if old[p] == m.expert and p // ppr == m.src_rank)
    assert [m.dst_phys for m in moves] == sorted(m.dst_phys for m in moves)


def test_plan_from_phy2log():
    # world 2, 2 experts per rank, 3 physical per rank -> 1 replica slot per rank
    phy = [0, 1, 3, 2, 3, 0]
    p = plan_from_phy2log(phy, world=2, num_experts=4, experts_per_rank=2)
    assert p.slot_src.tolist() == [[3], [0]]
    # redundant slot holding a home expert or -1 becomes empty
    p = plan_from_phy2log([0, 1, 1, 2, 3, -1], world=2, num_experts=4, experts_per_rank=2)
    assert p.is_empty
    layers = plan_from_phy2log([phy, phy], world=2, num_experts=4, experts_per_rank=2)
    assert isinstance(layers, list) and len(layers) == 2 and layers[0] == layers[1]
    with pytest.raises(PlanError, match=r"new_phy2log\[1\] \(rank 0, local slot 1\) = 3.*use moves_from_phy2log"):
        plan_from_phy2log([0, 3, 1, 2, 3, 0], world=2, num_experts=4, experts_per_rank=2)
    with pytest.raises(PlanError, match="at least world \\* experts_per_rank"):
        plan_from_phy2log([0, 1], world=2, num_experts=4, experts_per_rank=2)
    with pytest.raises(PlanError, match=r"new_phy2log\[2\] = 9 is out of range"):
        plan_from_phy2log([0, 1, 9, 2, 3, 0], world=2, num_experts=4, experts_per_rank=2)
