"""Choosing device, transport and window (ultracomm.dataplane), GPU availability errors, SM defaults."""

from __future__ import annotations

import logging
import sys

import pytest
import torch

import ultracomm.cuda.support as cs
import ultracomm.transports as transports
import ultracomm.windows as windows
from ultracomm import Context, ExpertLayout, LoopbackDomain, Member
from ultracomm.comm import Comm
from ultracomm.dataplane import check_master_devices, device_type, select, transport_kwargs
from ultracomm.env import Config
from ultracomm.errors import RegistrationError
from ultracomm.cuda.hwprofile import validate
from ultracomm.cuda.sm_budget import FALLBACK_PER_CTA_BW, choose_sms, default_sms
from ultracomm.transports.base import Transport
from ultracomm.transports.host import HostTransport
from ultracomm.windows import CudaIpcWindow, CudaLocalWindow, TorchSymmWindow

NO_TMA = bool(cs.torch_cuda_reason() or cs.cuda_module_reason())


class FakeTorchComm(Comm):
    """Stands in for a process group where only ``kind`` matters (no collective is called)."""

    kind = "torch"
    rank, world = 0, 2

    def _board(self):  # pragma: no cover - must not be reached
        raise AssertionError("selection must not run collectives")

    def _next_sequence(self):  # pragma: no cover - must not be reached
        raise AssertionError("selection must not run collectives")


def layout() -> ExpertLayout:
    return ExpertLayout((Member("fc1", (4, 8), torch.bfloat16), Member("fc2", (8,), torch.bfloat16)))


@pytest.mark.parametrize(
    "transport, window, device, want",
    [
        ("auto", "auto", None, "cpu"),
        ("host", "auto", None, "cpu"),
        ("auto", "local", None, "cpu"),
        ("auto", "host_shm", None, "cpu"),
        ("tma", "auto", None, "cuda"),
        ("auto", "cuda_local", None, "cuda"),
        ("auto", "torch_symm", None, "cuda"),
        ("auto", "cuda_ipc", None, "cuda"),
        ("auto", "auto", "cuda", "cuda"),
        ("auto", "auto", "cuda:1", "cuda"),
        ("auto", "auto", 0, "cuda"),
        ("auto", "auto", "cpu", "cpu"),
        ("auto", "cuda_ipc", "cuda:0", "cuda"),
        ("tma", "local", None, "cpu"),  # an explicit window says where memory lives
    ],
)
def test_device_type_rules(transport, window, device, want):
    assert device_type(transport, window, device) == want


@pytest.mark.parametrize(
    "transport, window, device, match",
    [
        ("auto", "local", "cuda", r"window 'local' lives on the CPU but device='cuda'"),
        ("auto", "cuda_ipc", "cpu", r"window 'cuda_ipc' lives on the CUDA but device='cpu'"),
        ("tma", "auto", "cpu", r"transport 'tma' runs on a GPU but device='cpu'"),
        ("host", "auto", "cuda:0", r"transport 'host' runs on the CPU but device='cuda:0'; use transport='tma'"),
        ("auto", "auto", "meta", r"device must be a CPU or CUDA device, got 'meta'"),
        ("auto", "bogus", None, r"window provider 'bogus' is not available in this build"),
    ],
)
def test_device_type_contradictions(transport, window, device, match):
    with pytest.raises(ValueError, match=match):
        device_type(transport, window, device)


def test_auto_transport_follows_the_device(monkeypatch):
    assert transports.resolve_transport("auto", "cpu") is HostTransport

    class FakeTma:
        name = "tma"

    monkeypatch.setitem(transports.TRANSPORTS, "tma", FakeTma)
    assert transports.resolve_transport("auto", "cuda") is FakeTma
    assert transports.resolve_transport("tma", "cpu") is FakeTma  # an explicit name is taken as given
    with pytest.raises(
        ValueError,
        match=r"transport 'nccl' is not available in this build; transports: "
        r"\['copy_engine', 'host', 'p2p', 'split', 'tma'\]",
    ):
        transports.resolve_transport("nccl")


@pytest.mark.skipif(not NO_TMA, reason="this machine can run tma")
def test_tma_here_names_what_is_missing():
    with pytest.raises(cs.NotAvailableError, match=r"^ultracomm: transport 'tma' is not available: ") as ei:
        transports.resolve_transport("auto", "cuda")
    msg = str(ei.value)
    assert any(part in msg for part in ("is a CPU build", "no CUDA device is visible", "ultracomm._cuda is not built"))


