"""Contract tests of the vLLM EPLB communicator: vLLM's own calls, release by release.

Upstream read (not imported, not copied): the vLLM wheels 0.20.0 - 0.34.0 from PyPI
(``pip download vllm==X --no-deps``), ``vllm/distributed/eplb/rebalance_execute.py``
(``rearrange_expert_weights_inplace``, ``move_to_buffer``, ``move_from_buffer``,
``get_ep_ranks_with_experts_batch``; 0.32+ ``_execute_migration_batches``),
``vllm/distributed/eplb/migration_scheduler.py`` (0.32+, ``schedule_migration_batches``),
``vllm/distributed/eplb/eplb_communicator.py`` (the ``EplbCommunicator`` base class,
``TorchDistNcclEplbCommunicator``, ``create_eplb_communicator``) and
``vllm/distributed/eplb/eplb_state.py`` (how the factory is called, 0.34's
``owned_expert_buffer or expert_buffer``).  :func:`rearrange` below restates what
``rearrange_expert_weights_inplace`` does to the communicator and to the weights, written here
from that reading.  Each contract test runs it twice, once over :class:`P2P` (vLLM's
``torch_nccl`` communicator: per rank pair, sends and receives matched in the order posted)
and once over ultracomm's communicator, and requires bit-identical weights on every rank.
"""

from __future__ import annotations

import threading
import types

import numpy as np
import pytest
import torch

from ultracomm import LoopbackDomain
from ultracomm.errors import ConfigError, PlanError
from ultracomm.integrations import vllm_eplb, vllm_protocol
from ultracomm.integrations.vllm_eplb import UltracommEplbCommunicator, create_eplb_communicator
from ultracomm.integrations.vllm_protocol import protocol_for

PPR = 3  # physical experts per rank
SHAPES = [((10, 6), torch.bfloat16), ((7,), torch.float32)]  # e.g. w13 and w2 rows; 28 B rows: unaligned


@pytest.fixture
def no_installed_vllm(monkeypatch):
    """The default vllm_version as on a machine without vLLM, whatever this one has."""
    monkeypatch.setattr(vllm_protocol, "installed_vllm_version", lambda: None)


