"""Megatron MoE ECHO's elastic expert dispatchers (NVIDIA/Megatron-LM PR #2368) over ultracomm.

The PR's MoE layer (head a2b16b87; also Victarry/Megatron-LM ``feat/moe-echo-rebase-v2`` at
bb6ff24a) builds its weight dispatcher from the config and the process-group collection, by
``config.moe_echo_expert_dispatcher_type``:

* ``"alltoall"``: ``MoEElasticExpertDispatcher(config, pg_collection)`` -- here
  :class:`EchoElasticExpertDispatcher`;
* ``"hybridep"`` (upstream's default): ``MoESyncFreeElasticExpertDispatcher(config,
  pg_collection)`` -- here :class:`EchoSyncFreeElasticExpertDispatcher`;
* :func:`build_expert_dispatcher` picks one the same way.

Both read the EP group from ``pg_collection.ep``, the home experts from
``config.num_moe_experts`` and the spare ("echo") slots from ``config.moe_num_echo_experts``
(global counts; each EP rank holds ``1 / ep_size`` of each), and require
``config.moe_enable_echo``.  The layer calls, per forward::

    fc1_meta = dispatcher.preprocess(expert_offloading_map)   # bool [num_home, num_spare]
    fc2_meta = dispatcher.preprocess(expert_offloading_map)   # a second object, same map
    fc1_spares = dispatcher.expert_dispatch(fc1_meta, *fc1_home_weights)
    fc2_spares = dispatcher.expert_dispatch(fc2_meta, *fc2_home_weights)

and, with ``moe_echo_recompute_expert_dispatch``, each ``expert_dispatch`` once more in the
backward (same metadata, same weights, gradients on).  What comes back, as upstream:

* ``EchoElasticExpertDispatcher.expert_dispatch``: a list of ``num_local_spares`` tensors in the
  weights' dtype; a filled slot is shaped like one home weight, an empty one is a zero-size
  ``[0, weight.numel()]`` tensor (upstream's empty split of the received rows);
* ``EchoSyncFreeElasticExpertDispatcher.expert_dispatch``: a tuple of ``num_local_spares``
  tensors, every one shaped like a home weight (an empty slot's content is unspecified upstream,
  the padding of its dispatch buffer; here zeros), with ``requires_grad`` set on each (as
  rebase-v2 bb6ff24a does; a2b16b87 leaves it unset under ``no_grad``).

Gradients: every home weight receives the sum of its spares' gradients, through the backward of
``expert_dispatch`` (the :class:`~ultracomm.integrations.megatron_echo.EchoExpertDispatcher`
backward: into ``main_grad`` where the weight has one, else as its autograd gradient).
Differences from upstream, on purpose: the sum is in fp32 for 16-bit weights
(``config.moe_balance_expert_weight_grad_combine_dtype``, default ``fp32``; upstream sums in the
weights' dtype), and ``grad_added_to_main_grad`` is never set (upstream's sync-free backward sets
it, which makes Megatron's DDP hook drop the home expert's own ``.grad`` where that wgrad is not
fused into ``main_grad``).

fc1 and fc2 are told apart by their home weights (the same tensors, or the same storage), not by
the metadata object, so a recomputed dispatch reuses its forward's Context; weights made anew each
step take the Context of a set that is gone, so the number of Contexts stays that of the weight sets
alive at once.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from ..comm import as_comm
from ..errors import InputError
from .megatron_echo import EchoDispatchMetadata, EchoExpertDispatcher, expert_count_problem

__all__ = [
    "EchoElasticExpertDispatcher",
    "EchoSyncFreeElasticExpertDispatcher",
    "EchoElasticMetadata",
    "build_expert_dispatcher",
]

_TYPES = ("hybridep", "alltoall")


def _err(cls: str, msg: str) -> InputError:
    return InputError(f"ultracomm: {cls}: {msg}")


@dataclass
class EchoElasticMetadata(EchoDispatchMetadata):
    """What ``preprocess`` derives, with upstream's field names besides ultracomm's own:
    ``global_routing_map`` (the map given), ``routing_map`` (its rows of this rank's home
    experts), ``has_experts_per_slot`` (long ``[num_local_spares]``: 1 filled, 0 empty) and
    ``handle`` (None; upstream's sync-free dispatch keeps its buffer layout there)."""

    routing_map: torch.Tensor | None = None
    has_experts_per_slot: torch.Tensor | None = None
    handle: Any = None

    @property
    def global_routing_map(self) -> torch.Tensor:
        return self.expert_offloading_map


class EchoElasticExpertDispatcher(EchoExpertDispatcher):
    """Upstream's ``MoEElasticExpertDispatcher(config, pg_collection)`` over ultracomm.

    Extra keywords as :class:`~ultracomm.integrations.megatron_echo.EchoExpertDispatcher`
    (``max_microbatches``, ``Context`` options).  Build every layer's dispatcher before the
    first dispatch; ``close_dispatchers(pg_collection.ep)`` at the end.
    """

    def __init__(self, config: Any, pg_collection: Any = None, *, max_microbatches: int | None = None, **options: Any):
        name = type(self).__name__
        if pg_collection is None or not hasattr(pg_collection, "ep"):
            raise _err(name, f"pg_collection must carry the EP group as .ep, got {type(pg_collection).__name__}")
        if not getattr(config, "moe_enable_echo", False):
            raise _err(name, "requires config.moe_enable_echo (upstream: --moe-enable-echo)")
        num_home = getattr(config, "num_moe_experts", None)
        num_spare = getattr(config, "moe_num_echo_experts", None)
        ep_size = as_comm(pg_collection.ep).world
        problem = expert_count_problem(
            ep_size, (("config.num_moe_experts", num_home), ("config.moe_num_echo_experts", num_spare))
        )
        if problem:  # named by the config fields the caller set (the base class would name its arguments)
            raise _err(name, problem)
        super().__init__(config, pg_collection.ep, num_home, num_spare, max_microbatches=max_microbatches, **options)
        self.pg_collection = pg_collection
        self.num_local_home_experts = num_home // self.ep_size
        self.num_local_echo_experts = self.num_local_spare_experts
        #: per dispatch key, per Context: the data_ptrs and weak references of the weights it last served
        self._roles: dict[tuple, list[tuple[tuple, tuple]]] = {}

    def preprocess(self, routing_map: torch.Tensor) -> EchoElasticMetadata:
        """Check the bool ``[num_moe_experts, moe_num_echo_experts]`` map (each spare holds at
        most one expert) and plan the multicast.  Each call returns a new metadata object."""
        base = super().preprocess(routing_map)
        M, r = self.num_local_home_experts, self.ep_rank
        return EchoElasticMetadata(
            base.expert_offloading_map,
            base.plan,
            base.local_spare_home_indices,
            base.local_copies,
            routing_map=routing_map[r * M : (r + 1) * M],
            has_experts_per_slot=(base.local_spare_home_indices >= 0).long(),
        )

    def expert_dispatch(self, metadata: EchoElasticMetadata, *expert_weights: torch.Tensor) -> list[torch.Tensor]:
        """This rank's spare slots' weights from its ``num_local_home_experts`` home weights of
        one projection (upstream's call; collective): a list, an empty slot ``[0, numel]``."""
        out = self._spares(metadata, expert_weights)
        numel = expert_weights[0].numel()
        return [
            t if filled else (t.reshape(1, numel)[:0] if t.requires_grad else t.new_empty((0, numel)))
            for t, filled in zip(out, metadata.has_experts_per_slot.tolist())
        ]

    # ------------------------------------------------------------------ internals
    def _spares(self, metadata: Any, expert_weights: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        if not isinstance(metadata, EchoElasticMetadata):
            raise _err(type(self).__name__, f"metadata must come from preprocess(), got {type(metadata).__name__}")
        return self.dispatch(metadata, *expert_weights)

    def _call_index(self, metadata: EchoDispatchMetadata, key: tuple, weights: Sequence[torch.Tensor]) -> int:
        """fc1 and fc2 come with a metadata object each: the Context is chosen by the home
        weights instead -- the same tensors, or tensors at the same addresses (views of them; the
        Context pins the storage it registered), get the Context they had (a recomputed dispatch
        its forward's).  A new set gets the first Context whose weights are gone (weights made
        anew per step; a dispatch's autograd node holds its weights until its backward, so none
        is pending there), else a new one."""
        roles = self._roles.setdefault(key, [])
        ptrs = tuple(w.data_ptr() for w in weights)
        mine = (ptrs, tuple(weakref.ref(w) for w in weights))
        free = None
        for i, (held, refs) in enumerate(roles):
            if held == ptrs or all(r() is w for r, w in zip(refs, weights)):
                roles[i] = mine
                return i
            if free is None and all(r() is None for r in refs):
                free = i
        if free is None:
            roles.append(mine)
            return len(roles) - 1
        roles[free] = mine
        return free


class EchoSyncFreeElasticExpertDispatcher(EchoElasticExpertDispatcher):
    """Upstream's ``MoESyncFreeElasticExpertDispatcher(config, pg_collection)`` over ultracomm:
    as :class:`EchoElasticExpertDispatcher`, but ``expert_dispatch`` returns a tuple of full-shape
    weights (zeros for an empty slot), each with ``requires_grad`` set."""

    def expert_dispatch(self, metadata: EchoElasticMetadata, *expert_weights: torch.Tensor) -> tuple[torch.Tensor, ...]:
        out = self._spares(metadata, expert_weights)
        for t in out:
            t.requires_grad_(True)  # a leaf under no_grad; already set on a graph output
        return tuple(out)


def build_expert_dispatcher(config: Any, pg_collection: Any, **options: Any) -> EchoElasticExpertDispatcher:
    """The dispatcher upstream's MoE layer builds for ``config.moe_echo_expert_dispatcher_type``
    (``"hybridep"``, upstream's default: sync-free; ``"alltoall"``), over ultracomm."""
    kind = getattr(config, "moe_echo_expert_dispatcher_type", "hybridep")
    if kind not in _TYPES:
        raise _err(
            "build_expert_dispatcher", f"config.moe_echo_expert_dispatcher_type must be one of {_TYPES}, got {kind!r}"
        )
    cls = EchoSyncFreeElasticExpertDispatcher if kind == "hybridep" else EchoElasticExpertDispatcher
    return cls(config, pg_collection, **options)