def test_tma_reasons_are_specific(monkeypatch):
    monkeypatch.delitem(transports.TRANSPORTS, "tma", raising=False)
    # a GPU torch without the _cuda module: only the module is named
    monkeypatch.setattr(cs, "torch_cuda_reason", lambda: None)
    monkeypatch.setitem(sys.modules, "ultracomm._cuda", None)
    cs._import_cuda.cache_clear()
    try:
        with pytest.raises(cs.NotAvailableError) as ei:
            transports.resolve_transport("tma")
        assert "ultracomm._cuda is not built or does not load" in str(ei.value)
        assert "CPU build" not in str(ei.value)
        # _cuda present, the Python side missing
        monkeypatch.setattr(cs, "cuda_module_reason", lambda: None)
        monkeypatch.setitem(sys.modules, "ultracomm.transports.tma", None)
        with pytest.raises(cs.NotAvailableError, match=r"ultracomm.transports.tma.TmaTransport\) does not load"):
            transports.resolve_transport("tma")
        assert "tma" not in transports.TRANSPORTS  # a failed load is not cached
    finally:
        cs._import_cuda.cache_clear()


def test_cpu_torch_reason(monkeypatch):
    monkeypatch.setattr(torch.version, "cuda", None)
    assert "is a CPU build (torch.version.cuda is None)" in cs.torch_cuda_reason()
    monkeypatch.setattr(torch.version, "cuda", "13.0")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert "no CUDA device is visible" in cs.torch_cuda_reason()


def test_gpu_windows_say_which_group_they_need(monkeypatch):
    loop = LoopbackDomain(1).group(0)
    monkeypatch.setattr(cs, "torch_cuda_reason", lambda: None)
    for mod in (windows.cuda_local, windows.cuda_ipc, windows.torch_symm):
        monkeypatch.setattr(mod, "torch_cuda_reason", lambda: None)
    assert CudaLocalWindow.unavailable_reason(loop) is None
    assert "needs a LoopbackGroup" in CudaLocalWindow.unavailable_reason(FakeTorchComm())
    assert "for a LoopbackGroup use cuda_local" in CudaIpcWindow.unavailable_reason(loop)
    assert "for a LoopbackGroup use cuda_local" in TorchSymmWindow.unavailable_reason(loop)
    assert CudaIpcWindow.unavailable_reason(FakeTorchComm()) is None


@pytest.mark.skipif(cs.torch_cuda_reason() is None, reason="this machine has a GPU")
def test_gpu_window_on_a_cpu_machine_is_refused():
    def body(group):
        with pytest.raises(cs.NotAvailableError, match=r"^ultracomm: the cuda_local window is not available: "):
            CudaLocalWindow.create(group, 1024)
        return True

    assert LoopbackDomain(2).run(body) == [True, True]


def _patch_available(monkeypatch, available: dict[str, bool]):
    for name, ok in available.items():
        cls = windows.PROVIDERS[name]
        monkeypatch.setattr(
            cls, "unavailable_reason", staticmethod(lambda comm, ok=ok, n=name: None if ok else f"{n} off")
        )


@pytest.mark.parametrize(
    "kind, available, allowed, want",
    [
        ("loopback", dict(cuda_local=True, torch_symm=True, cuda_ipc=True), None, "cuda_local"),
        ("torch", dict(cuda_local=False, torch_symm=True, cuda_ipc=True), None, "torch_symm"),
        ("torch", dict(cuda_local=False, torch_symm=False, cuda_ipc=True), None, "cuda_ipc"),
        ("torch", dict(cuda_local=False, torch_symm=True, cuda_ipc=True), ("cuda_ipc",), "cuda_ipc"),
    ],
)
def test_auto_window_prefers_in_order(monkeypatch, kind, available, allowed, want):
    _patch_available(monkeypatch, available)
    comm = LoopbackDomain(1).group(0) if kind == "loopback" else FakeTorchComm()
    assert windows.resolve_provider("auto", comm, "cuda", allowed) == want


def test_auto_window_none_available_lists_why(monkeypatch):
    _patch_available(monkeypatch, dict(cuda_local=False, torch_symm=False, cuda_ipc=False))
    with pytest.raises(cs.NotAvailableError) as ei:
        windows.resolve_provider("auto", FakeTorchComm(), "cuda", ("torch_symm", "cuda_ipc"))
    assert str(ei.value) == (
        "ultracomm: no GPU window is available here: cuda_local: not accepted by the transport; "
        "torch_symm: torch_symm off; cuda_ipc: cuda_ipc off; nvshmem: not accepted by the transport"
    )


def test_auto_window_cpu_is_unchanged():
    assert windows.resolve_provider("auto", LoopbackDomain(1).group(0)) == "local"
    assert windows.resolve_provider("auto", FakeTorchComm()) == "host_shm"


