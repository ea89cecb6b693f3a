"""Load profiler: what the balancer saw, what it did and what it cost, per (step, layer,
micro-batch), on disk in a compact format that reads back with one function.

    from ultracomm.profile import Profiler, load_trace

    prof = Profiler("trace/")                    # or ULTRACOMM_PROFILE=trace/ for a Context
    ctx = Context(..., profile=prof)            # records plans, schedule stats and op times
    for step in ...:
        for layer in ...:
            res = planner(load, domain, slots)  # load: int [world, E] tokens rank s -> expert e
            prof.record(layer, load=load, plan=res)
            ctx.weight_sync(vid, res.plan) ...
        prof.step()                             # optional: steps are found automatically too
    prof.close()
    trace = load_trace("trace/")                # every array back (a :class:`Trace`)

A record holds, per (step, layer, micro-batch):

* the load matrix ``[world, E]`` the planner saw (``detail="full"``), or only its per-expert
  totals ``[E]`` (``detail="experts"``: ``world`` times less disk);
* the plan (``slot_src [world, slots]``, ``home_of [E]``) and the tokens each rank computes
  after balancing (a :class:`~ultracomm.planners.PlannerResult` gives them exactly; for a bare
  :class:`~ultracomm.plan.ReplicaPlan` each expert's tokens are split evenly over its
  instances, as :func:`ultracomm.scenarios.max_mean_after` does);
* the schedule's stats of both ops (per-rank egress/ingress, depth, lower bound, predicted
  time) and its trees (parent rank/slot and depth of every replica slot);
* measured op times (seconds): for the host and p2p transports the wall time of the
  transport's ``run`` on this rank's operation thread (host timers); for the stream-ordered
  ones (``tma``, ``copy_engine``) the device time between two CUDA timing events recorded on
  the caller's stream just before and after the operation is enqueued -- nothing waits for
  them in the operation; the writer reads ``elapsed_time`` once the end event completed (NaN
  if it did not within ``op_wait_s``).  In a one-GPU loopback domain a rank's call that only
  deposits its share has no time; the rank completing the set times the whole set; operations
  enqueued under CUDA graph capture have none (they run at replay);
* imbalance (max:mean rank load) before and after balancing, derived when read back.

Anything not given stays empty (masks ``has_load``, ``has_plan``, ``has_stats``; ``NaN`` op
times), so a Context alone records plans, stats and times, and a user alone records loads.

Steps and micro-batches
-----------------------
A record is filled from two sides: :meth:`Profiler.record` (load and plan, from the user or a
replica manager) and the Context's operations (plan, schedule, op times; bound to the
micro-batch slot ``vid``).  Each side fills the oldest record of the layer in the current
step that it has not filled yet, or starts a new one (micro-batch = how many records the
layer has in the step so far, unless ``microbatch=`` says).  With ``steps="auto"`` (default)
a step ends when a layer starts a new record while no micro-batch is in flight (every vid
released by ``grad_reduce``/``end``): a forward that comes back to a layer it has seen.  With
gradient accumulation and no pipelining each micro-batch is then its own step; call
:meth:`Profiler.step` at the end of each optimizer step (with ``steps="manual"``) to group
them.  :meth:`Profiler.step` always ends the current step.

Memory and disk
---------------
The current step's records are kept in memory up to ``max_buffer_bytes`` (a larger step is
written in parts); finished steps wait, up to another ``max_buffer_bytes``, for one writer
thread.  It collects the steps handed over within ``write_interval_s`` (1 s), waits (up to
``op_wait_s``) for their operations still running, computes what was kept by reference
(plan arrays, schedule stats and trees, CUDA event times), writes them as one
``<n>_step<first>[-<last>].npz`` (zip, deflate level 1; loads as int32 when they fit) and
rewrites ``index.json`` (atomically).  When the writer falls behind, recording waits: memory
stays bounded whatever the disk does.  An error of the writer is raised by the next call.

Directories and files
---------------------
A trace directory is created with mode 0700; an existing one (and, for a Context, the directory
``ULTRACOMM_PROFILE`` or ``profile=`` names) must belong to this user and not be group- or
world-writable, else the Profiler refuses it (:mod:`ultracomm.private_dir`): anyone else who can
write there could plant symbolic links at the names the writer uses.  Every file is created
exclusively (``O_EXCL|O_NOFOLLOW``, mode 0600) under an unpredictable temporary name in the
checked directory, then renamed into place.

Reruns: a Context given a directory that already holds a trace (a job run again with the same
``ULTRACOMM_PROFILE``) writes into the first free ``run<n>`` subdirectory (``run1``, ``run2``,
...; with world > 1 ``run<n>/rank<r>``, the first run ``rank<r>`` directly below the
directory).  A :class:`Profiler` made directly refuses such a directory unless ``overwrite=True``.

Cost when off
-------------
A Context without a profile pays one ``is not None`` test per operation; ``perf/bench_profile.py``
prints the figures (off / on, per op and per record).

Plain routing statistics
------------------------
:func:`from_routing_stats` turns a ``[steps, layers, E]`` token-count array a user already logs
into a :class:`Trace` (``detail="experts"``); :func:`import_routing_stats` writes it as a trace
directory; ``load_trace("counts.npy", world=64)`` reads such an array directly.

CLI::

    python -m ultracomm.profile show TRACE
    python -m ultracomm.profile import COUNTS.npy -o TRACE --world 64

Modules: :mod:`.recorder` (Profiler, the Context's hook), :mod:`.trace` (reading back,
imports), :mod:`.fields` (array names shared by both).
"""

from __future__ import annotations

from .fields import FORMAT, OPS, spread_expert_load
from .recorder import Profiler, profile_for_context
from .trace import Trace, from_routing_stats, import_routing_stats, load_trace, read_counts

__all__ = [
    "Profiler",
    "Trace",
    "load_trace",
    "from_routing_stats",
    "import_routing_stats",
    "read_counts",
    "spread_expert_load",
    "profile_for_context",
    "OPS",
    "FORMAT",
]
