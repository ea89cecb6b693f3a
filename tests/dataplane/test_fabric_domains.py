"""Multi-node NVLink (NVL72-class) detection: a CUDA rank whose GPU completed its fabric registration is in
domain nvlink:<cluster uuid>/<clique id>; fabric records are injected (nothing here ran on such a system)."""

from __future__ import annotations

import ctypes

import pytest

from ultracomm.dataplane import domains
from ultracomm.cuda import fabric
from ultracomm.cuda.fabric import FabricInfo, fabric_key

UUID = "00112233445566778899aabbccddeeff"


@pytest.mark.parametrize(
    "info,key",
    [
        (FabricInfo(UUID, 7, 3), f"nvlink:{UUID}/7"),
        (FabricInfo(UUID, 7, 2), None),  # registration in progress
        (FabricInfo(UUID, 7, 1), None),  # not started
        (FabricInfo(UUID, 7, 0), None),  # not supported (e.g. an H100 HGX board)
        (FabricInfo(UUID, 7, 3, status=3), None),  # completed with an error
        (FabricInfo("0" * 32, 0, 3), None),  # no cluster
        (None, None),
    ],
)
def test_fabric_key(info, key):
    assert fabric_key(info) == key


def test_cuda_ranks_take_the_fabric_key_and_cpu_ranks_the_host():
    seen = []

    def query(device):
        seen.append(device)
        return FabricInfo(UUID, 4, 3)

    d = domains.rank_domain("", 1, 4, "cuda", device=3, fabric=query)
    assert (d.key, d.source, d.host) == (f"nvlink:{UUID}/4", "nvlink", domains.host_key()) and seen == [3]
    d = domains.rank_domain("", 1, 4, "cuda", device=0, fabric=lambda dev: FabricInfo(UUID, 4, 2))
    assert (d.key, d.source) == (domains.host_key(), "host")  # not registered yet: the host decides
    d = domains.rank_domain("", 1, 4, "cpu", fabric=lambda dev: pytest.fail("a CPU rank asked for fabric info"))
    assert (d.key, d.source) == (domains.host_key(), "host")
    # a declaration wins over detection; a per-rank list gives each rank its entry
    assert domains.rank_domain("rack9", 1, 4, "cuda", fabric=query).key == "rack9"
    d = domains.rank_domain("a,a,b,b", 2, 4, "cuda", fabric=query)
    assert (d.declared, d.key, d.source) == ("a,a,b,b", "b", "declared")


def test_nvlink_domain_over_hosts_is_one_tma_domain_on_nvshmem():
    key = f"nvlink:{UUID}/4"
    views = [domains.RankDomain("", h, key, "nvlink") for h in ("h1/x", "h1/x", "h2/y", "h2/y")]
    domains.check_domains(views, "cuda")  # one CUDA domain may span hosts
    choice = domains.choose_transport("cuda", [v.key for v in views], [v.host for v in views])
    assert (choice.transport, choice.window, choice.domain_of) == ("tma", "nvshmem", (0, 0, 0, 0))
    assert "window nvshmem, since CUDA IPC handles do not reach across hosts" in choice.describe()
    with pytest.raises(ValueError, match="spans several hosts"):
        domains.check_domains(views, "cpu")
    # two racks: two domains of four, each spanning two hosts -> p2p between them (GPU split not built)
    other = [domains.RankDomain("", h, f"nvlink:{UUID}/5", "nvlink") for h in ("h3/z", "h3/z", "h4/w", "h4/w")]
    choice = domains.choose_transport("cuda", [v.key for v in views + other], [v.host for v in views + other])
    assert choice.transport == "p2p" and choice.domain_of == (0,) * 4 + (1,) * 4


def test_nvml_struct_matches_nvml_h():
    # nvmlGpuFabricInfo_v2 = NVML_STRUCT_VERSION(GpuFabricInfo, 2) = sizeof | 2 << 24 = 0x02000024 in nvml.h
    assert ctypes.sizeof(fabric._FabricInfoV2) == 36 and fabric.FABRIC_INFO_V2_VERSION == 0x02000024
    s = fabric._FabricInfoV2(version=fabric.FABRIC_INFO_V2_VERSION, status=0, cliqueId=9, state=3)
    s.clusterUuid[:] = list(bytes.fromhex(UUID))
    assert fabric._from_struct(s) == FabricInfo(UUID, 9, 3, 0)


def test_no_gpu_means_no_fabric_info():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert fabric.gpu_fabric_info(0) is None  # no exception, whatever NVML/pynvml this machine has
