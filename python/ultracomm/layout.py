"""ExpertLayout: the members of one expert and where they sit in a replica slot.

One expert's weights are one contiguous byte range of a weight slot, its gradients one
contiguous byte range of a grad slot.  Member ``m`` starts at the end of member ``m-1``
rounded up to ``align`` bytes (16 B by default, what TMA bulk copies need)::

    weight slot:  | fc1 (2I*H*2 B) | pad | fc2 (H*I*2 B) |
                  ^ weight_offsets[0]    ^ weight_offsets[1]      ^ weight_bytes

``weight_bytes`` / ``grad_bytes`` end at the last member's last byte and are *not*
padded at the end; a pool that packs slots back to back should step by
``weight_stride`` / ``grad_stride`` (the same sizes rounded up to ``align``).

Gradients use ``grad_dtype`` (fp32 by default) for every member, whatever the weight
dtype: replicas' gradients are accumulated in it.
"""
from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .errors import LayoutError, RegistrationError

__all__ = ["Member", "ExpertLayout", "GRAD_DTYPES", "MAX_EXPERT_BYTES", "MAX_MEMBERS"]

#: Largest expert (weights or grads, bytes): bounds every byte count and window offset
#: derived from a layout far below where uint64 arithmetic could overflow.
MAX_EXPERT_BYTES = 1 << 40

#: Members one expert may have: the executors' bound (kMaxMembers in
#: include/ultracomm/exec_view.h, _core.MAX_MEMBERS; test_exec_protocol checks they agree).
MAX_MEMBERS = 8

#: Gradient dtypes the reduction kernels support.
GRAD_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


def _align_up(n: int, a: int) -> int:
    return (n + a - 1) // a * a


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()


@dataclass(frozen=True)
class Member:
    """One parameter of an expert, e.g. ``Member("fc1", (2 * inter, hidden), torch.bfloat16)``.

    Attributes:
        name: unique name within the layout.
        shape: shape of ONE expert's tensor (without the leading experts dimension).
        dtype: weight dtype.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"member name must be a non-empty str, got {self.name!r}")
        try:  # operator.index: ints (and numpy ints) only; 3.7 or "3" are errors, not truncated
            if isinstance(self.shape, (str, bytes)) or any(isinstance(d, bool) for d in self.shape):
                raise TypeError
            shape = tuple(operator.index(d) for d in self.shape)
        except TypeError:
            raise LayoutError(
                f"member {self.name!r}: shape must be a tuple of ints, got {self.shape!r}"
            ) from None
        if len(shape) == 0 or any(d <= 0 for d in shape):
            raise LayoutError(
                f"member {self.name!r}: shape {shape} must have at least one dimension and "
                "all dimensions positive"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(
                f"member {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}"
            )
        nbytes = math.prod(shape) * max(_itemsize(self.dtype), _itemsize(torch.float32))
        if nbytes > MAX_EXPERT_BYTES:
            raise LayoutError(
                f"member {self.name!r}: shape {shape} is {nbytes} bytes (weights or fp32 grads) for one expert; "
                f"at most {MAX_EXPERT_BYTES} (1 TiB) fits the window's arithmetic"
            )
        object.__setattr__(self, "shape", shape)

    @property
    def numel(self) -> int:
        """Elements in one expert's tensor."""
        return math.prod(self.shape)


