// The device control plane's quota planner on the GPU: include/ultracomm/quota_plan.h, the
// source the host build runs, with a warp as the lane group.  One CTA of kProbes warps: each
// search round probes kProbes thresholds at once (warp w probes the round's threshold w), and
// thread 0 moves the bracket between rounds.  Reads the gathered loads [W, E] (int32) from
// device memory, writes the plan to device memory: no host involvement, no allocation (the
// scratch is the caller's), so it can be captured in a CUDA graph.
#include "cuda_check.h"
#include "launch.h"
#include "ultracomm/quota_plan.h"

namespace ultracomm {
namespace {

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
  __device__ __forceinline__ int64_t sum(int64_t v) const {
    for (int32_t d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
  }
};

__global__ void __launch_bounds__(32 * quota::kProbes, 1)
    k_quota_plan(gpu::QuotaArgs a) {
#if defined(__CUDA_ARCH__)
  __shared__ quota::Bracket bracket;
  __shared__ int64_t thresholds[quota::kProbes];
  __shared__ int32_t feasible[quota::kProbes];
  __shared__ int32_t status;
  __shared__ int32_t probes;
  const WarpGroup g;
  const int32_t warp = static_cast<int32_t>(threadIdx.x >> 5);
  quota::Problem p{a.world, a.experts_per_rank, a.slots, a.min_tokens, a.tol, a.eps_bp, a.expert_load, a.node_of};
  const int32_t W = p.world, E = p.experts(), K = p.slots;
  // per-expert totals of the gathered loads (int32 counts -> int64)
  for (int32_t e = static_cast<int32_t>(threadIdx.x); e < E; e += static_cast<int32_t>(blockDim.x)) {
    int64_t s = 0;
    for (int32_t r = 0; r < W; ++r) s += a.loads[int64_t(r) * E + e];
    a.expert_load[e] = s;
  }
  __syncthreads();
  const quota::Shared sh = quota::shared_view(a.scratch, W, E);
  if (warp == 0) {
    int32_t st = quota::check_problem(p);
    if (st == quota::kOk) st = quota::prepare(p, sh, g);
    if (g.lane() == 0) {
      status = st;
      probes = 0;
      if (st == quota::kOk) bracket = quota::start_bracket(p, sh);
    }
  }
  __syncthreads();
  if (status == quota::kOk) {
    while (!quota::search_done(bracket)) {
      const int64_t t = quota::round_threshold(bracket, warp);
      bool ok = false;
      if (t) ok = quota::probe(p, sh, quota::probe_view(a.scratch, W, E, K, warp), t, g);
      if (g.lane() == 0) {
        thresholds[warp] = t;
        feasible[warp] = ok ? 1 : 0;
      }
      __syncthreads();
      if (threadIdx.x == 0) {
        for (int32_t i = 0; i < quota::kProbes; ++i) probes += thresholds[i] ? 1 : 0;
        quota::next_bracket(bracket, thresholds, feasible);
      }
      __syncthreads();
    }
  }
  if (warp == 0) {
    quota::Result res{status, probes, bracket.round, 0, bracket.hi};
    if (status == quota::kOk) {
      const quota::ProbeState st = quota::probe_view(a.scratch, W, E, K, 0);
      quota::probe(p, sh, st, bracket.hi, g);
      for (int64_t i = g.lane(); i < int64_t(W) * K; i += 32) {
        a.slot_src[i] = st.src[i];
        a.slot_quota[i] = st.quota[i];
      }
      res.probes += 1;
      res.replicas = 0;
      for (int64_t i = g.lane(); i < int64_t(W) * K; i += 32) res.replicas += st.src[i] >= 0 ? 1 : 0;
      res.replicas = static_cast<int32_t>(g.sum(res.replicas));
    }
    if (g.lane() == 0) *a.result = res;
  }
#endif
}

}  // namespace

namespace gpu {

int64_t quota_scratch_bytes(int32_t world, int32_t experts, int32_t slots) {
  return 8 * quota::scratch_words(world, experts, slots, quota::kProbes);
}

void launch_quota_plan(const QuotaArgs& a, cudaStream_t stream) {
  k_quota_plan<<<1, 32 * quota::kProbes, 0, stream>>>(a);
  UC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gpu
}  // namespace ultracomm
