"""The PR #2368 form of the Megatron MoE ECHO adapter (``EchoElasticExpertDispatcher``,
``EchoSyncFreeElasticExpertDispatcher``) against a restatement, in this file, of what upstream's
two weight dispatchers do, driven as upstream's MoE layer drives them.

Upstream, read at:

* NVIDIA/Megatron-LM PR #2368, head a2b16b8733bb4ced46880d6adee6f19124732991:
  ``megatron/core/transformer/moe/token_dispatcher.py`` (``MoEElasticExpertDispatcher``,
  ``MoESyncFreeElasticExpertDispatcher``, ``MoEElasticExpertMetadata``),
  ``megatron/core/transformer/moe/fused_a2a.py`` (``HybridEPExpertDispatch``: the sync-free
  forward and backward), ``megatron/core/transformer/moe/moe_layer.py`` (``__init__``'s choice by
  ``moe_echo_expert_dispatcher_type``; ``echo_forward``: ``gen_offloading_plan`` with
  ``approx_bin_packing`` for one spare per rank else ``one_shot_greedy``, two ``preprocess``
  calls on one map, ``expert_dispatch`` for fc1 then fc2, optionally under
  ``CheckpointWithoutOutput(only_calculate_input_grad=True)`` with the recompute hooked on the
  layer's output) and ``megatron/core/tensor_parallel/random.py`` (``CheckpointWithoutOutput``);
* Victarry/Megatron-LM ``feat/moe-echo-rebase-v2``, bb6ff24a4a1b79beb9d2da22eb29a4cde990c85c: the
  same classes (token_dispatcher.py l.1680 / l.1793) and layer (moe_layer.py l.331-336,
  l.705-706); the sync-free ``expert_dispatch`` sets ``requires_grad`` on what it returns;
  ``experts.py`` ``set_expert_weights`` (a zero-size result becomes a weight-shaped placeholder
  whose backward gives the zero-size tensor a zero gradient).

The facts restated: the alltoall form returns a list, a filled slot shaped like a home weight, an
empty slot a ``[0, numel]`` tensor, its backward returns each home weight the sum of its spares'
gradients through autograd (in the weights' dtype); the sync-free form returns a tuple of
weight-shaped tensors (an empty slot's content is the dispatch buffer's padding upstream; the
restatement uses zeros, as the adapter does), and its backward adds the sum into ``main_grad``,
sets ``grad_added_to_main_grad`` and returns no gradient.  Ranks are loopback threads; the
restatement moves weights and gradients with ``all_gather_object``.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

import moe_harness as mh
from test_integration_megatron_echo import home_params, layer_output, token_counts
from ultracomm import LoopbackDomain
from ultracomm.errors import InputError
from ultracomm.integrations.megatron_echo import close_dispatchers, gen_offloading_plan
from ultracomm.integrations.megatron_echo_elastic import (
    EchoElasticExpertDispatcher,
    EchoSyncFreeElasticExpertDispatcher,
    build_expert_dispatcher,
)

WORLD, M, S, LAYERS = 4, 2, 1, 2
E = WORLD * M


# ---------------------------------------------------------------------------- upstream, restated
class _UpstreamDispatch(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ref, omap, *weights):
        r, K = ref.group.rank, ref.num_local_spares
        shape, numel = weights[0].shape, weights[0].numel()
        rows = ref.group.all_gather_object(
            torch.stack([w.detach().reshape(-1) for w in weights]).clone(), op="ref", what="home weights"
        )
        out = []
        for j in range(r * K, (r + 1) * K):
            held = omap[:, j].nonzero().squeeze(1).tolist()
            if held:
                out.append(rows[held[0] // M][held[0] % M].reshape(shape).clone())
            else:
                out.append(weights[0].new_zeros(shape if ref.sync_free else (0, numel)))
        ctx.ref, ctx.omap, ctx.weights = ref, omap, weights
        return tuple(out)

    @staticmethod
    def backward(ctx, *grads):
        ref, omap, weights = ctx.ref, ctx.omap, ctx.weights
        r, K = ref.group.rank, ref.num_local_spares
        mine = [None if g is None or g.numel() == 0 else g.detach().clone() for g in grads]
        every = ref.group.all_gather_object(mine, op="ref", what="spare grads")
        sums = []
        for i, w in enumerate(weights):
            total = torch.zeros_like(w)
            for j in omap[r * M + i].nonzero().squeeze(1).tolist():  # spares in global order
                g = every[j // K][j % K]
                if g is not None:
                    total += g.reshape(w.shape)
            sums.append(total)
        if not ref.sync_free:
            return (None, None, *sums)
        for w, total in zip(weights, sums):
            w.main_grad.add_(total)
            w.grad_added_to_main_grad = True
        return (None, None) + (None,) * len(weights)


class Upstream:
    """Restated ``MoEElasticExpertDispatcher`` (``sync_free=False``) or
    ``MoESyncFreeElasticExpertDispatcher`` (bb6ff24a: results with ``requires_grad`` set)."""

    def __init__(self, config, pg_collection, sync_free: bool):
        self.group, self.sync_free = pg_collection.ep, sync_free
        self.num_local_spares = config.moe_num_echo_experts // self.group.world

    def preprocess(self, routing_map):
        return SimpleNamespace(global_routing_map=routing_map, handle=None)

    def expert_dispatch(self, metadata, *weights):
        out = _UpstreamDispatch.apply(self, metadata.global_routing_map.cpu(), *weights)
        if not self.sync_free:
            return list(out)
        for t in out:
            t.requires_grad_(True)
        return tuple(out)


class _Placeholder(torch.autograd.Function):
    """``set_expert_weights``' stand-in for an empty slot (zeros here: no token reaches it)."""

    @staticmethod
    def forward(ctx, x, shape):
        ctx.like = x
        return torch.zeros(shape, dtype=x.dtype)

    @staticmethod
    def backward(ctx, g):
        return torch.zeros_like(ctx.like), None


