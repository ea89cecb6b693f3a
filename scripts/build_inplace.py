"""Fallback build for machines without scikit-build-core/pybind11/CMake (e.g. a bare GPU box
with only torch, nvcc and ninja): compiles ``ultracomm._core`` with
``torch.utils.cpp_extension`` (pybind11 headers ship with torch) and, when nvcc is found,
``ultracomm._cuda`` by invoking nvcc and the host compiler directly (cpp_extension cannot
build .cu files against a CPU torch; _cuda links no torch anyway) into a copy of the package
under ``build/inplace/`` and prints the folder to put on PYTHONPATH.  The source tree is not
touched.  Sources, CUDA architectures and nvcc flags are read from csrc/CMakeLists.txt so the
two builds cannot drift apart.  ``--dry-run`` prints the _cuda commands without running them.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import os
import re
import shlex
import shutil
import subprocess
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CMAKE = os.path.join(ROOT, "csrc", "CMakeLists.txt")


def cmake_list(pattern: str) -> list[str]:
    return re.search(pattern, open(CMAKE).read(), re.S).group(1).split()


def cmake_set(name: str) -> str:
    m = re.search(r"^set\(" + name + r"\s+(.*)\)\s*$", open(CMAKE).read(), re.M)
    return re.sub(r'\s+CACHE\s+STRING\s+".*"$', "", m.group(1)).strip().strip('"')


def cmake_sources() -> list[str]:
    host = cmake_list(r"set\(ULTRACOMM_HOST_SOURCES(.*?)\)")
    bind = cmake_list(r"pybind11_add_module\(_core(.*?)\)")
    return [os.path.join(ROOT, "csrc", s) for s in host + bind]


def build_core(pkg: str, work: str) -> None:
    from torch.utils.cpp_extension import load

    # load() imports the module it built, and _core's init imports ultracomm.errors and
    # ultracomm.records: from this copy (on a bare machine no other ultracomm is installed)
    sys.path.insert(0, os.path.dirname(pkg))
    load(
        name="_core",
        sources=cmake_sources(),
        extra_include_paths=[os.path.join(ROOT, "include"), os.path.join(ROOT, "csrc")],
        extra_cflags=["-O3", "-std=c++20", "-ffp-contract=off"],
        build_directory=work,
        verbose=False,
        is_python_module=True,
    )
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    shutil.copy(os.path.join(work, "_core.so"), os.path.join(pkg, "_core" + suffix))
    # cpp_extension links libc10/libtorch: load torch's libraries before _core in this copy
    init = os.path.join(pkg, "__init__.py")
    text = open(init).read()
    open(init, "w").write(
        text.replace(
            "from __future__ import annotations\n",
            "from __future__ import annotations\n\nimport torch  # noqa: F401\n",
            1,
        )
    )


def find_nvcc() -> str | None:
    for c in (os.environ.get("NVCC"), shutil.which("nvcc"), "/usr/local/cuda/bin/nvcc"):
        if c and os.path.exists(c):
            return os.path.realpath(c)
    return None


def cuda_root(nvcc: str) -> str:
    """The toolkit folder (include/cuda_runtime_api.h): CUDA_HOME, nvcc's parent, /usr/local/cuda."""
    for c in (os.environ.get("CUDA_HOME"), os.path.dirname(os.path.dirname(nvcc)), "/usr/local/cuda"):
        if c and os.path.exists(os.path.join(c, "include", "cuda_runtime_api.h")):
            return c
    raise RuntimeError(f"build_inplace: no CUDA toolkit headers next to {nvcc}; set CUDA_HOME")


def pybind11_include() -> str:
    try:
        import pybind11

        return pybind11.get_include()
    except ImportError:
        import torch.utils.cpp_extension as ce

        for d in ce.include_paths():
            if os.path.exists(os.path.join(d, "pybind11", "pybind11.h")):
                return d
    raise RuntimeError("pybind11 headers not found (pip install pybind11, or a torch that bundles them)")


def cuda_architectures() -> str:
    """ULTRACOMM_CUDA_ARCHITECTURES as the CMake build would get it: a definition in
    SKBUILD_CMAKE_DEFINE (scripts/gpu_check.sh sets the GPU's own, e.g. ``90-real``), else the
    variable in the environment, else csrc/CMakeLists.txt's default (every CI architecture: about
    three times the compile)."""
    m = re.search(
        r"(?:^|;)ULTRACOMM_CUDA_ARCHITECTURES=(.*?)(?=;[A-Za-z_]\w*=|$)", os.environ.get("SKBUILD_CMAKE_DEFINE", "")
    )
    if m and m.group(1).strip():
        return m.group(1).strip()
    return os.environ.get("ULTRACOMM_CUDA_ARCHITECTURES") or cmake_set("ULTRACOMM_CUDA_ARCHITECTURES")


