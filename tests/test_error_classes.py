"""Every error the package raises for a cause it detected is an ``UltracommError`` (errors.py's
promise, issue 35's contract): this test reads every ``raise`` in python/ultracomm and refuses a
builtin exception class, except where Python's protocols or an upstream contract ask for one
(``ALLOWED``, each with its reason).  Also: the input classes stay what generic handlers catch."""

from __future__ import annotations

import ast
import builtins
import pathlib

import numpy as np
import pytest

import ultracomm
from ultracomm.errors import InputError, InputTypeError, UltracommError, same_kind

PACKAGE = pathlib.Path(ultracomm.__file__).parent
BUILTIN = {
    name
    for name in dir(builtins)
    if isinstance(getattr(builtins, name), type) and issubclass(getattr(builtins, name), BaseException)
}

#: (module, enclosing function, builtin class): why a builtin is right there
ALLOWED = {
    ("__init__.py", "__getattr__", "AttributeError"): "a module __getattr__ must raise AttributeError",
    ("layout.py", "Member.__post_init__", "TypeError"): "caught by the try around it, turned into a LayoutError",
    ("profile/trace.py", "Trace.find", "KeyError"): "a lookup by key: Python's protocol for a missing key",
    ("tools/bench.py", "", "SystemExit"): "the command line's exit status",
    # the UltraEP adapter keeps upstream's types and texts (Dots-Infra/UltraEP v1.0.0 94cab099,
    # ultra_ep/manager.py; tests/integrations/test_integration_ultraep_contract.py checks them)
    ("integrations/ultraep.py", "Manager.update_placement", "AssertionError"): "UltraEP: verify_reduced_loads asserts",
    ("integrations/ultraep.py", "Manager.__init__", "TypeError"): "UltraEP: check_dtype's TypeError",
    ("integrations/ultraep.py", "Manager.__init__", "ValueError"): "UltraEP: fp32 gradients only",
    ("integrations/ultraep.py", "Manager.set_weight_sync_plan_mode", "ValueError"): "UltraEP: plan_mode's values",
    ("integrations/ultraep.py", "Manager.reroute", "ValueError"): "UltraEP: backend='cuda' only",
    ("blame.py", "status_offsets", "AssertionError"): "an invariant of ultracomm's own window layout",
    ("moe/reroute.py", "RerouteTable.from_result", "AssertionError"): "an invariant: a planner bug",
    ("planners/base.py", "build_result", "AssertionError"): "an invariant: a planner bug",
    ("transports/copy_engine/watchdog.py", "Watchdog._error", "AssertionError"): "unreachable: raise_record raises",
}


def builtin_raises(package: pathlib.Path = PACKAGE) -> list[tuple[str, str, str, int]]:
    """(module, enclosing function, builtin class, line) of every builtin raised in ``package``."""
    found = []
    for path in sorted(package.rglob("*.py")):
        rel = path.relative_to(package).as_posix()
        scope: list[str] = []

        class Visitor(ast.NodeVisitor):
            def generic_visit(self, node):
                named = isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                if named:
                    scope.append(node.name)
                super().generic_visit(node)
                if named:
                    scope.pop()

            def visit_Raise(self, node):
                exc = node.exc
                func = exc.func if isinstance(exc, ast.Call) else exc
                if isinstance(func, ast.Name) and func.id in BUILTIN:
                    found.append((rel, ".".join(scope), func.id, node.lineno))
                self.generic_visit(node)

            def visit_FunctionDef(self, node):
                # a helper that builds the error its callers raise counts as a raise (not one that
                # passes any exception on: -> BaseException / Exception)
                returns = node.returns
                if isinstance(returns, ast.Name) and returns.id in BUILTIN - {"BaseException", "Exception"}:
                    found.append((rel, ".".join([*scope, node.name]), returns.id, node.lineno))
                self.generic_visit(node)

        Visitor().visit(ast.parse(path.read_text(), str(path)))
    return found


def test_no_builtin_exception_is_raised_for_a_cause_ultracomm_detected():
    found = builtin_raises()
    bad = [
        f"{rel}:{line} ({where or 'module'}) raises {name}"
        for rel, where, name, line in found
        if (rel, where, name) not in ALLOWED
    ]
    assert not bad, (
        "raise ultracomm's classes (errors.py: InputError for a bad value, InputTypeError for a bad type, "
        "UltracommTimeout, UltracommError), or add the place to ALLOWED with its reason:\n" + "\n".join(bad)
    )
    # every allowance still names a place that exists (none outlives its code)
    assert {(rel, where, name) for rel, where, name, _ in found} >= set(ALLOWED)


