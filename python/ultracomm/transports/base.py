"""What every transport shares: the contract Context calls them through, and the types they take.

A transport is a class with the class attributes below (its *declared capabilities*); Context
reads them and never probes a transport (no ``getattr`` / ``inspect`` on it):

``name``, ``window_providers``
    its name and the window kinds it runs over.
``options``
    the constructor keywords it takes beyond the common ones (``rank, world, window, wlayout,
    layout, timeout_s``), from :data:`OPTIONS`: what ``dataplane.transport_kwargs`` passes it.
``stream_ordered``
    ``run(..., stream=)`` only enqueues on a CUDA stream (failures are collected by
    ``check_error()``); else ``run`` blocks until done here.
``build_on_device``
    it builds a schedule from a :class:`~ultracomm.resident_plan.ResidentPlan` on the GPU.
``takes_slot``
    ``run(..., slot=)``: it keeps plans per micro-batch slot (a plan arena).
``window_flags``
    its window holds ready flags and digests: ``reject(op, epoch[, stream])`` publishes a
    rejected plan, and the window plan check (``ULTRACOMM_PLAN_CHECK``) can run on it.
``names_by_evidence``
    its timeouts name stopped ranks by evidence: the Context sets ``witness``.

and, as instance attributes, ``message_costs`` (alpha-beta costs of its messages, or None) and
``plan_arena_bytes`` (device memory set aside for plans).
"""

from __future__ import annotations

import abc
import dataclasses
from dataclasses import dataclass
from typing import Any, ClassVar, Sequence

import torch

from .. import _core
from ..errors import InputTypeError, RegistrationError
from ..records import Op

#: Constructor keywords a transport may declare in ``options``.
OPTIONS = frozenset(
    {
        "comm",
        "num_workers",
        "jitter_us",
        "multicast_sms",
        "reduce_sms",
        "domain_of",
        "split_route",
        "experts_per_rank",
        "plan_slots",
        "tile_bytes",
        "reduce_path",
    }
)

#: The host executor's tile when a caller names none (kDefaultTileBytes, include/ultracomm/records/exec_view.h).
DEFAULT_TILE_BYTES = 64 * 1024


class Transport(abc.ABC):
    """The declared contract of a transport (see the module docstring)."""

    name: ClassVar[str]
    window_providers: ClassVar[tuple[str, ...]]
    options: ClassVar[frozenset[str]] = frozenset()
    stream_ordered: ClassVar[bool] = False
    build_on_device: ClassVar[bool] = False
    takes_slot: ClassVar[bool] = False
    window_flags: ClassVar[bool] = False
    names_by_evidence: ClassVar[bool] = False
    #: alpha-beta costs of this transport's messages (a relay tree's depth is chosen with them)
    message_costs: Any = None
    #: device memory this transport set aside for plans at setup (bytes)
    plan_arena_bytes: int = 0
    #: the Context's :class:`ultracomm.blame.Witness` where ``names_by_evidence``
    witness: Any = None

    def __init_subclass__(cls, **kw: Any) -> None:
        super().__init_subclass__(**kw)
        bad = set(cls.options) - OPTIONS
        if bad:
            raise InputTypeError(
                f"transport {cls.__name__} declares unknown options {sorted(bad)}; known: {sorted(OPTIONS)}"
            )

    @abc.abstractmethod
    def run(
        self,
        op: Op,
        schedule: Any,
        epoch: int,
        masters: "Masters",
        my_slots: Sequence[int],
        local_index_of: Sequence[int],
        op_name: str | None = None,
        **kw: Any,
    ) -> Any:
        """Run (blocking) or enqueue (``stream_ordered``: ``stream=``) ``op`` of ``schedule`` for this
        rank at ``epoch``; ``slot=`` where ``takes_slot``."""

    def quiesce(self) -> None:
        """Let operations in flight end (done or failed); stream-ordered transports with internal
        streams override it."""

    def abandoned_streams(self) -> bool:
        """Whether a failure left streams blocked for good (a device-wide synchronize would hang)."""
        return False

    def close(self) -> None:
        """Free what the transport holds (the window is the Context's)."""


GRAD_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


