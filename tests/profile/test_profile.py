"""ultracomm.profile: record -> load round trips, step and micro-batch assignment, bounded
buffers, the Context hook (loopback ranks), imports of plain routing statistics."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch

from ultracomm import Context, ExpertLayout, LoopbackDomain, Member, build_schedule
from ultracomm.planners import Domain, get_planner
from ultracomm.profile import Profiler, from_routing_stats, import_routing_stats, load_trace, spread_expert_load
from ultracomm.scenarios import zipf_load

W, EPR, S = 4, 3, 2
E = W * EPR
WB, GB = 4096, 8192


def planned(seed: int, world: int = W, epr: int = EPR, slots: int = S):
    load = zipf_load(world, world * epr, 64, 2, 2.0, seed, epr)
    res = get_planner("quota")(load, Domain.flat(world, epr), slots)
    return load, res, build_schedule(res.plan, WB, GB, chunk_bytes=1024)


def test_round_trip_full_records(tmp_path):
    want = []
    with Profiler(tmp_path / "t", meta={"model": "qwen3-30b-a3b"}) as prof:
        for step in range(3):
            for layer in range(2):
                load, res, sched = planned(10 * step + layer)
                times = {"weight_sync": 1e-3 * (step + 1) + layer * 1e-6, "grad_reduce": 0.5 + step}
                key = prof.record(layer, load=load, plan=res, schedule=sched, times=times)
                assert key == (step, layer, 0)
                want.append((load, res, sched, times))
    tr = load_trace(tmp_path / "t")
    assert (tr.world, tr.num_experts, tr.experts_per_rank, tr.slots_per_rank, tr.detail) == (W, E, EPR, S, "full")
    assert tr.meta == {"model": "qwen3-30b-a3b"}
    assert len(tr) == 6 and tr["step"].tolist() == [0, 0, 1, 1, 2, 2] and tr["layer"].tolist() == [0, 1] * 3
    assert tr["microbatch"].tolist() == [0] * 6
    for i, (load, res, sched, times) in enumerate(want):
        assert tr["load"][i].dtype == np.int64 and np.array_equal(tr["load"][i], load)
        assert np.array_equal(tr.load_matrix(i), load)
        assert np.array_equal(tr["expert_load"][i], load.sum(0))
        assert np.array_equal(tr["slot_src"][i], res.slot_src)
        assert np.array_equal(tr["home_of"][i], np.arange(E) // EPR)
        assert np.array_equal(tr["rank_load_after"][i], res.rank_load.astype(np.float64))
        assert tr.plan(i) == res.plan
        for op in ("multicast", "reduce"):
            st = sched.stats(op)
            pr, ps, d = sched.tree(op)
            assert tr[f"{op}_egress"][i].tolist() == list(st["egress"])
            assert tr[f"{op}_ingress"][i].tolist() == list(st["ingress"])
            for k in ("depth", "max_egress", "max_ingress", "lower_bound_bytes"):
                assert tr[f"{op}_{k}"][i] == st[k]
            for k in ("lower_bound_s", "predicted_s", "tree_lower_bound_s"):
                assert tr[f"{op}_{k}"][i] == st[k]
            assert np.array_equal(tr[f"{op}_parent_rank"][i], pr)
            assert np.array_equal(tr[f"{op}_parent_slot"][i], ps)
            assert np.array_equal(tr[f"{op}_tree_depth"][i], d)
        assert tr["time_weight_sync"][i] == times["weight_sync"]
        assert tr["time_grad_reduce"][i] == times["grad_reduce"]
        assert np.isnan(tr["time_restore"][i])
        before = load.sum(0).reshape(W, EPR).sum(1)
        assert np.array_equal(tr.rank_load_before[i], before)
        assert tr.imbalance_before[i] == before.max() / before.mean()
        assert tr.imbalance_after[i] == res.rank_load.max() / res.rank_load.mean()
    assert tr["has_load"].all() and tr["has_plan"].all() and tr["has_stats"].all()
    # loads=False reads the matrices on demand, file by file
    lazy = load_trace(tmp_path / "t", loads=False)
    assert "load" not in lazy.arrays
    assert all(np.array_equal(m, w[0]) for m, w in zip(lazy.loads(range(6)), want))


def test_partial_records_and_detail_experts(tmp_path):
    load, res, sched = planned(1)
    with Profiler(tmp_path / "t", detail="experts", steps="manual") as prof:
        prof.record(0, load=load)  # load only
        prof.record(1, plan=res.plan)  # a bare ReplicaPlan: even split after
        prof.record(2, load=load.sum(0), plan=res.plan)  # per-expert totals + plan
    tr = load_trace(tmp_path / "t")
    assert "load" not in tr.arrays and not tr["has_full_load"].any()
    assert tr["has_load"].tolist() == [True, False, True]
    assert tr["has_plan"].tolist() == [False, True, True]
    assert not tr["has_stats"].any()
    assert np.array_equal(tr["expert_load"][0], load.sum(0)) and not tr["expert_load"][1].any()
    assert np.isnan(tr["rank_load_after"][0]).all() and np.isnan(tr["rank_load_after"][1]).all()
    # even split of each expert over its home and replicas (workloads.max_mean_after's model)
    reps = np.bincount(res.slot_src[res.slot_src >= 0], minlength=E)
    share = load.sum(0) / (1.0 + reps)
    want = np.bincount(np.arange(E) // EPR, weights=share, minlength=W)
    for r in range(W):
        want[r] += sum(share[e] for e in res.slot_src[r] if e >= 0)
    assert np.allclose(tr["rank_load_after"][2], want, rtol=0, atol=1e-9)
    assert np.isnan(tr.imbalance_before[1]) and np.isnan(tr.imbalance_after[0])
    # per-expert totals become [world, E] loads spread evenly
    m = tr.load_matrix(0)
    assert np.array_equal(m.sum(0), load.sum(0)) and (m.max(0) - m.min(0)).max() <= 1


def test_large_counts_stay_int64(tmp_path):
    load = np.zeros((W, E), np.int64)
    load[1, 5] = 2**40 + 3
    with Profiler(tmp_path / "t") as prof:
        prof.record(0, load=load)
        prof.record(0, load=np.ones((W, E), np.int32))
    tr = load_trace(tmp_path / "t")
    assert tr["load"][0, 1, 5] == 2**40 + 3 and np.array_equal(tr["load"][1], np.ones((W, E)))


def test_steps_and_microbatches(tmp_path):
    load = np.ones((W, E), np.int64)
    with Profiler(tmp_path / "a") as prof:  # auto: a layer coming back while nothing is in flight
        keys = [prof.record(layer, load=load) for layer in (0, 1, 2, 0, 1, 0)]
    assert keys == [(0, 0, 0), (0, 1, 0), (0, 2, 0), (1, 0, 0), (1, 1, 0), (2, 0, 0)]
    with Profiler(tmp_path / "m", steps="manual") as prof:
        keys = [prof.record(0, load=load), prof.record(0, load=load), prof.record(1, load=load)]
        prof.step()
        keys += [prof.record(0, load=load), prof.record(0, load=load, microbatch=5), prof.record(0, load=load)]
    assert keys == [(0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0), (1, 0, 5), (1, 0, 6)]
    assert prof.current_step == 1
    with Profiler(tmp_path / "x") as prof:  # an explicit micro-batch seen again starts a step
        assert prof.record(3, load=load, microbatch=1) == (0, 3, 1)
        assert prof.record(3, load=load, microbatch=0) == (0, 3, 0)
        assert prof.record(3, load=load, microbatch=1) == (1, 3, 1)
    tr = load_trace(tmp_path / "x")
    assert tr["step"].tolist() == [0, 0, 1] and tr["microbatch"].tolist() == [0, 1, 1]


def test_buffer_bound_writes_parts(tmp_path):
    loads = [np.full((W, E), i, np.int64) for i in range(10)]
    with Profiler(tmp_path / "t", steps="manual", max_buffer_bytes=2000) as prof:
        for i, ld in enumerate(loads):
            prof.record(i, load=ld)
            assert prof._bytes <= 2000 + 2 * (ld.nbytes + 300)
    idx = json.loads((tmp_path / "t" / "index.json").read_text())
    assert len(idx["files"]) > 1 and all(f["steps"] == [0, 0] for f in idx["files"])
    assert sum(f["records"] for f in idx["files"]) == 10
    tr = load_trace(tmp_path / "t")
    assert tr["layer"].tolist() == list(range(10))
    assert all(np.array_equal(tr["load"][i], loads[i]) for i in range(10))


def test_bad_inputs(tmp_path):
    with pytest.raises(ValueError, match="detail must be one of"):
        Profiler(tmp_path / "a", detail="all")
    with pytest.raises(ValueError, match="steps must be 'auto' or 'manual'"):
        Profiler(tmp_path / "a", steps="never")
    (tmp_path / "f").write_text("x")
    with pytest.raises(ValueError, match="is a file; give a directory"):
        Profiler(tmp_path / "f")
    with Profiler(tmp_path / "t") as prof:
        prof.record(0, load=np.ones((W, E), np.int64))
        with pytest.raises(ValueError, match="world is 5 here but 4 earlier"):
            prof.record(1, load=np.ones((5, E), np.int64))
        with pytest.raises(ValueError, match="integer token counts"):
            prof.record(1, load=np.ones((W, E)))
        with pytest.raises(ValueError, match="negative"):
            prof.record(1, load=-np.ones((W, E), np.int64))
        with pytest.raises(ValueError, match=r"unknown op names \['sync'\]"):
            prof.record(1, times={"sync": 1.0})
        with pytest.raises(TypeError, match="ReplicaPlan or a PlannerResult"):
            prof.record(1, plan=np.zeros((W, S)))
    with pytest.raises(ValueError, match="already holds a trace"):
        Profiler(tmp_path / "t")
    with Profiler(tmp_path / "t", overwrite=True) as prof:
        prof.record(0, load=np.full((2, 2), 7, np.int64))
    tr = load_trace(tmp_path / "t")
    assert len(tr) == 1 and tr.world == 2 and tr["load"][0].tolist() == [[7, 7], [7, 7]]
    with pytest.raises(RuntimeError, match="closed"):
        prof.record(0, load=np.ones((2, 2), np.int64))
    with pytest.raises(ValueError, match="holds no trace"):
        load_trace(tmp_path)


def test_writer_error_is_raised(tmp_path):
    prof = Profiler(tmp_path / "t")
    prof.record(0, load=np.ones((W, E), np.int64))
    shutil.rmtree(tmp_path / "t")
    with pytest.raises(RuntimeError, match="writing the trace to .* failed"):
        prof.close()


class FakeEvent:
    """Stands for a CUDA event: elapsed_time in milliseconds, synchronize() before reading."""

    def __init__(self, ms: float):
        self.ms, self.synced = ms, False

    def synchronize(self) -> None:
        self.synced = True

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert end.synced
        return end.ms - self.ms


def test_op_hook_events_and_waiting_for_running_ops(tmp_path):
    load, res, sched = planned(3)
    prof = Profiler(tmp_path / "t", op_wait_s=30)
    prof.record(0, load=load, plan=res)
    rec = prof.op_begin("weight_sync", "vid-a", 0, res.plan, sched)  # merges into the record above
    go = threading.Event()
    done = threading.Thread(
        target=lambda: (go.wait(), prof.op_end(rec, "weight_sync", (FakeEvent(1.0), FakeEvent(3.5))))
    )
    done.start()
    prof.step()  # returns at once; the writer waits for the running op
    go.set()
    done.join()
    rec2 = prof.op_begin("weight_sync", "vid-b", 0, None, None)
    prof.op_end(rec2, "weight_sync", None)  # a failed op: no time
    prof.close()
    tr = load_trace(tmp_path / "t")
    assert len(tr) == 2
    assert tr["has_load"].tolist() == [True, False] and tr["has_stats"].tolist() == [True, False]
    assert tr["time_weight_sync"][0] == pytest.approx(2.5e-3, abs=0) and np.isnan(tr["time_weight_sync"][1])
    assert tr["step"].tolist() == [0, 1] and tr.late_ops == 0


def test_spread_expert_load():
    el = np.array([0, 1, 5, 8, 13, 4], np.int64)
    m = spread_expert_load(el, 4)
    assert m.shape == (4, 6) and np.array_equal(m.sum(0), el) and ((m.max(0) - m.min(0)) <= 1).all()
    assert m[:, 1].tolist() == [0, 1, 0, 0] and m[:, 2].tolist() == [1, 1, 2, 1]
    with pytest.raises(ValueError, match="world must be an int"):
        spread_expert_load(el, 0)


def test_routing_stats_import(tmp_path):
    rng = np.random.default_rng(0)
    counts = rng.integers(0, 1000, size=(5, 3, E))
    tr = from_routing_stats(counts, W)
    assert (len(tr), tr.world, tr.experts_per_rank, tr.detail) == (15, W, EPR, "experts")
    assert np.array_equal(tr["expert_load"].reshape(5, 3, E), counts)
    assert tr["step"].tolist() == np.repeat(np.arange(5), 3).tolist() and tr["layer"].tolist() == [0, 1, 2] * 5
    assert np.array_equal(tr.rank_load_before, counts.reshape(15, W, EPR).sum(2))
    on_disk = import_routing_stats(counts, tmp_path / "t", W)
    for k in ("step", "layer", "microbatch", "expert_load", "has_load", "has_plan"):
        assert np.array_equal(on_disk[k], tr[k]), k
    np.save(tmp_path / "c.npy", counts)
    assert np.array_equal(load_trace(tmp_path / "c.npy", world=W)["expert_load"], tr["expert_load"])
    with pytest.raises(ValueError, match="say how many EP ranks"):
        load_trace(tmp_path / "c.npy")
    with pytest.raises(ValueError, match="do not divide over world = 5"):
        from_routing_stats(counts, 5)
    with pytest.raises(ValueError, match=r"counts must be \[steps, layers, E\]"):
        from_routing_stats(counts[0], W)
    mb = from_routing_stats(rng.integers(0, 9, size=(2, 2, 3, E)), W)
    assert mb["microbatch"].tolist() == [0, 1, 2] * 4


def test_cli_import_and_show(tmp_path):
    counts = np.arange(2 * 2 * E).reshape(2, 2, E)
    np.save(tmp_path / "c.npy", counts)
    run = [sys.executable, "-m", "ultracomm.profile"]
    out = subprocess.run(
        run + ["import", str(tmp_path / "c.npy"), "-o", str(tmp_path / "t"), "--world", str(W)],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "4 records, 2 steps, 2 layers" in out
    out = subprocess.run(run + ["show", str(tmp_path / "t")], capture_output=True, text=True, check=True).stdout
    assert f"world {W}, {E} experts ({EPR}/rank)" in out and "with load 4, plan 0, stats 0" in out
    bad = subprocess.run(run + ["show", str(tmp_path / "nothing")], capture_output=True, text=True)
    assert bad.returncode == 2 and "nothing does not exist" in bad.stderr


# ----------------------------------------------------------------------------- Context hook

LAYOUT = ExpertLayout((Member("fc1", (8, 4), torch.float32), Member("fc2", (16,), torch.float32)))


def _masters(rank: int, epr: int):
    w = [torch.full((epr, *m.shape), float(rank), dtype=m.dtype) for m in LAYOUT.members]
    g = [torch.zeros((epr, *m.shape), dtype=torch.float32) for m in LAYOUT.members]
    return w, g


def test_context_records_plans_stats_and_op_times(tmp_path):
    world, epr, slots = 2, 2, 1
    load = np.array([[50, 1, 1, 1], [60, 2, 1, 1]], np.int64)
    res = get_planner("quota")(load, Domain.flat(world, epr), slots)

    def body(group):
        prof = Profiler(tmp_path / f"user{group.rank}")
        with Context(
            group,
            LAYOUT,
            epr,
            slots,
            num_layers=2,
            max_microbatches=4,
            num_workers=1,
            chunk_bytes=64,
            tile_bytes=16,
            profile=prof,
        ) as ctx:
            for layer in range(2):
                ctx.register_masters(layer, *_masters(ctx.rank, epr))
            for step in range(2):
                vids = []
                for mb in range(2):  # two micro-batches of layer 0 in flight (pipelining)
                    prof.record(0, load=load, plan=res)
                    vid = ctx.begin(0)
                    ctx.weight_sync(vid, res.plan)
                    vids.append(vid)
                v1 = ctx.begin(1)
                ctx.weight_sync(v1, res.plan)
                ctx.end(v1)
                for vid in vids:
                    ctx.restore(vid)
                    work = ctx.grad_reduce(vid, async_op=True)
                prof.step()  # before the last grad_reduce finished: the writer waits for it
                work.wait()
            sched = ctx.schedule_for(res.plan)
        prof.close()
        return sched.stats()

    stats = LoopbackDomain(world).run(body)
    for r in range(world):
        tr = load_trace(tmp_path / f"user{r}")
        assert tr["step"].tolist() == [0, 0, 0, 1, 1, 1]
        assert tr["layer"].tolist() == [0, 0, 1] * 2 and tr["microbatch"].tolist() == [0, 1, 0] * 2
        assert tr["has_load"].tolist() == [True, True, False] * 2  # record() and the ops met in one record
        assert tr["has_stats"].all() and tr["has_plan"].all()
        assert all(np.array_equal(s, res.slot_src) for s in tr["slot_src"])
        assert tr["multicast_egress"][0].tolist() == list(stats[r]["multicast"]["egress"])
        assert tr["reduce_lower_bound_bytes"][0] == stats[r]["reduce"]["lower_bound_bytes"]
        l0, l1 = tr["layer"] == 0, tr["layer"] == 1
        for op in ("weight_sync", "restore", "grad_reduce"):
            assert (tr[f"time_{op}"][l0] > 0).all(), op
        assert (tr["time_weight_sync"][l1] > 0).all()
        assert np.isnan(tr["time_restore"][l1]).all() and np.isnan(tr["time_grad_reduce"][l1]).all()
        assert tr.late_ops == 0


def test_context_profile_from_env_per_rank(tmp_path, monkeypatch):
    monkeypatch.setenv("ULTRACOMM_PROFILE", str(tmp_path / "env"))
    plan_src = np.array([[2], [-1]], np.int32)

    def body(group):
        from ultracomm import ReplicaPlan

        with Context(group, LAYOUT, 2, 1, num_layers=1, num_workers=1) as ctx:
            ctx.register_masters(0, *_masters(ctx.rank, 2))
            for _ in range(3):
                vid = ctx.begin(0)
                ctx.weight_sync(vid, ReplicaPlan.make(plan_src, experts_per_rank=2))
                ctx.end(vid)  # inference: each forward comes back to layer 0 -> a new step
        return True

    LoopbackDomain(2).run(body)
    for r in range(2):
        tr = load_trace(tmp_path / "env", rank=r)
        assert tr.path.endswith(f"rank{r}") and tr["step"].tolist() == [0, 1, 2]
        assert (tr["time_weight_sync"] > 0).all() and tr["slot_src"][:, :, 0].tolist() == [[2, -1]] * 3
    assert load_trace(tmp_path / "env").path.endswith("rank0")
    with pytest.raises(ValueError, match="not rank 7"):
        load_trace(tmp_path / "env", rank=7)


def test_context_profile_off_and_bad(tmp_path, monkeypatch):
    """profile=False or "" (e.g. an unset variable's default) is off, as ULTRACOMM_PROFILE="" is: ""
    recorded into the current directory (an index.json there, a run<n> per rerun)."""
    monkeypatch.chdir(tmp_path)

    def body(group):
        for off in (False, "", " "):
            with Context(group, LAYOUT, 2, 1, num_layers=1, num_workers=1, profile=off) as ctx:
                assert ctx.profiler is None
        with pytest.raises(TypeError, match="profile must be a directory, a Profiler"):
            Context(group, LAYOUT, 2, 1, num_layers=1, num_workers=1, profile=3)
        return True

    LoopbackDomain(1).run(body)
    assert list(tmp_path.iterdir()) == []