class FakeTma(Transport):
    name = "tma"
    window_providers = ("cuda_ipc", "torch_symm", "cuda_local")
    stream_ordered = True
    options = frozenset({"num_workers", "jitter_us", "multicast_sms", "reduce_sms"})

    def __init__(
        self,
        *,
        rank,
        world,
        window,
        wlayout,
        layout,
        num_workers,
        timeout_s,
        jitter_us=0,
        multicast_sms=None,
        reduce_sms=None,
    ):
        pass


def test_select_logs_the_choice(monkeypatch, caplog):
    monkeypatch.setitem(transports.TRANSPORTS, "tma", FakeTma)
    _patch_available(monkeypatch, dict(cuda_local=True, torch_symm=True, cuda_ipc=True))
    monkeypatch.setattr("ultracomm.dataplane.resolve_device", lambda d: torch.device("cuda", 3))
    with caplog.at_level(logging.INFO, logger="ultracomm"):
        cls, provider, dev = select(Config(), LoopbackDomain(1).group(0), "cuda")
    assert (cls, provider, dev) == (FakeTma, "cuda_local", torch.device("cuda", 3))
    assert "rank 0: window auto -> cuda_local" in caplog.text
    assert "rank 0: transport tma (auto), window cuda_local (auto) on cuda:3" in caplog.text


def test_select_refuses_a_window_the_transport_cannot_use():
    with pytest.raises(
        ValueError,
        match=r"transport 'host' cannot use window 'cuda_local'; use one of "
        r"\('host_shm', 'local'\)",
    ):
        select(Config(transport="host", window="cuda_local"), LoopbackDomain(1).group(0))


@pytest.mark.skipif(not NO_TMA, reason="this machine can run tma")
def test_context_on_cuda_here_fails_before_setup():
    def body(group):
        for kw in (dict(device="cuda"), dict(window="cuda_local"), dict(transport="tma")):
            with pytest.raises(cs.NotAvailableError, match="transport 'tma' is not available"):
                Context(group, layout(), 1, 1, num_layers=1, **kw)
        return True

    assert LoopbackDomain(2).run(body) == [True, True]


def test_transport_kwargs_pass_resolved_sms(caplog):
    cfg = Config(multicast_sms=0, reduce_sms=7, intra_bw=370e9, log_level="debug")
    with caplog.at_level(logging.DEBUG, logger="ultracomm"):
        kw = transport_kwargs(FakeTma, cfg, None, rank=2, world=4, window=None, wlayout={}, layout=None)
    want_auto = default_sms(370e9, FALLBACK_PER_CTA_BW["multicast"])
    assert want_auto == 11  # ceil(370e9 / 34.5e9): the tile mover's measured per-CTA rate
    assert (kw["multicast_sms"], kw["reduce_sms"]) == (want_auto, 7)
    assert "rank 2: multicast_sms=11 (auto: ceil(nvlink bw 3.7e+11 / measured per-CTA fallback 3.45e+10" in caplog.text
    assert "rank 2: reduce_sms=7 (ULTRACOMM_REDUCE_SMS=7)" in caplog.text
    host_kw = transport_kwargs(HostTransport, cfg, None, rank=0, world=1, window=None, wlayout={}, layout=None)
    assert "multicast_sms" not in host_kw and host_kw["num_workers"] == cfg.num_workers


def test_default_sms_formula():
    assert default_sms(370e9, 16e9) == 24  # ceil(23.1)
    assert default_sms(370e9, 185e9) == 2  # exact multiple: no extra SM
    assert default_sms(370e9, 1e9) == 32  # capped
    assert default_sms(370e9, 1e9, device_sms=20) == 20
    assert default_sms(1e9, 1e12) == 1
    with pytest.raises(ValueError, match="must be > 0"):
        default_sms(0, 1e9)


def _profile(**over):
    d = dict(
        schema="ultracomm.hwprofile/1",
        device="NVIDIA H200",
        compute_capability="9.0",
        sm_count=132,
        date="2025-12-01T00:00:00Z",
        torch="2.11.0+cu130",
        cuda="13.0",
        source="perf/bench_gpu.py",
        d2d_copy_bw=2.0e12,
        per_sm_copy_bw=100e9,
        per_sm_reduce_bw=None,
        sm_sweep=[[1, 100e9], [2, 190e9]],
        reduce_bw=None,
        torch_reduce_bw=None,
        flag_rtt_s=None,
        launch_s=3e-6,
        relay_hop_s=[],
        chunk_overhead_s=None,
        hop_bw=None,
    )
    d.update(over)
    return d


