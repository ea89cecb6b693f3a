"""CUDA executor checks that need nvcc but no GPU: every CUDA source compiles for each
architecture the build lists, with warnings as errors and no spills or local memory; the SASS
holds the instructions the movers claim (bulk copies and system-scope flags on sm_90/sm_100,
128-bit vector accesses on sm_80, no non-coherent .nc loads); inline asm stays in one file;
``ultracomm._cuda`` imports and explains itself on a machine without a GPU."""

from __future__ import annotations

import glob
import os
import re
import subprocess
import sys

import pytest
import torch

import cuda_build as cb

ROOT = cb.ROOT
MOVER_TMA = os.path.join(ROOT, "csrc", "cuda", "mover_tma.cuh")
needs_nvcc = pytest.mark.skipif(cb.find_nvcc() is None, reason="nvcc not found (CUDA compile checks need it)")


@pytest.fixture(scope="session")
def compiled():
    return cb.compile_all()


def _sass_or_skip(compiled, name, arch):
    if cb.find_tool("cuobjdump") is None:
        pytest.skip("cuobjdump not found: pip install nvidia-cuda-cuobjdump (scripts/setup.sh does)")
    return cb.sass(compiled[name], arch)


def _ops(sass_text: str) -> set[str]:
    """Instruction mnemonics (with modifiers) of a SASS listing."""
    return set(re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass_text, re.M))


def test_build_lists_explicit_architectures():
    archs = cb.real_archs()
    assert 80 in archs and 90 in archs and 100 in archs, archs  # sm_80 vector path, sm_90/100 TMA
    flags = " ".join(cb.nvcc_flags())
    for f in ("--Werror all-warnings", "-warn-spills", "-warn-lmem-usage", "-fmad=false"):
        assert f in flags


@needs_nvcc
def test_every_source_compiles_without_spills_or_local_memory(compiled):
    assert {"k_persistent", "k_bench", "k_loads"} <= set(compiled)
    for name, c in compiled.items():
        assert "warning" not in c.log.lower(), c.log
        funcs = cb.ptxas_functions(c.log)
        for arch in cb.real_archs():
            got = {f for (a, f) in funcs if a == f"sm_{arch}"}
            assert got, f"{name}: no kernel compiled for sm_{arch}"
        for (arch, f), props in funcs.items():
            assert "0 bytes stack frame, 0 bytes spill stores, 0 bytes spill loads" in props, (name, arch, f, props)
    # one persistent kernel per grad dtype and reduce path (register hunks, TMA-staged)
    kp = {f for (_, f) in cb.ptxas_functions(compiled["k_persistent"].log)}
    assert len([f for f in kp if "k_persistent" in f]) == 6, kp
    assert len([f for f in kp if _staged(f)]) == 3, kp


