"""The CPU fault matrix in its small form (issue 35): one case per transport x fault kind -- a rank
SIGKILLed as its weight_sync starts, a rank SIGSTOPped between forward and backward -- in a
4-rank MoE training run (tests/mp/fault_matrix_worker.py).  Every survivor raises
UltracommTimeout naming exactly the faulted rank as stopped (blame by evidence:
ultracomm.blame), none hangs, no /dev/shm segment is left.  ``python perf/fault_matrix.py`` runs
the whole matrix (perf/README.md, "Failure semantics (CPU fault matrix)")."""

from __future__ import annotations

import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "perf"))

import fault_matrix  # noqa: E402

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="needs POSIX shared memory (/dev/shm)"),
]


@pytest.mark.parametrize("transport,phase,kind,victims,world", fault_matrix.cases(small=True))
def test_every_survivor_names_the_faulted_rank(transport, phase, kind, victims, world):
    case = fault_matrix.run_case(transport, phase, kind, victims, world)
    rows = fault_matrix.classify(case)
    detail = "\n".join(f"rank {r['rank']}: {r.get('type')} named {r['named']}: {r.get('text', '')[:800]}" for r in rows)
    assert not case["hung"], f"hung: {case['hung']}\n{detail}"
    assert not case["leaked"], f"leaked: {case['leaked']}"
    assert len(rows) == world - len(victims)
    for r in rows:
        assert r["raised"] and r["timeout"], detail
        assert not r["wrong"], detail  # no live rank is ever called stopped
        assert r["right"], detail


def test_named_stopped_reads_the_evidence_sentence_and_older_wordings():
    assert fault_matrix.named_stopped(
        "x; by evidence, stopped: ranks [1, 3] (rank 1: ...); state unknown: ranks [2]"
    ) == {1, 3}
    assert fault_matrix.named_stopped("x; by evidence, stopped: ranks []; alive (heartbeat fresh): ranks [0]") == set()
    assert fault_matrix.unknown_listed("by evidence, stopped: ranks []; state unknown: ranks [2, 5]") == {2, 5}
    assert fault_matrix.named_stopped("ranks [0, 3] did not arrive (timeout ...); they are likely stalled") == {0, 3}
    assert fault_matrix.named_stopped("...; rank 2 is likely stalled or dead, or called ...") == {2}
