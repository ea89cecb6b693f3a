"""GPU window providers on a device: cuda_local in one process, cuda_ipc and torch_symm between two
processes (torchrun, gloo; both may share one GPU: only copies, no spinning kernel)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from ultracomm import LoopbackDomain
from ultracomm.windows import CudaLocalWindow, open_window

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_cuda_local_window():
    def body(group):
        win = open_window("cuda_local", group, 4096, device="cuda:0")
        assert isinstance(win, CudaLocalWindow) and win.device == torch.device("cuda", 0)
        assert int(win.local.count_nonzero()) == 0
        group.barrier()
        win.peer_view((group.rank + 1) % group.world).fill_(group.rank + 1)
        torch.cuda.synchronize()
        group.barrier()
        assert int((win.local != (group.rank - 1) % group.world + 1).sum()) == 0
        assert win.shared is group.domain.shared
        return win.peer_bases

    bases = LoopbackDomain(3).run(body)
    assert bases[0] == bases[1] == bases[2] and len(set(bases[0])) == 3


@pytest.mark.slow
@pytest.mark.parametrize("provider", ["cuda_ipc", "torch_symm"])
def test_window_between_two_processes(provider):
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        "--nproc-per-node=2",
        os.path.join(ROOT, "tests", "mp", "gpu_window_worker.py"),
        provider,
    ]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if provider == "torch_symm" and torch.cuda.device_count() < 2:
        # torch's symmetric memory maps one device per rank: two ranks on one GPU get our error first
        assert p.returncode != 0
        assert "window 'torch_symm' needs one GPU per rank, but ranks 0 and 1 use the same GPU" in p.stderr, p.stderr[
            -3000:
        ]
        return
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "rank 0 OK" in p.stdout and "rank 1 OK" in p.stdout
