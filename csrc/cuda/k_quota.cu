// The device control plane's quota planner on the GPU: quota::plan() of
// include/ultracomm/impl/quota_plan.h -- the source the host build runs -- on one CTA of kProbes
// warps.  Each search round probes kProbes thresholds at once (warp w the round's threshold w,
// its receiver choices warp min-reductions); the CTA's 256 threads derive the rank and expert
// orders between barriers; the warp whose threshold becomes the new upper bound copies its
// plan to the output while the others start the next round (no final re-probe).
//
// State: with quota::smem_words(W, E, K) * 8 bytes within the device's per-block shared-memory
// limit (EP64, K 2: 40 KB), the staged per-expert totals, node_of, the derived orders and
// every warp's probe state live in dynamic shared memory (k_quota_plan<true>); above it the
// kernel runs the same code on the caller's global scratch (k_quota_plan<false>,
// quota_scratch_bytes()).  Reads the gathered loads [W, E] (int32) from device memory, writes
// the per-expert totals, the plan and a quota::Result to device memory: no host involvement,
// no allocation, so it can be captured in a CUDA graph (the first launch on a device queries
// its limit and raises the kernel's dynamic shared-memory attribute: launch once before
// capturing, as plan_on_gpu's callers do).
#include <atomic>

#include "cuda_check.h"
#include "launch.h"
#include "pdl.h"
#include "ptx_extra.cuh"
#include "ultracomm/impl/quota_plan.h"

