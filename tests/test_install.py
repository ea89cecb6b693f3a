"""The standard install path a user types, in a fresh venv with build isolation: `pip wheel .`
must configure with whatever CMake the machine has (Debian 12 ships 3.25, which cannot build
the CUDA 20 kernels: pyproject's minimum makes scikit-build-core fetch a newer one), and the
wheel must hold the C++ core and, where nvcc is present, the CUDA module.  The optional extras
must name installable packages."""

from __future__ import annotations

import os
import shutil
import subprocess
import venv
import zipfile

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SKIP = {".git", ".venv", "build", "dist", "__pycache__", ".pytest_cache", ".hypothesis", "out"}


def _copy_source(dst: str) -> None:
    """The source tree without build outputs (the editable build's CMake cache would clash)."""

    def ignore(path, names):
        return [n for n in names if n in SKIP or n.endswith((".so", ".whl"))]

    shutil.copytree(ROOT, dst, ignore=ignore)


@pytest.fixture(scope="module")
def fresh_venv(tmp_path_factory):
    d = tmp_path_factory.mktemp("install")
    venv.create(d / "v", with_pip=True)
    return d, str(d / "v" / "bin" / "python")


@pytest.mark.slow
def test_isolated_pip_wheel_contains_core_and_cuda(fresh_venv):
    d, py = fresh_venv
    src = str(d / "src")
    _copy_source(src)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ULTRACOMM_", "PIP_NO_BUILD_ISOLATION"))}
    env["CMAKE_BUILD_PARALLEL_LEVEL"] = "2"
    p = subprocess.run(
        [py, "-m", "pip", "wheel", src, "--no-deps", "-w", str(d / "wheels")],
        capture_output=True,
        text=True,
        env=env,
        timeout=2400,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-6000:]
    wheels = list((d / "wheels").glob("ultracomm-*.whl"))
    assert len(wheels) == 1, wheels
    names = zipfile.ZipFile(wheels[0]).namelist()
    assert any(n.startswith("ultracomm/_core.") and n.endswith(".so") for n in names), names
    if shutil.which("nvcc") or os.path.exists("/usr/local/cuda/bin/nvcc"):
        assert any(n.startswith("ultracomm/_cuda.") and n.endswith(".so") for n in names), names
    meta = zipfile.ZipFile(wheels[0]).read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    assert 'Requires-Dist: nvshmem4py-cu13; extra == "nvshmem"' in meta, meta
    assert 'Requires-Dist: cuda-python; extra == "cuda"' in meta, meta


@pytest.mark.slow
def test_the_optional_extras_resolve(fresh_venv):
    """`pip install ultracomm[nvshmem]` / `[cuda]` pull these: they must exist for this Python."""
    _, py = fresh_venv
    p = subprocess.run(
        [py, "-m", "pip", "install", "--dry-run", "--no-deps", "nvshmem4py-cu13", "cuda-python"],
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "Would install" in p.stdout and "nvshmem4py-cu13" in p.stdout and "cuda-python" in p.stdout, p.stdout