@needs_nvcc
@pytest.mark.parametrize("arch", [90, 100])
def test_sass_bulk_copies_and_system_flags(compiled, arch):
    if arch not in cb.real_archs():
        pytest.skip(f"sm_{arch} not built")
    kernels = cb.kernel_sass(_sass_or_skip(compiled, "k_persistent", arch))
    assert len(kernels) == 6  # 3 grad dtypes x 2 reduce paths
    for fn, text in kernels.items():
        ops = _ops(text)
        assert "UBLKCP.S.G" in ops, fn  # cp.async.bulk global -> shared (read once)
        assert "UBLKCP.G.S" in ops, fn  # cp.async.bulk shared -> global (one per destination)
        assert "SYNCS.ARRIVE.TRANS64" in ops and "SYNCS.PHASECHK.TRANS64.TRYWAIT" in ops, fn  # mbarrier
        assert "FENCE.VIEW.ASYNC.G" in ops, fn  # fence.proxy.async.global after a relay's acquire
        assert {o for o in ops if o.startswith("LD") and o.endswith(".64.STRONG.SYS")}, fn  # ld.{relaxed,acquire}.sys
        assert {o for o in ops if o.startswith("ST") and o.endswith(".64.STRONG.SYS")}, fn  # st.release.sys
        assert "CCTL.IVALL" in ops and "MEMBAR.ALL.SYS" in ops, fn  # acquire / release halves
        # issue 34: flag waits poll relaxed (LD...64.STRONG.SYS, no CCTL.IVALL: an acquire in the
        # spin invalidated the whole L1 on every poll) and acquire once after the epoch is seen
        spins = [b for b in _loops(text) if any(re.search(r"\bLDG?\.E\.64\.STRONG\.SYS\b", i) for i in b)]
        assert len(spins) >= 2, f"{fn}: no polling loop found"
        for body in spins:
            assert not any("CCTL.IVALL" in i for i in body), (fn, body)
        # ... and publish N flags with one fence before the loop of relaxed stores (was a
        # MEMBAR.ALL.SYS per destination / per consumed flag / per leaf grad chunk)
        releases = [b for b in _loops(text) if any(re.search(r"\bSTG?\.E\.64\.STRONG\.SYS\b", i) for i in b)]
        assert len(releases) >= 2, f"{fn}: no flag release loop found"
        for body in releases:
            assert not any("MEMBAR" in i for i in body), (fn, body)


def _staged(fn: str) -> bool:
    """k_persistent<D, true>: the TMA-staged reduce's kernels (reduce_path="tma"), by the Itanium
    mangling of the bool template argument (Lb1E; the register-hunk kernels carry Lb0E)."""
    assert "k_persistent" in fn and ("ELb0E" in fn) != ("ELb1E" in fn), fn
    return "ELb1E" in fn


def _pairs(kernels: dict[str, str]) -> list[tuple[str, str, str]]:
    """(grad dtype, hunk kernel's SASS, staged kernel's SASS) per grad dtype."""
    out = []
    for dt in ("7GradF32", "7GradF16", "8GradBF16"):
        hunk = [t for f, t in kernels.items() if dt + "ELb0E" in f]
        staged = [t for f, t in kernels.items() if dt + "ELb1E" in f]
        assert len(hunk) == len(staged) == 1, (dt, list(kernels))
        out.append((dt, hunk[0], staged[0]))
    return out


def _instrs(text: str) -> list[tuple[str, list[int]]]:
    """(mnemonic, register numbers in operand order: the destination first) of each instruction."""
    out = []
    for m in re.finditer(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)\s*(.*?);", text, re.M):
        out.append((m.group(1), [int(r) for r in re.findall(r"\bR(\d+)\b", m.group(2))]))
    return out


def _lds_fed_fadds(text: str, window: int = 48) -> int:
    """LDS.128s whose value an FADD adds within `window` instructions: straight (fp32) or through
    one conversion (bf16: a shift / PRMT; fp16: HADD2.F32) -- the staged reduce adding from shared
    memory.  Register dataflow in program order; a register overwritten by anything else is dropped."""
    ins, n = _instrs(text), 0
    for i, (op, regs) in enumerate(ins):
        if not op.startswith("LDS.128") or not regs:
            continue
        loaded = {regs[0] + k for k in range(4)}
        for op2, r2 in ins[i + 1 : i + 1 + window]:
            if not r2:
                continue
            if op2.startswith("FADD") and loaded & set(r2[1:]):
                n += 1
                break
            if op2.startswith(("PRMT", "IMAD.U32", "IMAD.SHL", "SHF", "LOP3", "HADD2.F32")) and loaded & set(r2[1:]):
                loaded.add(r2[0])
            else:
                loaded.discard(r2[0])
    return n


