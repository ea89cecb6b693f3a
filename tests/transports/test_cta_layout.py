"""The persistent kernel's CTA layout (csrc/cuda/persistent_args.h: set_cta_layout, cta_rank,
launch_grid, shared_ring), built with g++ -Werror: the launch gives each rank its own CTA count (a
rank with no task in the op gets one, runner.h launch_ctas), the grid is their sum, and every
block of the grid maps to the rank that owns it and that rank's count -- the count its last CTA
out of run_tasks waits for before it drains (a wrong count drains too early or never)."""

from __future__ import annotations

import random
import subprocess
from pathlib import Path

import pytest

from cpp_build import CXX, build_probe

MAX_RANKS = 64  # kMaxLoopbackRanks
pytestmark = pytest.mark.skipif(CXX is None, reason="needs g++")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    return build_probe(tmp_path_factory.mktemp("cta_layout") / "probe", ["tests/cpp/cta_layout_probe.cpp"], opt="-O0")


def layouts(probe: Path, cases: list[tuple[int, list[int]]]) -> list[dict]:
    """[(sms, per-rank CTAs)] -> per case: grid, launch_grid, uniform, ring, fast, search."""
    args: list[str] = []
    for sms, ctas in cases:
        args += [str(sms), *map(str, ctas), "--"]
    lines = subprocess.run([str(probe), *args], capture_output=True, text=True, check=True).stdout.splitlines()
    assert len(lines) == 3 * len(cases), lines
    out = []
    for head, fast, search in zip(lines[0::3], lines[1::3], lines[2::3]):
        h = head.split()
        assert h[0::2] == ["grid", "launch_grid", "uniform", "ring"], head
        blocks = []
        for line, name in ((fast, "fast"), (search, "search")):
            words = line.split()
            assert words[0] == name, line
            blocks.append([tuple(int(x) for x in w.split(":")) for w in words[1:]])
        out.append(dict(zip(h[0::2], map(int, h[1::2])), fast=blocks[0], search=blocks[1]))
    return out


def expected_blocks(ctas: list[int]) -> list[tuple[int, int]]:
    """(rank, rank's CTAs) of every block, rank by rank: the layout written out."""
    return [(r, c) for r, c in enumerate(ctas) for _ in range(c)]


def test_every_block_maps_to_its_rank_over_many_layouts(probe):
    rng = random.Random(34)
    cases = [
        (132, [1]),
        (132, [7]),
        (132, [1] * MAX_RANKS),  # every rank idle: one CTA each
        (132, [3] * MAX_RANKS),
        (132, [130, 1, 1]),  # the bench's k=2 reduce at every SM: rank 0 busy, two idle ranks
        (132, [1, 1, 130]),
        (132, [1, 9, 1, 9, 1]),
        (132, [2, 1]),
        (132, [1, 2]),
    ]
    for _ in range(300):
        n = rng.choice([2, 3, 5, 9, 17, 33, 63, MAX_RANKS, rng.randint(1, MAX_RANKS)])
        busy = rng.randint(1, 40)
        cases.append((132, [busy if rng.random() < 0.4 else 1 for _ in range(n)]))
    for _ in range(100):
        n = rng.randint(1, MAX_RANKS)
        cases.append((132, [rng.randint(1, 12) for _ in range(n)]))
    got = layouts(probe, cases)
    for (_, ctas), g in zip(cases, got):
        want = expected_blocks(ctas)
        assert g["grid"] == g["launch_grid"] == sum(ctas), (ctas, g)
        assert g["fast"] == want, ctas
        assert g["search"] == want, ctas  # the binary search alone, also where the fast path would run
        assert g["uniform"] == (ctas[0] if len(set(ctas)) == 1 else 0), (ctas, g["uniform"])
        # each rank sees exactly its own count, as many times as it has CTAs
        for r, c in enumerate(ctas):
            assert [b for b in g["fast"] if b[0] == r] == [(r, c)] * c


def test_uniform_layout_is_the_old_division(probe):
    # before the per-rank layout, rank = block / ctas_per_rank and every rank had ctas_per_rank
    cases = [(132, [c] * n) for n in (1, 2, 3, 8, MAX_RANKS) for c in (1, 2, 4, 23, 66)]
    for (_, ctas), g in zip(cases, layouts(probe, cases)):
        c, n = ctas[0], len(ctas)
        old = [(b // c, c) for b in range(n * c)]
        assert g["uniform"] == c and g["fast"] == old and g["search"] == old


def test_shared_ring_when_a_loopback_grid_exceeds_the_sms(probe):
    # the whole grid counts: 130 CTAs on rank 0 plus one per idle rank is 132 (deep ring) or 133
    cases = [(132, [130, 1, 1]), (132, [131, 1, 1]), (132, [132]), (132, [133]), (4, [2, 2]), (4, [2, 3])]
    assert [g["ring"] for g in layouts(probe, cases)] == [0, 1, 0, 0, 0, 1]  # one rank: never (not co-resident)
