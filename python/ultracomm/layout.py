"""ExpertLayout: the members of one expert and where they sit in a replica slot.

One expert's weights are one contiguous byte range of a weight slot, its gradients one
contiguous byte range of a grad slot.  Member ``m`` starts at the end of member ``m-1``
rounded up to ``align`` bytes (16 B by default, what TMA bulk copies need)::

    weight slot:  | fc1 (2I*H*2 B) | pad | fc2 (H*I*2 B) |
                  ^ weight_offsets[0]    ^ weight_offsets[1]      ^ weight_bytes

``weight_bytes`` / ``grad_bytes`` end at the last member's last byte and are *not*
padded at the end; a pool that packs slots back to back should step by
``weight_stride`` / ``grad_stride`` (the same sizes rounded up to ``align``).

Gradients use ``grad_dtype`` (fp32 by default) for every member that carries one, whatever
the weight dtype: replicas' gradients are accumulated in it.  A member with ``grad=False``
(an FP8 weight's scales) has a zero-byte gradient range: it is multicast and never reduced.

FP8 runtime copies: the caller quantizes its high-precision masters each step into FP8
members (e4m3/e5m2, per-row or MXFP8 block scales) and scale members; ultracomm moves their
bytes unconverted (half the bytes of bf16) and reduces each FP8 member's gradient, in
``grad_dtype``, into the master of ``master_dtype`` it was quantized from.
"""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass
from typing import Optional, Sequence

import torch

from .errors import LayoutError, RegistrationError
from .fp8 import scale_shape

__all__ = ["Member", "ExpertLayout", "GRAD_DTYPES", "FP8_DTYPES", "MASTER_DTYPES", "MAX_EXPERT_BYTES", "MAX_MEMBERS"]

#: Largest expert (weights or grads, bytes): bounds every byte count and window offset
#: derived from a layout far below where uint64 arithmetic could overflow.
MAX_EXPERT_BYTES = 1 << 40

#: Members one expert may have: the executors' bound (kMaxMembers in
#: include/ultracomm/records/exec_view.h, _core.MAX_MEMBERS; test_exec_protocol checks they agree).
MAX_MEMBERS = 8

#: Gradient dtypes the reduction kernels support.
GRAD_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)

#: 8-bit float weight dtypes: a member of one of them that carries a gradient names the
#: dtype of the high-precision master it is quantized from (``master_dtype``).
FP8_DTYPES: tuple[torch.dtype, ...] = tuple(
    getattr(torch, n)
    for n in ("float8_e4m3fn", "float8_e5m2", "float8_e4m3fnuz", "float8_e5m2fnuz")
    if hasattr(torch, n)
)

