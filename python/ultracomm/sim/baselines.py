"""The all-to-all baseline: Megatron MoE ECHO's weight distribution and its autograd reverse.

weight_sync: every home stacks its local experts, ``index_select``s one row per replica it
must send (an HBM copy: read + write of its send bytes at ``hbm_bw``, which counts read +
write), then all ranks call ``all_to_all_single`` with split sizes (host lists: the plan's
counts come to the host first, ``d2h_latency_s``).  Assumptions, all in the all-to-all's
favour except the first two:

1. bulk-synchronous: the collective's transfers start when the *slowest* rank has finished
   its ``index_select`` and the collective has started up (``a2a_startup_s +
   a2a_per_peer_s * (W - 1)``: NCCL posts one send/recv pair per peer);
2. the collective ends when its last flow ends (every rank waits for it);
3. the transfers are the direct pattern (home -> every replica) on the same links at the
   same achieved bandwidth, shared max-min fairly; NCCL runs kernels on both sides of a
   send/recv, so each flow crosses the sender's and the receiver's SM pool, each with the same
   budget and per-SM copy rate as ultracomm's op (parity), with no per-chunk cost: NCCL's
   channel buffering is not charged;
4. no copy on the receive side (ECHO uses the output rows as the replica weights).

grad_reduce (its autograd reverse): the startup, the all-to-all of the replicas' grads back
to their homes, then an ``index_add_`` into the home's grad: read the received rows, read
and write the home rows (3 x grad bytes per received row at ``hbm_bw``), after the
collective.  The grad bytes are an explicit argument: compare both methods with the *same*
gradient dtype (ECHO's reverse moves grads in the weights' dtype, bf16; ultracomm's grad
slots use the layout's ``grad_dtype``, fp32 by default, bf16 when a user chooses it).
"""

from __future__ import annotations

import time
from typing import Optional

import numpy as np

from .engine import _run_flows
from .fabric import Fabric
from .model import SimResult, _critical, _finish, _opname, _plan_arrays, lower_bound
from ..errors import InputError


def simulate_alltoall(plan, weight_bytes: int, fabric: Fabric, op, *, grad_bytes: Optional[int] = None) -> SimResult:
    """Simulated makespan of Megatron MoE ECHO's all-to-all weight distribution (``op``
    multicast) or of its autograd reverse (``op`` reduce: ``grad_bytes`` is required, the
    bytes of one expert's gradient in the dtype being compared) for ``plan`` on ``fabric``.
    Assumptions in the module doc."""
    t0 = time.perf_counter()
    name = _opname(op)
    if name == "reduce" and grad_bytes is None:
        raise InputError(
            "simulate_alltoall(op='reduce') needs grad_bytes: pass the same gradient bytes the "
            "schedule it is compared with is charged (e.g. 2 x weight_bytes for bf16 weights with "
            "fp32 grads, weight_bytes for bf16 grads)"
        )
    src, home = _plan_arrays(plan)
    W = src.shape[0]
    fab = fabric.for_world(W)
    nbytes = int(weight_bytes) if name == "multicast" else int(grad_bytes)
    rr, ss = np.nonzero(src >= 0)
    ee = src[rr, ss]
    hh = home[ee]
    if name == "multicast":
        sr, dr = hh, rr
    else:
        sr, dr = rr, hh
    egress = np.bincount(sr, minlength=W).astype(np.int64) * nbytes
    ingress = np.bincount(dr, minlength=W).astype(np.int64) * nbytes
    node = fab.nodes
    inter = node[sr] != node[dr]
    inter_e = np.bincount(sr[inter], minlength=W).astype(np.int64) * nbytes
    inter_i = np.bincount(dr[inter], minlength=W).astype(np.int64) * nbytes
    host = fab.d2h_latency_s if name == "multicast" else 0.0  # split sizes to the host (forward)
    # its own bound: links only (its adds run as an HBM-bound index_add_, not in an SM budget)
    lb = lower_bound(plan, fab.replace(multicast_sms=0, reduce_sms=0), name, nbytes, host_s=host)
    if rr.size == 0 or nbytes == 0:
        return SimResult(
            name, "alltoall", 0.0, np.zeros(W), lb, -1, "", nbytes, 0, egress, ingress, wall_s=time.perf_counter() - t0
        )
    startup = fab.launch_s + fab.a2a_startup_s + fab.a2a_per_peer_s * (W - 1)
    sent_rows = np.bincount(hh, minlength=W)
    if name == "multicast":
        prep = float((2.0 * sent_rows * nbytes / fab.hbm_bw).max())  # index_select: read + write
        post = 0.0
    else:
        prep = 0.0
        post = float((3.0 * sent_rows * nbytes / fab.hbm_bw).max())  # index_add_: 2 reads + 1 write
    t_start = host + prep + startup
    n = rr.size
    ids = np.arange(n)
    # NCCL's send and recv kernels both use SMs: same budget and per-SM copy rate as ultracomm's op
    sms = fab.multicast_sms if name == "multicast" else fab.reduce_sms
    pool_bw = sms * fab.sm_copy_bw if sms > 0 else float("inf")
    end, events, updates = _run_flows(
        ids,
        ids + n,
        sr,
        dr,
        np.array([float(nbytes)]),
        fab,
        np.full(n, t_start),
        deps_enabled=False,
        pools=[(sr, pool_bw), (dr, pool_bw)],
    )
    coll_end = float(end.max())
    mk = coll_end + post
    prf = np.full(W, mk)
    cr, cl = _critical(
        _finish(end, sr, dr, W), egress, ingress, inter_e, inter_i, fab, coll_end, np.maximum(egress, ingress), pool_bw
    )
    return SimResult(
        name,
        "alltoall",
        mk,
        prf,
        lb,
        cr,
        cl,
        nbytes,
        int(n),
        egress,
        ingress,
        flows=int(n),
        chunks=1,
        effective_chunk_bytes=nbytes,
        events=events,
        rate_updates=updates,
        wall_s=time.perf_counter() - t0,
        parts={"host_s": host, "prep_s": prep, "startup_s": startup, "transfer_s": coll_end - t_start, "post_s": post},
    )
