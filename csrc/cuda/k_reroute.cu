// Reroute on the device: one source rank's RerouteTable (moe/reroute.py) from the gathered
// loads and the plan in device memory, with include/ultracomm/token_split.h -- the source the
// host build (_core.reroute_table) runs.  One thread per expert; no allocation (the scratch is
// the caller's), so it can be captured in a CUDA graph.
#include "cuda_check.h"
#include "launch.h"
#include "ultracomm/token_split.h"

namespace ultracomm {
namespace {

__global__ void k_reroute_table(gpu::RerouteArgs a) {
#if defined(__CUDA_ARCH__)
  const split::Plan p{a.world, a.experts_per_rank, a.slots, a.loads, a.slot_src, a.slot_quota};
  const int32_t e = static_cast<int32_t>(blockIdx.x * blockDim.x + threadIdx.x);
  if (e >= p.experts()) return;
  const int64_t W = p.world;
  split::expert_table(p, e, a.rank, a.layout, a.bounds + e * W, a.columns + e * W,
                      a.scratch + e * split::scratch_words(p.world));
#endif
}

}  // namespace

namespace gpu {

int64_t reroute_scratch_bytes(int32_t world, int32_t experts) {
  return 8 * int64_t(experts) * split::scratch_words(world);
}

void launch_reroute_table(const RerouteArgs& a, cudaStream_t stream) {
  const int32_t E = a.world * a.experts_per_rank;
  const int32_t threads = 128;
  k_reroute_table<<<(E + threads - 1) / threads, threads, 0, stream>>>(a);
  UC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gpu
}  // namespace ultracomm
