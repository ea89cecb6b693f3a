"""How the ``p2p`` transport posts one wave of messages: a torch process group, or a loopback domain.

``messenger.exchange(ops)`` posts ``ops`` (``("send" | "recv", uint8 tensor, peer rank in the
group, tag)``) as one batch and returns one handle per op; ``handle.wait(timeout)`` blocks
until that message is done (raises on a timeout or a failed peer).  A post that fails at once
(gloo: the peer's connection is already closed) raises :class:`PostError` naming the op.  Several ops may share a
handle (NCCL completes a coalesced batch as a whole).

* :class:`TorchMessenger`: ``torch.distributed.batch_isend_irecv`` on the Context's group
  (gloo on the CPU, NCCL on GPUs).
* :class:`LoopbackMessenger`: ranks as threads of one process (a ``LoopbackGroup``): a
  mailbox per (source, destination, tag), first in first out like a gloo slot or an NCCL
  pair.  It makes ``transport="p2p"`` usable on loopback domains, where the test suite runs
  it for many plans without starting processes.
"""

from __future__ import annotations

import collections
import datetime
import threading
import weakref
from typing import Any, Sequence

import torch
import torch.distributed as dist

from ...comm import live_group
from ...errors import InputError, UltracommError, UltracommTimeout

__all__ = ["TorchMessenger", "LoopbackMessenger", "PostError", "messenger_for", "peer_failure"]

OpSpec = tuple  # (kind, tensor, peer, tag)

#: A Context's messages travel on tags of their own, ``tag * CHANNELS + channel``: every Context
#: numbers a pair's messages from 0, so two Contexts on one group with operations in flight at once
#: (async ops run on each Context's own thread) matched each other's messages -- one Context's
#: replica got another's bytes, no error.  ``channel``: see :func:`channel_of`.
CHANNELS = 4096
_MAX_TAG = 2**31 - 1  # gloo takes a non-negative int


def channel_of(comm: Any) -> int:
    """A Context's channel: its group's exchange count when its transport is built (inside the
    setup's agreement), alike on every rank, different for every Context made on the group (each
    setup exchanges).  Two live Contexts share one only if 4096 exchanges apart (mod CHANNELS)."""
    board = getattr(comm, "_store_board", None)
    if board is not None:
        return int(board.sequence) % CHANNELS
    domain = getattr(comm, "domain", None)
    return int(domain._sequence[comm.rank]) % CHANNELS if domain is not None else 0


def channel_tag(tag: int, channel: int) -> int:
    out = int(tag) * CHANNELS + channel
    if out > _MAX_TAG:
        raise InputError(f"ultracomm: p2p message tag {tag} is too large (at most {_MAX_TAG // CHANNELS} per pair)")
    return out


class TorchMessenger:
    """``batch_isend_irecv`` over a process group; peers are ranks of that group."""

    def __init__(self, group: Any, world: int, device: torch.device, channel: int = 0):
        self.channel = channel
        backend = self.backend = str(dist.get_backend(group)).lower()
        if device.type == "cpu" and "gloo" not in backend:
            raise InputError(
                f"ultracomm: transport 'p2p' on the CPU needs a gloo process group, this one is "
                f"{backend!r}; create the Context with device='cuda' for NCCL, or use a gloo group"
            )
        if device.type == "cuda" and "nccl" not in backend:
            raise InputError(
                f"ultracomm: transport 'p2p' on {device} needs an NCCL process group, this one is {backend!r}"
            )
        self._group_ref = weakref.ref(group)  # weak, as in TorchComm: ultracomm must not keep a destroyed group alive
        self._rank = dist.get_rank(group)
        self.global_rank = [dist.get_global_rank(group, r) for r in range(world)]
        self.coalesced = "nccl" in backend  # batch_isend_irecv groups NCCL messages into one Work
        if self.coalesced:
            # NCCL: a group's first batch_isend_irecv must involve every rank, and a wave rarely does; one
            # barrier here (every rank builds the transport together) is that first operation
            dist.barrier(group=group, device_ids=[device.index])

    @property
    def group(self) -> Any:
        return live_group(self._group_ref, self._rank)

    def exchange(self, ops: Sequence[OpSpec]) -> list:
        group = self.group
        if not self.coalesced:
            # what batch_isend_irecv does for gloo (isend / irecv one op at a time), minus their Python
            # argument checks: the group's own send / recv with the peer's rank in the group (ours already
            # are) and uint8 tensors.  A failed post names its message
            works = []
            send, recv = group.send, group.recv
            for i, (kind, tensor, peer, tag) in enumerate(ops):
                try:
                    works.append((send if kind == "send" else recv)([tensor], peer, channel_tag(tag, self.channel)))
                except RuntimeError as e:  # a peer's connection is gone
                    raise PostError(i, e) from None
            return works
        p2p = [
            dist.P2POp(
                dist.isend if kind == "send" else dist.irecv,
                tensor,
                self.global_rank[peer],
                group,
                channel_tag(tag, self.channel),
            )
            for kind, tensor, peer, tag in ops
        ]
        try:
            works = dist.batch_isend_irecv(p2p)
        except RuntimeError as e:
            raise PostError(0, e) from None
        whole = _AllOf(works)  # NCCL: one Work for the whole coalesced batch
        return [whole] * len(ops)


