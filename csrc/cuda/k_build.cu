// The device control plane's schedule builder on the GPU: include/ultracomm/sched_build.h, the
// source the host build (`_core.build_schedule_portable`) runs.  One thread builds (the builder
// is a short sequential pass); it reads the plan from device memory and writes this rank's task
// lists, refs and digest into caller memory (a plan arena slot): no host involvement, no
// allocation, capturable in a CUDA graph.
#include <cuda/atomic>

#include "cuda_check.h"
#include "k_build.h"
#include "ultracomm/sched_build.h"

namespace ultracomm {
namespace {

__global__ void __launch_bounds__(32, 1) k_build_schedule(gpu::BuildArgs a) {
#if defined(__CUDA_ARCH__)
  if (threadIdx.x != 0) return;
  const psched::OpOut mc{a.tasks[0], a.task_cap[0], a.refs[0], a.ref_cap[0]};
  const psched::OpOut rd{a.tasks[1], a.task_cap[1], a.refs[1], a.ref_cap[1]};
  *a.result = psched::build(a.problem, a.scratch, mc, rd);
#endif
}

// The device step's build (slot_build.h): same one-lane pass, written into the arena slot's views.
__global__ void __launch_bounds__(32, 1) k_build_slot(gpu::SlotBuildArgs a) {
#if defined(__CUDA_ARCH__)
  if (threadIdx.x != 0) return;
  const int32_t upstream = psched::upstream_status(a.exchange_status, a.plan_result);
  const psched::Result res = psched::build_into_views(a.problem, a.scratch, a.views, a.caps, upstream);
  using Word = cuda::atomic_ref<uint64_t, cuda::thread_scope_system>;
  if (res.status != psched::kOk) {  // sequence lock: odd while written (slot_build.h BuildReport)
    Word(a.report->failed_seq).fetch_add(1, cuda::memory_order_relaxed);
    __threadfence_system();
    a.report->failed = res;
    __threadfence_system();
    Word(a.report->failed_seq).fetch_add(1, cuda::memory_order_release);
  }
  a.report->result = res;
  // the host reads the generation, then the result: publish the result first
  __threadfence_system();
  Word(a.report->generation).fetch_add(1, cuda::memory_order_release);
#endif
}

}  // namespace

namespace gpu {

int64_t build_scratch_bytes(int32_t world, int32_t slots, int32_t experts) {
  return 8 * psched::scratch_words(world, slots, experts);
}

void launch_build_schedule(const BuildArgs& a, cudaStream_t stream) {
  k_build_schedule<<<1, 32, 0, stream>>>(a);
  UC_CUDA_CHECK(cudaGetLastError());
}

void launch_build_slot(const SlotBuildArgs& a, cudaStream_t stream) {
  k_build_slot<<<1, 32, 0, stream>>>(a);
  UC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gpu
}  // namespace ultracomm