namespace ultracomm {
namespace {

constexpr int32_t kThreads = 32 * quota::kProbes;

// quota::Group over the 32 lanes of one warp (all lanes active: the launch is 32 x kProbes).
struct WarpGroup {
  __device__ __forceinline__ int32_t lane() const { return static_cast<int32_t>(threadIdx.x & 31u); }
  __device__ __forceinline__ int32_t width() const { return 32; }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
  __device__ __forceinline__ uint64_t min(uint64_t v) const {
    for (int32_t d = 16; d > 0; d >>= 1) {
      const uint64_t o = __shfl_xor_sync(0xffffffffu, v, d);
      v = o < v ? o : v;
    }
    return v;
  }
  // lexicographic minimum of the lanes' (a, b): the butterfly leaves it in every lane
  __device__ __forceinline__ void min2(uint64_t& a, uint64_t& b) const {
    for (int32_t d = 16; d > 0; d >>= 1) {
      const uint64_t oa = __shfl_xor_sync(0xffffffffu, a, d), ob = __shfl_xor_sync(0xffffffffu, b, d);
      const bool take = oa < a || (oa == a && ob < b);
      a = take ? oa : a;
      b = take ? ob : b;
    }
  }
  __device__ __forceinline__ int64_t sum(int64_t v) const {
    for (int32_t d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
  }
};

// quota::Group over the whole CTA (the derived orders, the plan's clearing, the bracket):
// a warp reduction, one word per warp through shared memory `red`, then every thread folds
// the kProbes words (the second barrier keeps `red` until every thread has read it).
struct CtaGroup {
  uint64_t* red;  // [kProbes] __shared__
  __device__ __forceinline__ int32_t lane() const { return static_cast<int32_t>(threadIdx.x); }
  __device__ __forceinline__ int32_t width() const { return kThreads; }
  __device__ __forceinline__ void sync() const { __syncthreads(); }
  __device__ __forceinline__ uint64_t min(uint64_t v) const {
    v = WarpGroup{}.min(v);
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    for (int32_t w = 0; w < quota::kProbes; ++w) v = red[w] < v ? red[w] : v;
    __syncthreads();
    return v;
  }
  __device__ __forceinline__ int64_t sum(int64_t v) const {
    v = WarpGroup{}.sum(v);
    if ((threadIdx.x & 31u) == 0) red[threadIdx.x >> 5] = static_cast<uint64_t>(v);
    __syncthreads();
    v = 0;
    for (int32_t w = 0; w < quota::kProbes; ++w) v += static_cast<int64_t>(red[w]);
    __syncthreads();
    return v;
  }
};

// quota::Cta: warp w is probe group w.
struct WarpCta {
  uint64_t* red;
  __device__ __forceinline__ int32_t group() const { return static_cast<int32_t>(threadIdx.x >> 5); }
  __device__ __forceinline__ int32_t groups() const { return quota::kProbes; }
  __device__ __forceinline__ WarpGroup lanes() const { return {}; }
  __device__ __forceinline__ CtaGroup all() const { return {red}; }
};

// kInShared: dynamic shared memory holds, in int64 words, expert_load [E] | node_of [W] int32
// (words_i32(W)) | quota scratch (shared_words + kProbes probe states), quota::smem_words().
template <bool kInShared>
__global__ void __launch_bounds__(kThreads, 1) k_quota_plan(gpu::QuotaArgs a) {
#if defined(__CUDA_ARCH__)
  extern __shared__ __align__(16) int64_t smem[];
  __shared__ quota::Round rd;
  __shared__ uint64_t red[quota::kProbes];
  // PDL (pdl.h): the exchange's loads are complete and visible after the wait, before anything
  // is read or written; then the build may be scheduled (its CTA waits for this grid to finish)
  dev::grid_dependency_wait();
  dev::launch_dependents();
  quota::Problem p{a.world, a.experts_per_rank, a.slots, a.min_tokens, a.tol, a.eps_bp, a.expert_load, a.node_of};
  const int32_t bad = quota::check_problem(p);  // before any loop over the shape
  if (bad != quota::kOk) {
    if (threadIdx.x == 0) *a.result = quota::Result{bad, 0, 0, 0, 0};
    return;
  }
  const int32_t W = p.world, E = p.experts();
  // per-expert totals of the gathered loads (int32 counts -> int64): thread e reads column e,
  // the warp's 32 loads of one row coalesced
  for (int32_t e = static_cast<int32_t>(threadIdx.x); e < E; e += kThreads) {
    int64_t s = 0;
    for (int32_t r = 0; r < W; ++r) s += a.loads[int64_t(r) * E + e];
    a.expert_load[e] = s;  // an output too (plan_on_gpu's expert_load)
    if constexpr (kInShared) smem[e] = s;
  }
  int64_t* scratch = a.scratch;
  if constexpr (kInShared) {
    int32_t* node = reinterpret_cast<int32_t*>(smem + E);
    for (int32_t r = static_cast<int32_t>(threadIdx.x); a.node_of && r < W; r += kThreads) node[r] = a.node_of[r];
    p.expert_load = smem;
    p.node_of = a.node_of ? node : nullptr;
    scratch = smem + E + quota::words_i32(W);
  }
  __syncthreads();
  const quota::Result res = quota::plan(p, scratch, quota::Plan{a.slot_src, a.slot_quota}, rd, WarpCta{red});
  if (threadIdx.x == 0) *a.result = res;
#endif
}

// The dynamic shared memory k_quota_plan<true> may take on `device`: the opt-in per-block limit
// less the kernel's static shared memory, raised on the kernel once per device (host calls, no
// stream work).  0 until queried.
constexpr int kMaxDevices = 64;
std::atomic<int64_t> g_smem_limit[kMaxDevices];

int64_t smem_limit() {
  int device = 0;
  UC_CUDA_CHECK(cudaGetDevice(&device));
  if (device < 0 || device >= kMaxDevices) return 0;  // not cached: global scratch
  int64_t limit = g_smem_limit[device].load(std::memory_order_acquire);
  if (limit > 0) return limit;
  int optin = 0;
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&optin, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  cudaFuncAttributes attr{};
  UC_CUDA_CHECK(cudaFuncGetAttributes(&attr, k_quota_plan<true>));
  limit = int64_t(optin) - int64_t(attr.sharedSizeBytes);
  if (limit > 0)
    UC_CUDA_CHECK(
        cudaFuncSetAttribute(k_quota_plan<true>, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(limit)));
  limit = limit > 0 ? limit : 1;  // 1: queried, nothing fits
  g_smem_limit[device].store(limit, std::memory_order_release);
  return limit;
}

}  // namespace

namespace gpu {

// The global fallback's scratch (k_quota_plan<false>); allocated always, so a launch never
// depends on which variant runs.
int64_t quota_scratch_bytes(int32_t world, int32_t experts, int32_t slots) {
  return 8 * quota::scratch_words(world, experts, slots, quota::kProbes);
}

void launch_quota_plan(const QuotaArgs& a, cudaStream_t stream) {
  const quota::Problem shape{a.world, a.experts_per_rank, a.slots, 1, 0, 0, nullptr, nullptr};
  const bool sized = quota::check_problem(shape) == quota::kOk;  // else the kernel reports kBadShape
  const int64_t bytes = sized ? 8 * quota::smem_words(a.world, shape.experts(), a.slots) : 0;
  const bool pdl = programmatic_launch_here();  // sm_90+ and ULTRACOMM_PDL (pdl.h)
  if (sized && bytes <= smem_limit())
    launch_programmatic(pdl, k_quota_plan<true>, dim3(1), dim3(kThreads), static_cast<size_t>(bytes), stream, a);
  else
    launch_programmatic(pdl, k_quota_plan<false>, dim3(1), dim3(kThreads), 0, stream, a);
}

}  // namespace gpu
}  // namespace ultracomm