def peer_failure(
    where: str, what: str, peer: int, timeout_s: float, cause: BaseException | None, posting: bool = False
) -> UltracommTimeout:
    """The error for a message to or from ``peer`` that did not complete: posting refused at once,
    the connection lost while waiting (gloo notices a dead peer's closed socket asynchronously, so
    a dead peer gives either), or the wait ran out of time."""
    text = (str(cause).strip().splitlines() or ["no detail"])[0] if cause is not None else ""
    if posting:
        how = f"could not {what} (posting failed at once)"
    elif cause is not None and not (isinstance(cause, TimeoutError) or "timed out" in text.lower()):
        how = f"could not {what} (the connection failed while waiting)"
    else:
        how = f"gave up after waiting up to {timeout_s:g} s to {what}"
    detail = f" ({type(cause).__name__}: {text})" if cause is not None else ""
    # who stopped is for the evidence to say (ultracomm.blame: P2PTransport.run adds it); the peer may be
    # alive and waiting in turn, or have raised and left
    err = UltracommTimeout(
        f"ultracomm: {where} {how} (timeout ULTRACOMM_TIMEOUT_S={timeout_s:g}); the peer, rank "
        f"{peer}, did not complete it: stalled, dead, failed earlier or in a different "
        f"operation{detail}"
    )
    err.peer = peer
    err.closed = bool(posting or (cause is not None and "timed out" not in how and "gave up" not in how))
    return err


class PostError(Exception):
    """Posting op ``index`` of a batch failed (``cause``: the backend's error)."""

    def __init__(self, index: int, cause: BaseException):
        super().__init__(f"posting message {index} failed: {cause}")
        self.index, self.cause = index, cause


class _AllOf:
    """The Works of one coalesced batch as one handle."""

    def __init__(self, works: list):
        self.works = works

    def wait(self, timeout: datetime.timedelta) -> bool:
        for w in self.works:
            w.wait(timeout)
        return True


class _Mailboxes:
    """One loopback domain's messages in flight: FIFO per (source, destination, tag)."""

    def __init__(self) -> None:
        self.cv = threading.Condition()
        self.boxes: dict[tuple[int, int, int], collections.deque] = collections.defaultdict(collections.deque)


class _Sent:
    def wait(self, timeout: datetime.timedelta) -> bool:
        return True  # the bytes were copied into the mailbox when posted


class _Receive:
    def __init__(self, boxes: _Mailboxes, key: tuple[int, int, int], out: torch.Tensor):
        self.boxes, self.key, self.out = boxes, key, out
        self.done = False

    def wait(self, timeout: datetime.timedelta) -> bool:
        if self.done:
            return True
        b = self.boxes
        with b.cv:
            if not b.cv.wait_for(lambda: len(b.boxes[self.key]) > 0, timeout=timeout.total_seconds()):
                raise UltracommTimeout(
                    f"loopback p2p: nothing from rank {self.key[0]} with tag {self.key[2]} within "
                    f"{timeout.total_seconds():g} s"
                )
            data = b.boxes[self.key].popleft()
        if data.numel() != self.out.numel():
            raise UltracommError(
                f"loopback p2p: rank {self.key[0]} sent {data.numel()} bytes with tag {self.key[2]}, "
                f"rank {self.key[1]} expected {self.out.numel()}"
            )
        self.out.copy_(data)
        self.done = True
        return True


class LoopbackMessenger:
    """Mailboxes shared by the threads of one loopback domain."""

    def __init__(self, comm: Any, channel: int = 0):
        self.rank, self.channel = comm.rank, channel
        with comm.domain._lock:
            self.boxes = comm.domain.shared.setdefault("ultracomm.p2p_mailboxes", _Mailboxes())

    def exchange(self, ops: Sequence[OpSpec]) -> list:
        out: list = []
        sends = []
        for kind, tensor, peer, tag in ops:
            tag = channel_tag(tag, self.channel)
            if kind == "send":
                sends.append(((self.rank, peer, tag), tensor.clone()))
                out.append(_Sent())
            else:
                out.append(_Receive(self.boxes, (peer, self.rank, tag), tensor))
        if sends:
            with self.boxes.cv:
                for key, data in sends:
                    self.boxes.boxes[key].append(data)
                self.boxes.cv.notify_all()
        return out


def messenger_for(comm: Any, world: int, device: torch.device):
    """The messenger of a Context's group: loopback mailboxes or the torch process group."""
    kind = getattr(comm, "kind", None)
    if kind == "loopback":
        if device.type != "cpu":
            raise InputError(
                "ultracomm: transport 'p2p' on a LoopbackGroup runs on the CPU only; use transport='tma' "
                "with a cuda_local window for one-GPU loopback domains"
            )
        return LoopbackMessenger(comm, channel_of(comm))
    group = getattr(comm, "pg", None)
    if kind != "torch" or group is None:
        raise InputError(
            f"ultracomm: transport 'p2p' needs a torch.distributed process group or a LoopbackGroup, "
            f"got {type(comm).__name__}"
        )
    return TorchMessenger(group, world, device, channel_of(comm))
