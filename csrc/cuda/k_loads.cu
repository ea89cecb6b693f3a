// k_load_exchange: the expert-load all-gather over the load board (layout and protocol:
// load_exchange.h).  One CTA per rank entry; every CTA pushes its rank's tag and counts into
// every board (16-byte vectors), releases one flag per board after one fence, waits (bounded,
// relaxed polls, then one acquire) for every sender's flag in its own board, checks every
// sender's tag against its own and copies the gathered counts out, every thread's loads in
// flight at once.  No host involvement: launch, flags and timeout all stream-ordered on the
// device, capturable in a CUDA graph.
#include <cuda/atomic>

#include <atomic>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "launch.h"
#include "load_exchange.h"
#include "ptx_extra.cuh"

namespace ultracomm {
namespace {

constexpr int kLoadThreads = 256;
constexpr int kSpinsPerCheck = 32;  // relaxed polls between two deadline checks
constexpr int kCopyBatch = 8;       // read-back: vectors each thread loads before it stores any

// System scope: the flag is read by other GPUs (and, on a host board, other processes).
// Relaxed poll = ld.relaxed.sys (no L1 invalidation per spin); one acquire = ld.acquire.sys
// (LDG...STRONG.SYS + CCTL.IVALL) once the value was seen.
__device__ uint64_t flag_load_relaxed(uintptr_t addr) {
  return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(addr))
      .load(cuda::memory_order_relaxed);
}
__device__ uint64_t flag_load_acquire(uintptr_t addr) {
  return cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(addr))
      .load(cuda::memory_order_acquire);
}
__device__ void flag_store_relaxed(uintptr_t addr, uint64_t v) {
  cuda::atomic_ref<uint64_t, cuda::thread_scope_system>(*reinterpret_cast<uint64_t*>(addr))
      .store(v, cuda::memory_order_relaxed);
}

struct Ctx {
  const LoadExchangeShape& s;
  const LoadRankArgs& r;
  const uintptr_t* base;  // shared memory: every board's base (board q: base[q])
  uint64_t n;             // this exchange's number
  uint64_t first;         // record(n, 0)'s offset in any board: ((n % entries) * world) * record_bytes
  bool vec;               // counts, out, bases and records all 16-byte aligned, E % 4 == 0
};

__device__ uintptr_t record(const Ctx& c, int32_t board, int32_t sender) {
  return c.base[board] + c.first + static_cast<uint64_t>(sender) * c.s.record_bytes;
}

// Counts into every board (thread i: vector i % V of board i / V, so a warp's stores to one
// board are contiguous), tags by thread q into board q; then, after the barrier, warp 0 issues
// one fence.acq_rel.sys and the relaxed flag stores: a reader that acquires n sees the tag and
// all E counts (GPU_NOTES: one fence for N flags, not N release stores).
__device__ void post(const Ctx& c) {
  const int32_t W = c.s.world, E = c.s.num_experts, me = c.r.rank;
  if (c.vec) {
    const int32_t V = E / 4;
    const int4* src = reinterpret_cast<const int4*>(c.r.counts);
    for (int32_t i = threadIdx.x; i < W * V; i += blockDim.x)
      reinterpret_cast<int4*>(record(c, i / V, me) + kLoadHeaderBytes)[i % V] = src[i % V];
  } else {
    for (int32_t i = threadIdx.x; i < W * E; i += blockDim.x)
      reinterpret_cast<int32_t*>(record(c, i / E, me) + kLoadHeaderBytes)[i % E] = c.r.counts[i % E];
  }
  for (int32_t q = threadIdx.x; q < W; q += blockDim.x)
    *reinterpret_cast<uint64_t*>(record(c, q, me) + kLoadTagOffset) = c.r.tag;
  __syncthreads();
  if (threadIdx.x < 32) {
    cuda::atomic_thread_fence(cuda::memory_order_acq_rel, cuda::thread_scope_system);
    for (int32_t q = threadIdx.x; q < W; q += 32) flag_store_relaxed(record(c, q, me), c.n);
  }
}

