"""Worker of tests/test_group_reinit.py: two ranks (processes) over a store the launcher hosts, as
torchrun's agent does, each initialise the default group, make three ultracomm exchanges, destroy
it, and do it all again; in the second group rank 1 comes late to the third exchange.  Prints, per
rank, every exchange's values as JSON (rank 0's third of the second group must be the second
group's: the old group's value was there)."""

from __future__ import annotations

import datetime
import json
import multiprocessing
import sys
import time


def rank_main(rank: int, port: int, q) -> None:
    import torch.distributed as dist

    from ultracomm.comm import as_comm

    out = []
    for group in range(2):
        store = dist.TCPStore("127.0.0.1", port, 2, is_master=False, timeout=datetime.timedelta(seconds=60))
        dist.init_process_group("gloo", store=store, rank=rank, world_size=2)
        comm = as_comm(None, timeout_s=30.0)
        try:
            for i in range(3):
                if group == 1 and rank == 1 and i == 2:
                    time.sleep(1.0)
                out.append(comm.all_gather_object([group, i, rank], op="test", what=f"exchange {i}"))
        except Exception as e:  # noqa: BLE001 - the outcome under test
            out.append(f"{type(e).__name__}: {e}")
        dist.destroy_process_group()
    q.put((rank, out))


def main() -> None:
    import torch.distributed as dist

    store = dist.TCPStore("127.0.0.1", 0, 2, is_master=True, wait_for_workers=False)
    ctx = multiprocessing.get_context("spawn")
    q = ctx.Queue()
    procs = [ctx.Process(target=rank_main, args=(r, store.port, q)) for r in range(2)]
    for p in procs:
        p.start()
    got = dict(q.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
    print(json.dumps([got[0], got[1]]), flush=True)
    sys.exit(0)


if __name__ == "__main__":
    main()