@needs_nvcc
@pytest.mark.parametrize("arch", [90, 100])
def test_sass_staged_reduce_adds_from_shared_memory(compiled, arch):
    # reduce_path="tma" (issue 34, mover_tma.cuh reduce_staged): beside the copy path's bulk copies,
    # which both kernels of a dtype hold, the staged kernel issues the reduce's own bulk loads
    # (more UBLKCP.S.G, with their mbarrier expect_tx: SYNCS.ARRIVE.TRANS64), every thread waits on
    # a stage (more SYNCS.PHASECHK), the refill fences the generic reads before the async writes
    # (one more FENCE.VIEW.ASYNC.S), and its FADDs add values that LDS.128 read from shared memory
    # (the register-hunk kernel has none: its adds read LDG results); no local memory in either
    if arch not in cb.real_archs():
        pytest.skip(f"sm_{arch} not built")
    packs = int(re.search(r"constexpr int kStagedPacks = (\d+);", open(MOVER_TMA).read()).group(1))
    for dt, hunk, staged in _pairs(cb.kernel_sass(_sass_or_skip(compiled, "k_persistent", arch))):
        h, s = _ops_list(hunk), _ops_list(staged)
        count = lambda ops, name: sum(o == name for o in ops)  # noqa: E731
        assert count(s, "UBLKCP.S.G") > count(h, "UBLKCP.S.G") > 0, dt
        assert count(s, "SYNCS.ARRIVE.TRANS64") > count(h, "SYNCS.ARRIVE.TRANS64"), dt
        assert count(s, "SYNCS.PHASECHK.TRANS64.TRYWAIT") > count(h, "SYNCS.PHASECHK.TRANS64.TRYWAIT"), dt
        assert count(s, "FENCE.VIEW.ASYNC.S") > count(h, "FENCE.VIEW.ASYNC.S"), dt
        assert _lds_fed_fadds(staged) >= packs, (dt, arch)  # one per pack a thread folds
        assert _lds_fed_fadds(hunk) == 0, (dt, arch)
        for ops in (h, s):
            assert not [o for o in ops if o.startswith(("LDL", "STL"))], (dt, arch)


def _ops_list(sass_text: str) -> list[str]:
    """Instruction mnemonics of a SASS listing, in program order."""
    return re.findall(r"^\s+/\*[0-9a-f]+\*/\s+(?:@!?U?P\w+\s+)?([A-Z][A-Z0-9_.]+)", sass_text, re.M)


def _limits() -> dict[str, int]:
    """The integer constants of csrc/cuda/mover_limits.h (what the kernel and the launcher use)."""
    text = open(os.path.join(ROOT, "csrc", "cuda", "mover_limits.h")).read()
    return {k: int(v) for k, v in re.findall(r"constexpr (?:int|uint32_t) (k\w+) = (\d+);", text)}


@needs_nvcc
@pytest.mark.parametrize("arch", [90, 100])
def test_tma_ring_depth_and_shared_memory(compiled, arch):
    # issue 34: >= 128 KB of loads in flight per CTA, a stage refilled once the ONE store group
    # that read it is done (cp.async.bulk.wait_group.read N for every N the ring can need:
    # SASS DEPBAR.LE SB0, N for N = 0 .. stages - 1), not once the previous tile's stores are
    # (only N = 0 and 1 before); the deep ring plus static smem fits a CTA, two shared rings an SM
    if arch not in cb.real_archs():
        pytest.skip(f"sm_{arch} not built")
    lim = _limits()
    tile, stages, shared, lag = lim["kTmaTileBytes"], lim["kTmaStages"], lim["kTmaStagesShared"], lim["kTmaStoreGroups"]
    assert (stages - lag) * tile >= 128 * 1024, lim
    static = {int(m) for m in re.findall(r"(\d+) bytes smem", compiled["k_persistent"].log)}
    assert static and max(static) <= 4096, static
    # the staged reduce (reduce_path="tma") adds none: its operands go through this ring, its
    # barriers are the ring's, and every persistent kernel of an architecture declares as much
    # static shared memory as the others
    per_arch = re.findall(
        r"Compiling entry function '\S*k_persistent\S*' for 'sm_(\d+)'.*?(\d+) bytes smem",
        compiled["k_persistent"].log,
        re.S,
    )
    assert len({b for a, b in per_arch if int(a) == arch}) == 1, per_arch
    ring = lambda n: n * (tile + 8)  # noqa: E731  stages, then one mbarrier each
    assert ring(stages) + max(static) <= lim["kSmemPerCtaMax"] == 232448
    assert 2 * (ring(shared) + max(static) + 1024) <= 228 * 1024  # 1 KB reserved per CTA
    for fn, text in cb.kernel_sass(_sass_or_skip(compiled, "k_persistent", arch)).items():
        waits = {int(n, 16) for n in re.findall(r"\bDEPBAR\.LE SB0, (0x[0-9a-f]+)", text)}
        assert waits == set(range(stages)), (fn, sorted(waits))


