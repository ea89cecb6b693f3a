"""The GPU window providers' setup driven on the CPU, so that every line of ``create`` runs here.

``torch_symm`` never ran past its same-GPU refusal on a device (every device run so far had one
GPU), and ``cuda_ipc``'s two-process test needs one.  Here the ranks are loopback threads that
pose as a torch process group; the GPU pieces are stand-ins on CPU memory: torch's symmetric
memory (``empty`` at an offset inside a larger block, a ``rendezvous`` that meets every rank, the
per-group switch of torch < 2.7) and CUDA IPC (``UntypedStorage._share_cuda_`` /
``_new_shared_cuda`` with torch's argument order, a handle that names the exporter's block).
What is checked: ``peer_bases`` address every rank's window, the window is zeroed before the
barrier, and a failed check raises the same error on every rank."""

from __future__ import annotations

import struct
import threading
from types import SimpleNamespace

import pytest
import torch

from ultracomm import LoopbackDomain
from ultracomm.errors import PeerError
from ultracomm.windows import cuda_ipc, gpu_common, open_window, torch_symm

NBYTES = 4096


def as_torch_group(group, name="g0"):
    """A loopback rank that passes for a torch process group (what the providers check)."""
    group.kind = "torch"
    group.group = SimpleNamespace(group_name=name)
    return group


