"""Fabric simulator: a flow-level model of a scale-up domain that predicts the makespan of a
:class:`~ultracomm.schedule.Schedule` (weight_sync = multicast, grad_reduce = reduce), of
Megatron MoE ECHO's all-to-all weight distribution, and the lower bound of DESIGN.md.

    python -m ultracomm.sim --model qwen3-235b-a22b --domain nvl72 --ep 64 --slots 2 \\
        --imbalance 1.5,2,3 [--planner greedy] [--grad-dtype bf16,fp32] [--profile FILE] [--json FILE]
    python -m ultracomm.sim --calibrate        # UltraEP's published EP64 figures
    python -m ultracomm.sim --goals            # the project's goal sweep
    python -m ultracomm.sim --sensitivity      # one case over the latency / overhead / chunk grid

Everything here is *simulated*: no byte moves, and no figure of this package was measured
on a GPU.  Modules, one concern each:

====================  =======================================================================
``fabric``            :class:`Fabric` (links, latencies, SM budgets, host costs) and presets
``hardware``          defaults and sources of the non-link costs; the hardware profile JSON
``engine``            the event-driven fluid flow engine (max-min fair sharing)
``model``             a Schedule's ops as flows (:func:`simulate`), :func:`lower_bound`
``baselines``         the all-to-all baseline (:func:`simulate_alltoall`)
``compare``           one plan by every method with the same gradient dtype; rows and tables
``calibration``       UltraEP's published EP64 figures next to the simulated ones
``goal_sweep``        the goal sweep and its counts
``sensitivity_grid``  ranges over hop latency, per-chunk overhead and chunk size
``cli``               ``python -m ultracomm.sim``
====================  =======================================================================

Hardware profiles: ``--profile FILE`` (or ``ULTRACOMM_HW_PROFILE``, or the newest
``perf/gpu/*profile*.json``) applies what ``perf/bench_gpu.py`` measured (schema in
:mod:`ultracomm.cuda.hwprofile`: per-SM copy and reduce rates, HBM copy rate, per-chunk overhead,
launch floor, SM count); without one the assumed costs of :mod:`ultracomm.sim.hardware` stand,
and every output says which.

Fabric model
------------
A :class:`Fabric` is a set of GPUs with, per GPU, four independent links: NVLink egress and
ingress (``intra_bw`` each, one number per direction, non-blocking switch) and, when the
domain spans several nodes, RDMA egress and ingress (``inter_bw`` each, rail-optimised: one
NIC per GPU, non-blocking network).  A transfer between ranks of one node uses the
sender's NVLink egress and the receiver's NVLink ingress; a transfer between nodes uses the
two RDMA links only (GPUDirect RDMA does not touch NVLink).  Bandwidths are *achieved*
figures (the ``*_peak`` fields hold the vendor numbers; see :data:`FABRICS`).

SMs.  Each rank has an SM pool per op: ``multicast_sms x sm_copy_bw`` for weight_sync (the
sender's SMs push every copy, relays included), ``reduce_sms x sm_reduce_bw`` for
grad_reduce (the receiver's SMs pull each source and add it into an fp32 partial).  Every
chunk costs one SM ``chunk_overhead_s`` beyond its bytes (flag release / acquire, bulk-store
drain), so a pool moves ``sms * chunk / (chunk / rate + overhead)`` bytes/s: the per-chunk
cost lowers throughput when SMs, not links, bound the op.  The presets use ultracomm's
default budgets (``ULTRACOMM_MULTICAST_SMS`` / ``ULTRACOMM_REDUCE_SMS``); a budget of 0 turns
the pool off (a bare :class:`Fabric`).

Flows.  Every tree edge of the schedule (one sender -> one receiver slot of one expert,
taken from the task lists: a copy task's destinations, a reduce task's sources) is a flow
that carries the expert's chunks in order.  At any instant the flows that have a chunk ready
share links and SM pools max-min fairly (progressive filling; rates are recomputed whenever
a flow starts, stalls, resumes or ends -- an event-driven fluid model).  This models an
executor that keeps chunks of every tree edge in flight (the persistent kernel's SMs claim
chunk tasks in list order; the host executor's workers behave alike when workers >= edges
per rank).

Dependencies (chunk pipelining).  A flow leaves node X (a replica slot or a master copy).
Chunk ``c`` may leave X when every flow *into* X has delivered chunk ``c``:

* multicast: X is a relay; its single incoming flow is its parent's copy into it;
* reduce (pull): X is a relay whose partial ``self + sum(children)`` of chunk ``c`` is what
  its parent pulls, so all of X's children must have delivered chunk ``c``.

A delivered chunk becomes visible ``hop latency + chunk_overhead_s`` after its last byte left.

Fixed costs.  Every op starts ``launch_s`` after its host-side part.  A schedule-driven
weight_sync first brings the plan to the host (``d2h_latency_s``), builds this rank's task
lists (``host_build_s``) and copies them to the device (``h2d_latency_s`` + bytes /
``h2d_bw``); restore and grad_reduce reuse them.  The all-to-all pays the D2H of its split
sizes.  The host executor (CPU) has none of these; the GPU presets charge them.

Chunking.  The schedule's own chunks are simulated (1 MiB by default: 36 chunks of a
Qwen3-235B expert, 84 of a DeepSeek-V3 one).  ``max_chunks`` merges consecutive chunks into
at most that many *effective* chunks to bound the event count; merging only lengthens the
pipeline fill, so a coarsened result is an upper bound of the exact one.

Lower bound
-----------
:func:`lower_bound` is DESIGN.md's bound with tiers and SM pools.  For one op moving ``B``
bytes per replica, with ``recv[r]`` the filled slots of rank ``r``, ``once[r]`` the experts
homed on ``r`` that have replicas, ``total`` the replicas and ``W`` the ranks:

* one node:  ``max(max recv, max once, total / W) * B / intra_bw``;
* several nodes: a rank's two links can both carry, so the terms above are divided by
  ``intra_bw + inter_bw``; plus the RDMA tier alone (replicas whose node holds no other
  copy, homes whose expert is replicated only elsewhere, per-node in/out over its NICs);
* SM pools: every replica is written (or pulled and added) once by some rank's pool and a
  home handles each of its replicated experts at least once: ``max(max once, total / W) * B
  / pool``;

plus the fixed cost ``host + launch_s + hop latency + chunk_overhead_s``.  The reduce bound is
the same with grad bytes and the roles of egress and ingress swapped.  On one node without
SM pools the byte term equals the schedule builder's ``stats()['lower_bound_bytes']``.

All-to-all baseline, calibration, sensitivity: see :mod:`~ultracomm.sim.baselines`,
:mod:`~ultracomm.sim.calibration` (the model is *optimistic for relay* against UltraEP's
published figures) and :mod:`~ultracomm.sim.sensitivity_grid`.

Domains larger than a preset: ``--ep 64`` on ``h200x8`` is an error (naming ``8x8-rdma`` and
``nvl72``): an 8-GPU preset never grows into several nodes silently.
"""