@dataclass(frozen=True)
class ExpertLayout:
    """The members of one expert, their gradient dtype and slot alignment.

    Attributes:
        members: the expert's parameters, in slot order.
        grad_dtype: dtype of every member's gradient (float32, bfloat16 or float16).
        align: byte alignment of each member inside a slot; a power of two >= 16.
    """

    members: tuple[Member, ...]
    grad_dtype: torch.dtype = torch.float32
    align: int = 16

    def __post_init__(self) -> None:
        members = tuple(self.members)
        object.__setattr__(self, "members", members)
        if not members:
            raise LayoutError("an ExpertLayout needs at least one member (e.g. fc1, fc2)")
        if len(members) > MAX_MEMBERS:
            raise LayoutError(f"an ExpertLayout has at most {MAX_MEMBERS} members, got {len(members)}; "
                              "concatenate small parameters (e.g. biases) into one member")
        for m in members:
            if not isinstance(m, Member):
                raise LayoutError(f"members must be Member instances, got {type(m).__name__}")
        names = [m.name for m in members]
        dup = sorted({n for n in names if names.count(n) > 1})
        if dup:
            raise LayoutError(f"duplicate member names {dup}; give each member a unique name")
        if self.grad_dtype not in GRAD_DTYPES:
            raise LayoutError(
                f"grad_dtype {self.grad_dtype} is not supported; use one of "
                "torch.float32, torch.bfloat16, torch.float16"
            )
        a = self.align
        if not isinstance(a, int) or isinstance(a, bool) or a < 16 or a > 1 << 20 or a & (a - 1):
            raise LayoutError(f"align must be a power of two in [16, 2^20], got {a!r}")
        if max(self.weight_bytes, self.grad_bytes) > MAX_EXPERT_BYTES:
            raise LayoutError(
                f"one expert is {self.weight_bytes} bytes of weights and {self.grad_bytes} bytes of grads; at "
                f"most {MAX_EXPERT_BYTES} (1 TiB) each fits the window's arithmetic"
            )

    # -- constructors -------------------------------------------------------------

    @classmethod
    def swiglu(
        cls,
        hidden: int,
        moe_inter: int,
        dtype: torch.dtype = torch.bfloat16,
        grad_dtype: torch.dtype = torch.float32,
        align: int = 16,
    ) -> "ExpertLayout":
        """A SwiGLU expert: ``fc1 [2*moe_inter, hidden]`` (gate and up fused) and
        ``fc2 [hidden, moe_inter]``, both ``dtype``."""
        return cls(
            (
                Member("fc1", (2 * moe_inter, hidden), dtype),
                Member("fc2", (hidden, moe_inter), dtype),
            ),
            grad_dtype,
            align,
        )

    @classmethod
    def from_tensors(
        cls,
        weights: Sequence[torch.Tensor],
        names: Optional[Sequence[str]] = None,
        grad_dtype: torch.dtype = torch.float32,
        align: int = 16,
    ) -> "ExpertLayout":
        """Infer the layout from stacked weights ``[experts_per_rank, *shape]``, one per
        member; names default to ``fc1, fc2, ...``."""
        if names is None:
            names = [f"fc{i + 1}" for i in range(len(weights))]
        if len(names) != len(weights):
            raise LayoutError(f"{len(names)} names for {len(weights)} weight tensors")
        members = []
        for n, w in zip(names, weights):
            if w.ndim < 2:
                raise LayoutError(
                    f"weight {n!r} has shape {tuple(w.shape)}; expected "
                    "[experts_per_rank, *member_shape]"
                )
            members.append(Member(n, tuple(w.shape[1:]), w.dtype))
        return cls(tuple(members), grad_dtype, align)

    # -- lookup ------------------------------------------------------------------

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(m.name for m in self.members)

    def index_of(self, name: str) -> int:
        """Position of member ``name``."""
        try:
            return self.names.index(name)
        except ValueError:
            raise LayoutError(f"no member named {name!r}; members are {list(self.names)}") from None

    def _member(self, m: int | str) -> Member:
        return self.members[self.index_of(m) if isinstance(m, str) else m]

    def numel(self, m: int | str) -> int:
        """Elements of member ``m`` (index or name) for one expert."""
        return self._member(m).numel

    # -- byte layout --------------------------------------------------------------

    @staticmethod
    def _offsets(sizes: Sequence[int], align: int) -> tuple[int, ...]:
        out, end = [], 0
        for s in sizes:
            off = _align_up(end, align)
            out.append(off)
            end = off + s
        return tuple(out)

    @property
    def weight_sizes(self) -> tuple[int, ...]:
        """Bytes of each member's weights for one expert (numel × member dtype size)."""
        return tuple(m.numel * _itemsize(m.dtype) for m in self.members)

    @property
    def weight_offsets(self) -> tuple[int, ...]:
        """Byte offset of each member inside a weight slot (multiples of ``align``)."""
        return self._offsets(self.weight_sizes, self.align)

    @property
    def weight_bytes(self) -> int:
        """Bytes from a weight slot's start to the end of its last member (no tail
        padding; see ``weight_stride``)."""
        return self.weight_offsets[-1] + self.weight_sizes[-1]

    @property
    def weight_stride(self) -> int:
        """``weight_bytes`` rounded up to ``align``: the step between slots packed at ``align``.
        (A Context's window steps by ``wlayout["weight_stride"]``, padded further to 256 B.)"""
        return _align_up(self.weight_bytes, self.align)

    @property
    def grad_sizes(self) -> tuple[int, ...]:
        """Bytes of each member's gradient for one expert (numel × grad dtype size)."""
        g = _itemsize(self.grad_dtype)
        return tuple(m.numel * g for m in self.members)

    @property
    def grad_offsets(self) -> tuple[int, ...]:
        """Byte offset of each member inside a grad slot (multiples of ``align``)."""
        return self._offsets(self.grad_sizes, self.align)

    @property
    def grad_bytes(self) -> int:
        """Bytes from a grad slot's start to the end of its last member (no tail
        padding; see ``grad_stride``)."""
        return self.grad_offsets[-1] + self.grad_sizes[-1]

    @property
    def grad_stride(self) -> int:
        """``grad_bytes`` rounded up to ``align``: the step between slots packed at ``align``.
        (A Context's window steps by ``wlayout["grad_stride"]``, padded further to 256 B.)"""
        return _align_up(self.grad_bytes, self.align)

    # -- registration -------------------------------------------------------------

    def check_tensors(
        self,
        weights: Sequence,
        grads: Optional[Sequence],
        experts_per_rank: int,
    ) -> None:
        """Validate the home tensors a rank registers.

        Args:
            weights: one entry per member, in member order: a stacked
                ``[experts_per_rank, *member.shape]`` tensor of ``member.dtype``, or a list
                of ``experts_per_rank`` per-expert ``[*member.shape]`` tensors.
            grads: ``None`` (weights only, e.g. inference) or the same in ``grad_dtype``.
            experts_per_rank: experts hosted by this rank.

        All tensors must be contiguous and on one device.  A stacked tensor must start at an
        address aligned to ``align`` bytes (only its base is checked: a member whose
        per-expert size is not a multiple of ``align`` leaves later rows unaligned, which
        the host executor accepts but GPU transports may not); per-expert tensors may sit
        at any address (Megatron's ``main_grad`` views into grad buckets).

        Raises:
            RegistrationError: naming the member, what was expected, what was given,
            and what to do.
        """
        if not isinstance(experts_per_rank, int) or experts_per_rank < 0:
            raise RegistrationError(
                f"experts_per_rank must be a non-negative int, got {experts_per_rank!r}"
            )
        groups = [("weights", weights, None)]
        if grads is not None:
            groups.append(("grads", grads, self.grad_dtype))
        device: list = []
        for kind, entries, forced_dtype in groups:
            if isinstance(entries, torch.Tensor) or len(entries) != len(self.members):
                got = "a single tensor" if isinstance(entries, torch.Tensor) else f"{len(entries)}"
                raise RegistrationError(
                    f"{kind}: expected one tensor per member {list(self.names)} "
                    f"({len(self.members)}), got {got}; pass a list in member order"
                )
            for m, entry in zip(self.members, entries):
                where = f"{kind}[{m.name!r}]"
                dtype = forced_dtype or m.dtype
                if isinstance(entry, torch.Tensor):
                    self._check_one(where, entry, (experts_per_rank, *m.shape), dtype, forced_dtype, device,
                                    aligned=True)
                    continue
                if isinstance(entry, (str, bytes)) or not isinstance(entry, Sequence):
                    raise RegistrationError(
                        f"{where}: expected a stacked tensor or a list of {experts_per_rank} per-expert "
                        f"tensors, got {type(entry).__name__}"
                    )
                if len(entry) != experts_per_rank:
                    raise RegistrationError(
                        f"{where}: a per-expert list needs experts_per_rank = {experts_per_rank} tensors, "
                        f"got {len(entry)}"
                    )
                for i, t in enumerate(entry):
                    self._check_one(f"{where}[{i}]", t, m.shape, dtype, forced_dtype, device, aligned=False)

    def _check_one(self, where: str, t: object, want_shape: tuple, want_dtype: torch.dtype,
                   forced_dtype: Optional[torch.dtype], device: list, aligned: bool) -> None:
        if not isinstance(t, torch.Tensor):
            raise RegistrationError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(want_shape):
            raise RegistrationError(
                f"{where}: expected shape {list(want_shape)}, got {list(t.shape)}; "
                + ("stack this rank's experts along dim 0 ([experts_per_rank, *member.shape]) or pass a list of "
                   "per-expert tensors" if aligned else "each per-expert tensor has the member's shape")
                + " (transpose if your framework stores the member the other way round)"
            )
        if t.dtype != want_dtype:
            hint = "grad_dtype of the layout" if forced_dtype else "member dtype"
            raise RegistrationError(
                f"{where}: expected dtype {want_dtype} ({hint}), got {t.dtype}; convert "
                "the tensor or build the layout with the dtype you use"
            )
        if not t.is_contiguous():
            raise RegistrationError(
                f"{where}: tensor is not contiguous (strides {list(t.stride())}); call "
                ".contiguous() and register the result (keep it as the parameter's storage)"
            )
        if not device:
            device.extend((t.device, where))
        elif t.device != device[0]:
            raise RegistrationError(
                f"{where}: on device {t.device}, but {device[1]} is on {device[0]}; all "
                "registered tensors must be on the same device: move them with .to()"
            )
        if aligned and t.numel() and t.data_ptr() % self.align:
            raise RegistrationError(
                f"{where}: data_ptr 0x{t.data_ptr():x} is not aligned to {self.align} "
                "bytes; register a tensor that starts its own allocation (e.g. .clone()) "
                "rather than a view at an odd offset"
            )
