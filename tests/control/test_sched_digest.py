"""The portable builder's digest (include/ultracomm/impl/sched_write.h ``digest``; issue 33): what ranks
publish beside their ready flags to check they run the same plan.  A combinable hash -- one
mixed term per digested field (inputs and both chosen trees), summed mod 2^64, then mixed with
the header -- so the CTA computes it in parallel and every lane count gets the same value:

- it equals an independent Python evaluation of the definition (so the C++ is what the comment
  says, on the host build of the header the kernel compiles);
- host lanes 1..32 in several warp shapes and the kernel's CTA shape (256 lanes in warps of 32)
  give the one-lane value, through ``build_schedule_portable``, ``build_into_views`` and the
  digest alone (``schedule_digest_portable``);
- changing any single field -- a header word, one slot_src / home_of / node_of entry, one
  parent_rank / parent_slot of either tree -- changes it (the per-rank task and ref lists are
  functions of exactly these, so any change to any rank's lists is a change here).
"""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ultracomm import _core

M64 = (1 << 64) - 1
TAG = 0x50B1D001


def mix64(z: np.ndarray) -> np.ndarray:
    z = np.asarray(z, dtype=np.uint64)
    with np.errstate(over="ignore"):
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def py_digest(slot_src, home_of, node_of, wb, gb, chunk, hop, max_depth, trees) -> int:
    """The definition in sched_write.h, evaluated with numpy (independent of the C++)."""
    W, S = slot_src.shape
    E = len(home_of)
    nodes = np.zeros(W, np.int32) if node_of is None else np.asarray(node_of, np.int32)
    segs = [(1, np.asarray(slot_src, np.int32).ravel()), (2, np.asarray(home_of, np.int32)), (3, nodes)]
    for op, (pr, ps) in enumerate(trees):
        segs.append((4 + op, np.concatenate([np.asarray(pr, np.int32).ravel(), np.asarray(ps, np.int32).ravel()])))
    total = 0
    for seg, words in segs:
        idx = np.arange(len(words), dtype=np.uint64)
        keys = (np.uint64(seg) << np.uint64(56)) | (idx << np.uint64(32)) | words.astype(np.uint32).astype(np.uint64)
        total = (total + int(mix64(keys).astype(object).sum())) & M64
    h = 0x9E3779B97F4A7C15
    for x in (TAG, W, S, E, wb, gb, chunk, hop, max_depth):
        h = int(mix64(np.uint64(h ^ x)))
    return int(mix64(np.uint64(h ^ int(mix64(np.uint64(total))))))


