"""Compile-only checks of the CUDA sources (no GPU needed): builds every ``csrc/cuda/*.cu`` for
each real architecture of csrc/CMakeLists.txt with the same nvcc flags (warnings as errors,
ptxas refusing spills and local memory) plus ``-Xptxas -v``, and disassembles the objects with
``cuobjdump`` (PyPI ``nvidia-cuda-cuobjdump``).  Results are cached under
``build/cuda-check/<hash of sources, flags and nvcc>`` so a session compiles once.
"""

from __future__ import annotations

import glob
import hashlib
import os
import re
import shutil
import site
import subprocess
import sys
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CMAKE = os.path.join(ROOT, "csrc", "CMakeLists.txt")


def cmake_value(name: str) -> str:
    """The value of ``set(NAME ...)`` in csrc/CMakeLists.txt (first line, CACHE part dropped)."""
    text = open(CMAKE).read()
    m = re.search(r"^set\(" + name + r"\s+(.*)\)\s*$", text, re.M)
    if not m:
        raise RuntimeError(f"{name} not set in {CMAKE}")
    v = m.group(1)
    v = re.sub(r'\s+CACHE\s+STRING\s+".*"$', "", v)
    return v.strip().strip('"')


def nvcc_flags() -> list[str]:
    return cmake_value("ULTRACOMM_NVCC_FLAGS").split()


def real_archs() -> list[int]:
    """SASS architectures of the build, e.g. [80, 90, 100] for "80-real;90-real;100-real;100-virtual"."""
    out = []
    for a in cmake_value("ULTRACOMM_CUDA_ARCHITECTURES").split(";"):
        if a.endswith("-virtual"):
            continue
        out.append(int(a.split("-")[0].rstrip("a")))
    return out


def find_nvcc() -> str | None:
    for c in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.exists(c):
            return c
    return None


def find_tool(name: str) -> str | None:
    """cuobjdump / nvdisasm: PyPI's nvidia-cuda-* wheels (site-packages/nvidia/cu*/bin), then PATH."""
    dirs = [*site.getsitepackages(), site.getusersitepackages(), *sys.path]
    for d in dirs:
        for p in glob.glob(os.path.join(d, "nvidia", "cu*", "bin", name)) + glob.glob(
            os.path.join(d, "nvidia", "cuda_*", "bin", name)
        ):
            if os.access(p, os.X_OK):
                return p
    return shutil.which(name)


def sources() -> list[str]:
    return sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))


def _digest(nvcc: str) -> str:
    h = hashlib.sha256()
    # what nvcc reads: kernels and headers (the host-only .cpp files do not invalidate the cache)
    files = sorted(
        f
        for f in glob.glob(os.path.join(ROOT, "csrc", "cuda", "*"))
        + glob.glob(os.path.join(ROOT, "include", "ultracomm", "**", "*.h"), recursive=True)
        if not f.endswith(".cpp")
    )
    for f in files:
        h.update(f.encode())
        h.update(open(f, "rb").read())
    h.update(" ".join(nvcc_flags()).encode())
    h.update(repr(real_archs()).encode())
    h.update(subprocess.run([nvcc, "--version"], capture_output=True, text=True).stdout.encode())
    return h.hexdigest()[:16]


@dataclass
class Compiled:
    source: str
    obj: str
    log: str  # nvcc + ptxas -v output
    sass: dict[int, str] = field(default_factory=dict)  # arch -> cuobjdump -sass text


def compile_all(jobs: int = 2) -> dict[str, Compiled]:
    """Compile every CUDA source (cached); raises RuntimeError with nvcc's output on failure."""
    nvcc = find_nvcc()
    if nvcc is None:
        raise FileNotFoundError("nvcc not found")
    out = os.path.join(ROOT, "build", "cuda-check", _digest(nvcc))
    os.makedirs(out, exist_ok=True)
    gencode = [f"-gencode=arch=compute_{a},code=sm_{a}" for a in real_archs()]
    result = {}
    for src in sources():
        name = os.path.splitext(os.path.basename(src))[0]
        obj, log = os.path.join(out, name + ".o"), os.path.join(out, name + ".log")
        if not (os.path.exists(obj) and os.path.exists(log)):
            cmd = [
                nvcc,
                "-std=c++20",
                "-O3",
                f"-I{ROOT}/include",
                *gencode,
                *nvcc_flags(),
                "-Xptxas=-v",
                f"--threads={jobs}",
                "-c",
                src,
                "-o",
                obj + ".tmp",
            ]
            p = subprocess.run(cmd, capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"nvcc failed on {name}.cu:\n{' '.join(cmd)}\n{p.stdout}{p.stderr}")
            open(log, "w").write(p.stdout + p.stderr)
            os.replace(obj + ".tmp", obj)
        result[name] = Compiled(src, obj, open(log).read())
    return result


def sass(c: Compiled, arch: int) -> str:
    """cuobjdump -sass of one architecture's cubin in a compiled object (cached on the object)."""
    if arch not in c.sass:
        path = c.obj + f".sm_{arch}.sass"
        if not os.path.exists(path):
            tool = find_tool("cuobjdump")
            if tool is None:
                raise FileNotFoundError("cuobjdump not found (pip install nvidia-cuda-cuobjdump)")
            p = subprocess.run([tool, "-sass", "-arch", f"sm_{arch}", c.obj], capture_output=True, text=True)
            if p.returncode != 0:
                raise RuntimeError(f"cuobjdump failed: {p.stderr}")
            open(path + ".tmp", "w").write(p.stdout)
            os.replace(path + ".tmp", path)
        c.sass[arch] = open(path).read()
    return c.sass[arch]


def kernel_sass(text: str) -> dict[str, str]:
    """Split cuobjdump -sass text into {mangled function name: its instructions}."""
    parts = re.split(r"^\s+Function : (\S+)\s*$", text, flags=re.M)
    return {parts[i]: parts[i + 1] for i in range(1, len(parts) - 1, 2)}


def ptxas_functions(log: str) -> dict[tuple[str, str], str]:
    """{(arch, function): its 'Function properties' lines} from an -Xptxas -v log."""
    out = {}
    arch = None
    lines = log.splitlines()
    for i, line in enumerate(lines):
        m = re.search(r"Compiling entry function '(\S+)' for '(sm_\w+)'", line)
        if m:
            arch = m.group(2)
        m = re.search(r"Function properties for (\S+)", line)
        if m and arch:
            out[(arch, m.group(1))] = "\n".join(lines[i + 1 : i + 3])
    return out


def kernel_texts(source: str, function: str) -> list[str]:
    """The SASS of the one kernel whose mangled name contains ``function`` in ``csrc/cuda/<source>.cu``,
    one text per real architecture; skips the calling test when nvcc or cuobjdump is missing."""
    import pytest

    if find_nvcc() is None or find_tool("cuobjdump") is None:
        pytest.skip("nvcc / cuobjdump not found")
    c = compile_all()[source]
    out = []
    for arch in real_archs():
        fns = [v for k, v in kernel_sass(sass(c, arch)).items() if function in k]
        assert len(fns) == 1, f"{function} in {source}.cu for sm_{arch}: {len(fns)} kernels"
        out.append(fns[0])
    return out
