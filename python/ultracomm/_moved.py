"""Old import paths of modules that moved (the layout in README.md).

Each old path is a module of one call, ``alias(globals(), "<new path>")``: it makes the old name
the moved module itself (the same object in ``sys.modules``, so attributes and monkeypatches
agree) and warns once, naming the new path.  ``python -m <old path>`` runs the new module.
"""
from __future__ import annotations

import importlib
import runpy
import sys
import warnings


def _importer_level() -> int:
    """The ``stacklevel`` that names the code importing the old path (past ``importlib.import_module``
    and ``ultracomm``'s lazy attributes), so Python's default filters show it where that is ``__main__``."""
    level, frame = 3, sys._getframe(3)  # 1: alias, 2: the old path's module
    while frame is not None:
        if not ("importlib" in frame.f_code.co_filename and "_bootstrap" in frame.f_code.co_filename):
            if frame.f_globals.get("__name__") not in ("importlib", "ultracomm"):
                return level
            level += 1  # warnings skips the import system's own frames, not these
        frame = frame.f_back
    return level


def alias(old_globals: dict, new: str) -> None:
    """Called by the module at an old path with its ``globals()``; ``new`` is the moved module."""
    old = old_globals["__spec__"].name
    message = f"{old} is deprecated: import {new} (the module moved there)"
    if old_globals["__name__"] == "__main__":  # python -m <old>
        warnings.warn(message, DeprecationWarning, stacklevel=2)
        runpy.run_module(new, run_name="__main__", alter_sys=True)
        return
    warnings.warn(message, DeprecationWarning, stacklevel=_importer_level())
    sys.modules[old] = importlib.import_module(new)
