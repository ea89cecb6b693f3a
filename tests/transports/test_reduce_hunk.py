"""The device reduce's hot path (include/ultracomm/impl/reduce_hunk.h, driven by
csrc/cuda/mover_common.cuh ``vec_reduce``): NCCL-style hunks -- U 16-byte packs per lane, dst and a
group of G sources loaded before the first add, fp32 adds in the schedule's source order, hardware
fp16/bf16 conversions with the NaN rule in a slow path.

* CPU: tests/cpp/reduce_hunk_check.cpp (g++) runs the hunk code with the device's distribution of
  packs against the host executor's reduce (csrc/movers/host_reduce.h, scalar and F16C) bit for
  bit, on random fp32/bf16/fp16 inputs with NaNs, infinities, subnormals and overflowing sums, with
  half.h's conversions and with GPU-like ones (canonical NaNs); a mutant whose conversion flushes
  subnormals must fail.
* SASS (nvcc, no GPU): every register-hunk persistent kernel issues a run of >= (G + 1) x U
  16-byte loads before an FADD (dst's and the group's loads in flight; the old loop had at most 5);
  every persistent kernel has hardware fp16/bf16 conversions (HADD2.F32, F2FP...PACK_AB), no
  FFMA/HFMA (also test_cuda_build.py), no local memory (test_cuda_build.py checks stack and spills
  of every kernel), and <= 128 registers (two CTAs per SM).

The TMA-staged reduce (reduce_path="tma", the same header's "Staged reduce", driven by
csrc/cuda/mover_tma.cuh reduce_staged): the same g++ check runs its fills through a ring of its
own (the device's geometry and small ones that wrap the ring many times) against the host reduce
bit for bit, including the ring's bookkeeping (expect_tx = the bytes loaded, the refill's start
derived from the adds' cursor); a mutant that refills a stage before its fill was added must fail.
Its SASS claims (bulk loads, FADDs fed by LDS.128) are test_cuda_build.py's.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest

import cuda_build as cb

ROOT = Path(__file__).resolve().parents[2]
CXX = shutil.which("g++")
MOVER = ROOT / "csrc" / "cuda" / "mover_common.cuh"


def _build(out: Path, defs: list[str]) -> Path:
    exe = out / ("check" + "".join(d.replace("-D", "_") for d in defs))
    cmd = [
        CXX,
        "-std=c++20",
        "-O2",
        "-Wall",
        "-Wextra",
        "-Werror",
        "-ffp-contract=off",
        *defs,
        f"-I{ROOT / 'include'}",
        f"-I{ROOT / 'csrc'}",
        str(ROOT / "tests/cpp/reduce_hunk_check.cpp"),
        "-o",
        str(exe),
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    assert r.returncode == 0, f"{' '.join(cmd)}\n{r.stderr[-4000:]}"
    return exe


@pytest.mark.skipif(CXX is None, reason="needs g++")
def test_hunk_reduce_matches_host_reduce_bit_for_bit(tmp_path):
    exe = _build(tmp_path, [])
    for seed in (1, 2):
        r = subprocess.run(
            [str(exe), "--seed", str(seed), "--rounds", "2"], capture_output=True, text=True, timeout=300
        )
        assert r.returncode == 0, r.stdout[-4000:] + r.stderr[-2000:]
        assert " 0 mismatching" in r.stdout, r.stdout


@pytest.mark.skipif(CXX is None, reason="needs g++")
def test_hunk_check_catches_a_flushing_conversion(tmp_path):
    exe = _build(tmp_path, ["-DUC_MUTATE_FTZ"])
    r = subprocess.run([str(exe), "--rounds", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 1 and "MISMATCH" in r.stdout, r.stdout[-2000:]


@pytest.mark.skipif(CXX is None, reason="needs g++")
def test_staged_check_catches_a_stage_refilled_too_early(tmp_path):
    # the staged variants' ring refills a stage before its fill was added: the poisoned stage (or
    # the next fill's bytes) reaches the sums; only the staged variants may mismatch
    exe = _build(tmp_path, ["-DUC_MUTATE_STAGED_EARLY_REFILL"])
    r = subprocess.run([str(exe), "--rounds", "1"], capture_output=True, text=True, timeout=300)
    bad = [line for line in r.stdout.splitlines() if line.startswith("MISMATCH")]
    assert r.returncode == 1 and bad, r.stdout[-2000:]
    assert all(" staged " in line for line in bad), bad[:5]


def _constant(name: str) -> int:
    m = re.search(rf"constexpr int {name} = (\d+);", MOVER.read_text())
    assert m, name
    return int(m.group(1))


def _ops_in_order(text: str) -> list[str]:
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", text, re.M)


def _load_runs(ops: list[str]) -> list[int]:
    """Lengths of the runs of 16-byte global loads (LDG.E.128*) between FADDs, in address order."""
    runs, n = [], 0
    for o in ops:
        if o.startswith("LDG.E.128"):
            n += 1
        elif o.startswith("FADD"):
            if n:
                runs.append(n)
            n = 0
    return runs


@pytest.fixture(scope="module")
def compiled():
    if cb.find_nvcc() is None:
        pytest.skip("nvcc not found")
    return cb.compile_all()


@pytest.mark.parametrize("arch", [80, 90, 100])
def test_sass_reduce_hunk_loads_its_group_before_the_first_add(compiled, arch):
    if arch not in cb.real_archs():
        pytest.skip(f"sm_{arch} not built")
    if cb.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found: pip install nvidia-cuda-cuobjdump")
    unroll, group = _constant("kReduceUnroll"), _constant("kReduceGroup")
    kernels = cb.kernel_sass(cb.sass(compiled["k_persistent"], arch))
    assert len(kernels) == 6  # 3 grad dtypes x 2 reduce paths
    for fn, text in kernels.items():
        ops = _ops_in_order(text)
        runs = _load_runs(ops)
        # dst's U packs and a group's G x U, all before the first add (k = 2: one group; 12 loads,
        # where the old loop had at most 5).  The register-hunk kernels (Lb0E: k_persistent<D,
        # false>); in the staged kernels (Lb1E) the hunks only take the segments bulk copies cannot
        # (operands not congruent mod 16) and have fewer registers to group loads in
        if "ELb0E" in fn:
            assert runs and max(runs) >= (group + 1) * unroll, (fn, arch, sorted(runs)[-8:])
        # hardware conversions in the hot path: cvt.rn.{f16,bf16}x2.f32 (F2FP...PACK_AB) and,
        # for fp16, cvt.f32.f16 (HADD2.F32 from sm_80 on), instead of half.h's integer routines
        if "GradF16" in fn:
            assert "HADD2.F32" in ops and [o for o in ops if o.startswith("F2FP") and "BF16" not in o], (fn, arch)
        if "GradBF16" in fn:
            assert [o for o in ops if o.startswith("F2FP.BF16")], (fn, arch)
        assert not [o for o in ops if o.startswith(("FFMA", "HFMA"))], (fn, arch)
        assert not [o for o in ops if o.startswith(("LDL", "STL"))], (fn, arch)  # no local memory


def test_persistent_kernels_keep_two_ctas_per_sm(compiled):
    """<= 128 registers x 256 threads: two mover CTAs per SM, as before the hunks (109-124); a larger
    source group (G = 4: 140-156) would halve loopback grids and what co-resident compute keeps."""
    log = compiled["k_persistent"].log
    found = re.findall(
        r"Compiling entry function '(\S*k_persistent\S*)' for '(sm_\d+)'.*?Used (\d+) registers", log, re.S
    )
    assert len(found) == 6 * len(cb.real_archs()), found  # 3 grad dtypes x 2 reduce paths
    for fn, arch, regs in found:
        assert int(regs) <= 128, (fn, arch, regs)


def test_bench_reduce_sweep_rows_name_ctas_and_rate_per_cta():
    """perf/bench_gpu.py reduce_sweep (issue 34): k=2 fp32 and k=8 bf16/fp16 at 1..32 CTAs, each CTA
    count through both reduce paths (impl "tile mover": register hunks; "tile mover tma-staged":
    reduce_path="tma"), each row with its traffic per CTA, the staged row's note its rate as a share
    of the hunk row's; its own section, so the reduce goal and the profile's reduce fields keep
    reading the `reduce` rows."""
    import types

    from test_bench_gpu import DEVICE, bg, stub_gpu

    def mover_reduce(case, k, dt, nbytes, name, ctas, path="hunk"):
        used = min(ctas, 16)  # as if co-residency capped 23 and 32 at 16
        return bg.Row(
            "reduce",
            case,
            bg.REDUCE_IMPLS[path],
            nbytes,
            1e-3 if path == "hunk" else 0.8e-3,
            nbytes,
            (k + 2) * nbytes,
            0,
            f"{used} CTAs/rank",
            dict(k=k, dtype=name, ctas=used, reduce_path=path),
        )

    dtypes = types.SimpleNamespace(float32="f32", bfloat16="bf16", float16="f16")
    g = stub_gpu(tma_reason=None, quick=False, torch=dtypes, info=dict(cc="9.0"))
    g.mover_reduce = mover_reduce
    assert "reduce_sweep" in bg.SECTIONS and bg.SECTIONS.index("reduce_sweep") == bg.SECTIONS.index("reduce") + 1
    g.run_reduce_sweep()
    assert bg.REDUCE_IMPLS == {"hunk": "tile mover", "tma": "tile mover tma-staged"}
    hunk = [r for r in g.rows if r.impl == "tile mover"]
    staged = [r for r in g.rows if r.impl == "tile mover tma-staged"]
    assert len(g.rows) == 48 and [r.impl for r in g.rows[:2]] == ["tile mover", "tile mover tma-staged"]
    for rows in (hunk, staged):
        assert [r.case for r in rows[:8]] == [f"k=2 fp32 {c} CTAs" for c in (1, 2, 4, 8, 12, 16, 23, 32)]
        assert [r.case for r in rows[8::8]] == ["k=8 bf16 1 CTAs", "k=8 fp16 1 CTAs"] and len(rows) == 24
        assert all(r.section == "reduce_sweep" and r.size == 64 * bg.MiB for r in rows)
        r = rows[7]  # 32 asked, 16 ran: the rate is per CTA that ran
        assert r.extra["per_cta_busbw"] == r.busbw / 16 and r.note.endswith(f", {r.busbw / 16 / 1e9:.1f} GB/s per CTA")
        assert r.algbw_per_cta == r.algbw / 16  # the table's GB/s/CTA column
    assert all(r.note.startswith("16 CTAs/rank, 125.0% of tile mover's rate") for r in staged[5:8])
    assert staged[0].extra["vs_hunk"] == pytest.approx(1.25) and "vs_hunk" not in hunk[0].extra
    assert bg.goal_lines(g.rows)[1] == "goal reduce: not measured (reduce rows missing)"
    assert bg.build_profile(g.rows, DEVICE, "d")["per_sm_reduce_bw"] is None
    # before sm_90 the staged rows say why they were not measured; the hunk rows are measured
    old = stub_gpu(tma_reason=None, quick=True, torch=dtypes, info=dict(cc="8.0"))
    old.mover_reduce = mover_reduce
    old.run_reduce_sweep()
    assert {r.note for r in old.rows if r.impl == "tile mover tma-staged"} == {
        "not measured: reduce_path='tma' needs sm_90+ (bulk copies); this GPU is sm_80"
    }
    assert all(r.time_s for r in old.rows if r.impl == "tile mover") and len(old.rows) == 36