def cuda_commands(nvcc: str, work: str, out: str) -> tuple[list[list[str]], list[str]]:
    """(compile commands, link command) of _cuda: CMake's kernels, host sources and flags, for
    :func:`cuda_architectures`."""
    cuda_home = cuda_root(nvcc)
    inc = [f"-I{ROOT}/include", f"-I{ROOT}/csrc", f"-I{ROOT}/csrc/cuda", f"-I{cuda_home}/include"]
    gencode = []
    for a in cuda_architectures().split(";"):
        num, _, kind = a.partition("-")
        code = f"compute_{num}" if kind == "virtual" else f"sm_{num}"
        gencode.append(f"-gencode=arch=compute_{num.rstrip('a')}{'a' if num.endswith('a') else ''},code={code}")
    nvcc_flags = cmake_set("ULTRACOMM_NVCC_FLAGS").split()
    host_srcs = cmake_list(r"set\(ULTRACOMM_HOST_SOURCES(.*?)\)") + cmake_list(r"pybind11_add_module\(_cuda(.*?)\)")
    kernels = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    py_inc = [f"-I{sysconfig.get_paths()['include']}", f"-I{pybind11_include()}"]
    cxx = os.environ.get("CXX", "c++")
    compiles, objs = [], []
    for src in kernels:
        obj = os.path.join(work, os.path.basename(src) + ".o")
        # --threads 0: the architectures of one file compile in parallel (k_persistent.cu's four
        # are the longest single step of the build)
        compiles.append(
            [
                nvcc,
                "-std=c++20",
                "-O3",
                *inc,
                *gencode,
                *nvcc_flags,
                "--threads",
                "0",
                "-Xcompiler=-fPIC",
                "-c",
                src,
                "-o",
                obj,
            ]
        )
        objs.append(obj)
    for s in host_srcs:
        src = os.path.join(ROOT, "csrc", s)
        obj = os.path.join(work, s.replace("/", "_") + ".o")
        compiles.append(
            [
                cxx,
                "-std=c++20",
                "-O3",
                "-ffp-contract=off",
                "-fPIC",
                "-fvisibility=hidden",
                "-Wall",
                "-Wextra",
                *inc,
                *py_inc,
                "-c",
                src,
                "-o",
                obj,
            ]
        )
        objs.append(obj)
    libdir = next(
        (
            d
            for d in (f"{cuda_home}/lib64", f"{cuda_home}/targets/x86_64-linux/lib", f"{cuda_home}/lib")
            if os.path.exists(os.path.join(d, "libcudart_static.a"))
        ),
        f"{cuda_home}/lib64",
    )
    link = [cxx, "-shared", "-o", out, *objs, f"-L{libdir}", "-lcudart_static", "-ldl", "-lrt", "-lpthread"]
    return compiles, link


def build_cuda(pkg: str, work: str, dry_run: bool) -> bool:
    nvcc = find_nvcc()
    if nvcc is None:
        print("build_inplace: nvcc not found: skipping ultracomm._cuda", file=sys.stderr)
        return False
    os.makedirs(work, exist_ok=True)
    out = os.path.join(pkg, "_cuda" + sysconfig.get_config_var("EXT_SUFFIX"))
    compiles, link = cuda_commands(nvcc, work, out)
    if dry_run:
        for c in [*compiles, link]:
            print(shlex.join(c))
        return True

    def run(cmd):
        p = subprocess.run(cmd, capture_output=True, text=True)
        if p.returncode != 0:
            raise RuntimeError(f"build_inplace: failed:\n{shlex.join(cmd)}\n{p.stdout}{p.stderr}")

    with concurrent.futures.ThreadPoolExecutor(max_workers=os.cpu_count() or 2) as ex:
        list(ex.map(run, compiles))
    run(link)
    return True


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--dry-run", action="store_true", help="print the _cuda build commands only")
    ap.add_argument("--no-cuda", action="store_true", help="build _core only")
    args = ap.parse_args()
    out = os.path.join(ROOT, "build", "inplace")
    pkg = os.path.join(out, "ultracomm")
    if args.dry_run:
        build_cuda(pkg, os.path.join(out, "cuda_obj"), dry_run=True)
        return 0
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "python", "ultracomm"), pkg)
    work = os.path.join(out, "obj")
    os.makedirs(work, exist_ok=True)
    # cpp_extension waits forever on the lock a failed or killed earlier build left behind
    if os.path.exists(os.path.join(work, "lock")):
        os.remove(os.path.join(work, "lock"))
    # _cuda (nvcc, the longest part) builds while cpp_extension builds _core
    with concurrent.futures.ThreadPoolExecutor(max_workers=1) as ex:
        cuda = None if args.no_cuda else ex.submit(build_cuda, pkg, os.path.join(out, "cuda_obj"), False)
        build_core(pkg, work)
        if cuda is not None:
            cuda.result()
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
