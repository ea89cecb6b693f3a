"""ReplicaPlan: which logical expert each replica slot holds, and converters from the
plan formats of the systems ultracomm plugs into.

A plan is two small CPU tensors:

* ``slot_src``  int32 ``[world, slots_per_rank]`` -- the logical expert copied into
  replica slot ``(rank, slot)``; ``-1`` marks an empty slot.
* ``home_of``   int32 ``[E]`` -- the rank that holds the master copy of each expert
  (default ``e // experts_per_rank``).

Invariants (checked by :meth:`ReplicaPlan.validate`, raised as :class:`PlanError`):
expert ids in ``0..E-1`` or ``-1``; no replica on the expert's own home rank; no expert
twice on one rank; homes in ``0..world-1``.

Converters:

=============================================  ===========================================
Megatron MoE ECHO ``map_home_expert_to_spare``  :meth:`ReplicaPlan.from_echo_map` /
bool ``[E, S_global]``                         :meth:`ReplicaPlan.to_echo_map`
Megatron transport seam ``experts_to_copy``     :meth:`ReplicaPlan.from_experts_to_copy` /
int32 ``[EP, slots]``, -1 unused                :meth:`ReplicaPlan.to_experts_to_copy`
vLLM / DeepSeek EPLB ``phy2log`` ``[(L,) P]``   :func:`moves_from_phy2log` (weight moves),
                                               :func:`plan_from_phy2log` (home-fixed maps)
=============================================  ===========================================

Modules: :mod:`.replica_plan` (the plan, its checks, identity and the Megatron converters),
:mod:`.phy2log` (EPLB physical->logical maps), :mod:`.inputs` (the integer inputs every
converter accepts).
"""

from __future__ import annotations

from .inputs import ArrayLike as ArrayLike  # the inputs' type, named in signatures
from .phy2log import Move, moves_from_phy2log, plan_from_phy2log
from .replica_plan import ReplicaPlan
from .replica_plan import SlotShape as SlotShape  # the world/slots_per_rank shape ResidentPlan shares

__all__ = ["ReplicaPlan", "Move", "moves_from_phy2log", "plan_from_phy2log"]
