"""The load board: its byte layout and exchange protocol, one description for both boards
(:class:`~ultracomm.moe.loads.LoadBoard` in host memory, :class:`~ultracomm.moe.loads_gpu.GpuLoadBoard`
in GPU windows, whose kernel ``csrc/cuda/k_loads.cu`` gets these offsets; ``csrc/cuda/load_exchange.h``
repeats this text beside the pointer math).

Every rank owns one board (a small symmetric window); a peer's address is its base + offset.
Per board, ``entries x world`` records of ``record_bytes`` (a multiple of 64)::

    record(n, q) = ((n % entries) * world + q) * record_bytes
      +0   uint64 flag   the exchange number whose counts the record holds
      +8   uint64 tag    what sender q's exchange n is for (:class:`ExchangeTag`: operation, layer,
                         micro-batch slot), written with the counts
      +16  int32 [E]     sender q's expert token counts

Exchange ``n`` (1, 2, ... on every rank in the same order): sender ``q`` writes its tag and counts
into ``record(n, q)`` of EVERY rank's board, then stores ``flag = n`` with release semantics
there; each rank waits until its own ``record(n, q).flag >= n`` for every ``q`` (bounded by
``ULTRACOMM_TIMEOUT_S``), then reads the tags and counts.  A sender whose tag differs from the
reader's own is out of step (it runs another layer, micro-batch or operation at this exchange):
the reader raises :class:`~ultracomm.errors.PlanMismatchError` naming both, before the plan is
made from the loads -- every rank reads every rank's record, so every rank raises.  Writers push,
readers poll their own memory (on GPUs the polling stays local, the writes cross NVLink once).
With two entries a record is rewritten (exchange ``n + 2``) only after its reader posted
``n + 1``, i.e. finished reading ``n``.  Flags only grow, never reset.
"""

from __future__ import annotations

from dataclasses import dataclass
from ..errors import InputError

__all__ = ["BoardLayout", "ExchangeTag", "ENTRIES", "MAX_COUNT", "HEADER_BYTES", "timeout_text", "mismatch_text"]

ENTRIES = 2
MAX_COUNT = 2**31 - 1  # counts are int32: tokens one rank routes to one expert in one step
HEADER_BYTES = 16  # flag and tag ahead of the counts
_OPS = {"step": 1}  # operation codes of a tag (low byte)
_NO_GRAD = 1 << 8
_LAYER_SHIFT, _LAYER_BITS = 16, 24
_SLOT_SHIFT, _SLOT_BITS = 40, 24


@dataclass(frozen=True)
class ExchangeTag:
    """What one load exchange is for, as every rank must agree: the operation (``step``), the
    layer, the micro-batch slot of the layer (``vid % max_microbatches``) and whether the step
    takes a backward (``grad``).  ``value`` is the uint64 a record carries; :meth:`decode`
    reads one back (None for 0: an exchange whose caller named nothing).  ``str()`` is how
    errors name it, e.g. ``step(layer 0)``, ``step(layer 2, micro-batch slot 1, no grad)``."""

    layer: int
    slot: int = 0
    grad: bool = True
    op: str = "step"

    def __post_init__(self) -> None:
        if self.op not in _OPS:
            raise InputError(f"ultracomm: exchange tag operation must be one of {sorted(_OPS)}, got {self.op!r}")
        for name, v, bits in (("layer", self.layer, _LAYER_BITS), ("slot", self.slot, _SLOT_BITS)):
            if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v < 1 << bits:
                raise InputError(f"ultracomm: exchange tag {name} must be an int in 0..{(1 << bits) - 1}, got {v!r}")

    @property
    def value(self) -> int:
        return _OPS[self.op] | (0 if self.grad else _NO_GRAD) | self.layer << _LAYER_SHIFT | self.slot << _SLOT_SHIFT

    @classmethod
    def decode(cls, value: int) -> "ExchangeTag | None":
        value = int(value) & 0xFFFFFFFFFFFFFFFF
        ops = {c: o for o, c in _OPS.items()}
        code = value & 0xFF
        if value == 0 or code not in ops or value & 0xFE00:
            return None
        return cls(
            value >> _LAYER_SHIFT & ((1 << _LAYER_BITS) - 1), value >> _SLOT_SHIFT, not value & _NO_GRAD, ops[code]
        )

    @staticmethod
    def describe(value: int) -> str:
        """How an error names a record's tag (one this version does not write: its hex)."""
        tag = ExchangeTag.decode(value)
        if tag is not None:
            return str(tag)
        return "an exchange that names nothing" if int(value) == 0 else f"an unknown exchange (tag {int(value):#x})"

    def __str__(self) -> str:
        more = ([f"micro-batch slot {self.slot}"] if self.slot else []) + ([] if self.grad else ["no grad"])
        return f"{self.op}(layer {self.layer}{''.join(', ' + m for m in more)})"


@dataclass(frozen=True)
class BoardLayout:
    world: int
    num_experts: int
    entries: int = ENTRIES

    def __post_init__(self) -> None:
        if self.world < 1 or self.num_experts < 1 or self.entries < 2:
            raise InputError(
                f"ultracomm: a load board needs world >= 1, num_experts >= 1 and entries >= 2, got "
                f"{self.world}, {self.num_experts}, {self.entries}"
            )

    @property
    def record_bytes(self) -> int:
        return -(-(HEADER_BYTES + 4 * self.num_experts) // 64) * 64

    @property
    def total_bytes(self) -> int:
        """Bytes of one rank's board."""
        return self.entries * self.world * self.record_bytes

    def record(self, n: int, sender: int) -> int:
        """Offset of sender's record (its flag) for exchange ``n`` in any rank's board."""
        return ((n % self.entries) * self.world + sender) * self.record_bytes

    def tag(self, n: int, sender: int) -> int:
        """Offset of sender's uint64 :class:`ExchangeTag` value for exchange ``n``."""
        return self.record(n, sender) + 8

    def counts(self, n: int, sender: int) -> int:
        """Offset of sender's int32 counts for exchange ``n``."""
        return self.record(n, sender) + HEADER_BYTES


# the errors of an exchange, in the same words on both boards
def timeout_text(rank: int, op: str, timeout_s: float, missing: list[int], why: str | None = None) -> str:
    """The error of an exchange whose ``missing`` ranks never posted (both boards say this);
    ``why``: the evidence of who stopped (:mod:`ultracomm.blame`), else a guess."""
    why = why or "they are likely stalled or dead, or called a different operation"
    return (
        f"ultracomm: rank {rank} {op} (expert loads) timed out after {timeout_s:g} s: ranks {missing} did not "
        f"post their loads (timeout ULTRACOMM_TIMEOUT_S={timeout_s:g}); {why}: every rank must call step() for "
        "the same layers in the same order"
    )


def mismatch_text(rank: int, op: str, n: int, posted: dict[int, list[int]]) -> str:
    """The error of exchange ``n`` where ranks posted other tags (``posted``: tag value -> ranks):
    both boards say this, in the words of the store exchange (``Comm.all_gather_object``)."""
    parts = [
        f"{f'rank {rs[0]}' if len(rs) == 1 else f'ranks {rs}'} posted {ExchangeTag.describe(t)}"
        for t, rs in posted.items()
    ]
    return (
        f"ultracomm: rank {rank} {op} (expert loads): ranks called different operations ({'; '.join(parts)} "
        f"in load exchange {n}); every rank must call the same collective operations in the same order"
    )
