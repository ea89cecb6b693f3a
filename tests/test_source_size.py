"""No file under csrc/ (C++, CUDA, headers) is longer than 600 lines (project standard)."""
from __future__ import annotations

from pathlib import Path

CSRC = Path(__file__).resolve().parents[1] / "csrc"
LIMIT = 600
SUFFIXES = {".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh", ".txt"}


def test_no_csrc_file_over_600_lines():
    files = [p for p in CSRC.rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    assert any(p.name == "host_executor.cpp" for p in files)  # the walk found the sources
    over = {str(p.relative_to(CSRC)): n for p in files if (n := len(p.read_text(errors="replace").splitlines())) > LIMIT}
    assert not over, f"csrc/ files over {LIMIT} lines (split them: one small file per idea): {over}"
