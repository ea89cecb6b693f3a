// Launch interface of k_build.cu (the portable schedule builder on the GPU).
#pragma once
#include <cuda_runtime.h>

#include <cstdint>

#include "ultracomm/sched_build.h"

namespace ultracomm::gpu {

// Every pointer is device memory; the problem's arrays too.
struct BuildArgs {
  psched::Problem problem;
  int64_t* scratch;        // build_scratch_bytes()
  Task* tasks[2];          // per op (multicast, reduce): this rank's tasks
  int64_t task_cap[2];
  Ref* refs[2];
  int64_t ref_cap[2];
  psched::Result* result;  // status, counts, digest
};

int64_t build_scratch_bytes(int32_t world, int32_t slots, int32_t experts);
void launch_build_schedule(const BuildArgs& a, cudaStream_t stream);

}  // namespace ultracomm::gpu
