// Launch interface of k_build.cu (the portable schedule builder on the GPU: one CTA of
// psched::kBlockThreads, its scratch in shared memory when psched::launch_shape says it fits).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ultracomm/impl/sched_build.h"
#include "ultracomm/impl/slot_build.h"

namespace ultracomm::gpu {

// Every pointer is device memory; the problem's arrays too.
struct BuildArgs {
  psched::Problem problem;
  int64_t* scratch;  // build_scratch_bytes() (unused when the scratch fits shared memory)
  Task* tasks[2];    // per op (multicast, reduce): this rank's tasks
  int64_t task_cap[2];
  Ref* refs[2];
  int64_t ref_cap[2];
  psched::Result* result;  // status, counts, digest
};

int64_t build_scratch_bytes(int32_t world, int32_t slots, int32_t experts);
void launch_build_schedule(const BuildArgs& a, cudaStream_t stream);

// The device step: this rank entry's lists of both ops built into its ExecViews of one plan
// arena slot (include/ultracomm/impl/slot_build.h), whose templates the host wrote at setup.
struct SlotBuildArgs {
  psched::Problem problem;  // arrays in device memory
  int64_t* scratch;         // build_scratch_bytes() (unused when it fits shared memory)
  ExecView* views[2];       // device addresses: multicast, reduce
  psched::SlotCaps caps;
  psched::BuildReport* report;     // mapped host memory: the result, then generation + 1
  const int32_t* exchange_status;  // or null: the loads' exchange status word (nonzero: it failed)
  const int64_t* plan_result;      // or null: the planner's result words (low 32 bits of [0]: its status)
};
void launch_build_slot(const SlotBuildArgs& a, cudaStream_t stream);

}  // namespace ultracomm::gpu