class _Ckpt(torch.autograd.Function):
    @staticmethod
    def forward(ctx, fn, holder, *weights):
        with torch.no_grad():
            out = fn(*weights)
        ctx.weights, holder.ctx = weights, ctx
        return out

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(o, g) for o, g in zip(ctx.outputs, grads) if g is not None]
        need = [w for w in ctx.weights if w.requires_grad]
        got = torch.autograd.grad([o for o, _ in pairs], need, [g for _, g in pairs], allow_unused=True)
        by_id = {id(w): g for w, g in zip(need, got)}
        return (None, None) + tuple(by_id.get(id(w)) for w in ctx.weights)


class Recompute:
    """``CheckpointWithoutOutput(only_calculate_input_grad=True)`` as the layer uses it, restated:
    the dispatch runs without gradients, its results' storage is released after the layer's
    forward and refilled by running the dispatch again (gradients on) when the layer output's
    gradient arrives; the backward takes the weights' gradients from that second run."""

    def checkpoint(self, fn, *weights):
        self.fn, self.outputs = fn, list(_Ckpt.apply(fn, self, *weights))
        return self.outputs

    def discard_output_and_register_recompute(self, hook_tensor):
        for o in self.outputs:
            o.untyped_storage().resize_(0)
        hook_tensor.register_hook(self._recompute)

    def _recompute(self, _):
        with torch.enable_grad():
            again = list(self.fn(*self.ctx.weights))
        with torch.no_grad():
            for o, n in zip(self.outputs, again):
                o.untyped_storage().resize_(n.untyped_storage().size())
                o.untyped_storage().copy_(n.untyped_storage())
        self.ctx.outputs = again