from __future__ import annotations

from .baselines import simulate_alltoall
from .calibration import ULTRAEP, ULTRAEP_EXPERT, calibrate
from .cli import main
from .compare import GRAD_DTYPES, HDR, compare, compare_dtypes, fmt_row, make_plan, run_case, table
from .engine import _maxmin as _maxmin, _run_flows as _run_flows  # the tests' handles on the engine
from .fabric import FABRICS, Fabric, get_fabric
from .goal_sweep import GOAL_CONFIGS, GOAL_MODELS, goal_counts, goal_summary, goals
from .hardware import apply_profile, default_profile
from .model import SimResult, lower_bound, schedule_for, simulate
from .sensitivity_grid import SETTINGS, sensitivity, sensitivity_case

# names of the single-module simulator, kept for its callers
_HDR, _fmt_row, _table, _goal_summary = HDR, fmt_row, table, goal_summary

__all__ = [
    "Fabric",
    "FABRICS",
    "get_fabric",
    "SimResult",
    "simulate",
    "simulate_alltoall",
    "lower_bound",
    "schedule_for",
    "compare",
    "compare_dtypes",
    "make_plan",
    "run_case",
    "calibrate",
    "goals",
    "goal_counts",
    "goal_summary",
    "sensitivity",
    "sensitivity_case",
    "apply_profile",
    "default_profile",
    "GRAD_DTYPES",
    "SETTINGS",
    "ULTRAEP",
    "ULTRAEP_EXPERT",
    "GOAL_CONFIGS",
    "GOAL_MODELS",
    "main",
]