def master_pointers(members: Sequence, experts_per_rank: int) -> tuple[int, ...]:
    """Per (local expert, member) addresses; each member is a stacked
    ``[experts_per_rank, *shape]`` tensor or a tuple of ``experts_per_rank`` per-expert tensors."""
    ptrs = []
    for i in range(experts_per_rank):
        for t in members:
            if t is None:  # a member without a gradient: no bytes, no address
                ptrs.append(0)
            elif isinstance(t, torch.Tensor):
                ptrs.append(t.data_ptr() + i * (t.numel() // experts_per_rank * t.element_size()))
            else:
                ptrs.append(t[i].data_ptr())
    return tuple(ptrs)


def _fingerprint(t: torch.Tensor) -> tuple:
    """What the executor relies on: address, shape, dtype, contiguity, and a storage that still holds it."""
    return (
        t.data_ptr(),
        tuple(t.shape),
        t.dtype,
        t.is_contiguous(),
        t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size(),
    )


def _labelled(kind: str, members: Sequence, names: Sequence[str]) -> list[tuple[str, torch.Tensor]]:
    """``("weights['fc1']", t)`` for a stacked member, ``("weights['fc1'][i]", t)`` per expert of a list."""
    out = []
    for name, t in zip(names, members):
        if t is None:  # a member without a gradient
            continue
        if isinstance(t, torch.Tensor):
            out.append((f"{kind}[{name!r}]", t))
        else:
            out += [(f"{kind}[{name!r}][{i}]", x) for i, x in enumerate(t)]
    return out


@dataclass(frozen=True)
class Masters:
    """Addresses of this rank's master experts for one layer.

    ``weight_ptrs[i * M + m]`` / ``grad_ptrs[i * M + m]``: member ``m`` of local expert ``i``;
    a member is a stacked tensor or a tuple of per-expert tensors.  The tensors are kept so
    the addresses stay valid; ``grads`` is ``None`` when only weights were registered.
    ``changed()`` says whether a tensor was swapped since.
    """

    weights: tuple
    grads: tuple | None
    weight_ptrs: tuple[int, ...]
    grad_ptrs: tuple[int, ...]
    names: tuple[str, ...] = ()
    fingerprints: tuple[tuple, ...] = ()

    @classmethod
    def of(cls, weights: tuple, grads: tuple | None, experts_per_rank: int, names: Sequence[str]) -> "Masters":
        weights = tuple(w if isinstance(w, torch.Tensor) else tuple(w) for w in weights)
        grads = (
            None if grads is None else tuple(g if g is None or isinstance(g, torch.Tensor) else tuple(g) for g in grads)
        )
        m = cls(
            weights,
            grads,
            master_pointers(weights, experts_per_rank),
            master_pointers(grads or (), experts_per_rank),
            tuple(names),
        )
        return dataclasses.replace(m, fingerprints=tuple(_fingerprint(t) for _, t in m._tensors()))

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        return _labelled("weights", self.weights, self.names) + _labelled("grads", self.grads or (), self.names)

    def check(self, layer: int) -> "Masters":
        """Itself, if every tensor is as registered (else RegistrationError naming it)."""
        changed = self.changed()
        if changed:
            raise RegistrationError(
                f"ultracomm: layer {layer}: registered tensor {changed} no longer has the address or size it was "
                "registered with (replaced by param.data = ..., set_(), or a resized storage); call "
                f"register_masters({layer}, ...) again with the tensors to use"
            )
        return self

    def changed(self, names: Sequence[str] | None = None) -> str | None:
        """``"weights['fc1']"`` (``"grads['fc1'][3]"`` for a per-expert list) for the first
        tensor whose address, shape or storage differs from registration; ``None`` if all
        are as registered."""
        flat = self.__dict__.get("_flat")
        if flat is None:  # the tensors in _tensors() order, without their labels (made only for a report)
            flat = tuple(t for _, t in self._tensors())
            object.__setattr__(self, "_flat", flat)
        for i, (t, fp) in enumerate(zip(flat, self.fingerprints)):
            if _fingerprint(t) != fp:
                return self._tensors()[i][0]
        return None


def op_digest(schedule_digest: int, op: Op) -> int:
    """The digest a rank publishes beside ``ready[op]`` for ``op`` of a schedule: the schedule's
    64-bit digest xor the op (never ``_core.REJECTED_DIGEST``, which marks a rejected plan)."""
    d = (int(schedule_digest) ^ int(op)) & 0xFFFFFFFFFFFFFFFF
    return d ^ 0x2 if d == _core.REJECTED_DIGEST else d
