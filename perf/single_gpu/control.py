"""The control section: the device control plane of one layer and micro-batch (k_load_exchange, k_quota,
k_build_slot, k_reroute and the whole step) at the CONTROL_SHAPES, eager and graph-replayed, beside the
host path; and its graph rows."""

from __future__ import annotations

import statistics
import time
import traceback
from typing import Optional

import numpy as np

from .constants import (
    CONTROL_KERNELS,
    CONTROL_PER_GRAPH,
    CONTROL_REPLAYS,
    CONTROL_SHAPES,
    CONTROL_STEP,
    CONTROL_STEP_PDL,
)
from .rows import Row
from .timing import graph_note


def control_graph_rows(
    label: str,
    E: int,
    times: dict,
    wrong: dict,
    notes: Optional[dict] = None,
    per_graph: int = CONTROL_PER_GRAPH,
    replays: int = CONTROL_REPLAYS,
) -> list[Row]:
    """Rows of one control-plane shape timed inside replayed CUDA graphs: one per kernel of
    CONTROL_KERNELS (case ``<label> <kernel>``) and the whole step (``<label>
    exchange+plan+build+reroute`` / ``device step``: the four kernels in one graph), named as the
    eager rows are, told apart by the note ("graph replay") and ``extra["timing"] == "graph"``;
    then the step's graph with programmatic dependent launch (key ``pdl``: the same case, impl
    ``device step, PDL``, ``extra["pdl"]`` True; the plain step row has it False).
    ``times`` / ``wrong`` / ``notes``: by key (the case suffix); a missing time is "not measured"
    with ``notes[key]`` saying why."""
    notes = notes or {}
    rows = []
    for key, impl in (*CONTROL_KERNELS, CONTROL_STEP, CONTROL_STEP_PDL):
        t = times.get(key)
        more = notes.get(key, "")
        pdl = key == CONTROL_STEP_PDL[0]
        if pdl:  # the step again, in the same case as the plain one
            more = "programmatic dependent launch" + (f"; {more}" if more else "")
        note = (
            graph_note(per_graph, replays, more)
            if t is not None
            else f"not measured (graph replay): {notes.get(key) or 'no time'}"
        )
        case = f"{label} {CONTROL_STEP[0] if pdl else key}"
        extra = dict(timing="graph", per_graph=per_graph, replays=replays)
        if key in (CONTROL_STEP[0], CONTROL_STEP_PDL[0]):
            extra["pdl"] = pdl
        rows.append(Row("control", case, impl, E, t, 0, 0, wrong.get(key) if t is not None else None, note, extra))
    return rows


def _core_records(name: str):
    from ultracomm import records

    return getattr(records, name)


