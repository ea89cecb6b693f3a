"""The real kernel launchers of ``_cuda`` -- the host side of every ``csrc/cuda/*.cu`` as nvcc
compiled it (tests/cuda_build.py's objects) with runner.cpp and the plan arena -- linked against
a stub CUDA runtime that models what a device refuses (tests/cpp/cudart_launch_probe.cpp):
dynamic shared memory above 48 KB without the attribute, static + dynamic shared memory or
threads x registers beyond the device, cooperative grids the device cannot hold (occupancy from
ptxas' registers and shared memory), and calls that are illegal while a stream capture is under
way.  Every launch shape a Context makes, eager and captured, on sm_80 / sm_90 / sm_100 devices.
No GPU needed: a launch that the device would refuse shows up as a ``VIOLATION`` line.
"""

from __future__ import annotations

import re
import subprocess

import pytest

import cuda_build as cb
from cpp_build import CUDA_HOST_SOURCES, CXX, build_probe

pytestmark = pytest.mark.skipif(
    CXX is None or cb.find_nvcc() is None, reason="needs g++ and nvcc (the launchers' objects)"
)


def kernel_table(compiled) -> str:
    """mangled name, registers, static shared memory of every kernel for sm_90 (ptxas -v)."""
    rows = []
    for c in compiled.values():
        for (arch, fn), props in cb.ptxas_functions(c.log).items():
            if arch != "sm_90":
                continue
            m = re.search(r"Used (\d+) registers", props)
            s = re.search(r"(\d+) bytes smem", props)
            assert m, (fn, props)
            rows.append(f"{fn} {m.group(1)} {s.group(1) if s else 0}")
    return "\n".join(rows) + "\n"


@pytest.fixture(scope="module")
def probe(tmp_path_factory):
    compiled = cb.compile_all()
    d = tmp_path_factory.mktemp("cudart_launch")
    table = d / "kernels.txt"
    table.write_text(kernel_table(compiled))
    srcs = ["tests/cpp/cudart_launch_probe.cpp", *CUDA_HOST_SOURCES]
    exe = build_probe(d / "probe", srcs, cuda_headers=True, objects=[c.obj for c in compiled.values()])

    def run(*args: str) -> list[str]:
        out = subprocess.run(
            [str(exe), *args], capture_output=True, text=True, check=True, env={"UC_KERNEL_TABLE": str(table)}
        )
        return out.stdout.splitlines()

    return run


def _refused(log: list[str]) -> list[str]:
    return [line for line in log if line.startswith(("VIOLATION", "threw"))]


def test_every_kernel_is_registered_with_its_resources(probe):
    log = probe("kernels")
    names = {line.split(" regs ")[0] for line in log}
    for k in (
        "ultracomm::k_persistent<ultracomm::interp::GradF32, false>",
        "ultracomm::k_persistent<ultracomm::interp::GradBF16, true>",
        "ultracomm::k_quota_plan<true>",
        "ultracomm::k_quota_plan<false>",
        "ultracomm::k_build_slot",
        "ultracomm::k_reroute_table",
        "ultracomm::k_load_exchange<288>",
    ):
        assert k in names, log
    assert not _refused(log), log


@pytest.mark.parametrize("cc", ["8", "9", "10"])
@pytest.mark.parametrize("scenario", ["persistent", "persistent_captured"])
def test_persistent_launches_fit_the_device(probe, scenario, cc):
    # every (ranks, CTAs per rank, dtype, reduce path) a Context launches, incl. loopback grids
    # above the SM count (the shared ring) and at it (the deep ring, 192 KB: its attribute set)
    log = probe(scenario, cc)
    assert not _refused(log), _refused(log)
    launches = [line for line in log if line.startswith("launchEx ultracomm::k_persistent")]
    assert len(launches) > 50, log
    if cc != "8":
        assert any(" smem 196656 " in line for line in launches) and any(" smem 98328 " in line for line in launches)
    if scenario == "persistent_captured":
        captured = [line for line in launches if line.endswith(" s100")]
        assert len(captured) > 50 and not [line for line in captured if "cooperative" in line], captured


def test_persistent_rings_follow_a_99kb_device(probe):
    # an sm_120 part (RTX Blackwell: 99 KB per block, 100 KB per SM) runs the sm_100 code: the deep
    # ring is the most 32 KB stages that fit beside the kernels' static shared memory, and a
    # loopback grid above the SM count (two CTAs per SM, 50 KB each) gets no ring (vector path)
    statics = [
        int(line.rsplit(" static ", 1)[1])
        for line in probe("kernels", "12")
        if line.startswith("ultracomm::k_persistent<")
    ]
    assert len(statics) == 6, statics
    stage = 32768 + 8
    deep = max(s for s in range(2, 7) if s * stage <= 101376 - max(statics)) * stage
    log = probe("persistent", "12")
    assert not _refused(log), _refused(log)
    assert (
        f"cudaFuncSetAttribute ultracomm::k_persistent<ultracomm::interp::GradF32, false> MaxDynamicSharedMemorySize {deep}"
        in log
    )
    launches = [line for line in log if line.startswith("launchEx ultracomm::k_persistent")]
    grids = [(int(line.split(" grid ")[1].split()[0]), int(line.split(" smem ")[1].split()[0])) for line in launches]
    assert {smem for grid, smem in grids if grid > 132} == {0}, grids
    assert {smem for grid, smem in grids if grid <= 132} == {deep}, grids


def test_eager_plans_beside_another_streams_capture(probe):
    # the plan arena's event query and synchronize (a slot's previous staging copy) run in relaxed
    # capture mode: in torch's global mode they would fail while any stream is being captured and
    # invalidate that capture; the thread's mode is restored afterwards
    log = probe("persistent_beside_capture")
    assert not _refused(log), _refused(log)
    assert "mode restored" in log and len([line for line in log if line.startswith("launchEx")]) == 3, log


SHAPES = [
    ("8", "4", "2", "1"),
    ("8", "4", "2", "8"),
    ("64", "4", "2", "1"),
    ("64", "4", "2", "64"),
    ("288", "4", "2", "1"),
    ("288", "4", "2", "288"),
    ("1024", "8", "8", "1"),
    ("16", "4096", "8", "1"),
]


@pytest.mark.parametrize("cc", ["8", "9", "10"])
@pytest.mark.parametrize("shape", SHAPES, ids=["-".join(s) for s in SHAPES])
@pytest.mark.parametrize("scenario", ["control", "control_captured"])
def test_control_plane_launches_fit_the_device(probe, scenario, shape, cc):
    # exchange -> quota plan -> build -> reroute (world, experts per rank, slots, rank entries):
    # the planner's shared-memory variant raises its attribute before it launches above 48 KB,
    # also when its first launch on the device is captured; PDL only from sm_90
    log = probe(scenario, cc, *shape)
    assert not _refused(log), _refused(log)
    kernels = [line.split()[1] for line in log if line.startswith("launch")]
    assert [k.split("<")[0] for k in kernels] == [
        "ultracomm::k_load_exchange",
        "ultracomm::k_quota_plan",
        "ultracomm::k_build_slot",
        "ultracomm::k_reroute_table",
    ], log
    assert any(" pdl " in line for line in log) == (cc != "8"), log


def test_misc_launches_fit_the_device(probe):
    log = probe("misc")
    assert not _refused(log), _refused(log)
    assert len([line for line in log if line.startswith("launch")]) == 6, log
