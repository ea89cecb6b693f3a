"""The host side of ``_cuda`` (csrc/cuda/device_plan.cpp, runner.cpp) against a stub CUDA
runtime that logs every call (tests/cpp/cudart_stub_probe.cpp, built with g++ -Werror and
the toolkit's headers): the order of the runtime calls and the launch checks, without a GPU.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

from cpp_build import CUDA_HOST_SOURCES, CXX, build_probe, cuda_include


INC = cuda_include()
pytestmark = pytest.mark.skipif(CXX is None or INC is None, reason="needs g++ and the CUDA toolkit headers")


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    srcs = ["tests/cpp/cudart_stub_probe.cpp", *CUDA_HOST_SOURCES]
    return build_probe(tmp_path_factory.mktemp("cudart_stub") / "probe", srcs, cuda_headers=True)


def calls(probe: Path, scenario: str, *args: str) -> list[str]:
    return subprocess.run([str(probe), scenario, *args], capture_output=True, text=True, check=True).stdout.splitlines()


def test_plan_upload_waits_for_the_copy_to_land(probe):
    # a pageable cudaMemcpy may return before its DMA landed; the DMA rides the legacy stream,
    # which does not order torch's non-blocking streams: the plan waits for that stream
    log = calls(probe, "plan_upload")
    assert log[:3] == ["cudaMalloc 864", "cudaMemcpy 864 H2D", "cudaStreamSynchronize legacy"], log
    assert log[3] == "plan ready 864" and log[4:] == ["cudaFree"], log


def test_plan_upload_failure_frees_and_names_the_call(probe):
    log = calls(probe, "plan_upload_sync_fails")
    assert log[3] == "cudaFree", log
    assert log[4].startswith(
        "threw ultracomm._cuda: cudaStreamSynchronize(cudaStreamLegacy) after the plan upload "
        "failed: cudaErrorLaunchFailure"
    ), log
    assert "plan ready" not in "\n".join(log)


def test_loopback_launch_is_cooperative_with_the_movers_shared_memory(probe):
    # sm_90 stub device: TmaMover's 4 x 16 KiB stages + 4 mbarriers of dynamic shared memory; both
    # ranks have a task: ctas_per_rank each (the stub reads the layout back through cta_rank)
    assert calls(probe, "launch_2_4")[0] == "launch grid 8 smem 65568 cooperative s0 ctas 4,4 uniform"


def test_rank_without_tasks_gets_one_cta(probe):
    # a host-built plan (DevicePlan): ranks with >= 1 task get ctas_per_rank CTAs, ranks with none
    # one (they join and drain); the grid is the sum and the kernel's cta_rank maps it back
    assert calls(probe, "launch_3_100", "1", "0", "0")[0] == "launch grid 102 smem 65568 cooperative s0 ctas 100,1,1"
    assert calls(probe, "launch_3_100", "64", "0", "0")[0] == "launch grid 102 smem 65568 cooperative s0 ctas 100,1,1"
    assert calls(probe, "launch_4_100", "0", "3", "0", "1")[0] == (
        "launch grid 202 smem 65568 cooperative s0 ctas 1,100,1,100"
    )
    # no rank with a task: one CTA each, whatever ctas_per_rank says
    assert calls(probe, "launch_3_40", "0", "0", "0")[0] == "launch grid 3 smem 65568 cooperative s0 ctas 1,1,1 uniform"
    assert calls(probe, "launch_1_4", "0")[0] == "launch grid 1 smem 65568 plain s0"


def test_coresidency_counts_the_whole_grid(probe):
    # 264 co-resident on the stub (2 x 132 SMs): 262 on rank 0 + 1 per idle rank fits, 263 does not,
    # and the message says what the grid is made of
    assert calls(probe, "launch_3_262", "5", "0", "0")[0] == ("launch grid 264 smem 65568 cooperative s0 ctas 262,1,1")
    log = calls(probe, "launch_3_263", "5", "0", "0")
    assert not [line for line in log if line.startswith("launch ")], log
    assert log[-1] == (
        "threw ultracomm._cuda.Runner.launch: a loopback launch of 3 ranks (1 with tasks x 263 CTAs, 2 without "
        "x 1 CTA) = 265 CTAs cannot be co-resident on device 0 (at most 264 on its 132 SMs); every rank's CTAs "
        "must run at once, lower ctas_per_rank"
    ), log


def test_arena_launch_stays_uniform(probe):
    # a plan arena's plans may be built on the device: task counts unknown on the host, every rank
    # gets ctas_per_rank even where the uploaded entry has no task (ranks 1 and 2 here)
    log = calls(probe, "arena_uniform_4")
    assert [c for c in log if c.startswith("launch ")] == [
        "launch grid 12 smem 65568 cooperative s0 ctas 4,4,4 uniform"
    ]
    assert calls(probe, "arena_uniform_100")[-1] == (
        "threw ultracomm._cuda.Runner.launch: a loopback launch of 3 ranks x 100 CTAs = 300 CTAs cannot be "
        "co-resident on device 0 (at most 264 on its 132 SMs); every rank's CTAs must run at once, lower "
        "ctas_per_rank"
    )


@pytest.mark.parametrize(
    "ctas, max_grid, tasks, want, top",
    [
        (4, 264, [64, 0, 0], [4, 1, 1], 262),  # the bench's reduce: tasks on rank 0 only
        (4, 264, [1, 1, 1], [4, 4, 4], 88),  # uniform when every rank is busy: the old max // world
        (7, 264, [0, 5, 0, 5], [1, 7, 1, 7], 131),
        (3, 264, [0, 0], [1, 1], 264),  # nothing to claim: every launch is one CTA a rank
        (1, 2, [0, 0, 0], [1, 1, 1], 0),  # not even one CTA a rank fits
        (2, 2, [9], [2], 2),
        (5, 10, [3, 0], [5, 1], 9),
    ],
)
def test_launch_ctas_rule_and_the_largest_fitting_ctas_per_rank(probe, ctas, max_grid, tasks, want, top):
    log = calls(probe, "ctas", str(ctas), str(max_grid), *map(str, tasks))
    assert log == ["launch_ctas " + " ".join(map(str, want)), f"max_ctas_per_rank {top}"], log
    if top and any(tasks):  # the largest one fits and the next does not (the rule written out)
        assert [sum(c if t else 1 for t in tasks) <= max_grid for c in (top, top + 1)] == [True, False]


def test_launch_ctas_refuses_bad_input(probe):
    assert calls(probe, "ctas", "0", "264", "1")[-1] == (
        "threw ultracomm._cuda.launch_ctas: ctas_per_rank must be >= 1"
    )
    assert calls(probe, "ctas", "2", "264", "-1")[-1] == "threw ultracomm._cuda.launch_ctas: a task count is negative"


def test_one_rank_launch_is_plain(probe):
    assert calls(probe, "launch_1_4")[0] == "launch grid 4 smem 65568 plain s0"  # its rank has a task


def test_staged_reduce_launches_on_sm90_and_is_refused_before(probe):
    # reduce_path="tma" (kReduceStaged): the flag reaches the launcher, which picks the staged
    # kernels (k_persistent.cu); before sm_90 there are no bulk copies: refused before any launch
    assert calls(probe, "staged_9")[0] == "launch grid 1 smem 65568 plain s0 staged"  # its rank has no task
    log = calls(probe, "staged_8")
    assert not [line for line in log if line.startswith("launch ")], log
    assert log[-1] == (
        "threw ultracomm._cuda.Runner.launch: reduce_path='tma' (the TMA-staged reduce) needs bulk copies, "
        "sm_90 or newer; device 0 is sm_80: use reduce_path='hunk'"
    ), log


def test_loopback_launch_beyond_coresidency_is_refused_before_launch(probe):
    log = calls(probe, "launch_4_100")
    assert not [line for line in log if line.startswith("launch ")], log
    assert log[-1] == (
        "threw ultracomm._cuda.Runner.launch: a loopback launch of 4 ranks x 100 CTAs = 400 CTAs cannot "
        "be co-resident on device 0 (at most 264 on its 132 SMs); every rank's CTAs must run at once, "
        "lower ctas_per_rank"
    ), log


def test_launches_of_one_kind_on_two_streams_wait_for_the_previous(probe):
    # one DeviceState per op kind: a launch on another stream than the previous one of its kind
    # waits on the event recorded after it; same stream: in-stream order, no wait; the other
    # kind (reduce, its own state and event) is independent
    log = [c for c in calls(probe, "streams", "m1", "m1", "m2", "r1", "r3", "m3") if c != "cudaFree"]
    assert log == [
        "launch grid 1 smem 65568 plain s1",
        "cudaEventRecord e1 s1",
        "launch grid 1 smem 65568 plain s1",
        "cudaEventRecord e1 s1",
        "cudaStreamWaitEvent s2 e1",
        "launch grid 1 smem 65568 plain s2",
        "cudaEventRecord e1 s2",
        "launch grid 1 smem 65568 plain s1",
        "cudaEventRecord e2 s1",
        "cudaStreamWaitEvent s3 e2",
        "launch grid 1 smem 65568 plain s3",
        "cudaEventRecord e2 s3",
        "cudaStreamWaitEvent s3 e1",
        "launch grid 1 smem 65568 plain s3",
        "cudaEventRecord e1 s3",
    ], log


def test_launch_order_inside_a_capture_and_across_its_boundary(probe):
    # stub: stream handles >= 100 are capturing, capture id = handle // 100.  Within one capture
    # the wait is a graph edge; an event recorded eagerly is never waited on from a capture, nor
    # one recorded in a capture from outside it or from another capture (cudaErrorCapturedEvent)
    log = [c for c in calls(probe, "streams", "m1", "m100", "m101", "m201", "m2") if c != "cudaFree"]
    assert log == [
        "launch grid 1 smem 65568 plain s1",
        "cudaEventRecord e1 s1",
        "launch grid 1 smem 65568 plain s100",
        "cudaEventRecord e1 s100",
        "cudaStreamWaitEvent s101 e1",
        "launch grid 1 smem 65568 plain s101",
        "cudaEventRecord e1 s101",
        "launch grid 1 smem 65568 plain s201",
        "cudaEventRecord e1 s201",
        "launch grid 1 smem 65568 plain s2",
        "cudaEventRecord e1 s2",
    ], log


def _arena(probe, scenario):
    log = calls(probe, scenario)
    i = log.index("-- write slot 1")
    return log[:i], log[i:]


def test_plan_arena_is_allocated_once_and_written_with_async_copies(probe):
    # setup: the runner's state, then the arena: device memory and pinned staging, once
    setup, run = _arena(probe, "arena")
    # 3 slots x (2 op areas of 768 bytes + 1280 bytes of builder scratch: psched::scratch_words with
    # 8 candidate warps, the CTA build's global fallback); the pinned staging; the device builds'
    # results in mapped host memory
    assert setup[-4:] == ["cudaMalloc 8448", "cudaHostAlloc", "cudaHostAlloc mapped", "arena 8448 area 768"], setup
    # after setup: no cudaMalloc / cudaFree / pageable cudaMemcpy / host synchronisation; a new
    # plan is one async copy from the staging on the launch stream, behind the wait for the
    # previous launch of its kind, and the kernel reads it at the slot's fixed address (slot 1's
    # multicast area: arena base 8448 + 2 x 768; its lists at the arena's bounds, so that a device
    # build may follow in the same slot); running what the slot holds copies nothing
    view = "  views +9984 op 0 tasks 1 at +10464"
    assert run == [
        "-- write slot 1",
        "cudaMemcpyAsync 600 H2D s1 +9984",
        "cudaEventRecord e5 s1",
        "launch grid 1 smem 65568 plain s1",
        view,
        "cudaEventRecord e1 s1",
        "-- rerun slot 1",
        "cudaEventQuery e5",  # an eager launch retires the finished copies (a capture may then write)
        "launch grid 1 smem 65568 plain s1",
        view,
        "cudaEventRecord e1 s1",
        "-- rewrite slot 1",  # the previous copy out of this staging finished: no query, no wait
        "cudaMemcpyAsync 600 H2D s1 +9984",
        "cudaEventRecord e5 s1",
        "launch grid 1 smem 65568 plain s1",
        view,
        "cudaEventRecord e1 s1",
        "-- slot 2 empty",
        "cudaFree",
        "cudaFree",
        "threw ultracomm._cuda.Runner.launch: plan arena slot 2 holds no plan for this op; pass the "
        "plan's rank entries",
    ], run


def test_device_step_builds_into_the_templates_and_runs_what_it_built(probe):
    """The device step's host calls (issue 19): the static part of both op areas of a vid slot
    written once (async copies, the reduce one behind the reduce launch still running on another
    stream), the build enqueued behind every launch that may read the areas, then the persistent
    kernel runs what the build left: this rank's lists of the plan, exactly the portable builder's
    counts, parents and digest (the stub's "device" is host memory, so the build really runs)."""
    import numpy as np

    from ultracomm import _core

    src = [5, 9, 1, 13, 2, -1, 5, 6]
    log = calls(probe, "device_step", *map(str, src))
    want = _core.build_schedule_portable(
        np.array(src, np.int32).reshape(4, 2), (np.arange(16) // 4).astype(np.int32), None, 256, 512, 256, 1, 8, 64
    )
    i = log.index("-- templates slot 1")
    d = want["digest"]
    mc, rd = want["multicast"], want["reduce"]
    views = [
        f"  view {op} tasks {len(w['tasks'])} refs {len(w['refs'])} digest {d} my_slots 1,13 parent "
        f"{w['parent_rank'][1][0]},{w['parent_rank'][1][1]} first_task_expert {w['tasks'][0]['expert']}"
        for op, w in ((0, mc), (1, rd))
    ]
    want_log = [
        "-- templates slot 1",
        "cudaMemcpyAsync 936 H2D s1 +10752",
        "cudaEventRecord e5 s1",
        "cudaEventRecord e1 s1",
        "cudaStreamWaitEvent s1 e2",
        "cudaMemcpyAsync 1248 H2D s1 +11776",
        "cudaEventRecord e6 s1",
        "cudaEventRecord e2 s1",
        "-- build slot 1",  # behind both templates on its own stream: nothing to wait for
        "launch build_slot views +10752 +11776 caps 6/12 s1",
        "cudaEventRecord e1 s1",
        "cudaEventRecord e2 s1",
        *views,
        f"  result generation 1 status 0 digest {d} failures 0",
        "-- run slot 1",  # the first eager launch retires the finished copies (the earlier reduce's, the templates)
        "cudaEventQuery e4",
        "cudaEventQuery e5",
        "cudaEventQuery e6",
        "launch grid 1 smem 65568 plain s1",
        f"  views +10752 op 0 tasks {len(mc['tasks'])} at +11312",
        "cudaEventRecord e1 s1",
        "launch grid 1 smem 65568 plain s1",
        f"  views +11776 op 1 tasks {len(rd['tasks'])} at +12336",
        "cudaEventRecord e2 s1",
    ]
    assert log[i : i + len(want_log) + 1] == [*want_log, "-- build as rank 2 into rank 1's template"], log[i:]
    assert (mc["parent_rank"][1].tolist(), rd["parent_rank"][1].tolist()) == ([0, 3], [0, 3])
    rejected = str((1 << 64) - 1)
    cleared = [
        f"  view {op} tasks 0 refs 0 digest {rejected} my_slots -1,-1 parent -1,-1 first_task_expert -1"
        for op in (0, 1)
    ]
    # a build that does not fit its template (another rank's) runs nothing and publishes a rejection
    j = log.index("-- build as rank 2 into rank 1's template")
    assert log[j + 4 : j + 7] == [*cleared, "  result generation 2 status 1 digest 0 failures 1"]  # kBadShape
    # inputs that failed upstream (here the loads' exchange) are not built from; the build on s2
    # waits for both kinds' launches on s1, and the next reduce on s1 waits for the build
    j = log.index("-- build after a failed exchange")
    assert log[j + 1 : j + 8] == [
        "cudaStreamWaitEvent s2 e1",
        "cudaStreamWaitEvent s2 e2",
        "launch build_slot views +10752 +11776 caps 6/12 s2",
        "cudaEventRecord e1 s2",
        "cudaEventRecord e2 s2",
        *cleared,
    ]
    assert log[j + 8] == "  result generation 3 status 6 digest 0 failures 2"  # kExchangeFailed
    j = log.index("-- reduce on s1 after the build on s2")
    assert log[j + 1 : j + 3] == ["cudaStreamWaitEvent s1 e2", "launch grid 1 smem 65568 plain s1"]
    assert log[-1] == (
        "threw ultracomm._cuda.Runner.build_slot: plan arena slot 2 has no template for multicast; write_template first"
    )


def test_plan_arena_waits_only_when_the_device_is_a_whole_slot_cycle_behind(probe):
    _, run = _arena(probe, "arena_behind")  # the stub's previous copy out of the staging is still queued
    i = run.index("-- rewrite slot 1")
    # the launch's retire finds it in flight, then the write waits for it
    assert run[i + 1 : i + 5] == [
        "cudaEventQuery e5",
        "cudaEventQuery e5",
        "cudaEventSynchronize e5",
        "cudaMemcpyAsync 600 H2D s1 +9984",
    ]
    assert run.count("cudaEventSynchronize e5") == 1


def test_plan_arena_under_capture_copies_from_the_staging_at_replay(probe):
    # a captured copy is a graph node reading the staging when replayed: no event is recorded for
    # it (an event recorded in a capture cannot be queried outside it)
    _, run = _arena(probe, "arena_capture")
    assert [c for c in run if c.startswith("cudaMemcpyAsync")] == ["cudaMemcpyAsync 600 H2D s100 +9984"] * 2
    assert not [c for c in run if c.startswith(("cudaEventQuery", "cudaEventSynchronize", "cudaEventRecord e5"))]


def test_plan_beyond_the_arena_bounds_is_refused_before_anything_moves(probe):
    _, run = _arena(probe, "arena_over")
    assert run == [
        "-- write slot 1",
        "cudaFree",
        "cudaFree",
        "threw ultracomm._cuda.PlanArena: rank entry 0: 3 tasks exceed the plan arena's bound of 2 for "
        "multicast (set at setup from the Context's experts, slots, world, window chunks and loopback "
        "ranks)",
    ], run
