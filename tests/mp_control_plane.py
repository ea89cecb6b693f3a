"""Run under torchrun (gloo): ReplicaManager's default control plane on the host executor --
loads through the shared-memory board, the device quota planner's host build, the portable
schedule builder, window plan check -- makes no torch.distributed call and no store call after
setup, in two orders (two micro-batches in flight, backwards reversed) with and without
activation checkpointing; its master grads match the float64 no-replication reference and a
rerun is bit-identical.  Prints one line per rank; exit 1 on a failed check.

    torchrun --standalone --nproc-per-node 4 tests/mp_control_plane.py [agree | default]

``agree``: the plan agreed by a host collective instead (plan_check="agree"): the
counter's control, which must see calls.  ``default``: three layers, the manager with no
options at all (issue 32 item 8: the default plan check is the window's on the host transport).
Only calls made from ultracomm's frames count (a caller in the package on the stack).
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import moe_harness as mh  # noqa: E402

import ultracomm  # noqa: E402
from ultracomm import comm as comm_mod  # noqa: E402

MODE = sys.argv[1] if sys.argv[1:] else "window"
assert MODE in ("window", "agree", "default"), MODE
EPR, K, TOKENS = 2, 2, 16
LAYERS = 3 if MODE == "default" else 2
# the manager's options: none at all by default (its transport on a CPU gloo group is host)
OPTIONS = {} if MODE == "default" else dict(plan_check=MODE, transport="host")
UC_DIR = os.path.dirname(os.path.abspath(ultracomm.__file__)) + os.sep
# every communicating function of torch.distributed a library could call
DIST_FUNCS = (
    "all_gather_object",
    "all_gather",
    "all_reduce",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "send",
    "recv",
    "isend",
    "irecv",
    "batch_isend_irecv",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "reduce",
    "reduce_scatter",
    "all_to_all",
    "all_to_all_single",
    "monitored_barrier",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
)


def from_ultracomm(frame) -> bool:
    """Whether a frame of the ultracomm package is on the stack from ``frame`` up."""
    while frame is not None:
        if os.path.abspath(frame.f_code.co_filename).startswith(UC_DIR):
            return True
        frame = frame.f_back
    return False


class Counter:
    """Counts calls of DIST_FUNCS and of every store call ultracomm makes (comm._StoreBoard._call)
    made from ultracomm's frames while armed."""

    def __init__(self):
        self.armed, self.calls = False, []
        for name in DIST_FUNCS:
            fn = getattr(dist, name, None)
            if fn is not None:
                setattr(dist, name, self._wrap(name, fn))
        board = comm_mod._StoreBoard
        board._call = self._wrap("store", board._call)

    def _wrap(self, name, fn):
        def counted(*a, **kw):
            if self.armed and from_ultracomm(sys._getframe(1)):
                self.calls.append(name)
            return fn(*a, **kw)

        return counted

    def arm(self):
        self.armed = True

    def disarm(self):
        self.armed = False


def record_managers(seen: list) -> None:
    """Every ReplicaManager train_rank builds appends (transport, plan check, load board) to ``seen``."""
    import ultracomm.moe as moe_pkg

    class Recording(moe_pkg.ReplicaManager):
        def __init__(self, *a, **kw):
            super().__init__(*a, **kw)
            seen.append(
                (
                    self.ctx.transport.name,
                    "window" if self.ctx.window_plan_check else "agree",
                    type(self._board).__name__,
                )
            )

    moe_pkg.ReplicaManager = Recording


def main() -> int:
    dist.init_process_group("gloo")
    seen: list = []
    record_managers(seen)
    rank, world = dist.get_rank(), dist.get_world_size()
    counter = Counter()
    ref = mh.reference_grads(world, EPR, LAYERS, 2, tokens=TOKENS)
    ok = True
    for checkpoint in (None, "non_reentrant"):
        runs = []
        for _ in range(2):
            grads, imb = mh.train_rank(
                None,
                rank,
                world,
                EPR,
                K,
                LAYERS,
                "F0 F1 B1 B0",
                planner="device",
                checkpoint=checkpoint,
                counter=counter,
                tokens=TOKENS,
                manager_options=OPTIONS,
            )
            runs.append(grads)
        calls, counter.calls = counter.calls, []
        try:
            mh.check_rank_grads(runs[0], rank, ref, EPR, LAYERS)
            close = "yes"
        except AssertionError as e:
            close, ok = f"no ({e})", False
        same = all(
            torch.equal(a.view(torch.uint8), b.view(torch.uint8)) for la, lb in zip(*runs) for a, b in zip(la, lb)
        )
        ok = ok and same and (not calls or MODE == "agree")
        setups, seen[:] = sorted(set(seen)), []
        print(
            f"rank {rank} checkpoint={checkpoint}: managers {setups}; layers {LAYERS}; "
            f"calls after setup {len(calls)} {sorted(set(calls))}; "
            f"grads match no replication: {close}; rerun bit-identical: {'yes' if same else 'no'}; "
            f"imbalance {imb[0][0]:.2f} -> {imb[0][1]:.2f}",
            flush=True,
        )
    dist.barrier()
    dist.destroy_process_group()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
