"""The host transport: runs a rank's task list with the C++ host executor (``_core.run_host``)."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Sequence

import torch

from ... import _core
from ...records import Op
from ...blame import strip_blame
from .who_stopped import _AWAITED, latest_epochs, stopped_note

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
    return (t.data_ptr(), tuple(t.shape), t.dtype, t.is_contiguous(),
            t.untyped_storage().nbytes() >= (t.storage_offset() + t.numel()) * t.element_size())


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
        grads = None if grads is None else tuple(g if g is None or isinstance(g, torch.Tensor) else tuple(g)
                                                 for g in grads)
        m = cls(weights, grads, master_pointers(weights, experts_per_rank), master_pointers(grads or (), experts_per_rank),
                tuple(names))
        return dataclasses.replace(m, fingerprints=tuple(_fingerprint(t) for _, t in m._tensors()))

    def _tensors(self) -> list[tuple[str, torch.Tensor]]:
        return _labelled("weights", self.weights, self.names) + _labelled("grads", self.grads or (), self.names)

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


class HostTransport:
    """CPU executor over host windows (``host_shm`` or ``local``)."""

    name = "host"
    window_providers = ("host_shm", "local")

    def __init__(self, *, rank: int, world: int, window, wlayout: dict, layout, num_workers: int,
                 timeout_s: float, jitter_us: int = 0, peer_bases: Sequence[int] | None = None):
        """``peer_bases``: the pointer table to run over instead of ``window.peer_bases`` (the
        ``split`` transport's shadows stand in for ranks in other memory domains)."""
        self.rank, self.world = rank, world
        self.window = window
        self.wlayout = wlayout
        self.layout = layout
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.jitter_us = jitter_us
        self._grad_code = GRAD_DTYPE_CODE[layout.grad_dtype]
        self._bases = list(window.peer_bases if peer_bases is None else peer_bases)
        self._weight_members = (list(layout.weight_offsets), list(layout.weight_sizes))
        self._grad_members = (list(layout.grad_offsets), list(layout.grad_sizes))
        self._cache: dict = {}
        #: the Context's :class:`ultracomm.blame.Witness` (set by the Context): a timeout names
        #: ranks stopped by evidence; None: the ready flags' note (who_stopped) as before
        self.witness = None

    def _args(self, op: Op, schedule) -> tuple:
        """Per (schedule, op) executor arguments, built once: the schedule cache keeps them warm."""
        key = (schedule.digest, int(op))
        args = self._cache.get(key)
        if args is None:
            if len(self._cache) >= 128:
                self._cache.clear()
            args = (schedule.tasks(op, self.rank), schedule.refs(op, self.rank),
                    schedule.tree(op)[0][self.rank].tolist())
            self._cache[key] = args
        return args

    def reject(self, op: Op, epoch: int) -> None:
        """This rank rejected its plan for ``op`` at ``epoch``: publish it in its window instead of
        running the op, so every peer that exchanges data with it raises PlanMismatchError at once."""
        L = self.wlayout
        _core.publish_rejection(int(op), self.rank, epoch, self._bases[self.rank], L["slots"], L["weight_slot_bytes"],
                                L["grad_slot_bytes"], L["chunk_bytes"])

    def run(self, op: Op, schedule, epoch: int, masters: Masters, my_slots: Sequence[int],
            local_index_of: Sequence[int], op_name: str | None = None, abort_word: int = 0,
            lists: tuple | None = None) -> None:
        """Run ``op`` of ``schedule`` for this rank at ``epoch``; blocks until done here.
        ``op_name`` (``weight_sync``, ``restore``, ``grad_reduce``) names the operation in errors;
        ``abort_word``: address of a uint64 that stops the run once nonzero (``_core.run_host``);
        ``lists``: ``(tasks, refs)`` to run instead of the schedule's (the split transport's
        direct crossings drop the refs to other domains)."""
        tasks, refs, slot_parent = self._args(op, schedule)
        if lists is not None:
            tasks, refs = lists
        if op == Op.MULTICAST:
            member_off, member_bytes, ptrs = self._weight_members + (masters.weight_ptrs,)
        else:
            member_off, member_bytes, ptrs = self._grad_members + (masters.grad_ptrs,)
        try:
            self._run_host(op, epoch, tasks, refs, slot_parent, member_off, member_bytes, ptrs, my_slots,
                           local_index_of, op_name, op_digest(schedule.digest, op), abort_word)
        except _core.TimeoutError as e:
            witness = getattr(self, "witness", None)
            if witness is not None:  # blame by evidence (ultracomm.blame): heartbeats, failure words, records
                text = strip_blame(str(e))
                awaited = [int(r) for r in _AWAITED.findall(text)]
                why = witness.explain(epoch, f"{op_name or op.name.lower()} timed out", awaited)
                raise _core.TimeoutError(f"{text}; {why}") from None
            note = self._who_stopped(str(e), epoch)
            if note is None:
                raise
            raise _core.TimeoutError(f"{e}; {note}") from None

    def _who_stopped(self, message: str, epoch: int) -> str | None:
        """What the ready flags in this window say about who stopped first (who_stopped.py)."""
        try:
            own = list(self.window.peer_bases)
        except Exception:  # noqa: BLE001 - a closed window: nothing to read
            return None
        # a pointer that differs from the window's is a stand-in (split shadows), not the peer's flags
        readable = [b != 0 and b == w for b, w in zip(self._bases, own)]
        return stopped_note(message, epoch, self.rank,
                            latest_epochs(self._bases, readable, self.wlayout["ready_off"]))

    def _run_host(self, op, epoch, tasks, refs, slot_parent, member_off, member_bytes, ptrs, my_slots,
                  local_index_of, op_name, digest, abort_word) -> None:
        _core.run_host(
            int(op), self.rank, self.world, epoch,
            self.wlayout["slots"], self.wlayout["weight_slot_bytes"], self.wlayout["grad_slot_bytes"],
            self.wlayout["chunk_bytes"], self._bases, member_off, member_bytes, list(ptrs), list(local_index_of),
            self._grad_code, list(my_slots), tasks, refs,
            self.num_workers, self.timeout_s, self.jitter_us, epoch,
            slot_parent=slot_parent, op_name=op_name, digest=digest, abort_word=abort_word,
        )
