"""The drop-in layer for MoE stacks: :class:`ReplicaManager` (plan, reroute, replica
weights as autograd tensors, restore and reduce inside the backward pass), the
fp32-wgrad :func:`linear`, and token rerouting (:func:`reroute`, :class:`RerouteTable`)."""

from __future__ import annotations

from .autograd import linear
from .manager import ReplicaManager, Step
from .reroute import LAYOUTS, RerouteTable, num_columns, reroute

__all__ = ["ReplicaManager", "Step", "linear", "reroute", "RerouteTable", "LAYOUTS", "num_columns"]
