"""How the GPU ``split`` transport's side stream executes stream operations
(:mod:`.stream`): flags with the driver's stream memory operations, chunks with NCCL or,
on a one-GPU loopback domain, with one ``cuMemcpyAsync`` per message.

* WAIT_GE and WRITE -> gate kernels (:mod:`.cuda_gates`; a run of waits, or of writes, is one
  launch): a wait gate spins until ``*addr >= epoch``, a write gate writes its flags = epoch
  after a system-scope fence (so a receiver's flag follows its bytes) -- or, once the side
  watchdog released the gates, the wait gate leaves and the write gate writes nothing.
* SEND / RECV (:class:`NcclMessenger`): ``torch.distributed.batch_isend_irecv`` of one op with
  the side stream current.  ProcessGroupNCCL makes its NCCL stream wait for the current stream
  before the op, and ``Work.wait()`` makes the current stream wait for the op (stream-level, the
  host does not block), so the side stream's order is the global order of the module above.
  A batch is used (not a bare isend) because torch's NCCL coalescing path is meant to run
  point-to-point ops on the group's communicator (made by one barrier when the transport is
  built) rather than a per-pair communicator that the first send to a peer would create while
  the host waits for that peer -- unverified here (no device): if a first op per pair still
  blocks the host, it blocks once per pair, in the same global order on both ends.
* COPY (loopback, :func:`enqueue_loopback`): NCCL refuses two ranks on one GPU, so a message is
  one device-to-device ``cuMemcpyAsync`` from the sender's Ref to the receiver's.

What releases a failure (issue 35): a WAIT_GE or WRITE is not a stream memory operation but a
gate kernel (:mod:`.cuda_gates`) that leaves its wait, and skips its writes, once the side
watchdog opened the gates; an NCCL receive whose peer never sends, or a send whose peer never
receives, is released by aborting the transport's own NCCL group (:meth:`NcclMessenger.abort`,
which the watchdog calls on a timeout: NCCL's kernels poll the communicator's abort flag and then
move nothing).  The messages use that group (:func:`side_group`), so the user's group and its
collectives are not the ones aborted.  torch times an NCCL op from when it was queued; the side
group's own torch timeout (the process-group default) is far longer than the Context's, so the
watchdog's abort, not torch's, ends a stuck op.  The caller's stream joins the side stream
through a host word that the watchdog releases first (:mod:`.cuda_watchdog`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol, Sequence

import torch

from .stream import COPY, OWN, RECV, SEND, Ref, StreamOp
from ...errors import InputError

__all__ = [
    "Spaces",
    "NcclMessenger",
    "abort_group",
    "side_group",
    "side_group_options",
    "enqueue_rank_stream",
    "enqueue_loopback",
]


class Spaces:
    """What one rank's Refs point into: its own window (``own``, a uint8 CUDA tensor) and its
    shadows (``shadows``: a :class:`~.cuda_shadow.DeviceShadows`)."""

    def __init__(self, own: torch.Tensor, shadows: Any):
        self.own, self.shadows = own, shadows

    def tensor(self, ref: Ref) -> torch.Tensor:
        return self.own if ref.shadow == OWN else self.shadows.tensor(ref.shadow)

    def addr(self, ref: Ref) -> int:
        return int(self.tensor(ref).data_ptr()) + ref.off

    def view(self, ref: Ref, nbytes: int) -> torch.Tensor:
        return self.tensor(ref)[ref.off : ref.off + nbytes]


class Driver(Protocol):  # ultracomm.cuda.driver.Driver's calls used here
    def wait_value(self, stream: int, addr: int, value: int, equal: bool = False) -> None: ...
    def write_value(self, stream: int, addr: int, value: int) -> None: ...
    def memcpy(self, dst: int, src: int, nbytes: int, stream: int) -> None: ...
    def function(self, ptx: str, name: str) -> int: ...
    def launch(self, function: int, threads: int, stream: int, args: list) -> None: ...


class NcclMessenger:
    """SEND/RECV of a rank's side stream over a torch.distributed NCCL group (module docstring).
    ``global_rank[r]``: the global rank of group rank ``r``; ``owned``: the group was made for
    this messenger (:func:`side_group`) and :meth:`close` destroys it."""

    def __init__(self, group: Any, global_rank: Sequence[int], owned: bool = False):
        self.group, self.global_rank, self.owned = group, list(global_rank), owned
        self.aborted = False

    def abort(self) -> None:
        """Abort the group's communicators (:func:`abort_group`; the side watchdog's thread, on a
        failure): every send and receive queued in it returns, moving nothing more.  Only an owned
        group (never the user's); once."""
        if not self.owned or self.group is None or self.aborted:
            return
        self.aborted = True
        abort_group(self.group)

    def close(self) -> None:
        """Destroy an owned group (only when no side stream is blocked in it: the caller checks;
        an aborted group is left as it is: its communicators are gone)."""
        if self.aborted:
            self.group = None
            return
        if self.owned and self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group(self.group)
        self.group = None

    def post(self, kind: str, buf: torch.Tensor, peer: int, side: torch.cuda.Stream) -> None:
        import torch.distributed as dist

        fn = dist.isend if kind == SEND else dist.irecv
        with torch.cuda.device(buf.device), torch.cuda.stream(side):  # NCCL wants the current device set
            for w in dist.batch_isend_irecv([dist.P2POp(fn, buf, self.global_rank[peer], self.group)]):
                w.wait()  # NCCL: the current (side) stream waits for the op; the host does not


def abort_group(group: Any) -> None:
    """Abort a torch.distributed NCCL group's communicators (``ncclCommAbort``): ``ProcessGroup.abort()``
    (torch >= 2.7, pytorch#148798), else its NCCL backend's ``abort()`` / ``_abort()`` (torch 2.1-2.6,
    pytorch#96017).  Stock ProcessGroupNCCL returns from a user's abort without tearing the process
    down (its async error handling acts on its own timeouts, not on this call).  Raises
    ``UltracommError`` where this torch offers none of them."""
    fn = getattr(group, "abort", None)
    if fn is None:
        get = getattr(group, "_get_backend", None)
        backend = get(torch.device("cuda")) if get is not None else None
        fn = getattr(backend, "abort", None) or getattr(backend, "_abort", None)
    if fn is None:
        from ...errors import UltracommError

        raise UltracommError(
            f"ultracomm split: torch {torch.__version__} offers no abort of a process group "
            "(ProcessGroup.abort, ProcessGroupNCCL._abort): a side stream blocked in an NCCL "
            "receive stays blocked until torch's own timeout"
        )
    fn()


def side_group_options(max_ctas: int) -> Any:
    """NCCL options for the side stream's own communicator: thread-block clusters off (sm_90's
    default of 4 CTAs per cluster must fit in one GPC, which the persistent kernel's CTAs may
    leave too fragmented) and at most ``max_ctas`` CTAs, so NCCL's kernels fit on the SMs the
    persistent kernel leaves free (unverified on a device)."""
    import torch.distributed as dist

    opts = dist.ProcessGroupNCCL.Options()
    opts.config.cga_cluster_size = 1
    opts.config.min_ctas = 1
    opts.config.max_ctas = int(max_ctas)
    return opts


def side_group(comm_group: Any, world: int, device: torch.device, max_ctas: int) -> NcclMessenger:
    """A new NCCL group over the ranks of the Context's group ``comm_group`` for the side stream
    (its own communicator: NCCL options of :func:`side_group_options`, and a failure that leaves
    it blocked leaves the user's group alone).  Collective over ``comm_group``'s ranks only."""
    import torch.distributed as dist

    ranks = [dist.get_global_rank(comm_group, r) for r in range(world)]
    group = dist.new_group(
        ranks, backend="nccl", pg_options=side_group_options(max_ctas), use_local_synchronization=True
    )
    # a group's first batch_isend_irecv must involve every rank: make the communicator now, together
    dist.barrier(group=group, device_ids=[device.index])
    return NcclMessenger(group, ranks, owned=True)


def enqueue_rank_stream(
    ops: Sequence[StreamOp],
    epoch: int,
    spaces: Spaces,
    side: int,
    drv: Driver,
    messenger: Any,
    side_stream: Any,
    mark: Optional[Callable[[int], None]] = None,
    *,
    gates: Any,
) -> None:
    """Enqueue one rank's stream operations on stream ``side`` (its handle; ``side_stream``: the
    same as a torch stream, for the messenger): flag waits and writes as gates (``gates``: a
    :class:`.cuda_gates.Gates`), messages through ``messenger``; ``mark(k)`` after the k-th message
    (1-based)."""
    k = 0
    for step in gates.steps(ops, lambda o: spaces.addr(o.ref)):
        if step[0] == "gate":
            gates.launch(drv, side, step, epoch)
            continue
        op = step[1]
        if op.kind in (SEND, RECV):
            messenger.post(op.kind, spaces.view(op.ref, op.nbytes), op.peer, side_stream)
            k += 1
            if mark is not None:
                mark(k)
        else:
            raise InputError(f"ultracomm split: a rank's stream cannot hold {op.kind!r} ({op.what})")


def enqueue_loopback(
    seq: Sequence[StreamOp],
    epoch: int,
    spaces_of: dict[int, Spaces],
    side: int,
    drv: Driver,
    mark: Optional[Callable[[int], None]] = None,
    *,
    gates: Any,
) -> None:
    """Enqueue a loopback domain's merged sequence (:func:`.stream.loopback_sequence`) on
    ``side``; ``spaces_of[r]``: rank ``r``'s spaces; flag waits and writes as gates; ``mark(k)``
    after the k-th copy (1-based)."""
    k = 0
    for step in gates.steps(seq, lambda o: spaces_of[o.rank].addr(o.ref)):
        if step[0] == "gate":
            gates.launch(drv, side, step, epoch)
            continue
        op = step[1]
        if op.kind == COPY:
            sp = spaces_of[op.rank]
            drv.memcpy(sp.addr(op.ref), spaces_of[op.peer].addr(op.src), op.nbytes, side)
            k += 1
            if mark is not None:
                mark(k)
        else:
            raise InputError(f"ultracomm split: a loopback sequence cannot hold {op.kind!r} ({op.what})")