@needs_nvcc
def test_sass_sm80_vector_path(compiled):
    kernels = cb.kernel_sass(_sass_or_skip(compiled, "k_persistent", 80))
    for fn, text in kernels.items():
        ops = _ops(text)
        assert not {o for o in ops if o.startswith("UBLKCP")}, fn  # no bulk copies before sm_90
        assert {o for o in ops if o.startswith("LDG.E.128")}, fn  # 16-byte vector loads
        assert {o for o in ops if o.startswith("STG.E.128")}, fn  # and stores
        assert {o for o in ops if o.endswith(".64.STRONG.SYS")}, fn


@needs_nvcc
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_sass_reduction_adds_are_plain_rounded_adds(compiled, arch):
    """The ordered reduction is bit-identical to the host executor only if every + is one
    rounded fp32 add: FADDs in the kernels, and no fused multiply-add anywhere (half.h's
    conversions multiply and add separately; a contracted FFMA rounds once instead of twice)."""
    kernels = cb.kernel_sass(_sass_or_skip(compiled, "k_persistent", arch))
    for fn, text in kernels.items():
        ops = _ops(text)
        assert {o for o in ops if o.startswith("FADD")}, fn
        assert not {o for o in ops if o.startswith(("FFMA", "HFMA"))}, (fn, arch)


@needs_nvcc
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_sass_no_noncoherent_loads(compiled, arch):
    # ld.global.nc (SASS: LDG...CONSTANT) may return stale data a peer wrote after the acquire
    for name in compiled:
        text = _sass_or_skip(compiled, name, arch)
        bad = sorted({o for o in _ops(text) if ".CONSTANT" in o or o.startswith("LDG.E.NC")})
        assert not bad, (name, arch, bad)


#: where the kernel parameters start in constant bank 0, per architecture (the ABI's; a toolkit
#: that moves them fails the test below with the offsets it found)
PARAM_BASE = {80: 0x160, 90: 0x210, 100: 0x380}
PERSISTENT_ARGS_BYTES = 48 + 4 * 64  # persistent_args.h PersistentArgs: the header, cta_end[kMaxLoopbackRanks]


@needs_nvcc
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_sass_rank_lookup_reads_the_parameter_space(compiled, arch):
    # the per-rank CTA layout (PersistentArgs::cta_end, indexed by a runtime rank in cta_rank) is
    # read from the __grid_constant__ parameter itself: LDC with a register index into constant
    # bank 0 within the parameter block; never a local copy of the struct (no LDL/STL, no stack
    # frame), and every persistent kernel stays within the 128 registers of two CTAs an SM
    if arch not in cb.real_archs():
        pytest.skip(f"sm_{arch} not built")
    lo, hi = PARAM_BASE[arch], PARAM_BASE[arch] + PERSISTENT_ARGS_BYTES
    kernels = {f: t for f, t in cb.kernel_sass(_sass_or_skip(compiled, "k_persistent", arch)).items()}
    assert len(kernels) == 6, sorted(kernels)
    for fn, text in kernels.items():
        indexed = [int(d, 16) for d in re.findall(r"\bLDC(?:\.\w+)*\s+R\d+,\s*c\[0x0\]\[R\d+\+0x([0-9a-f]+)\]", text)]
        assert [d for d in indexed if lo <= d < hi], (fn, [hex(d) for d in indexed])
        assert not re.search(r"\b(LDL|STL)(\.\w+)*\s", text), fn
    regs = {
        f: int(re.search(r"Used (\d+) registers", p).group(1))
        for (a, f), p in cb.ptxas_functions(compiled["k_persistent"].log).items()
        if a == f"sm_{arch}" and "k_persistent" in f
    }
    assert len(regs) == 6 and max(regs.values()) <= 128, regs


