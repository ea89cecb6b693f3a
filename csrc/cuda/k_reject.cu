// k_reject: a rank that rejected its plan for an operation publishes that in its own window
// (interp.h publish_rejection: kRejectedDigest beside ready[op] = epoch), stream-ordered like
// the operation it replaces, so every peer touching it raises "rank r rejected its plan" at
// once instead of timing out.
#include "cuda_check.h"
#include "launch.h"
#include "mover_vec.cuh"

namespace ultracomm {
namespace {

// One warp; the view only needs op, epoch, layout and this rank's window base (as rank 0 of a
// one-entry table in shared memory).
__global__ void __launch_bounds__(32, 1) k_reject(ExecView v, uintptr_t own_base) {
#if defined(__CUDA_ARCH__)
  __shared__ dev::GroupShared sh;
  __shared__ uintptr_t base;
  if (threadIdx.x == 0) base = own_base;
  __syncthreads();
  v.window_bases = &base;
  v.rank = 0;
  dev::VecMover m(dev::MoverEnv{nullptr, nullptr, nullptr, v.epoch}, &sh, nullptr, false);
  interp::publish_rejection(v, m);
#endif
}

}  // namespace

namespace gpu {

void launch_reject(Op op, uint64_t epoch, uintptr_t own_base, const WindowLayout& layout, cudaStream_t stream) {
  ExecView v{};
  v.op = op;
  v.epoch = epoch;
  v.layout = layout;
  k_reject<<<1, 32, 0, stream>>>(v, own_base);
  UC_CUDA_CHECK(cudaGetLastError());
}

}  // namespace gpu
}  // namespace ultracomm
