// k_load_exchange: the expert-load all-gather over the load board (layout and protocol:
// load_exchange.h).  One CTA per rank entry; every CTA pushes its rank's tag and counts into
// every board, releases one flag per board, waits (bounded) for every sender's flag in its own
// board, checks every sender's tag against its own and copies the gathered counts out.  No host
// involvement: launch, flags and timeout all stream-ordered on the device, capturable in a CUDA
// graph.
#include <cuda/atomic>

#include "cuda_check.h"
#include "launch.h"
#include "load_exchange.h"
#include "ptx_extra.cuh"

namespace ultracomm {
namespace {

constexpr int kLoadThreads = 256;

// System scope: the flag is read by other GPUs (and, on a host board, other processes).
__device__ uint64_t flag_acquire(uintptr_t addr) {
  return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(addr))
      .load(cuda::memory_order_acquire);
}
__device__ void flag_release(uintptr_t addr, uint64_t v) {
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(addr))
      .store(v, cuda::memory_order_release);
}

__device__ uintptr_t record(const LoadExchangeArgs& a, uintptr_t base, uint64_t n, int32_t sender) {
  const uint64_t e = n % static_cast<uint64_t>(a.entries);
  return base + (e * static_cast<uint64_t>(a.world) + static_cast<uint64_t>(sender)) * a.record_bytes;
}

// Every thread pushes a stripe of the counts into every board (and thread q the tag into board
// q); each thread's writes are made visible system-wide (fence) before the barrier, after which
// one thread per board releases its flag: a reader that acquires n sees the tag and all E counts.
__device__ void post(const LoadExchangeArgs& a, const LoadRankArgs& r, uint64_t n) {
  for (int32_t q = 0; q < a.world; ++q) {
    const uintptr_t rec = record(a, r.bases[q], n, r.rank);
    int32_t* dst = reinterpret_cast<int32_t*>(rec + kLoadHeaderBytes);
    for (int32_t i = threadIdx.x; i < a.num_experts; i += blockDim.x) dst[i] = r.counts[i];
  }
  for (int32_t q = threadIdx.x; q < a.world; q += blockDim.x)
    *reinterpret_cast<uint64_t*>(record(a, r.bases[q], n, r.rank) + kLoadTagOffset) = r.tag;
  cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_system);
  __syncthreads();
  for (int32_t q = threadIdx.x; q < a.world; q += blockDim.x) flag_release(record(a, r.bases[q], n, r.rank), n);
}

// Thread q waits for sender q's flag in this rank's board (q >= blockDim: strided), then
// compares sender q's tag with this rank's.  The first failure (a timeout, or a tag that
// differs: a sender out of step) records the rank and what it showed; the others keep waiting
// out their own deadline so that every sender that did post is still read by the time the host
// looks.
__device__ void await_all(const LoadExchangeArgs& a, const LoadRankArgs& r, uint64_t n) {
  const uintptr_t own = r.bases[r.rank];
  for (int32_t q = threadIdx.x; q < a.world; q += blockDim.x) {
    const uintptr_t flag = record(a, own, n, q);
    const uint64_t t0 = dev::globaltimer_ns();
    uint64_t seen = flag_acquire(flag);
    while (seen < n) {
      if (dev::globaltimer_ns() - t0 >= a.timeout_ns) {
        if (atomicCAS(r.status, kLoadStatusOk, kLoadStatusTimeout) == kLoadStatusOk) {
          r.status[1] = q;
          r.status[2] = static_cast<int32_t>(seen & 0xffffffffu);
          r.status[3] = static_cast<int32_t>(seen >> 32);
        }
        break;
      }
      seen = flag_acquire(flag);
    }
    if (seen >= n) {  // acquired: the tag written before the flag is visible
      const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(flag + kLoadTagOffset);
      if (tag != r.tag && atomicCAS(r.status, kLoadStatusOk, kLoadStatusMismatch) == kLoadStatusOk) {
        r.status[1] = q;
        r.status[2] = static_cast<int32_t>(tag & 0xffffffffu);
        r.status[3] = static_cast<int32_t>(tag >> 32);
      }
    }
  }
  __syncthreads();  // every acquire happened before any thread reads the records below
}

__global__ void __launch_bounds__(kLoadThreads, 1) k_load_exchange(const LoadExchangeArgs a) {
#if defined(__CUDA_ARCH__)
  const LoadRankArgs& r = a.ranks[blockIdx.x];
  const uint64_t n = *r.seq + 1;  // read by every thread before thread 0 advances it below
  if (threadIdx.x == 0) r.status[0] = kLoadStatusOk;
  __syncthreads();
  post(a, r, n);
  await_all(a, r, n);
  const uintptr_t own = r.bases[r.rank];
  for (int32_t q = 0; q < a.world; ++q) {
    const int32_t* src = reinterpret_cast<const int32_t*>(record(a, own, n, q) + kLoadHeaderBytes);
    for (int32_t i = threadIdx.x; i < a.num_experts; i += blockDim.x)
      r.out[static_cast<int64_t>(q) * a.num_experts + i] = src[i];
  }
  if (threadIdx.x == 0) *r.seq = n;  // the next exchange on this stream runs n + 1
#endif
}

}  // namespace

namespace gpu {

void launch_load_exchange(const LoadExchangeArgs& a, cudaStream_t stream) {
  k_load_exchange<<<static_cast<unsigned>(a.nranks), kLoadThreads, 0, stream>>>(a);
  UC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gpu
}  // namespace ultracomm
