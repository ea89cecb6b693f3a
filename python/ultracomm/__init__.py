"""ultracomm: scale-up communication for MoE expert replication.

Copies hot experts' weights from their home rank into replica slots on other ranks
(relay-tree multicast with chunk streaming) and reduces the replicas' gradients back home
deterministically.  See ``Context`` for the runtime API and ``ReplicaPlan`` for plans.

Names are imported lazily (PEP 562), so ``import ultracomm.plan`` stays light; ``dir(ultracomm)``
lists them.  The drop-in for MoE stacks is :class:`ReplicaManager` (``ultracomm.moe``); adapters
for Megatron ECHO, UltraEP, vLLM EPLB and DeepEP's ``lb_`` calls live in ``ultracomm.integrations``; the README's Layout
section shows the package's layers.
"""

from __future__ import annotations

import importlib
from typing import Any

from . import _moved

_moved.install()  # the old import paths of modules that moved (one table: _moved.MOVED)

__version__ = "0.1.0"

_EXPORTS = {
    "Config": "env",
    "ConfigError": "errors",
    "Context": "context",
    "ExpertLayout": "layout",
    "InputError": "errors",
    "InputTypeError": "errors",
    "LayoutError": "errors",
    "LoopbackDomain": "comm",
    "LoopbackGroup": "comm",
    "Member": "layout",
    "Op": "records",
    "PlanError": "errors",
    "PlanMismatchError": "errors",
    "RegistrationError": "errors",
    "RelayMode": "records",
    "ReplicaPlan": "plan",
    "Schedule": "schedule",
    "UltracommError": "errors",
    "Work": "work",
    "build_schedule": "schedule",
    "run_loopback": "comm",
    "UltracommTimeout": "errors",
    "PeerError": "errors",
    "ClosedError": "errors",
    "ReplicaManager": "moe",
    "ResidentPlan": "resident_plan",
}
_SUBMODULES = ("moe", "integrations", "planners", "tools", "env", "sim")
_MOVED = ("workloads", "bench")  # attributes that still resolve (old paths: they warn), not listed

__all__ = sorted(_EXPORTS)


def __dir__() -> list[str]:
    """The public names (imported on first use) and subpackages, for dir() and completion."""
    return sorted({*__all__, *_SUBMODULES, "__version__"})


def __getattr__(name: str) -> Any:
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
    elif name in _SUBMODULES or name in _MOVED:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module 'ultracomm' has no attribute {name!r}")
    globals()[name] = value
    return value