def problem(seed, world, slots, experts, nodes):
    rng = np.random.default_rng(seed)
    home_of = (np.arange(experts) * world // experts).astype(np.int32)
    slot_src = np.full((world, slots), -1, np.int32)
    hot = rng.permutation(experts)[: max(1, experts // 3)]
    for r in range(world):
        picks = [int(e) for e in rng.permutation(hot) if home_of[e] != r][:slots]
        for s, e in enumerate(picks):
            if rng.random() < 0.85:
                slot_src[r, s] = e
    node_of = None if nodes == 0 else (np.arange(world) * min(nodes, world) // world).astype(np.int32)
    return slot_src, home_of, node_of


def trees_of(built) -> list:
    return [(built[op]["parent_rank"], built[op]["parent_slot"]) for op in ("multicast", "reduce")]


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seed=st.integers(0, 10**6),
    world=st.integers(2, 96),
    slots=st.integers(1, 4),
    epr=st.integers(1, 4),
    nodes=st.sampled_from([0, 2, 4]),
    chunk=st.sampled_from([16, 4096]),
    max_depth=st.sampled_from([1, 2, 8]),
    hop=st.sampled_from([0, 740, 1 << 20]),
)
def test_digest_is_its_definition_on_every_rank(seed, world, slots, epr, nodes, chunk, max_depth, hop):
    """The built digest is the Python evaluation of the definition over the inputs and the chosen
    trees, the same on every rank, and the serial oracle's (which computes it its own way)."""
    slot_src, home_of, node_of = problem(seed, world, slots, world * epr, nodes)
    wb, gb = 4096 + 16 * (seed % 7), 8192
    digests = set()
    for r in sorted({0, world - 1, seed % world}):
        args = (slot_src, home_of, node_of, wb, gb, chunk, r, max_depth, hop)
        got = _core.build_schedule_portable(*args)
        want = py_digest(slot_src, home_of, node_of, wb, gb, chunk, hop, max_depth, trees_of(got))
        assert got["digest"] == want
        assert _core.build_schedule_portable_serial_ref(*args)["digest"] == want
        digests.add(got["digest"])
    assert len(digests) == 1


LANE_SHAPES = [(n, 1) for n in range(1, 33)] + [(32, 32), (32, 4), (16, 4), (24, 8), (256, 32)]


def test_digest_does_not_depend_on_the_lanes():
    """Lanes 1..32 (warps of one lane), other warp shapes and the kernel's CTA (256 lanes in warps
    of 32): the digest alone, a build and a build into views all give the one-lane digest."""
    slot_src, home_of, node_of = problem(7, 40, 3, 120, 4)
    wb, gb, chunk, hop, depth = 1 << 20, 1 << 21, 1 << 16, 740, 8
    one = _core.build_schedule_portable(slot_src, home_of, node_of, wb, gb, chunk, 5, depth, hop)
    trees = trees_of(one)
    want = py_digest(slot_src, home_of, node_of, wb, gb, chunk, hop, depth, trees)
    assert one["digest"] == want
    for lanes, wl in LANE_SHAPES:
        got = _core.schedule_digest_portable(
            slot_src, home_of, node_of, wb, gb, chunk, depth, hop, trees, lanes=lanes, warp_lanes=wl
        )
        assert got == want, (lanes, wl)
    caps = ([64 * 64] * 2, [40 * 3] * 2)
    for lanes, wl in ((2, 0), (8, 0), (32, 0), (256, 32)):
        args = (slot_src, home_of, node_of, wb, gb, chunk, 5, depth, hop)
        assert _core.build_schedule_portable(*args, lanes=lanes, warp_lanes=wl)["digest"] == want, (lanes, wl)
        v = _core.build_into_views(*args, *caps, lanes=lanes, warp_lanes=wl)
        assert v["status"] == 0 and v["digest"] == want and v["multicast"]["digest"] == want, (lanes, wl)


def test_every_single_field_changes_the_digest():
    """Each header word, each entry of slot_src / home_of / node_of and each parent_rank /
    parent_slot of both trees, changed alone (to another value, including -1 and a high bit),
    gives a digest unlike the original's and unlike every other change's."""
    slot_src, home_of, node_of = problem(3, 6, 2, 12, 2)
    base = dict(
        slot_src=slot_src,
        home_of=home_of,
        node_of=node_of,
        weight_bytes=4096,
        grad_bytes=8192,
        chunk_bytes=1024,
        max_depth=8,
        hop_bytes=740,
    )
    built = _core.build_schedule_portable(slot_src, home_of, node_of, 4096, 8192, 1024, 0, 8, 740)
    trees = [(pr.copy(), ps.copy()) for pr, ps in trees_of(built)]

    def digest(**over):
        kw = {**base, "trees": trees, **over}
        d = _core.schedule_digest_portable(**kw)
        assert d == py_digest(
            kw["slot_src"],
            kw["home_of"],
            kw["node_of"],
            kw["weight_bytes"],
            kw["grad_bytes"],
            kw["chunk_bytes"],
            kw["hop_bytes"],
            kw["max_depth"],
            kw["trees"],
        )
        return d

    d0 = digest()
    assert d0 == built["digest"]
    seen = {d0}
    n = 0

    def changed(d):
        nonlocal n
        assert d not in seen, f"change {n} collides"
        seen.add(d)
        n += 1

    for name, value in (
        ("weight_bytes", 4112),
        ("grad_bytes", 8208),
        ("chunk_bytes", 2048),
        ("max_depth", 7),
        ("hop_bytes", 741),
        ("hop_bytes", 740 + (1 << 39)),
    ):
        changed(digest(**{name: value}))
    for name in ("slot_src", "home_of"):
        arr = base[name]
        for i in range(arr.size):
            for new in {int(arr.flat[i]) + 1, -1, int(arr.flat[i]) ^ (1 << 30)} - {int(arr.flat[i])}:
                a = arr.copy()
                a.flat[i] = new
                changed(digest(**{name: a}))
    for r in range(len(node_of)):
        a = node_of.copy()
        a[r] += 1
        changed(digest(node_of=a))
    changed(digest(node_of=np.ones_like(node_of)))  # a different node layout as a whole
    for op in range(2):
        for part in range(2):
            for i in range(trees[op][part].size):
                t = [(pr.copy(), ps.copy()) for pr, ps in trees]
                t[op][part].flat[i] += 1
                changed(digest(trees=t))
    # a tree of the other op (the two trees are not interchangeable)
    if not all(np.array_equal(a, b) for a, b in zip(trees[0], trees[1])):
        changed(digest(trees=[trees[1], trees[0]]))
    assert n > 100


def test_no_node_of_is_node_zero():
    """Without node_of every rank counts as node 0 (one node): the same digest as all zeros."""
    slot_src, home_of, _ = problem(5, 8, 2, 16, 0)
    built = _core.build_schedule_portable(slot_src, home_of, None, 4096, 4096, 1024, 0, 8, 0)
    zeros = np.zeros(8, np.int32)
    assert (
        _core.schedule_digest_portable(slot_src, home_of, zeros, 4096, 4096, 1024, 8, 0, trees_of(built))
        == built["digest"]
    )


def test_schedule_digest_portable_checks_its_trees():
    slot_src, home_of, _ = problem(5, 4, 1, 8, 0)
    t = (np.zeros((4, 1), np.int32), np.zeros((4, 1), np.int32))
    with pytest.raises(ValueError, match="not \\[world, slots\\]"):
        _core.schedule_digest_portable(slot_src, home_of, None, 16, 16, 16, 8, 0, [t, (t[0], np.zeros(3, np.int32))])
