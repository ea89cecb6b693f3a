"""A stalled cross-domain rank under the GPU split transport, on a one-GPU loopback domain of 4
ranks (domains {0, 1} and {2, 3}), in its own process: before issue 35's gates the side stream
stayed blocked after the failure, which would hang any later device-wide synchronize of a test
process (split_cuda_release_worker.py checks that it no longer does).  Prints one JSON line.  No
test runs it any more (test_split_cuda_gpu.py runs split_cuda_release_worker.py); it is kept as the
script perf/gpu/2026-12-04_nvidia-h200_run3/diag_run.sh traced.

Rank 0 (home of expert 0) runs with its kernel's task list withheld: it joins (ready, digest)
but never copies expert 0 into its shadows of ranks 2 and 3 (direct multicast), so the side
stream's wait for that chunk never passes, the kernel of rank 2 or 3 times out waiting for rank
0's chunk, and the watchdog releases the caller's stream after the timeout (issue 35: once, not twice).
"""

from __future__ import annotations

import json
import os
import time

import numpy as np
import torch

from ultracomm import ExpertLayout, Member, ReplicaPlan

LAYOUT = ExpertLayout((Member("fc1", (40, 24), torch.float32), Member("fc2", (56,), torch.float32)))
TIMEOUT_S = 2.0

from split_cuda_release_worker import contexts  # noqa: E402 - its Contexts (this script's folder is on sys.path)


def main() -> dict:
    ctxs = contexts(TIMEOUT_S)  # the release worker's four loopback ranks over the CUDA split
    tma0 = ctxs[0].transport.tma
    rank_args = tma0._rank_args

    def withheld(*args):
        key, make = rank_args(*args)

        def make_empty() -> dict:
            d = make()
            d["tasks"] = d["tasks"][:0]
            return d

        return key + ("withheld",), make_empty

    tma0._rank_args = withheld
    plan = ReplicaPlan.make(np.array([[-1], [-1], [0], [0]], np.int32), experts_per_rank=1)
    t = time.monotonic()
    for c in ctxs:
        c.weight_sync(c.begin(0), plan, async_op=False)
    stream = torch.cuda.current_stream()
    done = torch.cuda.Event()
    done.record(stream)
    done.synchronize()  # released by the watchdog, not by the blocked side stream
    waited = time.monotonic() - t
    later = bool(torch.ones(4, device="cuda:0").sum().item() == 4.0)
    errors = []
    for c in ctxs:
        try:
            c.transport.check_error()
            errors.append(None)
        except Exception as e:  # noqa: BLE001 - reported
            errors.append(f"{type(e).__name__}: {e}")
    abandoned = [c.transport.abandoned_streams() for c in ctxs]
    for c in ctxs:
        c.close()  # must not hang on the blocked side stream
    return dict(errors=errors, waited=waited, later_work=later, abandoned=abandoned, closed=True)


if __name__ == "__main__":
    print(json.dumps(main()), flush=True)
    # a side stream that stayed blocked (before the gates; or if they fail on a device): interpreter teardown (CUDA's or torch's frees) could wait
    # on it until the test's subprocess timeout
    os._exit(0)
