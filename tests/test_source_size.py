"""No file under csrc/ (C++, CUDA, headers) and no Python file under python/ is longer than 600
lines (project standard); the API's Context (``context.py``) and the ReplicaManager
(``moe/manager.py``) are held to 500 (issue 36)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
CSRC = ROOT / "csrc"
PYTHON = ROOT / "python"
LIMIT = 600
SUFFIXES = {".cpp", ".cc", ".h", ".hpp", ".cu", ".cuh", ".txt"}
#: Python files held below LIMIT, by path under python/
PYTHON_LIMITS = {"ultracomm/context.py": 500, "ultracomm/moe/manager.py": 500}


def _lines(p: Path) -> int:
    return len(p.read_text(errors="replace").splitlines())


def test_no_csrc_file_over_600_lines():
    files = [p for p in CSRC.rglob("*") if p.is_file() and p.suffix in SUFFIXES]
    assert any(p.name == "host_executor.cpp" for p in files)  # the walk found the sources
    over = {str(p.relative_to(CSRC)): n for p in files if (n := _lines(p)) > LIMIT}
    assert not over, f"csrc/ files over {LIMIT} lines (split them: one small file per idea): {over}"


def _python_files() -> dict[str, Path]:
    return {p.relative_to(PYTHON).as_posix(): p for p in PYTHON.rglob("*.py") if p.is_file()}


def test_no_python_file_over_600_lines():
    files = _python_files()
    assert "ultracomm/__init__.py" in files  # the walk found the package
    over = {rel: n for rel, p in files.items() if (n := _lines(p)) > LIMIT}
    assert not over, f"python/ files over {LIMIT} lines (split them: one small file per idea): {over}"


def test_context_and_manager_within_500_lines():
    files = _python_files()
    missing = sorted(set(PYTHON_LIMITS) - set(files))
    assert not missing, f"files with their own size limit no longer exist (update PYTHON_LIMITS): {missing}"
    over = {rel: (n, limit) for rel, limit in PYTHON_LIMITS.items() if (n := _lines(files[rel])) > limit}
    assert not over, f"python/ files over their limit, {{path: (lines, limit)}}: {over}"