@needs_nvcc
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_sass_join_by_first_ticket(compiled, arch):
    # the CTA that joins (publishes ready[op]) is elected by a ticket, RankState::join_ticket,
    # not by blockIdx: beside the two last-to-arrive counters (done_workers, done_ctas) each
    # kernel holds a third 32-bit device-scope atomic add (two when worker 0 joined), and the
    # 64-bit one of the claims (tiles, issue 34); plus one 32-bit add per tile retire site
    # (interp.h retire_tile: a split copy task's and a split reduce task's last-tile counter)
    for fn, text in cb.kernel_sass(_sass_or_skip(compiled, "k_persistent", arch)).items():
        adds32 = re.findall(r"\bATOM\.E\.ADD\.STRONG\.GPU\b", text)
        adds64 = re.findall(r"\bATOM\.E\.ADD\.64\.STRONG\.GPU\b", text)
        assert (len(adds32), len(adds64)) == (3 + 2, 1), (fn, len(adds32), len(adds64))


def _instructions(sass_text: str) -> list[tuple[int, str]]:
    """(address, instruction) of every line of a SASS listing, in program order."""
    return [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"^\s+/\*([0-9a-f]+)\*/\s+(.*?);", sass_text, re.M)]


def _loop_spans(sass_text: str) -> list[tuple[int, int]]:
    """Innermost loops of a SASS listing as (first, last) addresses: a backward branch's target
    and the branch, for branches whose range holds no other backward branch."""
    back = []
    for addr, ins in _instructions(sass_text):
        m = re.search(r"\bBRA\b.*?0x([0-9a-f]+)\s*$", ins)
        if m and int(m.group(1), 16) <= addr:
            back.append((int(m.group(1), 16), addr))
    return [(lo, hi) for lo, hi in back if not any(lo <= l2 and h2 <= hi and (l2, h2) != (lo, hi) for l2, h2 in back)]


def _loops(sass_text: str) -> list[list[str]]:
    """Innermost loops of a SASS listing: the instructions from a backward branch's target to the
    branch, for branches whose range holds no other backward branch."""
    lines = _instructions(sass_text)
    return [[ins for addr, ins in lines if lo <= addr <= hi] for lo, hi in _loop_spans(sass_text)]


@needs_nvcc
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_sass_drain_scans_flags_with_every_thread(compiled, arch):
    # issue 34's drain (interp.h drain -> mover_common.cuh first_below): every thread polls its
    # strided share of a slot's chunk flags relaxed (LD...64.STRONG.SYS, no CCTL.IVALL or MEMBAR
    # in the loop), acquires once after the loop (MEMBAR.ALL.SYS + CCTL.IVALL: the one acquire
    # of what it saw), then the CTA votes (__syncthreads_or: BAR.RED.OR, the kernel's only one)
    # -- not a leader acquiring flag by flag between two barriers
    for fn, text in cb.kernel_sass(_sass_or_skip(compiled, "k_persistent", arch)).items():
        lines = _instructions(text)
        votes = [addr for addr, ins in lines if re.match(r"BAR\.RED\.OR\b", ins)]
        assert len(votes) == 1, (fn, votes)  # first_below's vote, inlined once (drain is called once)
        scans = [(lo, hi) for lo, hi in _loop_spans(text) if hi < votes[0]]
        assert scans, f"{fn}: no loop before the drain's vote"
        lo, hi = max(scans, key=lambda span: span[1])  # the innermost loop that ends last before the vote
        body = [ins for addr, ins in lines if lo <= addr <= hi]
        assert sum(bool(re.search(r"\bLDG?\.E\.64\.STRONG\.SYS\b", i)) for i in body) == 1, (fn, body)
        assert not any("CCTL" in i or "MEMBAR" in i or re.match(r"BAR\b", i) for i in body), (fn, body)
        between = [ins for addr, ins in lines if hi < addr < votes[0]]
        assert sum("CCTL.IVALL" in i for i in between) == 1 and any("MEMBAR.ALL.SYS" in i for i in between), (
            fn,
            between,
        )
        assert not any(re.search(r"\bLDG?\.E\.64\.STRONG", i) for i in between), (fn, between)  # no acquire load


