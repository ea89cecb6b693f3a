"""Fallback build for machines without scikit-build-core/pybind11/CMake (e.g. a bare GPU box
with only torch, nvcc and ninja): compiles ``ultracomm._core`` with
``torch.utils.cpp_extension`` (pybind11 headers ship with torch) into a copy of the package
under ``build/inplace/`` and prints the folder to put on PYTHONPATH.  The source tree is not
touched.  Sources are read from csrc/CMakeLists.txt so the two builds cannot drift apart.
"""
from __future__ import annotations

import os
import re
import shutil
import sys
import sysconfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def cmake_sources() -> list[str]:
    text = open(os.path.join(ROOT, "csrc", "CMakeLists.txt")).read()
    host = re.search(r"set\(ULTRACOMM_HOST_SOURCES(.*?)\)", text, re.S).group(1).split()
    bind = re.search(r"pybind11_add_module\(_core(.*?)\)", text, re.S).group(1).split()
    return [os.path.join(ROOT, "csrc", s) for s in host + bind]


def main() -> int:
    from torch.utils.cpp_extension import load

    out = os.path.join(ROOT, "build", "inplace")
    pkg = os.path.join(out, "ultracomm")
    shutil.rmtree(pkg, ignore_errors=True)
    shutil.copytree(os.path.join(ROOT, "python", "ultracomm"), pkg)
    work = os.path.join(out, "obj")
    os.makedirs(work, exist_ok=True)
    load(name="_core", sources=cmake_sources(), extra_include_paths=[os.path.join(ROOT, "include")],
         extra_cflags=["-O3", "-std=c++20"], build_directory=work, verbose=False, is_python_module=True)
    suffix = sysconfig.get_config_var("EXT_SUFFIX")
    shutil.copy(os.path.join(work, "_core.so"), os.path.join(pkg, "_core" + suffix))
    # cpp_extension links libc10/libtorch: load torch's libraries before _core in this copy
    init = os.path.join(pkg, "__init__.py")
    text = open(init).read()
    open(init, "w").write(text.replace("from __future__ import annotations\n",
                                       "from __future__ import annotations\n\nimport torch  # noqa: F401\n", 1))
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
