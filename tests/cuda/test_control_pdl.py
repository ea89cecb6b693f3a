"""Programmatic dependent launch of the device control plane (issue 33; csrc/cuda/pdl.h):
k_load_exchange -> k_quota_plan -> k_build_slot -> k_reroute_table.  Without a GPU: the SASS of
the sm_90 / sm_100 builds holds griddepcontrol.wait (ACQBULK) and .launch_dependents (PREEXIT) in
each of the four kernels, the wait before any memory access of the three dependents (they may
start while their predecessor runs), and the sm_80 build holds neither; the launchers put the
attribute on exactly the three dependents and only where programmatic_launch_here() says so;
ULTRACOMM_PDL reaches _cuda's switch when ultracomm.cuda.support loads it.  Whether the chain
overlaps (and the graph-replayed "device step, PDL" row of perf/bench_gpu.py --only control) needs
a device: not checked here."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest

import cuda_build as cb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CHAIN = {
    "k_loads": ["k_load_exchange"],
    "k_quota": ["k_quota_plan"],
    "k_build": ["k_build_slot"],
    "k_reroute": ["k_reroute_table"],
}
DEPENDENTS = ("k_quota_plan", "k_build_slot", "k_reroute_table")
MEMORY = re.compile(r"\b(LDG|STG|LD|ST|LDS|STS|ATOM|ATOMS|ATOMG|RED|LDGSTS|UBLKCP)\b")


def chain_sass(arch: int) -> dict[str, str]:
    if cb.find_nvcc() is None:
        pytest.skip("nvcc not found (CUDA compile checks need it)")
    if cb.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    compiled = cb.compile_all()
    out = {}
    for src, names in CHAIN.items():
        for fn, text in cb.kernel_sass(cb.sass(compiled[src], arch)).items():
            if any(n in fn for n in names):
                out[fn] = text
    return out


@pytest.mark.parametrize("arch", [a for a in cb.real_archs() if a >= 90])
def test_sm90_builds_wait_then_launch_dependents(arch):
    kernels = chain_sass(arch)
    for names in CHAIN.values():
        assert any(n in fn for fn in kernels for n in names), (names, list(kernels))
    for fn, text in kernels.items():
        lines = [ln for ln in text.splitlines() if re.search(r"/\*[0-9a-f]{4}\*/", ln)]
        wait = next((i for i, ln in enumerate(lines) if "ACQBULK" in ln), None)
        trig = next((i for i, ln in enumerate(lines) if "PREEXIT" in ln), None)
        assert wait is not None, f"no griddepcontrol.wait (ACQBULK) in {fn} sm_{arch}"
        assert trig is not None, f"no griddepcontrol.launch_dependents (PREEXIT) in {fn} sm_{arch}"
        if any(d in fn for d in DEPENDENTS):
            # launched with the PDL attribute: nothing touches memory before the wait
            before = [ln for ln in lines[:wait] if MEMORY.search(ln)]
            assert not before, f"{fn} sm_{arch}: memory access before griddepcontrol.wait: {before}"
            assert wait < trig, f"{fn} sm_{arch}: dependents launched before this kernel waited"


@pytest.mark.parametrize("arch", [a for a in cb.real_archs() if a < 90])
def test_sm80_build_has_no_griddepcontrol(arch):
    kernels = chain_sass(arch)
    assert kernels
    for fn, text in kernels.items():
        assert "ACQBULK" not in text and "PREEXIT" not in text, f"{fn} sm_{arch}"


def _code(name: str) -> str:
    return re.sub(r"//[^\n]*", "", open(os.path.join(ROOT, "csrc", "cuda", name)).read())


def test_dependents_launch_with_the_attribute_only_where_the_device_has_it():
    """k_quota_plan (both variants), k_build_slot and k_reroute_table go through
    launch_programmatic with programmatic_launch_here() (the switch and sm_90+); no plain <<<>>>
    launch of them is left; k_load_exchange keeps its plain / cooperative launch.  Each kernel
    body starts with the wait."""
    quota, build, reroute, loads = (_code(f) for f in ("k_quota.cu", "k_build.cu", "k_reroute.cu", "k_loads.cu"))
    assert "const bool pdl = programmatic_launch_here();" in quota
    assert quota.count("launch_programmatic(pdl, k_quota_plan<") == 2 and "k_quota_plan<true><<<" not in quota
    assert "launch_programmatic(programmatic_launch_here(), k_build_slot," in build and "k_build_slot<<<" not in build
    assert "launch_programmatic(programmatic_launch_here(), k_reroute_table," in reroute
    assert "k_reroute_table<<<" not in reroute
    assert "launch_programmatic" not in loads and "ProgrammaticStreamSerialization" not in loads
    for text, kernel in (
        (quota, "k_quota_plan"),
        (build, "k_build_slot"),
        (reroute, "k_reroute_table"),
        (loads, "k_load_exchange"),
    ):
        body = text[text.index(kernel + "(", text.index("__global__")) :]
        body = body[body.index("#if defined(__CUDA_ARCH__)") :]
        first = [
            ln.strip()
            for ln in body.splitlines()[1:]
            if ln.strip() and not ln.strip().startswith(("extern __shared__", "__shared__"))
        ][0]
        assert first == "dev::grid_dependency_wait();", (kernel, first)
    pdl = _code("pdl.h")
    assert "cudaLaunchAttributeProgrammaticStreamSerialization" in pdl
    assert "programmaticStreamSerializationAllowed = 1" in pdl and "cfg.numAttrs = pdl ? 1 : 0;" in pdl
    assert re.search(r"cc_major_of\(device\) >= 9", pdl)
    extra = _code("ptx_extra.cuh")
    assert "NV_IF_TARGET(NV_PROVIDES_SM_90, (cudaGridDependencySynchronize();))" in extra
    assert "NV_IF_TARGET(NV_PROVIDES_SM_90, (cudaTriggerProgrammaticLaunchCompletion();))" in extra


def test_ultracomm_pdl_reaches_the_cuda_switch():
    """ULTRACOMM_PDL (env.py, default on) is what ultracomm.cuda.support sets on _cuda when it loads
    it; _cuda.set_programmatic_launch changes it at run time (no driver needed)."""
    from ultracomm.cuda import support

    cuda = support.cuda_module()
    if cuda is None or not hasattr(cuda, "programmatic_launch"):
        pytest.skip(f"ultracomm._cuda is not built here: {support.cuda_module_reason()}")
    code = (
        "from ultracomm.cuda import support; m = support.cuda_module(); print(m.programmatic_launch()); "
        "m.set_programmatic_launch(True); print(m.programmatic_launch())"
    )
    for value, want in ((None, "True"), ("0", "False"), ("off", "False"), ("1", "True")):
        env = {k: v for k, v in os.environ.items() if k != "ULTRACOMM_PDL"}
        if value is not None:
            env["ULTRACOMM_PDL"] = value
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
        assert out.returncode == 0, out.stderr
        assert out.stdout.split() == [want, "True"], (value, out.stdout, out.stderr)
    env = dict(os.environ, ULTRACOMM_PDL="sometimes")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode != 0 and "ULTRACOMM_PDL='sometimes' is invalid" in out.stderr


def test_process_field_reads_one_variable():
    from ultracomm.env import Config, process_field
    from ultracomm.errors import ConfigError

    assert process_field("pdl", {}) is True and Config().pdl is True
    assert process_field("pdl", {"ULTRACOMM_PDL": " no "}) is False
    # another variable's bad value does not fail it
    assert process_field("pdl", {"ULTRACOMM_TIMEOUT_S": "soon", "ULTRACOMM_PDL": "1"}) is True
    with pytest.raises(ConfigError, match="ULTRACOMM_PDL='2' is invalid"):
        process_field("pdl", {"ULTRACOMM_PDL": "2"})
    with pytest.raises(ConfigError, match="unknown config field"):
        process_field("nope", {})