@pytest.fixture
def fake_cuda(monkeypatch):
    """No GPU needed: the providers' usability check passes, devices resolve to the CPU, and
    ``torch.cuda.synchronize`` (the zeroing's wait) does nothing."""
    for mod in (torch_symm, cuda_ipc):
        monkeypatch.setattr(mod, "check_usable", lambda cls, comm: None)
        monkeypatch.setattr(mod, "resolve_device", lambda device: torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    assert gpu_common.zero_and_barrier  # the real one runs


class FakeSymm:
    """``torch.distributed._symmetric_memory``'s calls the provider makes: each rank's tensor sits
    ``offsets[rank]`` bytes into its own block, filled with garbage (``empty``)."""

    def __init__(self, world, offsets, enabled=False):
        self.world, self.offsets, self.enabled = world, offsets, enabled
        self.enable_calls: list[str] = []
        self.blocks: dict[int, torch.Tensor] = {}
        self.meet = threading.Barrier(world)
        self.rank = threading.local()

    def is_symm_mem_enabled_for_group(self, name):
        return self.enabled

    def enable_symm_mem_for_group(self, name):
        self.enable_calls.append(name)

    def empty(self, *size, dtype=None, device=None):
        (n,) = size
        assert dtype == torch.uint8 and device == torch.device("cpu")
        r = self.rank.value
        block = self.blocks[r] = torch.full((self.offsets[r] + n + 64,), 0xAB, dtype=torch.uint8)
        return block[self.offsets[r] : self.offsets[r] + n]

    def rendezvous(self, tensor, group):
        assert group == "g0" and tensor.dtype == torch.uint8
        self.meet.wait(timeout=30)  # collective: every rank's block exists now
        blocks = self.blocks

        class Handle:
            buffer_ptrs = [blocks[q].data_ptr() for q in range(self.world)]

            def get_buffer(self, rank, sizes, dtype, storage_offset=0):
                return blocks[rank][storage_offset : storage_offset + sizes[0]]

        return Handle()


def symm_windows(monkeypatch, world, offsets, uuids=None, enabled=False):
    symm = FakeSymm(world, offsets, enabled)
    monkeypatch.setattr(torch_symm, "_symm_module", lambda: symm)
    uuid_of = threading.local()
    monkeypatch.setattr(torch_symm, "device_uuid", lambda dev: uuid_of.value)

    def body(group):
        as_torch_group(group)
        symm.rank.value = group.rank
        uuid_of.value = (uuids or [f"GPU-{q}" for q in range(world)])[group.rank]
        try:
            w = open_window("torch_symm", group, NBYTES, device="cuda")
        except Exception as e:  # noqa: BLE001 - compared across ranks below
            return e
        got = (w.provider, list(w.peer_bases), int(w.local.count_nonzero()), w.local.data_ptr())
        group.barrier()  # every rank has looked at its own window before any writes into it
        w.peer_view((group.rank + 1) % world).fill_(group.rank + 1)  # through torch's get_buffer
        group.barrier()
        got += (int(w.local[0]),)
        w.close()
        return got

    return symm, LoopbackDomain(world).run(body)


def test_torch_symm_maps_every_rank_at_its_offset_and_zeroes_first(fake_cuda, monkeypatch):
    world = 3
    symm, out = symm_windows(monkeypatch, world, [256] * world)
    assert symm.enable_calls == ["g0"] * world  # torch < 2.7: switched on for the group first
    for r, (provider, bases, nonzero, ptr, seen) in enumerate(out):
        assert provider == "torch_symm" and nonzero == 0
        assert bases == [symm.blocks[q].data_ptr() + 256 for q in range(world)]
        assert bases[r] == ptr
        assert seen == (r - 1) % world + 1  # the left neighbour wrote into this rank's window
    symm2, _ = symm_windows(monkeypatch, 2, [0, 0], enabled=True)
    assert symm2.enable_calls == []  # already on (or torch >= 2.7): not called


def test_torch_symm_refuses_windows_at_different_offsets_on_every_rank(fake_cuda, monkeypatch):
    _, out = symm_windows(monkeypatch, 2, [256, 512])
    for e in out:
        assert isinstance(e, RuntimeError) and "different offsets of their buffers [256, 512]" in str(e)


def test_torch_symm_refuses_two_ranks_on_one_gpu_before_allocating(fake_cuda, monkeypatch):
    symm, out = symm_windows(monkeypatch, 3, [0] * 3, uuids=["GPU-a", "GPU-b", "GPU-a"])
    assert not symm.blocks
    for e in out:
        assert isinstance(e, ValueError) and "ranks 0 and 2 use the same GPU" in str(e)


class FakeIpc:
    """CUDA IPC through torch's storage sharing: a handle names the exporter's block; opening it
    returns that block's storage.  The argument order is torch.multiprocessing.reductions'."""

    def __init__(self):
        self.storages: dict[int, torch.UntypedStorage] = {}
        self.opened: list[tuple] = []

    def share(self, storage):
        self.storages[storage.data_ptr()] = storage
        handle = struct.pack("<Q", storage.data_ptr()) + bytes(56)
        return (0, handle, storage.nbytes(), 0, b"/torch_ref", 8, bytes(64), True)

    def new_shared(self, device, handle, size, offset, ref_handle, ref_offset, event_handle, event_sync):
        assert device is None or isinstance(device, int)
        assert isinstance(handle, bytes) and isinstance(ref_handle, bytes) and isinstance(event_handle, bytes)
        assert isinstance(size, int) and isinstance(offset, int) and isinstance(ref_offset, int)
        assert event_sync is True
        self.opened.append((device, size, offset, ref_offset))
        return self.storages[struct.unpack_from("<Q", handle)[0]]


def ipc_windows(monkeypatch, world, reach=None, nbytes=None):
    ipc = FakeIpc()
    monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_", lambda self: ipc.share(self), raising=False)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(ipc.new_shared), raising=False)

    def body(group):
        as_torch_group(group)
        n = nbytes[group.rank] if nbytes else NBYTES
        try:
            w = open_window("cuda_ipc", group, n, device="cuda", reach=reach)
        except Exception as e:  # noqa: BLE001 - compared across ranks below
            return e
        got = (list(w.peer_bases), int(w.local.count_nonzero()), w.local.data_ptr())
        group.barrier()  # every rank has looked at its own window before any writes into it
        for q in range(world):
            if w.peer_bases[q] and q != group.rank:
                w.peer_view(q)[group.rank] = group.rank + 1  # byte r of every reachable peer
        group.barrier()
        got += (w.local[:world].tolist(),)
        group.barrier()
        w.close()
        return got

    return ipc, LoopbackDomain(world).run(body)


def test_cuda_ipc_opens_every_peer_with_torchs_arguments(fake_cuda, monkeypatch):
    world = 3
    ipc, out = ipc_windows(monkeypatch, world)
    assert len(ipc.opened) == world * (world - 1)  # every rank opens every peer, never itself
    ptrs = [ptr for _, _, ptr, _ in out]
    for r, (bases, nonzero, ptr, seen) in enumerate(out):
        assert bases == ptrs and nonzero == 0
        assert seen == [0 if q == r else q + 1 for q in range(world)]


def test_cuda_ipc_with_reach_opens_only_its_domain(fake_cuda, monkeypatch):
    reach_of = {0: [True, True, False, False], 2: [False, False, True, True]}
    ipc = FakeIpc()
    monkeypatch.setattr(torch.UntypedStorage, "_share_cuda_", lambda self: ipc.share(self), raising=False)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared_cuda", staticmethod(ipc.new_shared), raising=False)

    def body(group):
        as_torch_group(group)
        reach = reach_of[group.rank // 2 * 2]
        w = open_window("cuda_ipc", group, NBYTES, device="cuda", reach=reach)
        bases = list(w.peer_bases)
        w.close()
        return bases

    out = LoopbackDomain(4).run(body)
    assert len(ipc.opened) == 4  # rank 0 opens 1, rank 1 opens 0, and so on: one peer each
    for r, bases in enumerate(out):
        mine = [q for q in range(4) if q // 2 == r // 2]
        assert [q for q in range(4) if bases[q]] == mine


def test_cuda_ipc_ranks_that_disagree_on_the_size_fail_together(fake_cuda, monkeypatch):
    _, out = ipc_windows(monkeypatch, 2, nbytes=[NBYTES, 2 * NBYTES])
    assert all(isinstance(e, (ValueError, PeerError)) for e in out)
    assert "ranks disagree on the layout" in str(out[0]) and "ranks disagree on the layout" in str(out[1])