# ---------------------------------------------------------------------------- the layer
def run(impl: str, form: str, mode: str, layers: int = LAYERS, schedule: str = "F0 B0", recompute: bool = False):
    """Train ``layers`` MoE layers as upstream's ``echo_forward`` does, with ``impl`` =
    ``"ultracomm"`` (the adapter; each dispatch's result also compared, bit for bit, with the
    restatement's) or ``"upstream"`` (the restatement).  ``form``: ``"alltoall"`` or
    ``"hybridep"``; ``mode`` as the first adapter's tests.  Returns per rank
    ``[layer][member] -> [M, *shape]`` master grads."""
    ddp, fused = mode != "grad", mode == "fused"
    domain = LoopbackDomain(WORLD)
    steps = schedule.split()
    in_flight = max(sum(1 if s[0] == "F" else -1 for s in steps[: i + 1]) for i in range(len(steps)))

    def body(group):
        r = group.rank
        config = SimpleNamespace(
            moe_enable_echo=True,
            num_moe_experts=E,
            moe_num_echo_experts=WORLD * S,
            moe_echo_expert_dispatcher_type=form,
            pipeline_model_parallel_size=in_flight,
            virtual_pipeline_model_parallel_size=None,
        )
        pgs = SimpleNamespace(ep=group)
        params, dispatchers, refs = [], [], []
        for layer in range(layers):
            params.append(home_params(r, ddp))
            refs.append(Upstream(config, pgs, sync_free=form == "hybridep"))
            dispatchers.append(build_expert_dispatcher(config, pgs, timeout_s=20) if impl == "ultracomm" else refs[-1])
        losses = {}
        for step in steps:
            mb = int(step[1:])
            if step[0] == "B":
                losses.pop(mb).backward()
                continue
            total = torch.zeros(())
            for layer in range(layers):
                x, rmap, probs, up = mh.batch(r, layer, mb, E)
                counts = token_counts(group, rmap)
                algorithm = "approx_bin_packing" if S == 1 else "one_shot_greedy"
                rerouting_map, rerouted_probs, omap = gen_offloading_plan(
                    rmap, probs, counts, r, num_ep_ranks=WORLD, num_spare_experts_per_ep_rank=S,
                    assignment_algorithm=algorithm, upstream="pr2368",
                )  # fmt: skip
                d = dispatchers[layer]
                metas = [d.preprocess(omap), d.preprocess(omap)]  # fc1's and fc2's
                spares, ckpts = [], []
                for m in range(2):
                    home = params[layer][m]
                    if recompute:
                        ckpts.append(Recompute())
                        out = ckpts[-1].checkpoint(lambda *w, d=d, meta=metas[m]: d.expert_dispatch(meta, *w), *home)
                    else:
                        out = d.expert_dispatch(metas[m], *home)
                    if impl == "ultracomm":
                        with torch.no_grad():
                            want = refs[layer].expert_dispatch(refs[layer].preprocess(omap), *home)
                        assert type(out) is (tuple if form == "hybridep" else list) or recompute
                        for got, w in zip(out, want):
                            assert got.dtype == w.dtype and got.shape == w.shape and torch.equal(got, w)
                            assert got.requires_grad or form == "alltoall"
                    shape = home[0].shape
                    spares.append([t if t.numel() else _Placeholder.apply(t, shape) for t in out])
                domain.shared[(mb, layer, r)] = (x, rerouting_map, rerouted_probs.detach(), up)
                group.barrier()
                out_layer = layer_output(domain.shared, mb, layer, r, params[layer], spares, fused)
                group.barrier()
                for c in ckpts:
                    c.discard_output_and_register_recompute(out_layer)
                total = total + out_layer
            losses[mb] = total
        grads = [
            [torch.stack([p.main_grad if ddp else p.grad for p in params[layer][m]]) for m in range(2)]
            for layer in range(layers)
        ]
        close_dispatchers(group)
        return grads

    return domain.run(body, timeout=240)


def assert_same_grads(got, want, tol: float = 1e-6) -> None:
    """Every master grad of every rank, layer and projection: the adapter's equals the
    restatement's up to the order of a few fp32 additions."""
    for r, (g_rank, w_rank) in enumerate(zip(got, want)):
        for layer, (g_layer, w_layer) in enumerate(zip(g_rank, w_rank)):
            for m, (g, w) in enumerate(zip(g_layer, w_layer)):
                assert g.shape == w.shape and g.dtype == w.dtype
                assert (g - w).abs().max() <= tol * w.abs().max(), f"rank {r} layer {layer} member {m}"


# upstream's supported combinations: alltoall through autograd (upstream turns the wgrad fusion
# off for it), the sync-free form into main_grad with the fused wgrad
@pytest.mark.parametrize("form, mode", [("alltoall", "plain"), ("alltoall", "grad"), ("hybridep", "fused")])
def test_grads_match_upstream_restated(form, mode):
    got = run("ultracomm", form, mode)
    assert_same_grads(got, run("upstream", form, mode))
    mh.check_grads(got, WORLD, M, LAYERS)


@pytest.mark.parametrize("form, mode", [("alltoall", "fused"), ("hybridep", "plain")])
def test_grads_match_no_replication_where_upstream_loses_some(form, mode):
    """The adapter also where the restatement drops gradients: the alltoall form's autograd sum
    after a fused wgrad set ``grad_added_to_main_grad`` (DDP's hook then skips ``.grad``), the
    sync-free form's flag before DDP's hook adds the home expert's own unfused ``.grad``."""
    mh.check_grads(run("ultracomm", form, mode), WORLD, M, LAYERS)


def test_recomputed_dispatch_pipeline_order():
    """``moe_echo_recompute_expert_dispatch``: each dispatch runs again in the backward with its
    forward's metadata (fc1's and fc2's separate objects), two micro-batches in flight."""
    got = run("ultracomm", "hybridep", "fused", schedule="F0 F1 B1 B0", recompute=True)
    assert_same_grads(got, run("upstream", "hybridep", "fused", schedule="F0 F1 B1 B0", recompute=True))
    mh.check_grads(got, WORLD, M, LAYERS, mbs=2)