#: dtypes of the high-precision masters an FP8 member's gradient reduces into.
MASTER_DTYPES: tuple[torch.dtype, ...] = (torch.float32, torch.bfloat16, torch.float16)


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
        dtype: weight dtype (any dtype: bytes are moved unconverted).
        grad: whether the member carries a gradient (``False``: scales, other constants;
            multicast only, no gradient range in a grad slot).
        master_dtype: the dtype of the master the member's gradient reduces into.  For an FP8
            member, the high-precision weights the caller quantizes from (``torch.bfloat16`` or
            ``torch.float32``; ``ReplicaManager`` checks its masters against it; None: any of
            them, or grads registered directly with a Context, as UltraEP's adapter does);
            otherwise ``dtype`` (the default): the registered weights are the masters.
    """

    name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    grad: bool = True
    master_dtype: Optional[torch.dtype] = None

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise LayoutError(f"member name must be a non-empty str, got {self.name!r}")
        try:  # operator.index: ints (and numpy ints) only; 3.7 or "3" are errors, not truncated
            if isinstance(self.shape, (str, bytes)) or any(isinstance(d, bool) for d in self.shape):
                raise TypeError
            shape = tuple(operator.index(d) for d in self.shape)
        except TypeError:
            raise LayoutError(f"member {self.name!r}: shape must be a tuple of ints, got {self.shape!r}") from None
        if len(shape) == 0 or any(d <= 0 for d in shape):
            raise LayoutError(
                f"member {self.name!r}: shape {shape} must have at least one dimension and all dimensions positive"
            )
        if not isinstance(self.dtype, torch.dtype):
            raise LayoutError(f"member {self.name!r}: dtype must be a torch.dtype, got {self.dtype!r}")
        if not isinstance(self.grad, bool):
            raise LayoutError(f"member {self.name!r}: grad must be True or False, got {self.grad!r}")
        self._check_master_dtype()
        nbytes = math.prod(shape) * max(_itemsize(self.dtype), _itemsize(torch.float32))
        if nbytes > MAX_EXPERT_BYTES:
            raise LayoutError(
                f"member {self.name!r}: shape {shape} is {nbytes} bytes (weights or fp32 grads) for one expert; "
                f"at most {MAX_EXPERT_BYTES} (1 TiB) fits the window's arithmetic"
            )
        object.__setattr__(self, "shape", shape)

    def _check_master_dtype(self) -> None:
        md = self.master_dtype
        if md is not None and not isinstance(md, torch.dtype):
            raise LayoutError(f"member {self.name!r}: master_dtype must be a torch.dtype or None, got {md!r}")
        if not self.grad:
            if md is not None:
                raise LayoutError(
                    f"member {self.name!r}: master_dtype is for members that carry a gradient; a "
                    "member with grad=False (e.g. scales) has no master to reduce into"
                )
            return
        if self.dtype in FP8_DTYPES:
            if md is not None and md not in MASTER_DTYPES:
                raise LayoutError(
                    f"member {self.name!r} is {self.dtype}: its master_dtype (the high-precision master it is quantized "
                    f"from and its gradient reduces into) must be one of {[str(d) for d in MASTER_DTYPES]}, got {md}"
                )
            return
        if md is not None and md != self.dtype:
            raise LayoutError(
                f"member {self.name!r}: master_dtype {md} differs from its dtype {self.dtype}; only an "
                "FP8 member's master has another dtype (the weights registered are the masters)"
            )

    @property
    def numel(self) -> int:
        """Elements in one expert's tensor."""
        return math.prod(self.shape)

    @property
    def fp8(self) -> bool:
        """An FP8 weight (e4m3/e5m2): a runtime copy of a master of ``master_dtype``."""
        return self.dtype in FP8_DTYPES

    @property
    def grad_master_dtype(self) -> Optional[torch.dtype]:
        """The dtype of the master this member's gradient reduces into (None: no gradient, or an
        FP8 member that names none: any of ``MASTER_DTYPES``)."""
        if not self.grad or (self.fp8 and self.master_dtype is None):
            return None
        return self.master_dtype or self.dtype


@dataclass(frozen=True)
class ExpertLayout:
    """The members of one expert, their gradient dtype and slot alignment.

    Attributes:
        members: the expert's parameters, in slot order.
        grad_dtype: dtype of every gradient (float32, bfloat16 or float16) of the members
            that carry one (``Member.grad``).
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
            raise LayoutError(
                f"an ExpertLayout has at most {MAX_MEMBERS} members, got {len(members)}; "
                "concatenate small parameters (e.g. biases) into one member"
            )
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
            (Member("fc1", (2 * moe_inter, hidden), dtype), Member("fc2", (hidden, moe_inter), dtype)),
            grad_dtype,
            align,
        )

    @classmethod
    def fp8_swiglu(
        cls,
        hidden: int,
        moe_inter: int,
        master_dtype: torch.dtype = torch.bfloat16,
        fp8_dtype: torch.dtype = torch.float8_e4m3fn,
        scaling: str = "mxfp8",
        align: int = 16,
    ) -> "ExpertLayout":
        """A SwiGLU expert as FP8 runtime copies: ``fc1 [2*moe_inter, hidden]`` and
        ``fc2 [hidden, moe_inter]`` in ``fp8_dtype``, each followed by its scales
        (``fc1_scale``, ``fc2_scale``; no gradient), gradients fp32 into masters of
        ``master_dtype``.

        ``scaling``: ``"mxfp8"`` -- one ``float8_e8m0fnu`` power-of-two scale per 32 elements
        of a row (``[rows, cols / 32]``; ``cols`` a multiple of 32); ``"row"`` -- one fp32 scale
        per row (``[rows, 1]``).  :mod:`ultracomm.fp8` quantizes into these shapes."""
        members = []
        for name, shape in (("fc1", (2 * moe_inter, hidden)), ("fc2", (hidden, moe_inter))):
            sshape, sdtype = scale_shape(shape, scaling)
            members += [
                Member(name, shape, fp8_dtype, master_dtype=master_dtype),
                Member(f"{name}_scale", sshape, sdtype, grad=False),
            ]
        return cls(tuple(members), torch.float32, align)

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
                    f"weight {n!r} has shape {tuple(w.shape)}; expected [experts_per_rank, *member_shape]"
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

    @property
    def grad_members(self) -> tuple[int, ...]:
        """Indices of the members that carry a gradient."""
        return tuple(i for i, m in enumerate(self.members) if m.grad)

    @property
    def fp8(self) -> bool:
        """Some member is an FP8 runtime copy (its master is registered apart: see
        ``ReplicaManager.register_layer(masters=...)``)."""
        return any(m.fp8 and m.grad for m in self.members)

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
            off = _align_up(end, align) if s else end  # an empty range (no gradient) needs no alignment
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
        return max(o + n for o, n in zip(self.weight_offsets, self.weight_sizes))

    @property
    def weight_stride(self) -> int:
        """``weight_bytes`` rounded up to ``align``: the step between slots packed at ``align``.
        (A Context's window steps by ``wlayout["weight_stride"]``, padded further to 256 B.)"""
        return _align_up(self.weight_bytes, self.align)

    @property
    def grad_sizes(self) -> tuple[int, ...]:
        """Bytes of each member's gradient for one expert (numel × grad dtype size; 0 for a
        member with ``grad=False``)."""
        g = _itemsize(self.grad_dtype)
        return tuple(m.numel * g if m.grad else 0 for m in self.members)

    @property
    def grad_offsets(self) -> tuple[int, ...]:
        """Byte offset of each member inside a grad slot (multiples of ``align``)."""
        return self._offsets(self.grad_sizes, self.align)

    @property
    def grad_bytes(self) -> int:
        """Bytes from a grad slot's start to the end of its last member (no tail
        padding; see ``grad_stride``)."""
        return max((o + n for o, n in zip(self.grad_offsets, self.grad_sizes) if n), default=0)

    @property
    def grad_stride(self) -> int:
        """``grad_bytes`` rounded up to ``align``: the step between slots packed at ``align``.
        (A Context's window steps by ``wlayout["grad_stride"]``, padded further to 256 B.)"""
        return _align_up(self.grad_bytes, self.align)

    # -- registration -------------------------------------------------------------

    def check_tensors(self, weights: Sequence, grads: Optional[Sequence], experts_per_rank: int) -> None:
        """Validate the home tensors a rank registers.

        Args:
            weights: one entry per member, in member order: a stacked
                ``[experts_per_rank, *member.shape]`` tensor of ``member.dtype``, or a list
                of ``experts_per_rank`` per-expert ``[*member.shape]`` tensors.
            grads: ``None`` (weights only, e.g. inference) or the same in ``grad_dtype``,
                with ``None`` for each member that carries no gradient (``grad=False``).
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
            raise RegistrationError(f"experts_per_rank must be a non-negative int, got {experts_per_rank!r}")
        for kind, entries in (("weights", weights), ("grads", grads)):
            if (entries is not None or kind == "weights") and not isinstance(entries, (torch.Tensor, Sequence)):
                raise RegistrationError(
                    f"ultracomm: {kind} must be {'None or ' if kind == 'grads' else ''}a list "
                    f"(one entry per member {list(self.names)}), got {type(entries).__name__}"
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
                if kind == "grads" and not m.grad:
                    if entry is not None:
                        raise RegistrationError(
                            f"{where}: member {m.name!r} carries no gradient (grad=False); pass None in its place"
                        )
                    continue
                if kind == "grads" and entry is None:
                    raise RegistrationError(
                        f"{where}: member {m.name!r} carries a gradient; pass its "
                        f"{self.grad_dtype} grads (None only for members with grad=False)"
                    )
                dtype = forced_dtype or m.dtype
                if isinstance(entry, torch.Tensor):
                    self._check_one(
                        where, entry, (experts_per_rank, *m.shape), dtype, forced_dtype, device, aligned=True
                    )
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

    def _check_one(
        self,
        where: str,
        t: object,
        want_shape: tuple,
        want_dtype: torch.dtype,
        forced_dtype: Optional[torch.dtype],
        device: list,
        aligned: bool,
    ) -> None:
        if not isinstance(t, torch.Tensor):
            raise RegistrationError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(want_shape):
            raise RegistrationError(
                f"{where}: expected shape {list(want_shape)}, got {list(t.shape)}; "
                + (
                    "stack this rank's experts along dim 0 ([experts_per_rank, *member.shape]) or pass a list of "
                    "per-expert tensors"
                    if aligned
                    else "each per-expert tensor has the member's shape"
                )
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