@needs_nvcc
@pytest.mark.parametrize("arch", [80, 90, 100])
def test_sass_load_exchange_flags(compiled, arch):
    # k_load_exchange (moe/board_layout.py protocol; one instantiation per rank capacity: 1, 64,
    # 288): the flags after the pushed counts are ONE fence (MEMBAR.ALL.SYS) and relaxed
    # system-scope stores (ST...64.STRONG.SYS); the wait polls relaxed (LD...64.STRONG.SYS with
    # no CCTL.IVALL in the spin) then acquires once (CCTL.IVALL after the loop); the counts move
    # as 16-byte vectors both ways, the read-back with several loads in flight before its
    # stores; the failure status is one CAS
    kernels = cb.kernel_sass(_sass_or_skip(compiled, "k_loads", arch))
    assert len(kernels) == 3 and all("k_load_exchange" in k for k in kernels), list(kernels)
    for name, text in kernels.items():
        ops = _ops(text)
        assert {o for o in ops if o.startswith("ST") and o.endswith(".64.STRONG.SYS")}, (name, ops)
        assert {o for o in ops if o.startswith("LD") and o.endswith(".64.STRONG.SYS")}, (name, ops)
        assert len(re.findall(r"\bMEMBAR\.ALL\.SYS\b", text)) == 1, name  # one fence for every board's flag
        assert {o for o in ops if o.startswith("ATOMG") and ".CAS" in o}, (name, ops)
        spins = [body for body in _loops(text) if any(re.search(r"\bLDG?\.E\.64\.STRONG\.SYS\b", i) for i in body)]
        assert spins, f"{name}: no polling loop found"
        for body in spins:
            assert not any("CCTL.IVALL" in i or "MEMBAR" in i for i in body), (name, body)  # relaxed polls
        assert "CCTL.IVALL" in text, name  # the one acquire after the poll
        stores = [o for o in ops if re.match(r"STG?\.E\.128", o)]
        loads = re.findall(r"\bLDG?\.E\.128\b", text)
        assert stores and len(loads) >= 8, (name, stores, len(loads))  # post + kCopyBatch read-back loads
        seq = re.findall(r"\b(LDG?|STG?)\.E\.128\b", text)  # 128-bit accesses in program order
        run = best = 0
        for op in seq:
            run = run + 1 if op.startswith("LD") else 0
            best = max(best, run)
        assert best >= 8, (name, seq)  # kCopyBatch loads in flight before the read-back's stores


def test_inline_asm_only_in_ptx_extra():
    files = glob.glob(os.path.join(ROOT, "csrc", "cuda", "*")) + glob.glob(
        os.path.join(ROOT, "include", "ultracomm", "**", "*.h"), recursive=True
    )
    assert files
    offenders = []
    for f in files:
        if os.path.basename(f) == "ptx_extra.cuh":
            continue
        text = re.sub(r"//[^\n]*", "", open(f).read())  # comments may name it
        if re.search(r"\basm\s*(volatile\s*)?\(", text) or "__asm__" in text:
            offenders.append(os.path.relpath(f, ROOT))
    assert not offenders, f"inline asm outside csrc/cuda/ptx_extra.cuh: {offenders}"