# ---------------------------------------------------------------------------- the calls themselves
def offloading_map() -> torch.Tensor:
    """2 ranks, 2 home experts and 2 spares each: spare 0 (rank 0) holds expert 0 (its own
    rank's), spare 1 (rank 0) expert 3, spare 2 (rank 1) expert 0, spare 3 empty."""
    m = torch.zeros(4, 4, dtype=torch.bool)
    m[0, 0] = m[3, 1] = m[0, 2] = True
    return m


def elastic_config(**kw):
    return SimpleNamespace(moe_enable_echo=True, num_moe_experts=4, moe_num_echo_experts=4, **kw)


@pytest.mark.parametrize("cls", [EchoElasticExpertDispatcher, EchoSyncFreeElasticExpertDispatcher])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_outputs_and_gradients_of_both_forms(cls, dtype):
    """fc1 and fc2 of one shape (3 x 3), each with its own metadata from one map: the results
    (type, shape, dtype, requires_grad, values) and each home weight's gradient (the sum of its
    spares', for fc1 and fc2 apart)."""
    sync_free = cls is EchoSyncFreeElasticExpertDispatcher

    def body(group):
        r = group.rank
        d = cls(elastic_config(), SimpleNamespace(ep=group), timeout_s=20)
        try:
            fcs = [
                [torch.nn.Parameter(torch.full((3, 3), float(10 * (2 * r + j) + 1 + 100 * m), dtype=dtype)) for j in range(2)]
                for m in range(2)
            ]  # fmt: skip
            metas = [d.preprocess(offloading_map()), d.preprocess(offloading_map())]
            assert metas[0] is not metas[1] and metas[0].handle is None
            assert torch.equal(metas[0].routing_map, offloading_map()[2 * r : 2 * r + 2])
            assert metas[0].global_routing_map is metas[0].expert_offloading_map
            outs = [d.expert_dispatch(metas[m], *fcs[m]) for m in range(2)]
            form = [(type(o).__name__, [(tuple(t.shape), t.dtype, t.requires_grad) for t in o]) for o in outs]
            values = [[float(t.detach()[0, 0]) if t.numel() else None for t in o] for o in outs]
            loss = sum(((r + 1) * (k + 1) * (m + 1) * t).sum() for m, o in enumerate(outs) for k, t in enumerate(o))
            loss.backward()
            return form, values, [[float(w.grad[0, 0]) for w in fc] for fc in fcs]
        finally:
            close_dispatchers(group)

    (form0, values0, grads0), (form1, values1, grads1) = LoopbackDomain(2).run(body, timeout=120)
    kind = "tuple" if sync_free else "list"
    assert form0 == [(kind, [((3, 3), dtype, True), ((3, 3), dtype, True)])] * 2
    empty = ((3, 3), dtype, True) if sync_free else ((0, 9), dtype, True)
    assert form1 == [(kind, [((3, 3), dtype, True), empty])] * 2
    assert values0 == [[1.0, 31.0], [101.0, 131.0]]  # expert 0 (same rank), expert 3 (rank 1)
    assert values1 == [[1.0, 0.0 if sync_free else None], [101.0, 0.0 if sync_free else None]]
    # expert 0: rank 0's spare 0 (1 * 1) + rank 1's spare 0 (2 * 1); expert 3: rank 0's spare 1 (1 * 2); fc2 twice
    assert grads0 == [[3.0, 0.0], [6.0, 0.0]] and grads1 == [[0.0, 2.0], [0.0, 4.0]]


def test_no_grad_results():
    """Under ``no_grad`` (upstream's recompute forward): the sync-free results still require
    grad (rebase-v2), the alltoall form's do not; an empty alltoall slot is ``[0, numel]``."""

    def body(group):
        pgs = SimpleNamespace(ep=group)
        got = []
        try:
            ds = [
                cls(elastic_config(), pgs, timeout_s=20)
                for cls in (EchoElasticExpertDispatcher, EchoSyncFreeElasticExpertDispatcher)
            ]
            for d in ds:
                with torch.no_grad():
                    out = d.expert_dispatch(d.preprocess(offloading_map()), *[torch.ones(2, 3)] * 2)
                got.append([(tuple(t.shape), t.requires_grad, t.is_leaf) for t in out])
            return got
        finally:
            close_dispatchers(group)

    _, got1 = LoopbackDomain(2).run(body, timeout=120)
    assert got1 == [[((2, 3), False, True), ((0, 6), False, True)], [((2, 3), True, True), ((2, 3), True, True)]]


