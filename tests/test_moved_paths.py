"""The old import paths of modules that moved (README, Layout): each gives the moved module itself
and a DeprecationWarning naming the new path; ``python -m`` on an old tool path runs the tool."""

from __future__ import annotations

import importlib
import os
import re
import subprocess
import sys

import pytest

import ultracomm

MOVED = {
    "ultracomm.cuda_driver": "ultracomm.cuda.driver",
    "ultracomm.fabric": "ultracomm.cuda.fabric",
    "ultracomm.hwprofile": "ultracomm.cuda.hwprofile",
    "ultracomm.cuda_loopback": "ultracomm.cuda.loopback",
    "ultracomm.loopback_launch": "ultracomm.cuda.loopback_launch",
    "ultracomm.sm_budget": "ultracomm.cuda.sm_budget",
    "ultracomm.stream_ordered": "ultracomm.cuda.stream_ordered",
    "ultracomm.cuda_support": "ultracomm.cuda.support",
    "ultracomm.domains": "ultracomm.dataplane.domains",
    "ultracomm.bench": "ultracomm.tools.bench",
    "ultracomm.echo_shm": "ultracomm.tools.echo_shm",
    "ultracomm.planners.eval": "ultracomm.tools.planner_eval",
    "ultracomm.planners.eval_refs": "ultracomm.tools.planner_refs",
    "ultracomm.planners.planted": "ultracomm.tools.planted",
    "ultracomm.reference": "ultracomm.tools.reference",
    "ultracomm.whatif": "ultracomm.tools.whatif",
    "ultracomm.workloads": "ultracomm.tools.workloads",
    "ultracomm.tools.workloads": "ultracomm.scenarios",
    "ultracomm.transports.copy_engine_plan": "ultracomm.transports.copy_engine.plan",
    "ultracomm.transports.copy_engine_watchdog": "ultracomm.transports.copy_engine.watchdog",
    "ultracomm.transports.who_stopped": "ultracomm.transports.host.who_stopped",
    "ultracomm.transports.p2p_messengers": "ultracomm.transports.p2p.messengers",
    "ultracomm.transports.p2p_waves": "ultracomm.transports.p2p.waves",
    "ultracomm.transports.bridge": "ultracomm.transports.split.bridge",
    "ultracomm.transports.bridge_direct": "ultracomm.transports.split.bridge_direct",
    "ultracomm.transports.bridge_program": "ultracomm.transports.split.bridge_program",
    "ultracomm.transports.split_cuda": "ultracomm.transports.split.cuda",
    "ultracomm.transports.split_cuda_movers": "ultracomm.transports.split.cuda_movers",
    "ultracomm.transports.split_cuda_shadow": "ultracomm.transports.split.cuda_shadow",
    "ultracomm.transports.split_cuda_watchdog": "ultracomm.transports.split.cuda_watchdog",
    "ultracomm.transports.shadow": "ultracomm.transports.split.shadow",
    "ultracomm.transports.split_stream": "ultracomm.transports.split.stream",
    "ultracomm.transports.tma_loopback": "ultracomm.transports.tma.loopback",
    "ultracomm.transports.plan_slots": "ultracomm.transports.tma.plan_slots",
}
PKG = os.path.dirname(ultracomm.__file__)


def _forget(name: str) -> None:
    """Drop an old path from sys.modules and its parent, so the next import runs its module again."""
    sys.modules.pop(name, None)
    parent, _, leaf = name.rpartition(".")
    vars(sys.modules[parent]).pop(leaf, None)


@pytest.mark.parametrize("old", sorted(MOVED))
def test_old_path_is_the_moved_module_and_warns(old):
    new = importlib.import_module(MOVED[old])
    _forget(old)
    with pytest.warns(DeprecationWarning) as caught:
        mod = importlib.import_module(old)
    assert [str(w.message) for w in caught] == [f"{old} is deprecated: import {MOVED[old]} (the module moved there)"]
    assert caught[0].filename == __file__  # names the importing code, not the import system
    assert mod is new and sys.modules[old] is new
    parent, _, leaf = old.rpartition(".")
    _forget(old)
    ns: dict = {}
    with pytest.warns(DeprecationWarning, match=re.escape(f"{old} is deprecated: import {MOVED[old]} ")):
        exec(f"from {parent} import {leaf} as via_from", ns)
    assert ns["via_from"] is new


def test_every_old_path_is_in_the_one_table():
    """ultracomm._moved.MOVED is MOVED, and no old path has a module file of its own (the table's finder
    answers for them; a file there would be shadowed)."""
    from ultracomm import _moved

    assert _moved.MOVED == MOVED
    for old in MOVED:
        path = os.path.join(os.path.dirname(PKG), *old.split("."))
        assert not os.path.exists(path + ".py") and not os.path.isdir(path), f"{old}: a file at an old path"
    assert not [
        f
        for root, _, files in os.walk(PKG)
        for f in files
        if f.endswith(".py") and re.search(r"^alias\(globals\(\)", open(os.path.join(root, f)).read(), re.M)
    ]


def test_lazy_attributes_of_moved_tools_still_resolve():
    import ultracomm.tools.bench
    import ultracomm.tools.workloads

    assert "tools" in dir(ultracomm) and "bench" not in dir(ultracomm)
    for name in ("bench", "workloads"):
        vars(ultracomm).pop(name, None)
        _forget(f"ultracomm.{name}")
        with pytest.warns(
            DeprecationWarning, match=rf"ultracomm\.{name} is deprecated: import ultracomm\.tools\.{name} "
        ):
            assert getattr(ultracomm, name) is sys.modules[f"ultracomm.tools.{name}"]


def test_python_m_on_an_old_tool_path_runs_the_tool():
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.path.dirname(PKG), os.environ.get("PYTHONPATH", "")])}
    out = subprocess.run(
        [sys.executable, "-m", "ultracomm.whatif", "--help"], capture_output=True, text=True, env=env, timeout=120
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.startswith("usage: python -m ultracomm.tools.whatif ")
    assert (
        "DeprecationWarning: ultracomm.whatif is deprecated: import ultracomm.tools.whatif (the module moved there)"
    ) in out.stderr
