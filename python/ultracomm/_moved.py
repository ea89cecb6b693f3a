"""Old import paths of modules that moved (the layout in README.md): one table, no files.

:data:`MOVED` maps each old dotted name to the module that now holds its code.  A finder that
``import ultracomm`` puts first on ``sys.meta_path`` answers for exactly these names: importing an
old path (``import``, ``from ... import``, ``importlib.import_module``) gives the moved module itself
(the same object in ``sys.modules``, so attributes and monkeypatches agree) and warns once with a
``DeprecationWarning`` naming the new path, attributed to the code that imported it.
``python -m <old path>`` warns and runs the new module as ``__main__``.

A module that moves adds one line here (tests/test_moved_paths.py lists the same table).
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import runpy
import sys
import warnings
from types import CodeType, ModuleType

#: old dotted name -> the module it moved to (a chain is followed: the message names the first hop)
MOVED: dict[str, str] = {
    # platform: CUDA driver/runtime, loopback launches, SM budget, hardware profiles, fabric
    "ultracomm.cuda_driver": "ultracomm.cuda.driver",
    "ultracomm.cuda_loopback": "ultracomm.cuda.loopback",
    "ultracomm.cuda_support": "ultracomm.cuda.support",
    "ultracomm.fabric": "ultracomm.cuda.fabric",
    "ultracomm.hwprofile": "ultracomm.cuda.hwprofile",
    "ultracomm.loopback_launch": "ultracomm.cuda.loopback_launch",
    "ultracomm.sm_budget": "ultracomm.cuda.sm_budget",
    "ultracomm.stream_ordered": "ultracomm.cuda.stream_ordered",
    # data plane
    "ultracomm.domains": "ultracomm.dataplane.domains",
    "ultracomm.transports.bridge": "ultracomm.transports.split.bridge",
    "ultracomm.transports.bridge_direct": "ultracomm.transports.split.bridge_direct",
    "ultracomm.transports.bridge_program": "ultracomm.transports.split.bridge_program",
    "ultracomm.transports.copy_engine_plan": "ultracomm.transports.copy_engine.plan",
    "ultracomm.transports.copy_engine_watchdog": "ultracomm.transports.copy_engine.watchdog",
    "ultracomm.transports.p2p_messengers": "ultracomm.transports.p2p.messengers",
    "ultracomm.transports.p2p_waves": "ultracomm.transports.p2p.waves",
    "ultracomm.transports.plan_slots": "ultracomm.transports.tma.plan_slots",
    "ultracomm.transports.shadow": "ultracomm.transports.split.shadow",
    "ultracomm.transports.split_cuda": "ultracomm.transports.split.cuda",
    "ultracomm.transports.split_cuda_movers": "ultracomm.transports.split.cuda_movers",
    "ultracomm.transports.split_cuda_shadow": "ultracomm.transports.split.cuda_shadow",
    "ultracomm.transports.split_cuda_watchdog": "ultracomm.transports.split.cuda_watchdog",
    "ultracomm.transports.split_stream": "ultracomm.transports.split.stream",
    "ultracomm.transports.tma_loopback": "ultracomm.transports.tma.loopback",
    "ultracomm.transports.who_stopped": "ultracomm.transports.host.who_stopped",
    # tools
    "ultracomm.bench": "ultracomm.tools.bench",
    "ultracomm.echo_shm": "ultracomm.tools.echo_shm",
    "ultracomm.planners.eval": "ultracomm.tools.planner_eval",
    "ultracomm.planners.eval_refs": "ultracomm.tools.planner_refs",
    "ultracomm.planners.planted": "ultracomm.tools.planted",
    "ultracomm.reference": "ultracomm.tools.reference",
    "ultracomm.whatif": "ultracomm.tools.whatif",
    "ultracomm.workloads": "ultracomm.tools.workloads",
    "ultracomm.tools.workloads": "ultracomm.scenarios",
}


def message(old: str) -> str:
    """The DeprecationWarning's text for ``old``."""
    return f"{old} is deprecated: import {MOVED[old]} (the module moved there)"


def target(old: str) -> str:
    """The module that holds ``old``'s code now (following chains of moves)."""
    seen = {old}
    new = MOVED[old]
    while new in MOVED and new not in seen:
        seen.add(new)
        new = MOVED[new]
    return new


def _internal(frame) -> bool:
    """A frame of the import system that ``warnings`` skips when it counts ``stacklevel``."""
    name = frame.f_code.co_filename
    return "importlib" in name and "_bootstrap" in name


def _importer_level() -> int:
    """The ``stacklevel``, for a ``warnings.warn`` in the caller, that names the code importing the
    old path: past the import system, ``importlib.import_module``, ``ultracomm``'s lazy attributes
    and this module (so Python's default filters show it where that code is ``__main__``)."""
    level, frame = 1, sys._getframe(1)  # 1: the frame that calls warnings.warn
    frame = frame.f_back
    while frame is not None:
        if not _internal(frame):  # warnings counts only these
            level += 1
            if frame.f_globals.get("__name__") not in ("importlib", "ultracomm", __name__):
                return level
        frame = frame.f_back
    return level


class _Loader(importlib.abc.Loader):
    """Loads an old path as the moved module (``sys.modules[old]`` becomes it)."""

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a plain module, replaced by the moved one in exec_module

    def exec_module(self, module: ModuleType) -> None:
        old = module.__spec__.name
        warnings.warn(message(old), DeprecationWarning, stacklevel=_importer_level())
        # the import system hands out whatever sys.modules[old] is once this returns
        sys.modules[old] = importlib.import_module(target(old))

    def is_package(self, fullname: str) -> bool:
        return False

    def get_code(self, fullname: str) -> CodeType:
        """``python -m <old path>``: runpy runs this code as ``__main__``."""
        return compile(
            f"import {__name__}\n{__name__}.run_main({fullname!r})\n",
            f"<{fullname}: moved to {MOVED[fullname]}>",
            "exec",
        )

    def get_source(self, fullname: str) -> None:
        return None


class _Finder(importlib.abc.MetaPathFinder):
    """Answers for the names of :data:`MOVED` only (ahead of the path and editable-install finders)."""

    def find_spec(self, fullname: str, path=None, target=None) -> importlib.machinery.ModuleSpec | None:
        if fullname not in MOVED:
            return None
        return importlib.machinery.ModuleSpec(fullname, _LOADER, origin=f"moved to {MOVED[fullname]}")


_LOADER = _Loader()
FINDER = _Finder()


def run_main(old: str) -> None:
    """``python -m <old path>``: warn (attributed to ``__main__``, so it shows), run the new module."""
    warnings.warn(message(old), DeprecationWarning, stacklevel=2)
    runpy.run_module(target(old), run_name="__main__", alter_sys=True)


def install() -> None:
    """Put the finder first on ``sys.meta_path`` (once)."""
    if FINDER not in sys.meta_path:
        sys.meta_path.insert(0, FINDER)
