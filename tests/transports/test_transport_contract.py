"""Issue 36: every transport declares what Context asks of it (ultracomm.transports.base), and
the declarations are true of its code: the options are keywords its constructor takes, a
transport that takes a slot has ``run(..., slot=)``, one with window flags has ``reject``,
one that names ranks by evidence has a ``witness`` the Context can set.  Context itself calls
transports only through the declarations (no ``getattr``/``inspect`` probes of a transport)."""

from __future__ import annotations

import ast
import importlib
import inspect
from pathlib import Path

import pytest

import ultracomm
from ultracomm.transports.base import OPTIONS, Transport

CLASSES = {
    "host": "ultracomm.transports.host:HostTransport",
    "p2p": "ultracomm.transports.p2p:P2PTransport",
    "split": "ultracomm.transports.split:SplitTransport",
    "tma": "ultracomm.transports.tma:TmaTransport",
    "copy_engine": "ultracomm.transports.copy_engine:CopyEngineTransport",
    "split_cuda": "ultracomm.transports.split.cuda:SplitCudaTransport",
}
COMMON = {"rank", "world", "window", "wlayout", "layout", "timeout_s"}


def _load(spec: str) -> type:
    mod, cls = spec.split(":")
    try:
        return getattr(importlib.import_module(mod), cls)
    except ImportError as e:  # tma / copy_engine / split on CUDA need the _cuda module's Python side
        pytest.skip(f"{spec} needs the _cuda module, built only where nvcc is found: {e}")


@pytest.mark.parametrize("key", sorted(CLASSES))
def test_declarations_are_true_of_the_code(key):
    cls = _load(CLASSES[key])
    assert issubclass(cls, Transport)
    params = inspect.signature(cls).parameters
    var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    assert COMMON <= set(params), f"{cls.__name__} lacks common constructor keywords"
    assert cls.options <= OPTIONS
    assert all(o in params or var_kw for o in cls.options), f"{cls.__name__} declares options it does not take"
    required = {
        n
        for n, p in params.items()
        if p.default is inspect.Parameter.empty and p.kind is inspect.Parameter.KEYWORD_ONLY
    }
    assert required <= COMMON | cls.options, f"{cls.__name__} requires {sorted(required - COMMON - cls.options)}"
    run = inspect.signature(cls.run).parameters
    assert ("slot" in run) == cls.takes_slot
    assert ("stream" in run) == cls.stream_ordered
    assert (
        cls.reject is not getattr(Transport, "reject", None) if hasattr(cls, "reject") else False
    ) == cls.window_flags
    if cls.names_by_evidence:
        assert "witness" in cls.__dict__ or "witness" in inspect.getsource(cls.__init__)
    if cls.build_on_device:
        assert cls.stream_ordered and cls.takes_slot


def test_context_does_not_probe_transports():
    root = Path(ultracomm.__file__).parent
    for rel in ("context.py", "cuda/stream_ordered.py", "dataplane/__init__.py", "moe/manager.py"):
        tree = ast.parse((root / rel).read_text())
        for node in ast.walk(tree):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
            ):
                target = ast.unparse(node.args[0])
                assert "transport" not in target, f"{rel}:{node.lineno}: {ast.unparse(node)} probes a transport"
            if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id == "inspect":
                pytest.fail(f"{rel}:{node.lineno}: inspect.{node.attr}: declare it on the transport instead")


def test_unknown_options_are_refused_at_class_creation():
    with pytest.raises(TypeError, match=r"declares unknown options \['colour'\]"):
        type("Odd", (Transport,), {"name": "odd", "window_providers": (), "options": frozenset({"colour"})})