def test_choose_sms_uses_the_profile_for_its_kind():
    prof = validate(_profile(), "p.json")
    # per_sm_copy_bw is a local (HBM) one-CTA figure: it budgets a loopback copy, not an NVLink one
    mc = choose_sms("multicast", 0, 370e9, 132, prof, link="local")
    assert mc.sms == 4 and "per_sm_copy_bw=1e+11 B/s from p.json (NVIDIA H200" in mc.source
    mc = choose_sms("multicast", 0, 370e9, 132, prof)
    assert mc.sms == 11 and "no profile figure for multicast on nvlink" in mc.source
    rd = choose_sms("reduce", 0, 370e9, 132, prof)  # the profile has no reduce figure: the fallback
    assert rd.sms == 26 and "no profile figure for reduce on nvlink" in rd.source
    assert choose_sms("reduce", 5, 370e9, 132, prof).sms == 5
    with pytest.raises(ValueError, match="kind must be 'multicast' or 'reduce'"):
        choose_sms("gather", 0, 1.0)


def test_masters_must_live_where_the_window_does():
    names = ("fc1", "fc2")
    cpu_w = [torch.zeros(2, 4, 8, dtype=torch.bfloat16), torch.zeros(2, 8, dtype=torch.bfloat16)]
    cpu_g = [torch.zeros(2, 4, 8), torch.zeros(2, 8)]
    check_master_devices(torch.device("cpu"), "host", names, cpu_w, cpu_g, 2)
    meta_g = [t.to("meta") for t in cpu_g]
    with pytest.raises(
        RegistrationError,
        match=r"grads\['fc1'\] is on meta, but this Context's window is on the "
        r"CPU \(transport 'host'\); move the tensors with .cpu\(\), or create "
        r"the Context with device='cuda'",
    ):
        check_master_devices(torch.device("cpu"), "host", names, cpu_w, meta_g, 2)
    # a device window: same device, and every expert's row 16-byte aligned
    with pytest.raises(
        RegistrationError,
        match=r"weights\['fc1'\] is on cpu, but this Context's window is on meta; "
        r"the tma transport reads and writes masters on the window's GPU",
    ):
        check_master_devices(torch.device("meta"), "tma", names, cpu_w, meta_g, 2)
    meta_w = [t.to("meta") for t in cpu_w]
    check_master_devices(torch.device("meta"), "tma", names, meta_w, meta_g, 2)  # 64 and 16 bytes per expert
    odd = [
        torch.zeros(2, 4, 8, dtype=torch.bfloat16, device="meta"),
        torch.zeros(2, 7, dtype=torch.bfloat16, device="meta"),
    ]
    with pytest.raises(
        RegistrationError,
        match=r"weights\['fc2'\]: every expert's row must start 16-byte aligned "
        r"for TMA bulk copies, got base 0x0 and 14 bytes per expert",
    ):
        check_master_devices(torch.device("meta"), "tma", names, odd, meta_g, 2)


def test_import_without_cuda_module(monkeypatch):
    monkeypatch.setitem(sys.modules, "ultracomm._cuda", None)
    cs._import_cuda.cache_clear()
    try:
        assert cs.cuda_module() is None
        assert "ultracomm._cuda is not built or does not load" in cs.cuda_module_reason()
        with pytest.raises(cs.NotAvailableError, match="ultracomm: the bench is not available: "):
            cs.require("the bench")
    finally:
        cs._import_cuda.cache_clear()


def test_profile_lookup_needs_a_device_or_a_path(tmp_path, monkeypatch):
    from ultracomm.cuda import hwprofile
    from ultracomm.cuda.sm_budget import choices_for_device

    (tmp_path / "h200_profile.json").write_text(__import__("json").dumps(_profile()))
    monkeypatch.setattr(hwprofile, "DEFAULT_DIR", str(tmp_path))
    mc, _ = choices_for_device(0, 0, 370e9, None, None, link="local")  # no device (CPU): the fallback
    assert mc.sms == 11 and "fallback" in mc.source
    mc, _ = choices_for_device(0, 0, 370e9, 132, "NVIDIA H200", link="local")  # found by device name
    assert mc.sms == 4 and "h200_profile.json" in mc.source
    mc, _ = choices_for_device(0, 0, 370e9, 132, "NVIDIA A100", link="local")  # another GPU's does not apply
    assert mc.sms == 11
    mc, _ = choices_for_device(0, 0, 370e9, None, None, str(tmp_path / "h200_profile.json"), link="local")
    assert mc.sms == 4
    mc, rd = choices_for_device(9, 8, 370e9, 132, "NVIDIA H200")  # explicit values: no lookup at all
    assert (mc.sms, rd.sms) == (9, 8)
