"""Tests for ultracomm.scenarios: model presets, load generators, the greedy planner and
workload specs."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ultracomm.plan import ReplicaPlan
from ultracomm.scenarios import (
    MODELS,
    WORKLOAD_FORMS,
    WORKLOADS,
    ModelSpec,
    expert_load,
    get_model,
    greedy_replicas,
    hot_plan,
    hot_rank_load,
    imbalance,
    make_workload,
    max_mean_after,
    rank_blocked_load,
    rotating_hot_load,
    zipf_load,
)

# bytes/expert column of shared/FACTS.md (bf16, 3 * hidden * moe_inter * 2)
FACTS_BYTES = {
    "qwen3-30b-a3b": 9_437_184,
    "qwen3-235b-a22b": 37_748_736,
    "deepseek-v3": 88_080_384,
    "glm-4.5": 47_185_920,
    "glm-4.5-air": 34_603_008,
    "kimi-k2": 88_080_384,
    "gpt-oss-120b": 49_766_400,
    "mixtral-8x7b": 352_321_536,
}

FAST = settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])

# ----------------------------------------------------------------------------- models


def test_models_match_facts_table():
    assert set(MODELS) == set(FACTS_BYTES)
    for name, want in FACTS_BYTES.items():
        m = get_model(name)
        assert m.name == name
        assert m.expert_weight_bytes() == want
        assert m.expert_weight_bytes(torch.bfloat16) == want
        assert m.expert_grad_bytes() == 2 * want  # fp32 grads
        assert m.expert_grad_bytes(torch.bfloat16) == want
        lay = m.layout()
        assert lay.weight_bytes == want
        assert lay.grad_bytes == 2 * want
        assert lay.members[0].shape == (2 * m.moe_inter, m.hidden)


def test_model_fields():
    m = get_model("Qwen3-235B-A22B")  # case-insensitive
    assert (m.hidden, m.moe_inter, m.num_experts, m.top_k, m.moe_layers) == (4096, 1536, 128, 8, 94)
    assert get_model("mixtral-8x7b").top_k == 2
    assert get_model("gpt-oss-120b").top_k == 4
    assert m.experts_per_rank(64) == 2
    with pytest.raises(ValueError, match="divide"):
        m.experts_per_rank(48)


def test_get_model_unknown_lists_names():
    with pytest.raises(ValueError) as ei:
        get_model("llama-moe")
    msg = str(ei.value)
    assert "llama-moe" in msg
    for name in MODELS:
        assert name in msg


def test_model_spec_validation():
    with pytest.raises(ValueError):
        ModelSpec("x", 0, 1, 8, 2, 1)
    with pytest.raises(ValueError):
        ModelSpec("x", 8, 8, 4, 8, 1)


# ----------------------------------------------------------------------------- conservation

sizes = st.tuples(
    st.integers(2, 64),  # world
    st.integers(1, 4),  # experts_per_rank
    st.integers(1, 300),  # tokens_per_rank
    st.integers(1, 8),  # top_k
    st.integers(0, 2**32 - 1),  # seed
)


def _check_load(load: np.ndarray, world: int, E: int, T: int, k: int) -> None:
    assert load.dtype == np.int64
    assert load.shape == (world, E)
    assert (load >= 0).all()
    assert (load.sum(axis=1) == T * k).all()


@FAST
@given(sizes, st.floats(1.0, 1.5))
def test_zipf_conserves_tokens(sz, target):
    world, epr, T, k, seed = sz
    E = world * epr
    k = min(k, epr)  # one rank can take every token: any target <= world is reachable
    load = zipf_load(world, E, T, k, target, seed)
    _check_load(load, world, E, T, k)
    assert load.max() <= T  # a token picks top_k distinct experts


@FAST
@given(sizes, st.sampled_from([0.0, 0.3, 0.5, 0.7, 0.9, 1.0]))
def test_hot_conserves_tokens(sz, fraction):
    world, epr, T, k, seed = sz
    E = world * epr
    k = min(k, E)
    load = hot_rank_load(world, E, T, k, fraction, seed, hot_rank=seed % world)
    _check_load(load, world, E, T, k)


@FAST
@given(sizes, st.integers(0, 50), st.integers(1, 8), st.floats(1.0, 50.0))
def test_rotating_conserves_tokens(sz, step, num_hot, skew):
    world, epr, T, k, seed = sz
    E = world * epr
    k, num_hot = min(k, E), min(num_hot, E)
    load = rotating_hot_load(world, E, T, k, step, num_hot, skew, seed)
    _check_load(load, world, E, T, k)
    assert load.max() <= T


# ----------------------------------------------------------------------------- zipf


@pytest.mark.parametrize("target", [1.5, 2.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1, 7])
def test_zipf_hits_target(target, seed):
    load = zipf_load(64, 256, 8192, 8, target, seed)
    assert abs(imbalance(load, 4) / target - 1) < 0.02
    assert (load.sum(axis=1) == 8192 * 8).all()


def test_zipf_uniform_and_rank_order():
    load = zipf_load(64, 256, 8192, 8, 1.0, 0)
    assert imbalance(load, 4) == 1.0
    # the hottest home rank depends on the seed (randomised rank order)
    hottest = {int(np.argmax(expert_load(zipf_load(16, 64, 512, 4, 2.0, s)).reshape(16, 4).sum(1))) for s in range(8)}
    assert len(hottest) > 1


def test_zipf_unreachable_target():
    with pytest.raises(ValueError, match="not reachable"):
        zipf_load(4, 8, 100, 2, 10.0, 0)
    with pytest.raises(ValueError, match=">= 1"):
        zipf_load(4, 8, 100, 2, 0.5, 0)
    with pytest.raises(ValueError, match="divide"):
        zipf_load(3, 8, 100, 2, 1.5, 0)


# ----------------------------------------------------------------------------- rank-blocked


@FAST
@given(sizes, st.floats(1.0, 2.0))
def test_rank_blocked_conserves_tokens(sz, target):
    world, epr, T, k, seed = sz
    E = world * epr
    k = min(k, E)
    try:
        load = rank_blocked_load(world, E, T, k, target, seed)
    except ValueError as e:  # a block spanning several ranks caps the imbalance
        assert "not reachable" in str(e) and k > epr
        return
    _check_load(load, world, E, T, k)
    assert load.max() <= T  # a token sends each of its top_k experts one assignment


@pytest.mark.parametrize("target", [1.5, 2.0, 3.0])
@pytest.mark.parametrize("seed", [0, 1])
def test_rank_blocked_hits_target_and_blocks(target, seed):
    # top_k = experts per rank (Qwen3-235B at EP16): a block is one rank, and each sender
    # sends every expert of a rank the same count (its tokens routed to that rank)
    load = rank_blocked_load(16, 128, 8192, 8, target, seed)
    assert abs(imbalance(load, 8) / target - 1) < 0.01
    per = load.reshape(16, 16, 8)
    assert (per == per[:, :, :1]).all()
    assert (per[:, :, 0].sum(axis=1) == 8192).all()
    # top_k < experts per rank: a rank's experts within one assignment of each other
    load = rank_blocked_load(8, 64, 1000, 4, target, seed)
    per = load.reshape(8, 8, 8)
    assert (per.max(axis=2) - per.min(axis=2) <= 1).all()
    assert (per.sum(axis=2) % 4 == 0).all()  # 4 assignments per token
    assert abs(imbalance(load, 8) / target - 1) < 0.01


def test_rank_blocked_spans_ranks():
    # DeepSeek-V3 at EP64: 4 experts per rank, top-8 -> a token covers its block's rank and
    # the next one; every expert of both gets one assignment per token
    load = rank_blocked_load(64, 256, 8192, 8, 2.0, 0)
    per = load.reshape(64, 64, 4)
    assert (per == per[:, :, :1]).all()
    n = per[:, :, 0]  # tokens per (sender, rank): the rank's own block + the previous one
    assert (n.sum(axis=1) == 2 * 8192).all()
    assert abs(imbalance(load, 4) / 2.0 - 1) < 0.01
    with pytest.raises(ValueError, match="not reachable"):
        rank_blocked_load(8, 16, 100, 4, 5.0, 0)  # a block spans 2 of 8 ranks: at most 4


def test_rank_blocked_deterministic_and_errors():
    a = rank_blocked_load(16, 64, 512, 4, 2.0, 7)
    assert np.array_equal(a, rank_blocked_load(16, 64, 512, 4, 2.0, 7))
    assert not np.array_equal(a, rank_blocked_load(16, 64, 512, 4, 2.0, 8))
    assert np.array_equal(rank_blocked_load(4, 8, 10, 2, 1.0, 0).sum(axis=1), [20] * 4)
    with pytest.raises(ValueError, match=">= 1"):
        rank_blocked_load(4, 8, 100, 2, 0.5, 0)
    with pytest.raises(ValueError, match="experts_per_rank"):
        rank_blocked_load(4, 8, 100, 2, 1.5, 0, experts_per_rank=3)


# ----------------------------------------------------------------------------- hot rank


@pytest.mark.parametrize("fraction", [0.3, 0.5, 0.7, 0.9])
def test_hot_rank_fraction(fraction):
    world, E, T, k = 64, 256, 8192, 8
    load = hot_rank_load(world, E, T, k, fraction, seed=3, hot_rank=5)
    total = T * k
    hot = load[:, 20:24].sum(axis=1)
    assert (np.abs(hot - fraction * total) <= 0.5).all()
    # the rest is spread evenly: other experts differ by at most one per sender
    cold = np.delete(load, np.arange(20, 24), axis=1)
    assert (cold.max(axis=1) - cold.min(axis=1) <= 1).all()
    # first hot_experts of the rank only
    load2 = hot_rank_load(world, E, T, k, fraction, seed=3, hot_rank=5, hot_experts=2)
    assert (np.abs(load2[:, 20:22].sum(axis=1) - fraction * total) <= 0.5).all()
    assert (load2[:, 20:22].max(axis=1) - load2[:, 20:22].min(axis=1) <= 1).all()


def test_hot_rank_rest_over_all():
    load = hot_rank_load(8, 32, 1000, 4, 0.5, 0, hot_rank=1, rest_over_all=True)
    # 2000 on the hot experts plus their 4/32 of the even 2000 (62.5 each, +-1 rounding)
    assert (np.abs(load[:, 4:8].sum(axis=1) - (2000 + 250)) <= 2).all()


def test_hot_rank_errors():
    with pytest.raises(ValueError, match="fraction"):
        hot_rank_load(4, 8, 10, 2, 1.5, 0)
    with pytest.raises(ValueError, match="hot_rank"):
        hot_rank_load(4, 8, 10, 2, 0.5, 0, hot_rank=4)
    with pytest.raises(ValueError, match="hot_experts"):
        hot_rank_load(4, 8, 10, 2, 0.5, 0, hot_experts=3)


# ----------------------------------------------------------------------------- rotating


def test_rotating_hot_set_moves():
    hots = []
    for step in range(4):
        load = rotating_hot_load(16, 64, 1024, 4, step, 4, 20.0, seed=5)
        hots.append(set(np.argsort(-expert_load(load), kind="stable")[:4].tolist()))
    for a, b in zip(hots, hots[1:]):
        assert not a & b  # consecutive steps: disjoint hot sets
    # a full tour returns to the start
    a = rotating_hot_load(16, 64, 1024, 4, 0, 4, 20.0, seed=5)
    b = rotating_hot_load(16, 64, 1024, 4, 16, 4, 20.0, seed=5)
    assert set(np.argsort(-expert_load(a))[:4]) == set(np.argsort(-expert_load(b))[:4])


# ----------------------------------------------------------------------------- metrics


def test_imbalance_and_expert_load():
    load = np.array([[3, 1, 0, 0], [1, 1, 2, 0]], dtype=np.int64)
    assert expert_load(load).tolist() == [4, 2, 2, 0]
    assert expert_load(load).dtype == np.int64
    assert imbalance(load, 2) == pytest.approx(6 / 4)
    assert imbalance(np.zeros((2, 4), np.int64), 2) == 1.0


# ----------------------------------------------------------------------------- planners


def _check_plan(plan: ReplicaPlan, world: int, spr: int, epr: int) -> None:
    src = plan.slot_src.numpy()
    assert src.shape == (world, spr)
    home = np.arange(world * epr) // epr
    for r in range(world):
        row = src[r][src[r] >= 0]
        assert len(set(row.tolist())) == row.size  # never twice on a rank
        assert (home[row] != r).all()  # never on its home rank
    plan.validate(experts_per_rank=epr)


@FAST
@given(st.integers(2, 64), st.integers(1, 4), st.integers(0, 3), st.integers(0, 2**31 - 1))
def test_greedy_valid_and_improves(world, epr, spr, seed):
    E = world * epr
    k = min(8, epr)
    target = 1.0 + (seed % 3) * 0.5 if world >= 3 else 1.5
    load = zipf_load(world, E, 256, k, target, seed)
    plan = greedy_replicas(load, world, spr, epr)
    _check_plan(plan, world, spr, epr)
    before = max_mean_after(load, ReplicaPlan.empty(world, spr, E))
    after = max_mean_after(load, plan)
    assert after <= before + 1e-12
    if not plan.is_empty:  # every replica placed lowered the maximum
        assert after < before


def test_greedy_on_skewed_loads():
    load = zipf_load(64, 256, 8192, 8, 2.0, 0)
    empty = ReplicaPlan.empty(64, 2, 256)
    assert max_mean_after(load, empty) == pytest.approx(imbalance(load, 4))
    plan = greedy_replicas(load, 64, 2, 4)
    _check_plan(plan, 64, 2, 4)
    assert max_mean_after(load, plan) < 0.6 * max_mean_after(load, empty)

    hot = hot_rank_load(64, 256, 8192, 8, 0.5, 0)
    plan = greedy_replicas(hot, 64, 2, 4)
    _check_plan(plan, 64, 2, 4)
    assert max_mean_after(hot, plan) < 1.1
    assert plan.num_replicas[:4].min() >= 20  # the hot experts got most replicas
    # [E] expert loads work too, and give the same plan
    assert greedy_replicas(expert_load(hot), 64, 2, 4) == plan


def test_greedy_uniform_load_places_nothing():
    load = zipf_load(8, 32, 1024, 4, 1.0, 0)
    assert greedy_replicas(load, 8, 2, 4).is_empty
    assert greedy_replicas(np.zeros((8, 32), np.int64), 8, 2, 4).is_empty


def test_greedy_small_exact():
    # rank 0 homes experts 0, 1; expert 0 is hot
    load = np.array([90, 10, 10, 10, 10, 10], dtype=np.int64)
    plan = greedy_replicas(load, 3, 1, 2)
    # expert 0 (90) is split 45/45 onto rank 1 (tie on load 20 with rank 2: lowest index),
    # then 30/30/30 onto rank 2; ranks 1 and 2 then share the maximum (50): stop
    assert plan.slot_src.tolist() == [[-1], [0], [0]]
    assert max_mean_after(load, plan) == pytest.approx(50 / (140 / 3))


def test_hot_plan():
    plan = hot_plan(64, 2, 4, expert=9, replicas=60)
    _check_plan(plan, 64, 2, 4)
    assert plan.num_replicas[9] == 60
    assert int(plan.num_replicas.sum()) == 60
    assert plan.slot_src[2, 0] == -1  # home rank of expert 9
    assert [r for r, _ in plan.replicas_of(9)] == list(range(3, 63))
    with pytest.raises(ValueError):
        hot_plan(4, 1, 2, 0, 4)
    with pytest.raises(ValueError):
        hot_plan(4, 0, 2, 0, 1)


def test_max_mean_after():
    load = np.array([[6, 0, 2, 0]], dtype=np.int64)
    plan = ReplicaPlan.make([[-1], [0]], num_experts=4)  # expert 0 on rank 1 too
    # rank 0: 3; rank 1: 3 + 2 = 5; mean 4
    assert max_mean_after(load, plan) == pytest.approx(5 / 4)


# ----------------------------------------------------------------------------- determinism


def test_determinism():
    args = (16, 64, 1000, 4)
    for f in (
        lambda s: zipf_load(*args, 2.0, s),
        lambda s: hot_rank_load(*args, 0.65, s),
        lambda s: rotating_hot_load(*args, 3, 4, 8.0, s),
    ):
        assert np.array_equal(f(11), f(11))
        assert not np.array_equal(f(11), f(12))
    load = zipf_load(*args, 2.0, 11)
    assert greedy_replicas(load, 16, 2, 4) == greedy_replicas(load.copy(), 16, 2, 4)


# ----------------------------------------------------------------------------- specs


@pytest.mark.parametrize("spec", list(WORKLOADS) + ["zipf:2.5", "blocked:1.5", "hot:0.5:2", "rotating:3:4:16"])
def test_make_workload_specs(spec):
    m = get_model("deepseek-v3")
    load = make_workload(spec, 64, m, tokens_per_rank=1024, seed=1)
    _check_load(load, 64, 256, 1024, 8)
    assert np.array_equal(load, make_workload(spec, 64, m, tokens_per_rank=1024, seed=1))


def test_make_workload_values():
    m = get_model("deepseek-v3")
    assert imbalance(make_workload("zipf:2", 64, m), 4) == pytest.approx(2.0, rel=0.02)
    hot = make_workload("hot:0.5", 64, m)
    assert (hot[:, :4].sum(axis=1) == 8192 * 8 // 2).all()


@pytest.mark.parametrize(
    "spec",
    [
        "",
        "zipf",
        "zipf:",
        "zipf:abc",
        "zipf:0.5",
        "zipf:1:2",
        "blocked",
        "blocked:0.9",
        "blocked:2:1",
        "hot",
        "hot:1.5",
        "hot:0.5:9",
        "hot:x",
        "rotating:-1",
        "rotating:1:2:3:4",
        "rotating:a",
        "gauss:2",
        "uniform:1",
        "zipf:nan",
    ],
)
def test_make_workload_bad_specs(spec):
    with pytest.raises(ValueError) as ei:
        make_workload(spec, 64, get_model("deepseek-v3"))
    msg = str(ei.value)
    for form in WORKLOAD_FORMS:
        assert form in msg


def test_make_workload_bad_world():
    with pytest.raises(ValueError, match="divide"):
        make_workload("zipf:2", 64, get_model("mixtral-8x7b"))
