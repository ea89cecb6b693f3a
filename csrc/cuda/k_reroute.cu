// Reroute on the device: one source rank's RerouteTable (moe/reroute.py) from the gathered
// loads and the plan in device memory, with include/ultracomm/impl/token_split.h's
// expert_table_lanes -- the row the host build (_core.reroute_table) computes with
// expert_table.  A warp per expert: lanes over the sources and the replica slots (ballots
// compact the expert's instances into shared memory), warp scans for the north-west corner and
// the cumulative bounds, and lane i writes entry i of the expert's rows (a warp's stores to a
// row are contiguous: coalesced).  No per-thread scratch in global memory: the caller's
// scratch is touched only by the exact-loop fallback for plans outside the closed form's
// domain (never a planner's valid plan).  No allocation: capturable in a CUDA graph.
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "launch.h"
#include "pdl.h"
#include "ptx_extra.cuh"
#include "ultracomm/impl/token_split.h"

namespace ultracomm {
namespace {

constexpr int kRerouteWarps = 8;        // experts per CTA
constexpr int kSmemBudget = 48 * 1024;  // static limit of dynamic shared memory without opt-in

struct WarpLanes {  // token_split.h's lane group: one warp
  __device__ __forceinline__ int32_t lane() const { return static_cast<int32_t>(threadIdx.x & 31u); }
  __device__ __forceinline__ int32_t width() const { return 32; }
  __device__ __forceinline__ void sync() const { __syncwarp(); }
  __device__ __forceinline__ int64_t sum(int64_t v) const {
    for (int32_t d = 16; d > 0; d >>= 1) v += __shfl_xor_sync(0xffffffffu, v, d);
    return v;
  }
  // Kogge-Stone inclusive scan, then this lane's exclusive prefix; total from lane 31
  __device__ __forceinline__ int64_t scan(int64_t v, int64_t* total) const {
    int64_t x = v;
    for (int32_t d = 1; d < 32; d <<= 1) {
      const int64_t y = __shfl_up_sync(0xffffffffu, x, d);
      if (lane() >= d) x += y;
    }
    *total = __shfl_sync(0xffffffffu, x, 31);
    return x - v;
  }
};

__global__ void __launch_bounds__(kRerouteWarps * 32) k_reroute_table(gpu::RerouteArgs a) {
#if defined(__CUDA_ARCH__)
  extern __shared__ int32_t reroute_smem[];  // [warps][world]: each warp's instance slots
  // PDL (pdl.h): the plan and the gathered loads are complete and visible after the wait (every
  // thread, before the early exit below: this grid completes only after its predecessor did)
  dev::grid_dependency_wait();
  dev::launch_dependents();
  const split::Plan p{a.world, a.experts_per_rank, a.slots, a.loads, a.slot_src, a.slot_quota};
  const int32_t warp = static_cast<int32_t>(threadIdx.x >> 5);
  const int32_t e = static_cast<int32_t>(blockIdx.x) * static_cast<int32_t>(blockDim.x >> 5) + warp;
  if (e >= p.experts()) return;  // whole warps leave: the group's shuffles stay full-warp
  const int64_t W = p.world;
  split::expert_table_lanes(p, e, a.rank, a.layout, a.bounds + e * W, a.columns + e * W, reroute_smem + warp * W,
                            a.scratch + e * split::scratch_words(p.world), WarpLanes{});
#endif
}

}  // namespace

namespace gpu {

int64_t reroute_scratch_bytes(int32_t world, int32_t experts) {
  return 8 * int64_t(experts) * split::scratch_words(world);  // the fallback's (see above)
}

void launch_reroute_table(const RerouteArgs& a, cudaStream_t stream) {
  const int32_t E = a.world * a.experts_per_rank;
  int32_t warps = kRerouteWarps;
  while (warps > 1 && int64_t(warps) * a.world * 4 > kSmemBudget) warps /= 2;
  const int64_t smem = int64_t(warps) * a.world * 4;
  if (smem > kSmemBudget)
    throw std::invalid_argument("ultracomm._cuda.reroute_table: world " + std::to_string(a.world) +
                                " needs more than 48 KB of shared memory per warp");
  launch_programmatic(programmatic_launch_here(), k_reroute_table, dim3(static_cast<unsigned>((E + warps - 1) / warps)),
                      dim3(static_cast<unsigned>(warps * 32)), static_cast<size_t>(smem), stream, a);
}

}  // namespace gpu
}  // namespace ultracomm