// The first failure (a timeout, or a tag that differs: a sender out of step) records the rank
// and what it showed; later ones keep the first.
__device__ void fail(const LoadRankArgs& r, int32_t code, int32_t q, uint64_t what) {
  if (atomicCAS(r.status, kLoadStatusOk, code) == kLoadStatusOk) {
    r.status[1] = q;
    r.status[2] = static_cast<int32_t>(what & 0xffffffffu);
    r.status[3] = static_cast<int32_t>(what >> 32);
  }
}

// Thread q waits for sender q's flag in this rank's board (q >= blockDim: strided): relaxed
// polls, the deadline read every kSpinsPerCheck, then one acquire load of the flag and the
// tag compare.  A thread that times out does not stop the others: every sender that did post
// is still read by the time the host looks.
__device__ void await_all(const Ctx& c) {
  for (int32_t q = threadIdx.x; q < c.s.world; q += blockDim.x) {
    const uintptr_t flag = record(c, c.r.rank, q);
    const uint64_t t0 = dev::globaltimer_ns();
    uint64_t seen = flag_load_relaxed(flag);
    for (uint32_t spin = 1; seen < c.n; ++spin) {
      if (spin % kSpinsPerCheck == 0 && dev::globaltimer_ns() - t0 >= c.s.timeout_ns) break;
      seen = flag_load_relaxed(flag);
    }
    if (seen < c.n) {
      fail(c.r, kLoadStatusTimeout, q, seen);
      continue;
    }
    flag_load_acquire(flag);  // orders the tag and counts written before the flag after it
    const uint64_t tag = *reinterpret_cast<const volatile uint64_t*>(flag + kLoadTagOffset);
    if (tag != c.r.tag) fail(c.r, kLoadStatusMismatch, q, tag);
  }
  __syncthreads();  // every acquire happened before any thread reads the records below
}

// Every sender's counts from this rank's board into out [world, E]: the W * E / 4 vectors
// spread over all threads, kCopyBatch loads issued before the first store (out may alias the
// board as far as the compiler knows, so it would not hoist them itself).
template <class T, int kPer>
__device__ void read_back(const Ctx& c) {
  const int32_t row = c.s.num_experts / kPer, total = c.s.world * row;
  T* out = reinterpret_cast<T*>(c.r.out);
  for (int32_t i0 = threadIdx.x; i0 < total; i0 += kCopyBatch * blockDim.x) {
    T v[kCopyBatch];
#pragma unroll
    for (int32_t k = 0; k < kCopyBatch; ++k) {
      const int32_t i = i0 + k * static_cast<int32_t>(blockDim.x);
      if (i < total) v[k] = reinterpret_cast<const T*>(record(c, c.r.rank, i / row) + kLoadHeaderBytes)[i % row];
    }
#pragma unroll
    for (int32_t k = 0; k < kCopyBatch; ++k) {
      const int32_t i = i0 + k * static_cast<int32_t>(blockDim.x);
      if (i < total) out[i] = v[k];
    }
  }
}

// __grid_constant__: the rank entries are read in place from the parameter bank (CTA r reads
// entry r), never copied to local memory.
template <int N>
__global__ void __launch_bounds__(kLoadThreads, 1) k_load_exchange(const __grid_constant__ LoadExchangeParams<N> a) {
#if defined(__CUDA_ARCH__)
  __shared__ uintptr_t staged[kMaxExchangeRanks];  // board bases (a larger world reads them from global)
  // PDL (pdl.h): launched without the attribute, so the wait returns at once; it is here so the
  // kernel stays correct if a launch ever carries it (the counts' producer done before any read)
  dev::grid_dependency_wait();
  const LoadRankArgs& r = a.ranks[blockIdx.x];
  const LoadExchangeShape& s = a.s;
  const uint64_t n = *r.seq + 1;  // read by every thread before thread 0 advances it below
  if (threadIdx.x == 0) r.status[0] = kLoadStatusOk;
  const bool fits = s.world <= kMaxExchangeRanks;
  bool misaligned = false;
  for (int32_t q = threadIdx.x; q < s.world; q += blockDim.x) {
    const uintptr_t b = r.bases[q];
    if (fits) staged[q] = b;
    misaligned = misaligned || (b % 16) != 0;
  }
  const bool vec = !__syncthreads_or(misaligned) && s.num_experts % 4 == 0 && s.record_bytes % 16 == 0 &&
                   reinterpret_cast<uintptr_t>(r.counts) % 16 == 0 && reinterpret_cast<uintptr_t>(r.out) % 16 == 0;
  const Ctx c{s,
              r,
              fits ? staged : r.bases,
              n,
              (n % static_cast<uint64_t>(s.entries)) * static_cast<uint64_t>(s.world) * s.record_bytes,
              vec};
  post(c);
  // the planner (k_quota_plan, launched with PDL) may now be scheduled: it waits in
  // griddepcontrol.wait until this grid completed (every CTA is resident already: a CTA that
  // issues this runs, so a loopback exchange's co-residency is not at stake)
  dev::launch_dependents();
  await_all(c);
  if (vec)
    read_back<int4, 4>(c);
  else
    read_back<int32_t, 1>(c);
  if (threadIdx.x == 0) *r.seq = n;  // the next exchange on this stream runs n + 1
#endif
}

