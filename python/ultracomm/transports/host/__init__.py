"""The host transport: runs a rank's task list with the C++ host executor (``_core.run_host``)."""

from __future__ import annotations

from typing import Sequence

from ... import _core
from ...errors import UltracommError
from ...records import Op
from ..base import DEFAULT_TILE_BYTES, GRAD_DTYPE_CODE, Masters, Transport, master_pointers, op_digest
from .who_stopped import latest_epochs, stopped_note

__all__ = ["HostTransport", "Masters", "master_pointers", "op_digest", "GRAD_DTYPE_CODE"]


class HostTransport(Transport):
    """CPU executor over host windows (``host_shm`` or ``local``)."""

    name = "host"
    window_providers = ("host_shm", "local")
    options = frozenset({"num_workers", "jitter_us", "tile_bytes"})
    window_flags = True
    names_by_evidence = True

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        window,
        wlayout: dict,
        layout,
        num_workers: int,
        timeout_s: float,
        jitter_us: int = 0,
        tile_bytes: int = DEFAULT_TILE_BYTES,
        peer_bases: Sequence[int] | None = None,
    ):
        """``tile_bytes``: the unit a worker claims (``ULTRACOMM_TILE_BYTES``): a chunk's tiles are
        moved by any worker, and the chunk is released by the worker that retires its last one.
        ``peer_bases``: the pointer table to run over instead of ``window.peer_bases`` (the
        ``split`` transport's shadows stand in for ranks in other memory domains)."""
        self.rank, self.world = rank, world
        self.window = window
        self.wlayout = wlayout
        self.layout = layout
        self.num_workers = num_workers
        self.timeout_s = timeout_s
        self.jitter_us = jitter_us
        self.tile_bytes = int(tile_bytes)
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
            args = (
                schedule.tasks(op, self.rank),
                schedule.refs(op, self.rank),
                schedule.tree(op)[0][self.rank].tolist(),
            )
            self._cache[key] = args
        return args

    def reject(self, op: Op, epoch: int) -> None:
        """This rank rejected its plan for ``op`` at ``epoch``: publish it in its window instead of
        running the op, so every peer that exchanges data with it raises PlanMismatchError at once."""
        L = self.wlayout
        _core.publish_rejection(
            int(op),
            self.rank,
            epoch,
            self._bases[self.rank],
            L["slots"],
            L["weight_slot_bytes"],
            L["grad_slot_bytes"],
            L["chunk_bytes"],
        )

    def run(
        self,
        op: Op,
        schedule,
        epoch: int,
        masters: Masters,
        my_slots: Sequence[int],
        local_index_of: Sequence[int],
        op_name: str | None = None,
        abort_word: int = 0,
        lists: tuple | None = None,
    ) -> None:
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
            self._run_host(
                op,
                epoch,
                tasks,
                refs,
                slot_parent,
                member_off,
                member_bytes,
                ptrs,
                my_slots,
                local_index_of,
                op_name,
                op_digest(schedule.digest, op),
                abort_word,
            )
        except _core.TimeoutError as e:
            witness = self.witness
            if witness is not None:  # blame by evidence (ultracomm.blame): heartbeats, failure words, records
                text = witness.timeout_text(str(e), epoch, f"{op_name or op.name.lower()} timed out")
                raise _core.TimeoutError(text) from None
            note = self._who_stopped(str(e), epoch)
            if note is None:
                raise
            raise _core.TimeoutError(f"{e}; {note}") from None
        except RuntimeError as e:
            if isinstance(e, UltracommError):  # a plan mismatch, an abort: already ultracomm's classes
                raise
            # the executor's other error records (a corrupt task list, an unknown code) are a
            # std::runtime_error, which pybind11 makes a builtin RuntimeError; the text is the executor's
            raise UltracommError(str(e)) from None

    def _who_stopped(self, message: str, epoch: int) -> str | None:
        """What the ready flags in this window say about who stopped first (who_stopped.py)."""
        try:
            own = list(self.window.peer_bases)
        except Exception:  # noqa: BLE001 - a closed window: nothing to read
            return None
        # a pointer that differs from the window's is a stand-in (split shadows), not the peer's flags
        readable = [b != 0 and b == w for b, w in zip(self._bases, own)]
        return stopped_note(message, epoch, self.rank, latest_epochs(self._bases, readable, self.wlayout["ready_off"]))

    def _run_host(
        self,
        op,
        epoch,
        tasks,
        refs,
        slot_parent,
        member_off,
        member_bytes,
        ptrs,
        my_slots,
        local_index_of,
        op_name,
        digest,
        abort_word,
    ) -> None:
        _core.run_host(
            int(op),
            self.rank,
            self.world,
            epoch,
            self.wlayout["slots"],
            self.wlayout["weight_slot_bytes"],
            self.wlayout["grad_slot_bytes"],
            self.wlayout["chunk_bytes"],
            self._bases,
            member_off,
            member_bytes,
            list(ptrs),
            list(local_index_of),
            self._grad_code,
            list(my_slots),
            tasks,
            refs,
            self.num_workers,
            self.timeout_s,
            self.jitter_us,
            epoch,
            slot_parent=slot_parent,
            op_name=op_name,
            digest=digest,
            abort_word=abort_word,
            tile_bytes=self.tile_bytes,
        )
