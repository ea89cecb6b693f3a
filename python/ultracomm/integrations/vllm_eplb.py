"""vLLM's EPLB communicator over ultracomm: expert moves as relay-tree multicasts.

vLLM rearranges experts between an old and a new ``phy2log`` map
(``vllm/distributed/eplb/rebalance_execute.py``, ``move_to_buffer``): per layer it calls
``communicator.set_transfer_context(old_indices, layer_idx)``, then
``add_send([w[src_row] for w in expert_weights], dst_rank, expert_id=e)`` and
``add_recv([b[dst_row] for b in expert_weights_buffers], src_rank, expert_id=e)`` for every
remote move, then ``execute()`` (``vllm/distributed/eplb/eplb_communicator.py``).  Its
communicators turn each pair into a point-to-point send, so an expert going to N ranks
leaves its holder N times.  :class:`UltracommEplbCommunicator` keeps the interface and, in
``execute()``, turns every expert's moves into one ultracomm multicast: one source (the
lowest-ranked rank that sends it; every holder of a logical expert holds the same weights)
and all its receivers, through a relay tree.

Before/after::

    communicator = create_eplb_communicator(group_coordinator, "torch_nccl", expert_weights)
    communicator = UltracommEplbCommunicator(ep_group, expert_weights)            # after
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

from ..context import Context
from ..errors import PlanError
from ..layout import ExpertLayout, Member
from ..plan import ReplicaPlan

__all__ = ["UltracommEplbCommunicator"]


class UltracommEplbCommunicator:
    """vLLM ``EplbCommunicator`` duck type (``add_send``, ``add_recv``, ``execute``).

    Args:
        ep_group: the EP process group (or ``LoopbackGroup``).
        expert_weights: one layer's expert weight tensors, each
            ``[num_local_physical_experts, ...]`` (the shapes and dtypes every layer uses).
        context_options: ``Context`` keywords (``timeout_s``, ``relay_mode``, ...).

    After ``execute()``, ``last_plan`` is the plan it ran (``None`` if nothing moved) and
    ``last_stats`` its schedule's statistics (trees, egress, lower bound).
    """

    needs_profile_buffer_reservation = False

    def __init__(self, ep_group: Any, expert_weights: Sequence[torch.Tensor], cuda_stream: Any = None,
                 **context_options: Any):
        if not expert_weights:
            raise ValueError("ultracomm: expert_weights must list the layer's expert weight tensors")
        self.ppr = int(expert_weights[0].shape[0])
        if any(int(w.shape[0]) != self.ppr for w in expert_weights):
            raise ValueError("ultracomm: every expert weight tensor needs the same leading "
                             "num_local_physical_experts dimension")
        self.members = [Member(f"w{i}", tuple(w.shape[1:]) or (1,), w.dtype) for i, w in enumerate(expert_weights)]
        layout = ExpertLayout(tuple(self.members))
        self.ctx = Context(ep_group, layout, self.ppr, self.ppr, 1, 1, **context_options)
        self.rank, self.world = self.ctx.rank, self.ctx.world
        self._spare = [torch.zeros(m.shape, dtype=m.dtype, device=expert_weights[0].device) for m in self.members]
        self._cuda_stream = cuda_stream
        self._sends: list[tuple[int, int, list[torch.Tensor]]] = []
        self._recvs: list[tuple[int, int, list[torch.Tensor]]] = []
        self.layer_idx: int | None = None
        self.last_plan: ReplicaPlan | None = None
        self.last_stats: dict | None = None

    # ------------------------------------------------------------------ vLLM's interface
    def set_stream(self, cuda_stream: Any) -> None:
        self._cuda_stream = cuda_stream

    def set_transfer_context(self, old_indices: Any, layer_idx: int) -> None:
        self.layer_idx = layer_idx

    def add_send(self, tensors: Sequence[torch.Tensor], dst_rank: int, expert_id: int | None = None) -> None:
        self._sends.append((self._expert(expert_id, "add_send"), int(dst_rank), self._check(tensors, "add_send")))

    def add_recv(self, tensors: Sequence[torch.Tensor], src_rank: int, expert_id: int | None = None) -> None:
        self._recvs.append((self._expert(expert_id, "add_recv"), int(src_rank), self._check(tensors, "add_recv")))

    def execute(self) -> None:
        """Run every queued move as one multicast per expert; collective (every rank calls it)."""
        sends, recvs = self._sends, self._recvs
        self._sends, self._recvs = [], []
        sent = sorted({e for e, _, _ in sends})
        mine = ([(e, d) for e, d, _ in sends], [(e, s) for e, s, _ in recvs], sent)
        views = self.ctx.comm.all_gather_object(mine, op="EPLB execute", what="queued moves")
        slot_src = self._plan(views)
        if slot_src is None:
            self.last_plan = self.last_stats = None
            return
        plan = ReplicaPlan.make(slot_src, experts_per_rank=self.ppr)
        source = {e: t for e, _, t in sends}
        weights = []
        for m in range(len(self.members)):
            rows = [self._aligned(source[e][m], self.members[m].shape) for e in sent]
            rows += [self._spare[m]] * (self.ppr - len(sent))
            weights.append(rows)
        self.ctx.register_masters(0, weights, None)
        vid = self.ctx.begin(0)
        try:
            self.ctx.weight_sync(vid, plan)
            for k, (_, _, tensors) in enumerate(recvs):
                for m, t in enumerate(tensors):
                    t.copy_(self.ctx.replica_weights[m][k].view(t.shape))
        finally:
            self.ctx.end(vid)
        self.last_plan, self.last_stats = plan, self.ctx.schedule_for(plan).stats()

    # ------------------------------------------------------------------ internals
    @staticmethod
    def _expert(expert_id: int | None, what: str) -> int:
        if expert_id is None:
            raise ValueError(f"ultracomm: {what} needs expert_id= (which logical expert moves): moves of one expert "
                             "become one multicast")
        return int(expert_id)

    def _check(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        tensors = list(tensors)
        if len(tensors) != len(self.members):
            raise ValueError(f"ultracomm: {what} got {len(tensors)} tensors; the layer has {len(self.members)} "
                             "expert weight tensors")
        for m, t in zip(self.members, tensors):
            if t.numel() != m.numel or t.dtype != m.dtype:
                raise ValueError(f"ultracomm: {what}: tensor {m.name} is {t.dtype} {list(t.shape)}; expected one "
                                 f"expert row {m.dtype} {list(m.shape)}")
        return tensors

    def _aligned(self, t: torch.Tensor, shape: tuple) -> torch.Tensor:
        """The row itself when the executor can read it in place, else an aligned copy."""
        t = t.contiguous().view(shape)
        return t if t.data_ptr() % self.ctx.layout.align == 0 else t.clone()

    def _plan(self, views: list) -> np.ndarray | None:
        """``slot_src [world, ppr]`` from every rank's queued moves, or None if nothing moves."""
        W, ppr = self.world, self.ppr
        senders: dict[int, set[int]] = {}
        for r, (sends, _, sent) in enumerate(views):
            if len(sent) > ppr:
                raise PlanError(f"ultracomm: rank {r} sends {len(sent)} distinct experts; at most "
                                f"num_local_physical_experts={ppr}")
            for e, d in sends:
                senders.setdefault(e, set()).add(r)
        if not any(recvs for _, recvs, _ in views):
            return None
        slot_src = np.full((W, ppr), -1, np.int64)
        for d, (_, recvs, _) in enumerate(views):
            if len(recvs) > ppr:
                raise PlanError(f"ultracomm: rank {d} receives {len(recvs)} experts; at most "
                                f"num_local_physical_experts={ppr}")
            for k, (e, s) in enumerate(recvs):
                if (e, d) not in views[s][0]:
                    raise PlanError(f"ultracomm: rank {d} expects expert {e} from rank {s}, which queued no "
                                    f"add_send of it to rank {d}; every add_recv needs the matching add_send")
                src = min(senders[e])  # one source per expert: the whole move is one multicast
                slot_src[d, k] = src * ppr + views[src][2].index(e)
        return slot_src
