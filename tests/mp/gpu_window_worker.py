"""torchrun worker: GPU window providers between processes (gloo control plane).

Run as ``torchrun --nproc-per-node 2 tests/mp/gpu_window_worker.py PROVIDER``.  Each rank opens a
window of PROVIDER on cuda:(rank % devices), checks it starts zeroed, writes its signature into
the next rank's window through that rank's peer view and the pointer table, and after a barrier
checks that its own window holds the previous rank's signature.  Prints ``rank R OK``.
No kernel spins here (copies only), so two processes may share one GPU.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist

from ultracomm.comm import as_comm
from ultracomm.windows import PROVIDERS


def main() -> None:
    provider = sys.argv[1]
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = torch.device("cuda", rank % torch.cuda.device_count())
    torch.cuda.set_device(dev)
    comm = as_comm(None)
    nbytes = 3 * 4096 + 256
    win = PROVIDERS[provider].create(comm, nbytes, device=dev)
    assert win.provider == provider and win.device == dev and win.nbytes == nbytes
    assert int(win.local.count_nonzero()) == 0, "window not zeroed"
    assert win.peer_bases[rank] == win.local.data_ptr()
    nxt = (rank + 1) % world
    peer = win.peer_view(nxt)
    assert peer.data_ptr() == win.peer_bases[nxt] and peer.numel() == nbytes
    sig = (torch.arange(nbytes, device=dev) * (rank + 3) % 251).to(torch.uint8)
    peer.copy_(sig)
    torch.cuda.synchronize(dev)
    comm.barrier()
    prev = (rank - 1) % world
    want = (torch.arange(nbytes, device=dev) * (prev + 3) % 251).to(torch.uint8)
    wrong = int((win.local != want).sum())
    assert wrong == 0, f"rank {rank}: {wrong} bytes of rank {prev}'s write are wrong"
    comm.barrier()
    win.close()
    print(f"rank {rank} OK", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
