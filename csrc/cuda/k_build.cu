// The device control plane's schedule builder on the GPU: include/ultracomm/impl/sched_build.h (and
// slot_build.h), the source the host build (`_core.build_schedule_portable`) runs, here on one CTA
// of psched::kBlockThreads threads: block reductions and scans over the CTA, one candidate tree
// per warp.  The scratch lives in dynamic shared memory when launch_shape() says it fits (EP64:
// 8 candidate warps in ~35 KB), else in the caller's global scratch.  It reads the plan from
// device memory and writes this rank's task lists, refs and digest into caller memory (a plan
// arena slot): no host involvement, no allocation, capturable in a CUDA graph.
#include <cuda/atomic>

#include "cuda_check.h"
#include "k_build.h"
#include "pdl.h"
#include "ptx_extra.cuh"
#include "ultracomm/impl/sched_build.h"

namespace ultracomm {
namespace {

constexpr int32_t kWarps = psched::kBlockThreads / 32;
static_assert(psched::kBlockThreads % 32 == 0 && kWarps >= psched::kMaxWarps, "a candidate tree per warp");

// psched warp group: the 32 lanes of one warp (all active: the launch is kBlockThreads threads).
struct WarpSub {
  __device__ __forceinline__ int32_t lane() const { return static_cast<int32_t>(threadIdx.x & 31u); }
  __device__ __forceinline__ int32_t width() const { return 32; }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
  __device__ __forceinline__ int64_t max(int64_t v) const {
    for (int32_t d = 16; d > 0; d >>= 1) {
      const int64_t o = __shfl_xor_sync(0xffffffffu, v, d);
      v = o > v ? o : v;
    }
    return v;
  }
};

// psched block group: the CTA.  Reductions and the scan go through warp shuffles and one
// shared word per warp, with a barrier after the read so the next call may rewrite them.
struct CtaGroup {
  __device__ __forceinline__ int32_t lane() const { return static_cast<int32_t>(threadIdx.x); }
  __device__ __forceinline__ int32_t width() const { return psched::kBlockThreads; }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ int64_t max(int64_t v) const {
    __shared__ int64_t part[kWarps];
    v = WarpSub{}.max(v);
    if ((threadIdx.x & 31u) == 0) part[threadIdx.x >> 5] = v;
    __syncthreads();
    v = part[0];
    for (int32_t w = 1; w < kWarps; ++w) v = part[w] > v ? part[w] : v;
    __syncthreads();
    return v;
  }
  __device__ __forceinline__ int64_t sum(int64_t v) const {
    int64_t t = 0;
    scan(v, t);
    return t;
  }
  // Exclusive prefix in lane (thread) order.
  __device__ __forceinline__ int64_t scan(int64_t v, int64_t& total) const {
    __shared__ int64_t part[kWarps];
    const int32_t ln = static_cast<int32_t>(threadIdx.x & 31u), wp = static_cast<int32_t>(threadIdx.x >> 5);
    int64_t x = v;  // inclusive within the warp
    for (int32_t d = 1; d < 32; d <<= 1) {
      const int64_t o = __shfl_up_sync(0xffffffffu, x, d);
      x += ln >= d ? o : 0;
    }
    if (ln == 31) part[wp] = x;
    __syncthreads();
    int64_t before = x - v;
    total = 0;
    for (int32_t w = 0; w < kWarps; ++w) {
      before += w < wp ? part[w] : 0;
      total += part[w];
    }
    __syncthreads();
    return before;
  }
  __device__ __forceinline__ int32_t add(int32_t* p, int32_t v) const { return atomicAdd(p, v); }
  __device__ __forceinline__ void amax(int32_t* p, int32_t v) const { atomicMax(p, v); }
  __device__ __forceinline__ int32_t warps() const { return kWarps; }
  __device__ __forceinline__ int32_t warp_id() const { return static_cast<int32_t>(threadIdx.x >> 5); }
  __device__ __forceinline__ WarpSub sub() const { return WarpSub{}; }
};

// The scratch: dynamic shared memory when the launch gave it, else the caller's global buffer.
__device__ __forceinline__ int64_t* scratch_of(int64_t* global, uint32_t smem_bytes) {
  extern __shared__ int64_t smem_scratch[];
  return smem_bytes != 0 ? smem_scratch : global;
}

__global__ void __launch_bounds__(psched::kBlockThreads, 1)
    k_build_schedule(gpu::BuildArgs a, int32_t warps, uint32_t smem_bytes) {
#if defined(__CUDA_ARCH__)
  const psched::OpOut mc{a.tasks[0], a.task_cap[0], a.refs[0], a.ref_cap[0]};
  const psched::OpOut rd{a.tasks[1], a.task_cap[1], a.refs[1], a.ref_cap[1]};
  const psched::Result res = psched::build(a.problem, scratch_of(a.scratch, smem_bytes), mc, rd, CtaGroup{}, warps);
  if (threadIdx.x == 0) *a.result = res;
#endif
}

// The device step's build (slot_build.h), written into the arena slot's views; thread 0 reports.
__global__ void __launch_bounds__(psched::kBlockThreads, 1)
    k_build_slot(gpu::SlotBuildArgs a, int32_t warps, uint32_t smem_bytes) {
#if defined(__CUDA_ARCH__)
  // PDL (pdl.h): the plan (and the exchange's status word) are complete and visible after the
  // wait, before the scratch or the views are touched; then the reroute may be scheduled
  dev::grid_dependency_wait();
  dev::launch_dependents();
  const int32_t upstream = psched::upstream_status(a.exchange_status, a.plan_result);
  const psched::Result res = psched::build_into_views(a.problem, scratch_of(a.scratch, smem_bytes), a.views, a.caps,
                                                      upstream, CtaGroup{}, warps);
  if (threadIdx.x != 0) return;
  using Word = cuda::atomic_ref<uint64_t, cuda::thread_scope_system>;
  if (res.status != psched::kOk) {  // sequence lock: odd while written (slot_build.h BuildReport)
    Word(a.report->failed_seq).fetch_add(1, cuda::memory_order_relaxed);
    __threadfence_system();
    a.report->failed = res;
    __threadfence_system();
    Word(a.report->failed_seq).fetch_add(1, cuda::memory_order_release);
  }
  a.report->result = res;
  // the host reads the generation, then the result: publish the result first (the other threads'
  // view writes are ordered before this fence by build_into_views' last barrier)
  __threadfence_system();
  Word(a.report->generation).fetch_add(1, cuda::memory_order_release);
#endif
}

// The launch of a problem: one CTA; shared-memory scratch when it fits (launch_shape).
psched::LaunchShape shape_of(const psched::Problem& p) { return psched::launch_shape(p.world, p.slots, p.num_experts); }

}  // namespace

namespace gpu {

int64_t build_scratch_bytes(int32_t world, int32_t slots, int32_t experts) {
  return 8 * psched::scratch_words(world, slots, experts);
}

void launch_build_schedule(const BuildArgs& a, cudaStream_t stream) {
  const psched::LaunchShape ls = shape_of(a.problem);
  k_build_schedule<<<1, ls.threads, static_cast<size_t>(ls.smem_bytes), stream>>>(a, ls.warps,
                                                                                  static_cast<uint32_t>(ls.smem_bytes));
  UC_CUDA_CHECK(cudaGetLastError());
}

void launch_build_slot(const SlotBuildArgs& a, cudaStream_t stream) {
  const psched::LaunchShape ls = shape_of(a.problem);
  launch_programmatic(programmatic_launch_here(), k_build_slot, dim3(1), dim3(static_cast<unsigned>(ls.threads)),
                      static_cast<size_t>(ls.smem_bytes), stream, a, ls.warps, static_cast<uint32_t>(ls.smem_bytes));
}

}  // namespace gpu
}  // namespace ultracomm