class ControlSection:
    """Gpu's control section."""

    def run_control(self) -> None:
        """The device control plane per layer and micro-batch (issues 19 and 33) on the CONTROL_SHAPES
        loads (EP8 .. EP288, zipf), every rank of a W-rank loopback world on this GPU: the loads'
        all-gather (``k_load_exchange``, every rank in one launch), the plan (``k_quota``), rank 0's
        schedule build into a plan-arena slot (``k_build_slot``) and its reroute table (``k_reroute``),
        each alone and as the whole step, timed two ways: eagerly from Python (CUDA events around
        back-to-back calls; small rows there are the host's enqueue rate, flagged cpu-bound) and
        inside a replayed CUDA graph (``Timer.graph``: device time, note "graph replay", extra
        timing=graph; the whole step's graph also with programmatic dependent launch, impl
        "device step, PDL", sm_90+; every other row without it), beside the host path they replace
        (loads copied to the host, the same planner's host build, the table built and uploaded).  #wrong: plan, build (status, task
        counts, digest) and table entries that differ from the host build's, gathered counts that
        differ from the posted ones, and nonzero exchange statuses."""
        if self.cuda_reason or not hasattr(self.cuda, "quota_plan"):
            self.rows.append(
                Row(
                    "control",
                    "-",
                    "-",
                    0,
                    None,
                    0,
                    0,
                    None,
                    f"not measured: {self.cuda_reason or 'this _cuda build has no quota_plan'}",
                )
            )
            return
        for label, W, epr in CONTROL_SHAPES:
            if self.late("control", label):
                continue
            try:
                self.control_shape(label, W, epr)
            except Exception as e:  # noqa: BLE001 - the next shape still runs
                self.errors.append(f"control {label}: {type(e).__name__}: {e}")
                self.rows.append(
                    Row("control", label, "-", W * epr, None, 0, 0, None, f"FAILED: {type(e).__name__}: {e}")
                )
                traceback.print_exc()
            finally:
                self.torch.cuda.synchronize(self.dev)
                self.torch.cuda.empty_cache()

    def control_shape(self, label: str, W: int, epr: int) -> None:
        """One shape's control rows.  Every row runs without programmatic dependent launch
        (``_cuda.set_programmatic_launch(False)``; the rows before it had none) except the step's
        graph row ``device step, PDL``, which turns it on (sm_90+; else the row says why)."""
        pdl_prev = self.cuda.programmatic_launch() if hasattr(self.cuda, "programmatic_launch") else None
        if pdl_prev is not None:
            self.cuda.set_programmatic_launch(False)
        try:
            self._control_shape(label, W, epr)
        finally:
            if pdl_prev is not None:
                self.cuda.set_programmatic_launch(pdl_prev)

    def _control_shape(self, label: str, W: int, epr: int) -> None:
        torch = self.torch
        from ultracomm import scenarios as workloads
        from ultracomm.moe.board_layout import BoardLayout
        from ultracomm.moe.reroute import RerouteTable
        from ultracomm.planners import Domain, get_planner
        from ultracomm.planners import device as dp

        E, S = W * epr, 2
        dom = Domain.flat(W, epr)
        load = workloads.zipf_load(W, E, 8192, 8, 2.0, seed=1)
        loads = torch.as_tensor(load, dtype=torch.int32, device=self.dev)
        host_plan = get_planner("device")
        out = dp.plan_on_gpu(loads, dom, S)
        t_plan, cpu = self.timer(lambda: dp.plan_on_gpu(loads, dom, S, out=out), reps=20)
        first = RerouteTable.from_plan(loads, out["slot_src"], out["slot_quota"], 0, epr, "echo")
        tab = dict(
            bounds=first.bounds,
            columns=first.columns,
            scratch=torch.empty(self.cuda.reroute_scratch_bytes(W, E) // 8, dtype=torch.int64, device=self.dev),
        )

        def device_path():
            dp.plan_on_gpu(loads, dom, S, out=out)
            RerouteTable.from_plan(loads, out["slot_src"], out["slot_quota"], 0, epr, "echo", out=tab)

        t_all, cpu_all = self.timer(device_path, reps=20)
        torch.cuda.synchronize(self.dev)
        ref = host_plan(load, dom, S)
        want_q = np.where(ref.slot_src >= 0, ref.slot_moves.sum(0), 0)
        ht = RerouteTable.from_plan(
            *(
                x.cpu()
                for x in (
                    loads,
                    torch.as_tensor(ref.slot_src, dtype=torch.int32),
                    torch.as_tensor(want_q, dtype=torch.int64),
                )
            ),
            0,
            epr,
            "echo",
        )

        def wrong_plan() -> int:
            return int(
                (out["slot_src"].cpu().numpy() != ref.slot_src).sum()
                + (out["slot_quota"].cpu().numpy() != want_q).sum()
            )

        def wrong_table(t) -> int:
            return int((t["bounds"].cpu() != ht.bounds).sum() + (t["columns"].cpu() != ht.columns).sum())

        wrong = wrong_plan() + wrong_table(dict(bounds=first.bounds, columns=first.columns))
        info = dp.decode_result(out["result"].cpu())
        note = f"probes {info['probes']}, rounds {info['rounds']}, replicas {info['replicas']}"
        self.rows.append(
            Row(
                "control",
                f"{label} plan",
                "k_quota",
                E,
                t_plan,
                0,
                0,
                wrong,
                note + (", cpu-bound" if cpu else ""),
                dict(timing="eager"),
            )
        )
        self.rows.append(
            Row(
                "control",
                f"{label} plan+reroute",
                "k_quota+k_reroute",
                E,
                t_all,
                0,
                0,
                wrong,
                note + (", cpu-bound" if cpu_all else ""),
                dict(timing="eager"),
            )
        )

        def host_path():
            res = host_plan(loads.cpu().numpy().astype(np.int64), dom, S)
            RerouteTable.from_result(res, 0, "echo").to(self.dev)
            torch.cuda.current_stream(self.dev).synchronize()

        host_path()
        ts = []
        for _ in range(3 if self.quick or W > 64 else 20):
            t0 = time.perf_counter()
            host_path()
            ts.append(time.perf_counter() - t0)
        self.rows.append(
            Row(
                "control",
                f"{label} plan+reroute",
                "host (D2H, plan, H2D)",
                E,
                statistics.median(ts),
                0,
                0,
                None,
                "wall time incl. the host sync",
                dict(timing="wall"),
            )
        )

        # the loads' all-gather: W loopback ranks' boards on this GPU, one (cooperative) launch
        L = BoardLayout(W, E)
        boards = torch.zeros((W, L.total_bytes), dtype=torch.uint8, device=self.dev)
        bases = torch.tensor([boards[r].data_ptr() for r in range(W)], dtype=torch.int64, device=self.dev)
        gathered = torch.zeros((W, W, E), dtype=torch.int32, device=self.dev)
        status = torch.zeros((W, 8), dtype=torch.int32, device=self.dev)
        seq = torch.zeros((W, 1), dtype=torch.int64, device=self.dev)
        entries = [
            dict(
                counts=loads[r].data_ptr(),
                out=gathered[r].data_ptr(),
                status=status[r].data_ptr(),
                bases=bases.data_ptr(),
                seq=seq[r].data_ptr(),
                rank=r,
            )
            for r in range(W)
        ]

        def exchange():
            self.cuda.load_exchange(entries, L.world, L.num_experts, L.entries, L.record_bytes, 10.0, self.stream())

        def wrong_exchange() -> int:
            return int((gathered.cpu() != loads.cpu().unsqueeze(0)).sum()) + int(status[:, 0].cpu().ne(0).sum())

        x_note = f"all {W} ranks in one launch (per rank: its own CTA)"
        fit = self.cuda.load_exchange_max_coresident(W) if hasattr(self.cuda, "load_exchange_max_coresident") else None
        if fit is not None:
            x_note += f"; {fit} CTAs fit at once"
        t_x, cpu_x = self.timer(exchange, reps=20)
        torch.cuda.synchronize(self.dev)
        wrong_x = wrong_exchange()
        self.rows.append(
            Row(
                "control",
                f"{label} exchange",
                "k_load_exchange",
                E,
                t_x,
                0,
                0,
                wrong_x,
                x_note + (", cpu-bound" if cpu_x else ""),
                dict(timing="eager"),
            )
        )

        def plan():
            dp.plan_on_gpu(gathered[0], dom, S, out=out)

        def reroute():
            RerouteTable.from_plan(gathered[0], out["slot_src"], out["slot_quota"], 0, epr, "echo", out=tab)

        build, wrong_build, b_note = self.control_build(W, epr, S, out)
        kernels = dict(exchange=exchange, plan=plan, build=build, reroute=reroute)
        step = tuple(kernels.values())  # not kernels itself: the step's own entry is added below

        def whole():
            for fn in step:
                fn()

        notes = {}
        if build is None:
            notes["build"] = notes[CONTROL_STEP[0]] = b_note
        else:
            t_all, cpu_all = self.timer(whole, reps=20)
            torch.cuda.synchronize(self.dev)
            self.rows.append(
                Row(
                    "control",
                    f"{label} {CONTROL_STEP[0]}",
                    CONTROL_STEP[1],
                    E,
                    t_all,
                    0,
                    0,
                    wrong_plan() + wrong_table(tab) + wrong_exchange() + wrong_build(),
                    "the whole control plane of one layer and micro-batch" + (", cpu-bound" if cpu_all else ""),
                    dict(timing="eager"),
                )
            )
            notes["build"] = b_note
        # the same kernels inside replayed CUDA graphs (one graph per row; the step: all four)
        times = {}
        if build is not None:
            kernels[CONTROL_STEP[0]] = whole
        for key, fn in kernels.items():
            if fn is None:
                continue
            try:
                times[key] = self.timer.graph(fn)
            except Exception as e:  # noqa: BLE001 - the row says why
                notes[key] = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize(self.dev)
        torch.cuda.synchronize(self.dev)
        wx, wp, wt = wrong_exchange(), wrong_plan(), wrong_table(tab)
        wb = wrong_build() if build is not None else None
        wrong_g = dict(exchange=wx, plan=wp, reroute=wt, build=wb)
        wrong_g[CONTROL_STEP[0]] = wx + wp + wt + (wb or 0)
        # the step's graph again, captured with programmatic dependent launch; #wrong from its outputs
        key = CONTROL_STEP_PDL[0]
        if build is None:
            notes[key] = b_note
        elif not hasattr(self.cuda, "programmatic_launch"):
            notes[key] = "this _cuda build has no programmatic launch switch"
        else:
            self.cuda.set_programmatic_launch(True)
            try:
                if not self.cuda.programmatic_launch(self.dev.index):
                    cc = torch.cuda.get_device_capability(self.dev)
                    notes[key] = f"sm_{cc[0]}{cc[1]} has no programmatic dependent launch (sm_90+)"
                else:

                    def stale() -> None:  # after the capture: what is checked was written by PDL replays only
                        for t in (gathered, out["slot_src"], out["slot_quota"], tab["bounds"], tab["columns"]):
                            t.fill_(-7)  # a value a replay did not rewrite shows as #wrong

                    times[key] = self.timer.graph(whole, prepare=stale)
                    torch.cuda.synchronize(self.dev)
                    wrong_g[key] = wrong_exchange() + wrong_plan() + wrong_table(tab) + wrong_build()
            except Exception as e:  # noqa: BLE001 - the row says why
                notes[key] = f"{type(e).__name__}: {e}"
                torch.cuda.synchronize(self.dev)
            finally:
                self.cuda.set_programmatic_launch(False)
        notes["exchange"] = x_note
        notes["plan"] = note
        self.rows.extend(control_graph_rows(label, E, times, wrong_g, notes))

    def control_build(self, W: int, epr: int, S: int, out: dict):
        """(build fn, its #wrong fn, note) for rank 0's schedule build into a plan-arena slot
        (k_build_slot, a DeepSeek-V3-sized expert: 3 x 7168 x 2048 bf16 weights, fp32 grads, 1 MiB
        chunks), after one eager row; (None, None, why) when this _cuda build or shape has none.
        #wrong: the build's status, task counts and digest against its host build (_core.build_into_views)."""
        torch = self.torch
        from ultracomm import _core

        if not hasattr(self.cuda.Runner, "build_slot"):
            return None, None, "this _cuda build has no Runner.build_slot"
        E = W * epr
        wb, gb, chunk = 3 * 7168 * 2048 * 2, 3 * 7168 * 2048 * 4, 1 << 20
        wl = _core.window_layout(S, wb, gb, chunk)
        runner = self.cuda.Runner(self.dev.index)
        tasks = ((epr + S) * wl["weight_chunks"], (epr + S) * wl["grad_chunks"])
        arena = self.cuda.PlanArena(
            self.dev.index, 1, nranks=1, world=W, num_experts=E, masters=epr, slots=S, tasks=tasks, refs=(W * S, W * S)
        )
        for op in (0, 1):  # rank 0's static part (addresses are never dereferenced: nothing is launched)
            entry = dict(
                op=op,
                rank=0,
                world=W,
                slots=S,
                weight_slot_bytes=wl["weight_slot_bytes"],
                grad_slot_bytes=wl["grad_slot_bytes"],
                chunk_bytes=wl["chunk_bytes"],
                window_bases=[(r + 1) << 32 for r in range(W)],
                member_off=[0],
                member_bytes=[wb if op == 0 else gb],
                master_ptrs=[(64 + i) << 24 for i in range(epr)],
                local_index_of=[e if e < epr else -1 for e in range(E)],
                grad_dtype=0,
                my_slots=[-1] * S,
                tasks=np.zeros(0, _core_records("TASK_DTYPE")),
                refs=np.zeros(0, _core_records("REF_DTYPE")),
                timeout_s=10.0,
                slot_parent=[-1] * S,
                digest=1,
            )
            runner.write_template(arena, 0, [entry], self.stream())
        home = torch.arange(E, dtype=torch.int32, device=self.dev) // epr
        hop = 740

        def build():
            runner.build_slot(
                arena,
                0,
                0,
                slot_src=out["slot_src"].data_ptr(),
                home_of=home.data_ptr(),
                node_of=0,
                world=W,
                slots=S,
                num_experts=E,
                rank=0,
                max_depth=8,
                weight_bytes=wb,
                grad_bytes=gb,
                chunk_bytes=chunk,
                hop_bytes=hop,
                stream=self.stream(),
            )

        def wrong_build() -> int:
            got = arena.build_result(0)
            want = _core.build_into_views(
                out["slot_src"].cpu().numpy(),
                home.cpu().numpy(),
                None,
                wb,
                gb,
                chunk,
                0,
                8,
                hop,
                list(tasks),
                [W * S, W * S],
            )
            return (
                int(got["status"] != 0)
                + int(got["digest"] != want["digest"])
                + sum(int(got["num_tasks"][i] != want[n]["num_tasks"]) for i, n in enumerate(("multicast", "reduce")))
            )

        t_build, cpu = self.timer(build, reps=20)
        self.torch.cuda.synchronize(self.dev)
        got = arena.build_result(0)
        note = f"tasks {got['num_tasks'][0]}/{got['num_tasks'][1]}, depth {got['depth'][0]}/{got['depth'][1]}"
        self.rows.append(
            Row(
                "control",
                f"{f'EP{W}'} build",
                "k_build_slot",
                E,
                t_build,
                0,
                0,
                wrong_build(),
                note + (", cpu-bound" if cpu else ""),
                dict(timing="eager"),
            )
        )
        return build, wrong_build, note