def test_no_restrict_on_device_data_paths():
    # __restrict__ on memory a peer writes turns loads into ld.global.nc
    for f in glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu*")):
        assert "__restrict__" not in re.sub(r"//[^\n]*", "", open(f).read()), f


def _cuda_module():
    try:
        from ultracomm import _cuda
    except ImportError as e:
        pytest.skip(f"ultracomm._cuda not built in this install ({e})")
    return _cuda


def test_cuda_module_imports_and_reports_availability():
    _cuda = _cuda_module()
    ok, why = _cuda.available(0)
    assert isinstance(ok, bool) and isinstance(why, str)
    assert _cuda.ERROR_RECORD_BYTES == 72 and _cuda.THREADS_PER_CTA == 256
    assert _cuda.TMA_TILE_BYTES % 16 == 0 and _cuda.TMA_STAGES >= 2  # bulk copies: 16-B sizes, double-buffered
    if not torch.cuda.is_available():
        assert not ok and why, "no GPU here: available() must say why"


def test_cuda_module_links_no_libcuda_cudart_or_torch():
    _cuda = _cuda_module()
    p = subprocess.run(["ldd", _cuda.__file__], capture_output=True, text=True)
    if p.returncode != 0:
        pytest.skip("ldd unavailable")
    for lib in ("libcuda.so", "libcudart.so", "libtorch", "libc10"):
        assert lib not in p.stdout, p.stdout


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the error on a machine without a GPU")
def test_tma_without_gpu_raises_clear_error():
    from ultracomm.cuda.support import NotAvailableError, cuda_runtime
    from ultracomm.errors import UltracommError

    with pytest.raises(
        NotAvailableError, match="the tma transport is not available: .*(CPU build|no CUDA device|driver)"
    ):
        cuda_runtime(0)
    assert issubclass(NotAvailableError, UltracommError)


def test_tma_transport_refuses_a_host_window():
    from ultracomm.transports.tma import TmaTransport

    class HostWin:
        provider = "host_shm"
        local = torch.zeros(16, dtype=torch.uint8)
        peer_bases = [0]

    with pytest.raises(ValueError, match="needs a GPU window"):
        TmaTransport(rank=0, world=1, window=HostWin(), wlayout={}, layout=None, num_workers=1, timeout_s=1.0)


def test_build_inplace_builds_cuda_with_cmake_flags():
    script = os.path.join(ROOT, "scripts", "build_inplace.py")
    p = subprocess.run([sys.executable, script, "--dry-run"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    out = p.stdout
    for src in cb.sources():
        assert os.path.basename(src) in out
    if cb.find_nvcc() is not None:
        for f in cb.nvcc_flags():
            assert f in out, f
        for a in cb.real_archs():
            assert f"sm_{a}" in out
        assert "_cuda" in out and "cudart_static" in out


def test_build_inplace_builds_only_the_architecture_gpu_check_asks_for():
    """scripts/gpu_check.sh exports SKBUILD_CMAKE_DEFINE=ULTRACOMM_CUDA_ARCHITECTURES=<the GPU's>-real
    for the pip build; its fallback build must honour it too (it compiled every CI architecture:
    three times the device time)."""
    if cb.find_nvcc() is None:
        pytest.skip("no nvcc: build_inplace prints no _cuda commands")
    script = os.path.join(ROOT, "scripts", "build_inplace.py")
    for define in ("ULTRACOMM_CUDA_ARCHITECTURES=90-real", "FOO=1;ULTRACOMM_CUDA_ARCHITECTURES=90-real;BAR=x"):
        env = dict(os.environ, SKBUILD_CMAKE_DEFINE=define)
        out = subprocess.run([sys.executable, script, "--dry-run"], capture_output=True, text=True, env=env).stdout
        archs = set(re.findall(r"-gencode=arch=compute_\w+,code=(\w+)", out))
        assert archs == {"sm_90"}, (define, archs)
