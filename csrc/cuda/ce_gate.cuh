// The copy_engine transport's gate kernel (issue 35): one wait-then-act step of an internal
// stream that a local abort can release and that then does nothing.
//
// Not part of the _cuda build (a .cuh: CMake globs cuda/*.cu).  Its PTX is embedded in
// python/ultracomm/transports/copy_engine/gate.py, loaded with cuModuleLoadData and launched with
// cuLaunchKernel (tests/transports/test_copy_engine_gate.py checks the embedded PTX is this file's, and that
// ptxas compiles it without spills).
//
// A gate replaces "cuStreamWaitValue64(peer word); cuMemcpyAsync(...); cuStreamWriteValue64(flag)"
// on an internal stream, whose wait only the peer could release.  desc (pinned host memory, read
// once) = [n_waits, n_copies, n_writes, 0,
//          n_waits  x (addr, value, mode: 0 GEQ (cyclic), 1 EQ),
//          n_copies x (dst, src, bytes),
//          n_writes x (addr, value)]
// value == ~0ull stands for `epoch`.  *abort (a host-mapped word this process's watchdog writes)
// != 0 releases every wait; a gate that sees it, at entry or while waiting, skips its copies and
// writes (nothing reaches a peer after an abort), so the stream drains at once.  One CTA: the
// writes follow every thread's copies (bar.sync, then a system-scope fence).
#include <cuda/atomic>
#include <cstdint>

namespace uc_gate {
constexpr unsigned long long kEpoch = ~0ull;
constexpr unsigned kAbortEvery = 64;  // spins between reads of the abort word (over PCIe)
using SysRef = cuda::atomic_ref<unsigned long long, cuda::thread_scope_system>;

// ld.relaxed.sys / st.relaxed.sys / fence.acq_rel.sys through libcu++ (no inline asm outside
// ptx_extra.cuh; this file is built on its own)
__device__ __forceinline__ unsigned long long ld_relaxed_sys(const unsigned long long* p) {
  return SysRef(*const_cast<unsigned long long*>(p)).load(cuda::memory_order_relaxed);
}
__device__ __forceinline__ void st_relaxed_sys(unsigned long long* p, unsigned long long v) {
  SysRef(*p).store(v, cuda::memory_order_relaxed);
}
__device__ __forceinline__ void fence_sys() {
  cuda::atomic_thread_fence(cuda::memory_order_acq_rel, cuda::thread_scope_system);
}
}  // namespace uc_gate

extern "C" __global__ void __launch_bounds__(256)
    uc_ce_gate(const unsigned long long* desc, unsigned long long epoch, const unsigned long long* abort_word) {
  using namespace uc_gate;
  __shared__ int go;
  const unsigned n_waits = static_cast<unsigned>(desc[0]);
  const unsigned n_copies = static_cast<unsigned>(desc[1]);
  const unsigned n_writes = static_cast<unsigned>(desc[2]);
  const unsigned long long* w = desc + 4;
  const unsigned long long* c = w + 3ull * n_waits;
  const unsigned long long* r = c + 3ull * n_copies;
  if (threadIdx.x == 0) {
    int ok = ld_relaxed_sys(abort_word) == 0;
    for (unsigned i = 0; ok && i < n_waits; ++i) {
      const unsigned long long* a = reinterpret_cast<const unsigned long long*>(w[3 * i]);
      const unsigned long long want = w[3 * i + 1] == kEpoch ? epoch : w[3 * i + 1];
      const bool eq = w[3 * i + 2] != 0;
      for (unsigned spins = 1;; ++spins) {
        const unsigned long long v = ld_relaxed_sys(a);
        if (eq ? v == want : static_cast<long long>(v - want) >= 0) break;
        if (spins % kAbortEvery == 0 && ld_relaxed_sys(abort_word) != 0) {
          ok = 0;
          break;
        }
        __nanosleep(100);
      }
    }
    if (ok) fence_sys();  // acquire: the peers' bytes behind the flags seen above
    go = ok;
  }
  __syncthreads();
  if (!go) return;
  for (unsigned i = 0; i < n_copies; ++i) {
    char* dst = reinterpret_cast<char*>(c[3 * i]);
    const char* src = reinterpret_cast<const char*>(c[3 * i + 1]);
    const unsigned long long n = c[3 * i + 2];
    unsigned long long head = 0;
    if (((c[3 * i] | c[3 * i + 1]) & 15) == 0) {
      head = n & ~15ull;
      for (unsigned long long o = 16ull * threadIdx.x; o < head; o += 16ull * blockDim.x) {
        *reinterpret_cast<uint4*>(dst + o) = *reinterpret_cast<const uint4*>(src + o);  // ld.global, not .nc
      }
    }
    for (unsigned long long o = head + threadIdx.x; o < n; o += blockDim.x)
      dst[o] = *reinterpret_cast<const volatile char*>(src + o);
  }
  __syncthreads();
  if (threadIdx.x == 0) {
    fence_sys();  // release: the copies above before the flags below
    for (unsigned i = 0; i < n_writes; ++i)
      st_relaxed_sys(reinterpret_cast<unsigned long long*>(r[2 * i]), r[2 * i + 1] == kEpoch ? epoch : r[2 * i + 1]);
  }
}