def test_the_scan_sees_raises_helpers_and_nesting(tmp_path):
    """The reader itself: a raise in a nested method and a helper returning a builtin are found."""
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "m.py").write_text(
        "class A:\n    def f(self):\n        raise ValueError('x')\n"
        "def g() -> TypeError:\n    return TypeError('y')\n"
        "def h():\n    raise InputError('fine')\n"
    )
    assert builtin_raises(pkg) == [("m.py", "A.f", "ValueError", 3), ("m.py", "g", "TypeError", 4)]


#: (module, class): why an exception class of the package need not be an UltracommError
INTERNAL_CLASSES = {
    ("comm.py", "_BoardUnreachable"): "a signal inside comm.py, raised again as UltracommTimeout / UltracommError",
    ("env_values.py", "_Bad"): "a parse failure env.py turns into a ConfigError naming the variable",
    ("transports/p2p/messengers.py", "PostError"): "caught by the p2p and split transports (peer_failure)",
    ("wire.py", "WireError"): "caught by comm.py, raised again as an UltracommError",
}


def test_every_exception_class_the_package_defines_is_an_ultracomm_error():
    """The raise scan above sees builtin names only: a class of the package's own that derives from
    a builtin (PrivateDirError, TraceExistsError, DriverError were ValueError / RuntimeError only)
    escaped 'except UltracommError' as surely.  Every class whose bases name a builtin exception
    names UltracommError (or a subclass) too, unless it is internal (INTERNAL_CLASSES)."""
    import importlib

    bad = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, ast.ClassDef) or (rel, node.name) in INTERNAL_CLASSES:
                continue
            if not any(isinstance(b, ast.Name) and b.id in BUILTIN for b in node.bases) or rel == "errors.py":
                continue
            module = importlib.import_module(
                "ultracomm." + rel[: -len(".py")].replace("/", ".").removesuffix(".__init__")
            )
            if not issubclass(getattr(module, node.name), UltracommError):
                bad.append(f"{rel}:{node.lineno} {node.name}")
    assert not bad, "derive from ultracomm.errors' classes, or add to INTERNAL_CLASSES with its reason:\n" + "\n".join(
        bad
    )


@pytest.mark.parametrize("cls, builtin", [(InputError, ValueError), (InputTypeError, TypeError)])
def test_input_errors_are_caught_by_both_handlers(cls, builtin):
    e = cls("ultracomm: bad")
    assert isinstance(e, UltracommError) and isinstance(e, builtin) and isinstance(e, RuntimeError)
    again = same_kind(e, "ultracomm: later")  # raised again by a later call: the same kind
    assert type(again) is cls and str(again) == "ultracomm: later"


def test_the_cores_argument_errors_are_input_errors():
    """The C++ modules translate their std::invalid_argument into ultracomm's InputError (module-local:
    csrc/bindings/py_errors.h) and _cuda's CudaError is an UltracommError."""
    from ultracomm import _core

    assert _core.InputError is InputError
    with pytest.raises(InputError, match="^ultracomm: build_schedule: max_depth must be in"):
        _core.build_schedule(
            2,
            1,
            2,
            np.array([1, 0], np.int32),
            np.array([0, 1], np.int32),
            None,
            64,
            64,
            16,
            0,
            0,
            1e9,
            1e9,
            -1,
            0.0,
            0.0,
        )
    cuda = pytest.importorskip("ultracomm._cuda")
    assert cuda.InputError is InputError and issubclass(cuda.CudaError, UltracommError)


def test_public_calls_raise_input_errors():
    """Two of the converted places (a name, a type), as a user meets them: the class and the message."""
    from ultracomm import Context, LoopbackDomain
    from ultracomm.planners import get_planner

    with pytest.raises(InputError, match=r"^ultracomm: unknown planner 'nope'; choose one of \["):
        get_planner("nope")
    with pytest.raises(InputTypeError, match="^ultracomm: layout must be an ExpertLayout, got str$"):
        Context(LoopbackDomain(1).group(0), "not a layout", 1, 1, 1)