def test_weights_made_anew_each_step_reuse_their_context():
    """Home weights that are new tensors each step (a per-step cast, a re-materialised parameter):
    the Contexts were keyed by data_ptr alone, so each step's new addresses built one more Context
    (holding the old weights).  A Context whose weights are gone is reused: two per key (fc1 and
    fc2 of one shape) however many steps; a Parameter whose storage is swapped (``param.data =
    ...``) keeps its Context; a forward that holds both sets (a recompute) still gets two."""

    def body(group):
        d = EchoElasticExpertDispatcher(elastic_config(), SimpleNamespace(ep=group), timeout_s=20)
        kept = [torch.nn.Parameter(torch.ones(3, 3)) for _ in range(2)]

        def train_step(step):  # its locals (weights, outputs, graph) are gone when it returns
            fcs = [[torch.nn.Parameter(torch.full((3, 3), float(step + m))) for _ in range(2)] for m in range(2)]
            metas = [d.preprocess(offloading_map()), d.preprocess(offloading_map())]
            outs = [d.expert_dispatch(metas[m], *fcs[m]) for m in range(2)]
            sum(t.sum() for o in outs for t in o).backward()
            return [float(w.grad[0, 0]) for w in fcs[0] + fcs[1]]

        try:
            grads = [train_step(step) for step in range(5)]
            kept[0].data = torch.ones(3, 3)  # new storage, same parameter
            with torch.no_grad():
                for _ in range(3):
                    d.expert_dispatch(d.preprocess(offloading_map()), *[torch.ones(2, 3)] * 2)
                    d.expert_dispatch(d.preprocess(offloading_map()), *kept)
            return grads, {k[0]: len(v) for k, v in d._roles.items()}, len(d._pool.members)
        finally:
            close_dispatchers(group)

    for r, (grads, roles, members) in enumerate(LoopbackDomain(2).run(body, timeout=120)):
        assert roles == {(3, 3): 2, (2, 3): 1} and members == 3, (roles, members)
        # expert 0's spares: rank 0's and rank 1's slot 0; expert 3's: rank 0's slot 1 (offloading_map)
        assert grads == [[2.0, 0.0, 2.0, 0.0] if r == 0 else [0.0, 1.0, 0.0, 1.0]] * 5, grads


def test_construction_from_config_and_pg_collection():
    def body(group):
        pgs = SimpleNamespace(ep=group)
        try:
            assert type(build_expert_dispatcher(elastic_config(), pgs)) is EchoSyncFreeElasticExpertDispatcher
            a2a = build_expert_dispatcher(elastic_config(moe_echo_expert_dispatcher_type="alltoall"), pgs)
            assert type(a2a) is EchoElasticExpertDispatcher and a2a.ep_group is group
            assert (a2a.num_home_experts, a2a.num_spare_experts, a2a.num_local_echo_experts) == (4, 4, 2)
            errors = []
            for make in (
                lambda: EchoElasticExpertDispatcher(SimpleNamespace(num_moe_experts=4, moe_num_echo_experts=4), pgs),
                lambda: EchoElasticExpertDispatcher(elastic_config(), None),
                lambda: EchoSyncFreeElasticExpertDispatcher(
                    SimpleNamespace(moe_enable_echo=True, num_moe_experts=4, moe_num_echo_experts=3), pgs
                ),
                lambda: build_expert_dispatcher(elastic_config(moe_echo_expert_dispatcher_type="nccl"), pgs),
                lambda: a2a.expert_dispatch(object(), torch.zeros(2)),
            ):
                with pytest.raises(InputError) as e:
                    make()
                errors.append(str(e.value))
            return errors
        finally:
            close_dispatchers(group)

    errors = LoopbackDomain(2).run(body, timeout=120)[0]
    assert errors == [
        "ultracomm: EchoElasticExpertDispatcher: requires config.moe_enable_echo (upstream: --moe-enable-echo)",
        "ultracomm: EchoElasticExpertDispatcher: pg_collection must carry the EP group as .ep, got NoneType",
        "ultracomm: EchoSyncFreeElasticExpertDispatcher: config.moe_num_echo_experts must be a positive multiple "
        "of the EP size 2, got 3",
        "ultracomm: build_expert_dispatcher: config.moe_echo_expert_dispatcher_type must be one of "
        "('hybridep', 'alltoall'), got 'nccl'",
        "ultracomm: EchoElasticExpertDispatcher: metadata must come from preprocess(), got object",
    ]
