// Microkernels for perf/bench_gpu.py: the launch floor and the flag round trip between two
// CTAs with the same system-scope release/acquire the movers use (mover_common.cuh).  The
// copy / fan-out / reduction / relay-chain measurements run real schedules through
// k_persistent instead (ultracomm.cuda.loopback).
#include <cuda/atomic>

#include "cuda_check.h"
#include "launch.h"
#include "ptx_extra.cuh"

namespace ultracomm {
namespace {

__global__ void k_empty() {}

__device__ uint64_t acquire(uint64_t* p) {
  return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*p).load(cuda::memory_order_acquire);
}
__device__ void release(uint64_t* p, uint64_t v) {
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*p).store(v, cuda::memory_order_release);
}

// CTA 0: ping = base + i, wait pong >= base + i; CTA 1: wait ping >= base + i, pong = base + i.
// One thread each.  A wait past timeout_ns stops both (the other times out too) and reports.
__global__ void k_flag_pingpong(uint64_t* ping, uint64_t* pong, uint64_t base, int64_t iters, uint64_t timeout_ns,
                                uint64_t* out) {
#if defined(__CUDA_ARCH__)
  if (threadIdx.x != 0) return;
  const bool first = blockIdx.x == 0;
  uint64_t* mine = first ? ping : pong;
  uint64_t* theirs = first ? pong : ping;
  const uint64_t t0 = dev::globaltimer_ns();
  uint64_t failed = 0;
  for (int64_t i = 1; i <= iters && !failed; ++i) {
    const uint64_t v = base + static_cast<uint64_t>(i);
    if (first) release(mine, v);
    const uint64_t start = dev::globaltimer_ns();
    while (acquire(theirs) < v) {
      if (dev::globaltimer_ns() - start > timeout_ns) {
        failed = static_cast<uint64_t>(i);
        break;
      }
    }
    if (!first && !failed) release(mine, v);
  }
  if (first) {
    out[0] = dev::globaltimer_ns() - t0;
    out[1] = failed;
  }
#endif
}

}  // namespace

namespace gpu {

void launch_empty(cudaStream_t stream) {
  k_empty<<<1, 1, 0, stream>>>();
  UC_CUDA_CHECK(cudaGetLastError());
}

void launch_flag_pingpong(uint64_t* ping, uint64_t* pong, uint64_t base, int64_t iters, uint64_t timeout_ns,
                          uint64_t* out, cudaStream_t stream) {
  // cooperative: both CTAs resident at once, or the launch fails (never a silent spin)
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(2);
  cfg.blockDim = dim3(32);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  UC_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k_flag_pingpong, ping, pong, base, iters, timeout_ns, out));
}

}  // namespace gpu
}  // namespace ultracomm
