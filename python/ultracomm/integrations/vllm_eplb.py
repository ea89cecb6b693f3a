"""vLLM's EPLB communicator over ultracomm: expert moves as relay-tree multicasts.

vLLM rearranges experts between an old and a new ``phy2log`` map
(``vllm/distributed/eplb/rebalance_execute.py``, ``move_to_buffer``): per layer it calls
``add_send([w[src_row] for w in expert_weights], dst_rank, expert_id=e)`` and
``add_recv([b[dst_row] for b in expert_buffer], src_rank, expert_id=e)`` for every remote
move, then ``execute()``; around that, release by release, ``set_transfer_context`` and the
properties listed in :mod:`ultracomm.integrations.vllm_protocol`.  vLLM's communicators turn
each pair into a point-to-point send, so an expert going to N ranks leaves its holder N times.
Here ``execute()`` turns every expert's moves into one ultracomm multicast: one source (the
lowest-ranked rank that sends it; every holder of a logical expert holds the same weights) and
all its receivers, through a relay tree.

Checked against vLLM 0.21 to 0.34 (the communicator calls of each release; a communicator is
made for one release, by default the installed vLLM's, and refuses others' calls).  The
factory has vLLM's signature, so vLLM's own code can use it::

    from vllm.distributed.eplb.eplb_communicator import create_eplb_communicator    # before
    from ultracomm.integrations.vllm_eplb import create_eplb_communicator           # after
    communicator = create_eplb_communicator(group_coordinator, backend, expert_weights, expert_buffer)

(vLLM 0.21-0.22: ``create_eplb_communicator(group_coordinator, backend, expert_weights)`` with
one layer's tensors, as those releases call it.)  ``eplb_state`` imports the factory by name:
``vllm.distributed.eplb.eplb_state.create_eplb_communicator = create_eplb_communicator``
switches a running vLLM over.

The stream given to ``set_stream`` (vLLM's async EPLB worker) carries the transfer: on a GPU
the multicast and the copies into the receive buffer are enqueued on it, as vLLM's own
communicators do, and the worker's ``stream.synchronize()`` waits for them.

Not checked: on a GPU (the tests here run CPU tensors and stand-in streams), and vLLM's
elastic EP (``StatelessGroupCoordinator``), whose groups this factory has not been tried on.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Sequence

import numpy as np
import torch

from ..context import Context
from ..errors import InputError, InputTypeError, PlanError
from ..layout import ExpertLayout, Member
from ..plan import ReplicaPlan
from .vllm_protocol import Protocol, protocol_for

__all__ = ["UltracommEplbCommunicator", "create_eplb_communicator"]


def _current_stream() -> Any:
    return torch.accelerator.current_stream()


def _set_stream(stream: Any) -> None:
    torch.accelerator.set_stream(stream)


@contextlib.contextmanager
def _on_stream(stream: Any) -> Iterator[None]:
    """``stream`` is the current stream inside (nothing changes for ``None``), as vLLM's
    communicators run their transfers."""
    if stream is None:
        yield
        return
    before = _current_stream()
    _set_stream(stream)
    try:
        yield
    finally:
        _set_stream(before)


def _expert_tensors(expert_weights: Any, what: str) -> list[torch.Tensor]:
    if (
        isinstance(expert_weights, torch.Tensor)
        or not expert_weights
        or not all(isinstance(t, torch.Tensor) for t in expert_weights)
    ):
        raise InputError(
            f"ultracomm: {what} must list one layer's expert weight tensors, each [num_local_physical_experts, ...]"
        )
    return list(expert_weights)


class UltracommEplbCommunicator:
    """vLLM's ``EplbCommunicator`` interface for one EP group.

    Args:
        ep_group: the EP process group (any backend: only its Store is used) or a ``LoopbackGroup``.
        expert_weights: one layer's expert weight tensors, each
            ``[num_local_physical_experts, ...]`` (the shapes and dtypes every layer uses).
        stream: the stream transfers run on (vLLM sets it with ``set_stream``).
        vllm_version: the vLLM release whose calls this communicator answers (``None``: the
            installed vLLM's, else 0.34); outside 0.21 - 0.34 raises ``ConfigError``.
        context_options: ``Context`` keywords (``timeout_s``, ``relay_mode``, ...); the Context
            lives where the weights do unless ``device=`` says otherwise.

    After ``execute()``, ``last_plan`` is the plan it ran (``None`` if nothing moved) and
    ``last_stats`` its schedule's statistics (trees, egress, lower bound).
    """

    def __init__(
        self,
        ep_group: Any,
        expert_weights: Sequence[torch.Tensor],
        stream: Any = None,
        *,
        vllm_version: str | None = None,
        **context_options: Any,
    ):
        self.protocol: Protocol = protocol_for(vllm_version)  # before anything is allocated
        expert_weights = _expert_tensors(expert_weights, "expert_weights")
        self.ppr = int(expert_weights[0].shape[0]) if expert_weights[0].dim() else 0
        if self.ppr < 1 or any(t.dim() == 0 or int(t.shape[0]) != self.ppr for t in expert_weights):
            raise InputError(
                "ultracomm: every expert weight tensor needs the same leading "
                "num_local_physical_experts dimension (at least 1)"
            )
        device = expert_weights[0].device
        self._cuda = device.type == "cuda"
        if self._cuda:
            context_options.setdefault("device", device)
        self.members = [Member(f"w{i}", tuple(w.shape[1:]) or (1,), w.dtype) for i, w in enumerate(expert_weights)]
        self.ctx = Context(ep_group, ExpertLayout(tuple(self.members)), self.ppr, self.ppr, 1, 1, **context_options)
        self.rank, self.world = self.ctx.rank, self.ctx.world
        self._spare = [torch.zeros(m.shape, dtype=m.dtype, device=device) for m in self.members]
        self._stream = stream
        self._done: Any = None  # event after the last execute's work (GPU): a later stream waits for it
        self._owned: list[torch.Tensor] | None = None  # a receive buffer of our own (see the factory)
        self._sends: list[tuple[int, int, list[torch.Tensor]]] = []
        self._recvs: list[tuple[int, int, list[torch.Tensor]]] = []
        self.layer_idx: int | None = None
        self.last_plan: ReplicaPlan | None = None
        self.last_stats: dict | None = None

    # ------------------------------------------------------------------ vLLM's interface
    @property
    def needs_profile_buffer_reservation(self) -> bool:
        """False: the window is allocated at construction, vLLM's profile run need not reserve
        NCCL buffers for it."""
        return False

    @property
    def needs_recv_rows(self) -> bool:
        """False (vLLM 0.34): ``execute`` learns every rank's moves itself."""
        return False

    @property
    def owned_expert_buffer(self) -> list[torch.Tensor] | None:
        """vLLM 0.34 receives into ``owned_expert_buffer or expert_buffer``: None (vLLM's own
        buffer) unless the factory was given none, as 0.34 does for its ``symm_mem`` backend."""
        return self._owned

    def set_stream(self, stream: Any) -> None:
        self._stream = stream

    def set_transfer_context(self, old_indices: Any, layer_idx: int, recv_rows: Any = None) -> None:
        if not self.protocol.transfer_context:
            self._mismatch("set_transfer_context()", "0.23")
        if recv_rows is not None and not self.protocol.recv_rows:
            self._mismatch("set_transfer_context(..., recv_rows)", "0.34")
        self.layer_idx = int(layer_idx)

    def add_send(self, tensors: Sequence[torch.Tensor], dst_rank: int, expert_id: int) -> None:
        self._sends.append(
            (int(expert_id), self._peer(dst_rank, "add_send", "dst_rank"), self._check(tensors, "add_send"))
        )

    def add_recv(self, tensors: Sequence[torch.Tensor], src_rank: int, expert_id: int) -> None:
        self._recvs.append(
            (int(expert_id), self._peer(src_rank, "add_recv", "src_rank"), self._check(tensors, "add_recv"))
        )

    def execute(self, old_indices: Any = None) -> None:
        """Run every queued move as one multicast per expert; collective (every rank calls it)."""
        if old_indices is not None and not self.protocol.execute_old_indices:
            self._mismatch("execute(old_indices=)", "0.21 and 0.22", newer=False)
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
        with _on_stream(self._stream):
            if self._done is not None:  # the replica slots are reused: wait for the last copy-out
                _current_stream().wait_event(self._done)
            weights = []
            for m in range(len(self.members)):
                rows = [self._aligned(source[e][m], self.members[m].shape) for e in sent]
                rows += [self._spare[m]] * (self.ppr - len(sent))
                weights.append(rows)
            self.ctx.register_masters(0, weights, None)
            vid = self.ctx.begin(0)
            try:
                self.ctx.weight_sync(vid, plan)  # stream-ordered transports enqueue on this stream
                for k, (_, _, tensors) in enumerate(recvs):
                    for m, t in enumerate(tensors):
                        t.copy_(self.ctx.replica_weights[m][k].view(t.shape), non_blocking=self._cuda)
            finally:
                self.ctx.end(vid)
            if self._cuda:
                self._done = torch.Event()
                self._done.record()
        self.last_plan, self.last_stats = plan, self.ctx.schedule_for(plan).stats()

    # ------------------------------------------------------------------ internals
    def _mismatch(self, call: str, release: str, newer: bool = True) -> None:
        raise InputTypeError(
            f"ultracomm: {call} is a call of vLLM {release}{'+' if newer else ''}, but this "
            f"communicator was made for vLLM {self.protocol.version} (vllm_version=); make it with "
            "the vllm_version of the vLLM that drives it"
        )

    def _peer(self, rank: Any, what: str, arg: str) -> int:
        r = int(rank)
        if not 0 <= r < self.world or r == self.rank:
            raise InputError(
                f"ultracomm: {what}: {arg}={rank!r} must be another rank of the EP group "
                f"(0..{self.world - 1}, not this rank {self.rank})"
            )
        return r

    def _check(self, tensors: Sequence[torch.Tensor], what: str) -> list[torch.Tensor]:
        tensors = list(tensors)
        if len(tensors) != len(self.members):
            raise InputError(
                f"ultracomm: {what} got {len(tensors)} tensors; the layer has {len(self.members)} expert weight tensors"
            )
        for m, t in zip(self.members, tensors):
            if t.numel() != m.numel or t.dtype != m.dtype:
                raise InputError(
                    f"ultracomm: {what}: tensor {m.name} is {t.dtype} {list(t.shape)}; expected one "
                    f"expert row {m.dtype} {list(m.shape)}"
                )
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
                raise PlanError(
                    f"ultracomm: rank {r} sends {len(sent)} distinct experts; at most num_local_physical_experts={ppr}"
                )
            for e, d in sends:
                senders.setdefault(e, set()).add(r)
        if not any(recvs for _, recvs, _ in views):
            return None
        slot_src = np.full((W, ppr), -1, np.int64)
        for d, (_, recvs, _) in enumerate(views):
            if len(recvs) > ppr:
                raise PlanError(
                    f"ultracomm: rank {d} receives {len(recvs)} experts; at most num_local_physical_experts={ppr}"
                )
            for k, (e, s) in enumerate(recvs):
                if (e, d) not in views[s][0]:
                    raise PlanError(
                        f"ultracomm: rank {d} expects expert {e} from rank {s}, which queued no "
                        f"add_send of it to rank {d}; every add_recv needs the matching add_send"
                    )
                src = min(senders[e])  # one source per expert: the whole move is one multicast
                slot_src[d, k] = src * ppr + views[src][2].index(e)
        return slot_src


def create_eplb_communicator(
    group_coordinator: Any,
    backend: str | None,
    expert_weights: Any,
    expert_buffer: Sequence[torch.Tensor] | None = None,
    *,
    vllm_version: str | None = None,
    **context_options: Any,
) -> UltracommEplbCommunicator:
    """vLLM's factory, same arguments (``vllm/distributed/eplb/eplb_communicator.py``).

    Args:
        group_coordinator: vLLM's ``GroupCoordinator`` of the EPLB group; its ``cpu_group``
            carries ultracomm's control plane.
        backend: vLLM's configured backend name; every backend is replaced by ultracomm, so it is
            only kept as ``communicator.backend``.
        expert_weights: vLLM 0.23+: every MoE layer's tensors (``model.expert_weights``), all
            layers alike; 0.21-0.22: one layer's (``model.expert_weights[0]``).
        expert_buffer: vLLM 0.23+: the receive buffer vLLM allocated (one tensor per weight
            tensor, a layer's shape); checked, left to vLLM (``owned_expert_buffer`` is None).
            ``None`` (vLLM 0.34 passes it for ``backend="symm_mem"`` and then needs
            ``owned_expert_buffer``): the communicator allocates one.  vLLM 0.21-0.22 has none.
        vllm_version, context_options: as :class:`UltracommEplbCommunicator`.
    """
    protocol = protocol_for(vllm_version)
    if backend is not None and not isinstance(backend, str):
        raise InputError(f"ultracomm: backend must be vLLM's communicator backend name (a str), got {backend!r}")
    if protocol.factory_all_layers:
        if (
            isinstance(expert_weights, torch.Tensor)
            or not expert_weights
            or any(isinstance(layer, torch.Tensor) for layer in expert_weights)
        ):
            raise InputError(
                f"ultracomm: vLLM {protocol.version} passes expert_weights as every MoE layer's "
                "list of tensors (model.expert_weights); got one layer's tensors or none"
            )
        layers = [_expert_tensors(layer, f"expert_weights[{i}]") for i, layer in enumerate(expert_weights)]
        first = layers[0]
        for i, layer in enumerate(layers[1:], 1):
            if [(t.shape, t.dtype) for t in layer] != [(t.shape, t.dtype) for t in first]:
                raise InputError(
                    f"ultracomm: expert_weights[{i}] differs from expert_weights[0] in its tensors' "
                    "shapes or dtypes; every MoE layer must have the same expert tensors"
                )
        if expert_buffer is not None:
            buf = list(expert_buffer)
            if [(tuple(b.shape), b.dtype) for b in buf] != [(tuple(t.shape), t.dtype) for t in first]:
                raise InputError(
                    "ultracomm: expert_buffer must be one tensor per expert weight tensor, each shaped "
                    "like a layer's (torch.empty_like of expert_weights[0])"
                )
    else:
        if expert_buffer is not None:
            raise InputError(
                f"ultracomm: vLLM {protocol.version}'s create_eplb_communicator takes no expert_buffer "
                "(added in 0.23); drop it, or pass the vllm_version of the vLLM that calls this"
            )
        first = _expert_tensors(expert_weights, f"expert_weights (vLLM {protocol.version}: one layer's tensors)")
    group = getattr(group_coordinator, "cpu_group", None)
    if group is None:
        raise InputError(
            "ultracomm: group_coordinator must be vLLM's GroupCoordinator of the EPLB group (with a "
            "cpu_group), as vLLM's get_eplb_group() returns"
        )
    comm = UltracommEplbCommunicator(group, first, vllm_version=protocol.version, **context_options)
    comm.backend = backend
    if expert_buffer is None and protocol.recv_rows:
        comm._owned = [torch.empty_like(t) for t in first]
    return comm