# ---------------------------------------------------------------- vLLM's calls, restated
def holders_and_needers(old: list[int], new: list[int], e: int, n: int) -> tuple[list[int], list[int]]:
    """``get_ep_ranks_with_experts_batch`` for one expert: ranks holding ``e`` in ``old`` (by
    first position, i.e. ascending), ranks with ``e`` in ``new`` that do not hold it (ascending)."""
    holders = sorted({p // n for p, x in enumerate(old) if x == e})
    needers = sorted({p // n for p, x in enumerate(new) if x == e} - set(holders))
    return holders, needers


def first_rows(local: list[int]) -> dict[int, int]:
    out: dict[int, int] = {}
    for row, e in enumerate(local):
        if e != -1:
            out.setdefault(e, row)
    return out


def remote_rows(old_local: list[int], new_local: list[int]) -> dict[int, int]:
    """Experts a rank must receive, each with the first row needing it (0.34's ``_remote_recv_rows``)."""
    out: dict[int, int] = {}
    for row, e in enumerate(new_local):
        if e != -1 and e not in old_local:
            out.setdefault(e, row)
    return dict(sorted(out.items()))


def migration_batches(old: list[int], new: list[int], n: int) -> list[list[tuple[int, int, list[int]]]]:
    """0.32+ ``schedule_migration_batches``: flows (src, dst, experts) of the unbatched path's
    sender assignment, one per directed rank pair in first-seen order, placed first-fit in the
    first batch where neither endpoint is busy."""
    world = len(old) // n
    pairs: dict[tuple[int, int], list[int]] = {}
    for e in sorted({x for x in new if x != -1}):
        senders, receivers = holders_and_needers(old, new, e, n)
        if not senders or not receivers:
            continue
        per, extra = divmod(len(receivers), len(senders))
        for i, s in enumerate(senders):
            for d in receivers[i * per : (i + 1) * per]:
                pairs.setdefault((s, d), []).append(e)
            if i < extra:
                pairs.setdefault((s, receivers[len(senders) * per + i]), []).append(e)
    batches: list[list[tuple[int, int, list[int]]]] = []
    busy: list[set[int]] = []
    for (s, d), experts in pairs.items():
        for batch, used in zip(batches, busy):
            if s not in used and d not in used:
                batch.append((s, d, experts))
                used |= {s, d}
                break
        else:
            batches.append([(s, d, experts)])
            busy.append({s, d})
    assert all(0 <= s < world and 0 <= d < world for b in batches for s, d, _ in b)
    return batches


def transfer_context(version: str, comm, old_np: np.ndarray, new: list[int], layer: int, n: int, rows_of) -> None:
    """The ``set_transfer_context`` call of ``version`` (none before 0.23; 0.34 reads
    ``needs_recv_rows`` and passes ``recv_rows``, ``None`` unless asked for)."""
    p = protocol_for(version)
    if p.recv_rows:
        recv_rows = None
        if comm.needs_recv_rows:
            recv_rows = [rows_of(r) for r in range(len(new) // n)]
        comm.set_transfer_context(old_np, layer, recv_rows)
    elif p.transfer_context:
        comm.set_transfer_context(old_np, layer)


def move_to_buffer(
    version: str, comm, old: list[int], new: list[int], weights, buffer, rank: int, layer: int, batched: bool = False
):
    """One layer of ``move_to_buffer``: local copies into the buffer, the communicator calls,
    and the metadata ``move_from_buffer`` needs (unchanged rows, rows filled locally, primary
    receive rows)."""
    n = PPR
    old_np = np.asarray(old, dtype=np.int64)
    old_loc, new_loc = old[rank * n : (rank + 1) * n], new[rank * n : (rank + 1) * n]
    unchanged = [o == x for o, x in zip(old_loc, new_loc)]
    local = [unchanged[i] or (new_loc[i] != -1 and new_loc[i] in old_loc) for i in range(n)]
    src_row = first_rows(old_loc)
    primary = remote_rows(old_loc, new_loc)
    for i in range(n):  # 1. local moves, before any communicator call
        if not unchanged[i] and local[i] and new_loc[i] in src_row:
            for w, b in zip(weights, buffer):
                b[i].copy_(w[src_row[new_loc[i]]])
    if batched:  # 0.32+ async transfer_layer with migration batching: one round per batch
        assert protocol_for(version).migration_batches
        new_row = first_rows(new_loc)
        for batch in migration_batches(old, new, n):
            transfer_context(version, comm, old_np, new, layer, n, lambda r: first_rows(new[r * n : (r + 1) * n]))
            for s, d, experts in batch:
                for e in experts:
                    if s == rank:
                        comm.add_send([w[src_row[e]] for w in weights], d, expert_id=e)
                    elif d == rank:
                        comm.add_recv([b[new_row[e]] for b in buffer], s, expert_id=e)
            comm.execute()
        return unchanged, local, primary
    transfer_context(
        version, comm, old_np, new, layer, n, lambda r: remote_rows(old[r * n : (r + 1) * n], new[r * n : (r + 1) * n])
    )
    for e in sorted(src_row):  # 2. sends: this holder's share of the receivers, by expert
        senders, receivers = holders_and_needers(old, new, e, n)
        if not receivers:
            continue
        per = len(receivers) // len(senders)
        i = senders.index(rank)
        mine = receivers[i * per : (i + 1) * per]
        if len(senders) * per + i < len(receivers):
            mine.append(receivers[len(senders) * per + i])
        for d in mine:
            comm.add_send([w[src_row[e]] for w in weights], d, expert_id=e)
    for e, row in primary.items():  # 3. receives into the primary row, by expert
        senders, receivers = holders_and_needers(old, new, e, n)
        if not senders:
            continue
        per = len(receivers) // len(senders)
        j = receivers.index(rank)
        s = senders[j // per] if j < len(senders) * per else senders[j - len(senders) * per]
        comm.add_recv([b[row] for b in buffer], s, expert_id=e)
    if protocol_for(version).execute_old_indices:  # 4.
        comm.execute(old_indices=old_np)
    else:
        comm.execute()
    return unchanged, local, primary


def move_from_buffer(new_loc: list[int], weights, buffer, meta) -> None:
    """Changed rows filled locally or as a primary receive come from the buffer; other rows
    of a received expert copy its primary row; untouched: unchanged rows and rows now -1."""
    unchanged, local, primary = meta
    prim_rows = set(primary.values())
    for i in range(PPR):
        if not unchanged[i] and (local[i] or i in prim_rows):
            for w, b in zip(weights, buffer):
                w[i].copy_(b[i])
    for i in range(PPR):
        e = new_loc[i]
        if not unchanged[i] and not local[i] and i not in prim_rows and e != -1 and e in primary:
            for w in weights:
                w[i].copy_(w[primary[e]])


def rearrange(version: str, comm, olds, news, layers, buffer, rank: int, batched: bool = False) -> None:
    """``rearrange_expert_weights_inplace`` (or, ``batched``, the async worker's
    ``transfer_layer`` with migration batching then ``move_from_buffer``), layer by layer."""
    for layer, (old, new) in enumerate(zip(olds, news)):
        meta = move_to_buffer(version, comm, old, new, layers[layer], buffer, rank, layer, batched)
        move_from_buffer(new[rank * PPR : (rank + 1) * PPR], layers[layer], buffer, meta)


class P2P:
    """vLLM's ``torch_nccl`` communicator over loopback threads: per (src, dst) pair, the k-th
    ``add_send`` lands in the k-th matching ``add_recv`` (as ``batch_isend_irecv`` matches)."""

    needs_profile_buffer_reservation = True
    needs_recv_rows = False
    owned_expert_buffer = None

    def __init__(self, rank: int, shared: dict):
        self.rank, self.shared = rank, shared
        self.sends: list = []
        self.recvs: list = []

    def set_stream(self, stream) -> None:
        pass

    def set_transfer_context(self, old_indices, layer_idx, recv_rows=None) -> None:
        pass

    def add_send(self, tensors, dst_rank, expert_id) -> None:
        self.sends.append((dst_rank, expert_id, list(tensors)))

    def add_recv(self, tensors, src_rank, expert_id) -> None:
        self.recvs.append((src_rank, expert_id, list(tensors)))

    def execute(self, old_indices=None) -> None:
        box, barrier = self.shared["box"], self.shared["barrier"]
        with self.shared["lock"]:
            for d, e, ts in self.sends:
                box.setdefault((self.rank, d), []).append((e, [t.clone() for t in ts]))
        barrier.wait()
        for s, e, ts in self.recvs:
            sent_e, sent = box[(s, self.rank)].pop(0)
            assert sent_e == e, f"rank {self.rank}: pair ({s}, {self.rank}) sends expert {sent_e}, receives {e}"
            for t, x in zip(ts, sent):
                t.copy_(x)
        assert all(not v for (s, d), v in box.items() if d == self.rank), "a send nobody received"
        barrier.wait()  # no rank deposits the next round's sends before every inbox is drained
        self.sends, self.recvs = [], []


# ---------------------------------------------------------------- expert contents
def expert_rows(layer: int, e: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * layer + 77 + e)
    return [torch.randn(shape, generator=g).to(dtype) for shape, dtype in SHAPES]


def empty_rows(layer: int, rank: int, row: int) -> list[torch.Tensor]:
    """What an empty (-1) physical row holds: something no expert holds."""
    return [torch.full(shape, -1000.0 - 100 * layer - 10 * rank - row).to(dtype) for shape, dtype in SHAPES]


def layer_weights(layer: int, old: list[int], rank: int) -> list[torch.Tensor]:
    rows = [
        expert_rows(layer, e) if e >= 0 else empty_rows(layer, rank, i)
        for i, e in enumerate(old[rank * PPR : (rank + 1) * PPR])
    ]
    return [torch.stack([r[m] for r in rows]) for m in range(len(SHAPES))]


def expected(layer: int, old: list[int], new: list[int], rank: int) -> list[torch.Tensor]:
    """After the move: row p holds expert new[p]; a row that becomes -1 keeps what it had."""
    rows = []
    for i in range(PPR):
        o, x = old[rank * PPR + i], new[rank * PPR + i]
        rows.append(
            expert_rows(layer, x) if x != -1 else (expert_rows(layer, o) if o != -1 else empty_rows(layer, rank, i))
        )
    return [torch.stack([r[m] for r in rows]) for m in range(len(SHAPES))]


def coordinator(group):
    """vLLM's ``GroupCoordinator`` as the factory uses it."""
    return types.SimpleNamespace(cpu_group=group, device_group=group, rank_in_group=getattr(group, "rank", None))


def make(version: str, group, layers, buffer, backend: str = "torch_nccl", **options):
    """``eplb_state``'s construction for ``version``: the factory, then (0.34) the receive buffer
    (0.34 passes none for ``symm_mem`` and takes the communicator's)."""
    p = protocol_for(version)
    if p.factory_all_layers:
        if p.recv_rows and backend == "symm_mem":
            buffer = None
        comm = create_eplb_communicator(
            coordinator(group), backend, layers, buffer, vllm_version=version, timeout_s=20, **options
        )
    else:
        comm = create_eplb_communicator(
            coordinator(group), "torch_nccl", layers[0], vllm_version=version, timeout_s=20, **options
        )
    if p.recv_rows:
        buffer = comm.owned_expert_buffer or buffer
        assert buffer is not None  # as eplb_state asserts
    return comm, buffer


def run_both(version: str, olds, news, batched: bool = False, **options):
    """Every rank's weights after vLLM's rearrangement over :class:`P2P` and over ultracomm."""
    world = len(olds[0]) // PPR
    shared = {"box": {}, "barrier": threading.Barrier(world), "lock": threading.Lock()}

    def body(group, use_ultracomm: bool):
        r = group.rank
        layers = [layer_weights(layer, old, r) for layer, old in enumerate(olds)]
        buffer = [torch.full_like(w, -7) for w in layers[0]]
        if not use_ultracomm:
            rearrange(version, P2P(r, shared), olds, news, layers, buffer, r, batched)
            return layers
        comm, buffer = make(version, group, layers, buffer, **options)
        try:
            assert comm.needs_profile_buffer_reservation is False  # the profile run's question
            rearrange(version, comm, olds, news, layers, buffer, r, batched)
        finally:
            comm.ctx.close()
        return layers

    ref = LoopbackDomain(world).run(lambda g: body(g, False))
    got = LoopbackDomain(world).run(lambda g: body(g, True))
    return ref, got


def random_maps(rng: np.random.Generator, world: int, experts: int, empties: int) -> tuple[list[int], list[int]]:
    """An (old, new) ``phy2log`` pair: every logical expert somewhere in each, replicas and
    same-rank duplicates allowed, ``empties`` rows -1 in old or new (each new expert still held)."""

    def placement() -> list[int]:
        slots = list(range(experts)) + list(rng.integers(0, experts, world * PPR - experts))
        rng.shuffle(slots)
        return [int(x) for x in slots]

    old, new = placement(), placement()
    for p in rng.choice(world * PPR, empties, replace=False):
        which = old if rng.random() < 0.5 else new
        if which is old and old.count(old[p]) == 1:
            continue  # the only copy: some rank would have nothing to receive from
        which[p] = -1
    return old, new


OLD = [0, 1, 2, 3, 4, 5, 6, 7, 0, 1, 2, 3]  # 4 ranks x 3 physical slots; experts 0..3 have two copies
NEW = [0, 1, 4, 3, 5, 0, 6, 7, 0, 0, 2, 1]  # expert 0 onto ranks 1 and 3, 4 onto rank 0, 1 within rank 3
VERSIONS = ["0.21.0", "0.22.1", "0.23.0", "0.24.0", "0.27.1", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]


def check(version: str, olds, news, batched: bool = False, **options) -> None:
    ref, got = run_both(version, olds, news, batched, **options)
    for r, (ref_layers, got_layers) in enumerate(zip(ref, got)):
        for layer, (want, have) in enumerate(zip(ref_layers, got_layers)):
            for m in range(len(SHAPES)):
                assert torch.equal(have[m], want[m]), f"vLLM {version}: rank {r} layer {layer} tensor {m}"
                assert torch.equal(want[m], expected(layer, olds[layer], news[layer], r)[m])


# ---------------------------------------------------------------- contract tests
@pytest.mark.parametrize("version", VERSIONS)
def test_vllm_rearrangement_gives_vllms_weights(version):
    """Two layers, each with its own maps, through one communicator; -1 rows in the second."""
    rng = np.random.default_rng(5)
    old2, new2 = random_maps(rng, 4, 7, empties=3)
    check(version, [OLD, old2], [NEW, new2])


def test_vllm_034_without_expert_buffer():
    """vLLM 0.34 configured with ``symm_mem``: ``eplb_state`` passes ``expert_buffer=None`` and
    receives into ``communicator.owned_expert_buffer`` (asserting it is not None)."""
    rng = np.random.default_rng(6)
    old2, new2 = random_maps(rng, 4, 9, empties=1)
    check("0.34.0", [OLD, old2], [NEW, new2], backend="symm_mem")


@pytest.mark.parametrize("version", ["0.32.0", "0.34.0"])
def test_vllm_migration_batches_give_vllms_weights(version):
    """0.32+: the async worker's batched rounds (several set_transfer_context/execute per layer)."""
    rng = np.random.default_rng(9)
    old2, new2 = random_maps(rng, 4, 8, empties=0)
    check(version, [OLD, old2], [NEW, new2], batched=True)


@pytest.mark.parametrize("seed", range(8))
def test_random_placements_match_vllm(seed):
    """Random maps with replicas, same-rank duplicates and -1 rows, world 2 to 5, relay on or off;
    releases 0.21 ... 0.34 in turn, 0.32's and 0.34's in batched rounds."""
    rng = np.random.default_rng(100 + seed)
    world = int(rng.integers(2, 6))
    experts = int(rng.integers(world, world * PPR + 1))
    maps = [random_maps(rng, world, experts, empties=int(rng.integers(0, 3))) for _ in range(2)]
    version = VERSIONS[seed * 5 % len(VERSIONS)]
    check(
        version,
        [m[0] for m in maps],
        [m[1] for m in maps],
        batched=protocol_for(version).migration_batches and seed % 4 != 1,
        relay_mode="force" if seed % 3 == 0 else "off",
    )


@pytest.mark.parametrize("relay", ["off", "force"])
def test_each_expert_is_one_multicast(relay):
    """vLLM 0.34 splits expert 0's receivers (ranks 1, 3) over its holders (ranks 0, 2): rank 0
    sends to 1, rank 2 to 3.  Here one source (rank 0) multicasts to both; rank 2 sends nothing."""

    def body(group):
        r = group.rank
        layers = [layer_weights(0, OLD, r)]
        comm, buffer = make("0.34.0", group, layers, [torch.full_like(w, -7) for w in layers[0]], relay_mode=relay)
        try:
            rearrange("0.34.0", comm, [OLD], [NEW], layers, buffer, r)
            return comm.last_plan, comm.last_stats
        finally:
            comm.ctx.close()

    for plan, stats in LoopbackDomain(4).run(body):
        assert [rk for rk, _ in plan.replicas_of(0 * PPR + 0)] == [1, 3]  # rank 0's first sent expert: 0
        assert int(plan.num_replicas.sum()) == 3  # 0 -> ranks 1 and 3, 4 -> rank 0
        egress = stats["multicast"]["egress"]
        expert_bytes = sum(int(np.prod(s)) * torch.empty((), dtype=d).element_size() for s, d in SHAPES)
        assert egress[2] == 0
        if relay == "force":  # home -> relay -> leaf: rank 0 sends expert 0 once
            assert egress[0] <= expert_bytes + 16 * len(SHAPES) and stats["multicast"]["depth"] >= 2


def test_nothing_to_move():
    def body(group):
        layers = [layer_weights(0, OLD, group.rank)]
        comm, buffer = make("0.34.0", group, layers, [torch.full_like(w, -7) for w in layers[0]])
        try:
            rearrange("0.34.0", comm, [OLD], [OLD], layers, buffer, group.rank)
            return comm.last_plan, [torch.equal(a, b) for a, b in zip(layers[0], layer_weights(0, OLD, group.rank))]
        finally:
            comm.ctx.close()

    assert LoopbackDomain(4).run(body) == [(None, [True, True])] * 4


# ---------------------------------------------------------------- versions and arguments
def one_layer() -> list[torch.Tensor]:
    return layer_weights(0, OLD, 0)


def test_unsupported_versions_raise_before_anything_is_built():
    group = object()  # never reached: the version is checked first
    with pytest.raises(
        ConfigError,
        match=r"vLLM 0\.20\.2 is not supported \(vLLM 0\.20 calls add_send\(tensor, "
        r"dst_rank\) once per weight tensor without expert_id.*matches vLLM 0\.21 "
        r"to 0\.34: upgrade vLLM",
    ):
        UltracommEplbCommunicator(group, one_layer(), vllm_version="0.20.2")
    with pytest.raises(
        ConfigError,
        match=r"vLLM 0\.35\.0rc1 is newer than the releases the vLLM EPLB communicator "
        r"was checked against \(0\.21 to 0\.34\)",
    ):
        create_eplb_communicator(coordinator(group), "torch_nccl", [one_layer()], None, vllm_version="0.35.0rc1")
    with pytest.raises(ConfigError, match=r"vllm_version must be a version string such as '0\.34\.0', got 34"):
        UltracommEplbCommunicator(group, one_layer(), vllm_version=34)
    with pytest.raises(ConfigError, match=r"vllm_version 'latest' is not a version"):
        UltracommEplbCommunicator(group, one_layer(), vllm_version="latest")


def test_version_defaults_to_the_installed_vllm(no_installed_vllm, monkeypatch):
    assert protocol_for().version == "0.34.0"
    monkeypatch.setattr(vllm_protocol, "installed_vllm_version", lambda: "0.22.1")
    p = protocol_for()
    assert (p.version, p.execute_old_indices, p.transfer_context, p.factory_all_layers) == (
        "0.22.1",
        True,
        False,
        False,
    )
    monkeypatch.setattr(vllm_protocol, "installed_vllm_version", lambda: "0.19.1")
    with pytest.raises(ConfigError, match=r"vLLM 0\.19\.1 is not supported; the vLLM EPLB communicator matches"):
        protocol_for()


def test_protocol_table():
    """The releases where the calls changed (see vllm_protocol's docstring for the files read)."""
    rows = {v: protocol_for(v) for v in ["0.21.0", "0.22.1", "0.23.0", "0.31.0", "0.32.0", "0.33.0", "0.34.0"]}
    assert [
        (p.execute_old_indices, p.transfer_context, p.recv_rows, p.factory_all_layers, p.migration_batches)
        for p in rows.values()
    ] == [
        (True, False, False, False, False),
        (True, False, False, False, False),
        (False, True, False, True, False),
        (False, True, False, True, False),
        (False, True, False, True, True),
        (False, True, False, True, True),
        (False, True, True, True, True),
    ]


def test_calls_of_another_release_are_refused(no_installed_vllm):
    def body(group):
        w = one_layer()
        made = {v: UltracommEplbCommunicator(group, w, vllm_version=v, timeout_s=20) for v in ("0.22.0", "0.33.0")}
        default = UltracommEplbCommunicator(group, w, timeout_s=20)
        try:
            assert default.protocol.version == "0.34.0"
            with pytest.raises(
                TypeError,
                match=r"set_transfer_context\(\) is a call of vLLM 0\.23\+, but this "
                r"communicator was made for vLLM 0\.22\.0 \(vllm_version=\)",
            ):
                made["0.22.0"].set_transfer_context(np.asarray(OLD), 0)
            with pytest.raises(
                TypeError,
                match=r"set_transfer_context\(\.\.\., recv_rows\) is a call of vLLM "
                r"0\.34\+, but this communicator was made for vLLM 0\.33\.0",
            ):
                made["0.33.0"].set_transfer_context(np.asarray(OLD), 0, [{}] * 4)
            with pytest.raises(
                TypeError,
                match=r"execute\(old_indices=\) is a call of vLLM 0\.21 and 0\.22, but "
                r"this communicator was made for vLLM 0\.34\.0",
            ):
                default.execute(old_indices=np.asarray(OLD))
            # what 0.34 reads and 0.34's set_transfer_context, answered
            assert (default.needs_recv_rows, default.owned_expert_buffer) == (False, None)
            default.set_transfer_context(np.asarray(OLD), 3, None)
            assert default.layer_idx == 3
        finally:
            for c in (*made.values(), default):
                c.ctx.close()

    LoopbackDomain(2).run(body)


def test_factory_arguments_checked_per_release():
    group = types.SimpleNamespace(rank=0)
    w = one_layer()
    buf = [torch.empty_like(t) for t in w]
    with pytest.raises(
        ValueError,
        match=r"vLLM 0\.34\.0 passes expert_weights as every MoE layer's list of "
        r"tensors \(model\.expert_weights\)",
    ):
        create_eplb_communicator(coordinator(group), "torch_nccl", w, buf, vllm_version="0.34.0")
    with pytest.raises(ValueError, match=r"expert_weights\[1\] differs from expert_weights\[0\]"):
        create_eplb_communicator(coordinator(group), "torch_nccl", [w, [w[0], w[1][:, :3]]], buf, vllm_version="0.24.0")
    with pytest.raises(ValueError, match=r"expert_buffer must be one tensor per expert weight tensor"):
        create_eplb_communicator(coordinator(group), "torch_nccl", [w], buf[:1], vllm_version="0.24.0")
    with pytest.raises(ValueError, match=r"vLLM 0\.22\.0's create_eplb_communicator takes no expert_buffer"):
        create_eplb_communicator(coordinator(group), "torch_nccl", w, buf, vllm_version="0.22.0")
    with pytest.raises(
        ValueError,
        match=r"expert_weights \(vLLM 0\.21\.0: one layer's tensors\) must list one "
        r"layer's expert weight tensors",
    ):
        create_eplb_communicator(coordinator(group), "torch_nccl", [w], vllm_version="0.21.0")
    with pytest.raises(ValueError, match=r"group_coordinator must be vLLM's GroupCoordinator"):
        create_eplb_communicator(group, "torch_nccl", [w], buf, vllm_version="0.34.0")
    with pytest.raises(ValueError, match=r"backend must be vLLM's communicator backend name \(a str\), got 3"):
        create_eplb_communicator(coordinator(group), 3, [w], buf, vllm_version="0.34.0")

    def body(g):  # vLLM's backend name kept, the first layer's shapes; a buffer of its own only when
        # 0.34 passes none
        made = [
            create_eplb_communicator(
                coordinator(g), backend, [w, [t.clone() for t in w]], buffer, vllm_version=version, timeout_s=20
            )
            for backend, buffer, version in [
                ("symm_mem", None, "0.34.0"),
                ("torch_nccl", buf, "0.34.0"),
                ("nixl", None, "0.33.0"),
            ]
        ]
        try:
            return [
                (
                    c.backend,
                    c.ppr,
                    [m.shape for m in c.members],
                    c.owned_expert_buffer and [(tuple(t.shape), t.dtype) for t in c.owned_expert_buffer],
                )
                for c in made
            ]
        finally:
            for c in made:
                c.ctx.close()

    owned = [((3, 10, 6), torch.bfloat16), ((3, 7), torch.float32)]
    assert (
        LoopbackDomain(2).run(body)
        == [
            [
                ("symm_mem", PPR, [(10, 6), (7,)], owned),
                ("torch_nccl", PPR, [(10, 6), (7,)], None),
                ("nixl", PPR, [(10, 6), (7,)], None),
            ]
        ]
        * 2
    )


def test_mismatched_moves_and_bad_peers():
    def body(group):
        comm = UltracommEplbCommunicator(group, one_layer(), vllm_version="0.34.0", timeout_s=20)
        try:
            w = one_layer()
            if group.rank == 1:  # expects expert 0 from rank 0, which sends nothing
                comm.add_recv([t[0] for t in w], 0, expert_id=0)
            with pytest.raises(PlanError, match="rank 1 expects expert 0 from rank 0, which queued no add_send"):
                comm.execute()
            with pytest.raises(
                ValueError,
                match=rf"add_send: dst_rank={group.rank} must be another rank of the EP "
                rf"group \(0\.\.3, not this rank {group.rank}\)",
            ):
                comm.add_send([t[0] for t in w], group.rank, expert_id=0)
            with pytest.raises(ValueError, match=r"add_recv: src_rank=4 must be another rank"):
                comm.add_recv([t[0] for t in w], 4, expert_id=0)
            with pytest.raises(TypeError, match="expert_id"):
                comm.add_send([t[0] for t in w], (group.rank + 1) % 4)
        finally:
            comm.ctx.close()

    LoopbackDomain(4).run(body)


# ---------------------------------------------------------------- the stream of set_stream
def test_set_stream_carries_the_transfer(monkeypatch):
    """vLLM's async worker calls ``set_stream(stream)`` and then ``stream.synchronize()`` after
    each layer (``async_worker.py``, 0.21-0.34): the multicast must run with that stream
    current, and the caller's stream be current again afterwards.  Streams are stand-ins here
    (no GPU); per thread, as CUDA's current stream is."""
    current = threading.local()
    monkeypatch.setattr(vllm_eplb, "_current_stream", lambda: getattr(current, "s", "caller"))
    monkeypatch.setattr(vllm_eplb, "_set_stream", lambda s: setattr(current, "s", s))

    def body(group):
        r = group.rank
        layers = [layer_weights(0, OLD, r)]
        comm, buffer = make("0.34.0", group, layers, [torch.full_like(w, -7) for w in layers[0]])
        seen = []
        sync = comm.ctx.weight_sync
        comm.ctx.weight_sync = lambda *a, **k: (seen.append(vllm_eplb._current_stream()), sync(*a, **k))[1]
        try:
            rearrange("0.34.0", comm, [OLD], [NEW], layers, buffer, r)  # no set_stream: the caller's
            comm.set_stream(f"eplb-stream-{r}")
            layers = [layer_weights(0, OLD, r)]
            rearrange("0.34.0", comm, [OLD], [NEW], layers, buffer, r)
            return (
                seen,
                vllm_eplb._current_stream(),
                [torch.equal(a, b) for a, b in zip(layers[0], expected(0, OLD, NEW, r))],
            )
        finally:
            comm.ctx.close()

    assert LoopbackDomain(4).run(body) == [(["caller", f"eplb-stream-{r}"], "caller", [True, True]) for r in range(4)]