template <int N>
void launch_n(const LoadExchangeArgs& a, cudaStream_t stream) {
  LoadExchangeParams<N> p;
  p.s = a.s;
  for (int32_t i = 0; i < a.s.nranks; ++i) p.ranks[i] = a.ranks[i];
  if (a.s.nranks == 1) {  // one rank per process: nothing in this launch waits on another CTA
    k_load_exchange<N><<<1, kLoadThreads, 0, stream>>>(p);
    UC_CUDA_CHECK(cudaGetLastError());
    return;
  }
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = dim3(static_cast<unsigned>(a.s.nranks));
  cfg.blockDim = dim3(kLoadThreads);
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeCooperative;  // every rank's CTA resident at once, or the launch fails
  attr[0].val.cooperative = 1;
  cfg.attrs = attr;
  // Not while the stream is captured into a graph (as the persistent kernel's loopback launch,
  // which ran captured on an H200): the occupancy check (check_and_launch) is what holds there.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  UC_CUDA_CHECK(cudaStreamIsCapturing(stream, &capture));
  cfg.numAttrs = capture == cudaStreamCaptureStatusNone ? 1 : 0;
  UC_CUDA_CHECK(cudaLaunchKernelEx(&cfg, k_load_exchange<N>, p));
}

// CTAs of k_load_exchange<N> resident at once on the current device, cached per device (the
// query is not a stream operation, but a capture should not pay for it each time).
template <int N>
int max_coresident() {
  static std::atomic<int> cache[64];
  int device = 0;
  UC_CUDA_CHECK(cudaGetDevice(&device));
  std::atomic<int>& slot = cache[device & 63];
  int v = slot.load(std::memory_order_relaxed);
  if (v > 0) return v;
  int per_sm = 0, sms = 0;
  UC_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, k_load_exchange<N>, kLoadThreads, 0));
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  v = per_sm * sms;
  slot.store(v, std::memory_order_relaxed);
  return v;
}

template <int N>
void check_and_launch(const LoadExchangeArgs& a, cudaStream_t stream) {
  if (a.s.nranks > 1) {
    const int fit = max_coresident<N>();
    if (a.s.nranks > fit)
      throw std::invalid_argument(
          "ultracomm._cuda.load_exchange: a loopback exchange of " + std::to_string(a.s.nranks) +
          " ranks needs every rank's CTA resident at once (each waits for all the others), but this GPU holds " +
          std::to_string(fit) + " k_load_exchange CTAs of " + std::to_string(kLoadThreads) +
          " threads at once: run fewer ranks per GPU");
  }
  launch_n<N>(a, stream);
}

}  // namespace

namespace gpu {

int load_exchange_max_coresident(int32_t nranks) {
  if (nranks <= 1) return max_coresident<1>();
  return nranks <= 64 ? max_coresident<64>() : max_coresident<kMaxExchangeRanks>();
}

void launch_load_exchange(const LoadExchangeArgs& a, cudaStream_t stream) {
  if (a.s.nranks == 1)
    check_and_launch<1>(a, stream);
  else if (a.s.nranks <= 64)
    check_and_launch<64>(a, stream);
  else
    check_and_launch<kMaxExchangeRanks>(a, stream);
}

}  // namespace gpu
}  // namespace ultracomm
