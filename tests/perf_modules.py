"""The benches under perf/ (scripts, not a package) as modules for the tests that read them."""

from __future__ import annotations

import importlib.util
import os
import sys
from types import ModuleType

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def load(name: str, fresh: bool = False) -> ModuleType:
    """``perf/<name>.py`` as the module ``name``: loaded once and shared (``fresh``: loaded again)."""
    if fresh or name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, os.path.join(ROOT, "perf", f"{name}.py"))
        mod = importlib.util.module_from_spec(spec)
        sys.modules[name] = mod
        spec.loader.exec_module(mod)
    return sys.modules[name]


def compiled_cuda():
    """``ultracomm._cuda`` for the benches' host-side rules (no device needed), or skip the test:
    it is built wherever nvcc is (CI builds it), so only a build without nvcc skips."""
    import pytest

    from ultracomm.cuda.support import cuda_module

    cuda = cuda_module()
    if cuda is None:
        pytest.skip("ultracomm._cuda is not built here (no nvcc at build time)")
    return cuda
