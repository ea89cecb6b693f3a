"""The nvshmem window provider: imports everywhere, says "not available: ..." where it cannot work,
carries NVSHMEM's unique id byte for byte, and (gpu marker) allocates, maps and finalises."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member
from ultracomm.cuda.support import NotAvailableError, cuda_module_reason, torch_cuda_reason
from ultracomm.windows import PROVIDERS, nvshmem as nvw


def test_module_imports_and_names_why_it_cannot_run_here():
    assert PROVIDERS["nvshmem"] is nvw.NvshmemWindow
    nv, why = nvw.nvshmem_module()
    assert (nv is None) == (why is not None)
    if nv is None:
        assert why.startswith("nvshmem4py does not import (") and "pip install nvshmem4py-cu13" in why
    reason = nvw.nvshmem_reason()
    if torch_cuda_reason() is not None or nv is None:
        assert reason and all(part in reason for part in filter(None, (why, torch_cuda_reason())))


def test_loopback_group_is_refused_with_the_provider_to_use():
    def body(group):
        assert nvw.NvshmemWindow.unavailable_reason(group).startswith("nvshmem needs a torch.distributed process group")
        # the transport is checked first: on a machine without tma, that is what is missing
        want = (
            r"^ultracomm: window 'nvshmem' is not available: nvshmem needs a torch.distributed process group .*"
            r"use cuda_local"
            if torch_cuda_reason() is None and cuda_module_reason() is None
            else r"^ultracomm: transport 'tma' is not available: "
        )
        with pytest.raises(NotAvailableError, match=want):
            Context(
                group,
                ExpertLayout((Member("w", (4, 4), torch.float32),)),
                1,
                1,
                num_layers=1,
                window="nvshmem",
                timeout_s=30.0,
            )
        return True

    assert LoopbackDomain(2).run(body) == [True, True]


def test_unique_id_travels_as_bytes():
    nv = pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed (optional extra ultracomm[nvshmem])")
    data = nvw._uid_bytes(nv)
    assert len(data) == 128
    assert nvw._uid_from(nv, data)._data.view("int8").tobytes() == data
    assert nvw._uid_bytes(nv) != data  # a fresh id each time: the bytes are the id, not a constant
    for name in ("init", "tensor", "get_peer_tensor", "free_tensor", "finalize"):  # what create/finalize call
        assert callable(getattr(nv, name))


def test_finalize_without_init_is_a_no_op():
    nvw.finalize()


@pytest.mark.gpu
def test_one_rank_window_on_the_symmetric_heap(tmp_path):
    pytest.importorskip("nvshmem.core", reason="nvshmem4py is not installed (optional extra ultracomm[nvshmem])")
    script = textwrap.dedent(f"""
        import torch, torch.distributed as dist
        from ultracomm.comm import as_comm
        from ultracomm.windows import nvshmem as nvw
        dist.init_process_group("gloo", init_method="file://{tmp_path}/init", rank=0, world_size=1)
        w = nvw.NvshmemWindow.create(as_comm(None), 4096, device="cuda")
        assert w.local.is_cuda and w.local.numel() == 4096 and int(w.local.sum()) == 0
        assert w.peer_bases == [w.local.data_ptr()]
        w.local.fill_(7)
        torch.cuda.synchronize()
        assert int(w.local.sum()) == 7 * 4096
        w.close()
        nvw.finalize()
        print("nvshmem window OK")
    """)
    p = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert p.returncode == 0 and "nvshmem window OK" in p.stdout, p.stdout[-3000:] + p.stderr[-3000:]
