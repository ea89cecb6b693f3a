// VecMover: the sm_80 device mover (A100/A800).  Every thread moves 16-byte units with plain
// vector loads/stores (LDG.E.128 / STG.E.128, to peer addresses over NVLink where the window
// is peer-mapped); before the leader releases a flag, the whole CTA has stored
// (__syncthreads), and the leader's st.release.sys orders those stores before the flag.
#pragma once
#include "mover_common.cuh"

namespace ultracomm::dev {

class VecMover : public MoverBase {
 public:
  static constexpr uint32_t kSmemBytes = 0;  // dynamic shared memory it needs

  // flags (persistent_args.h) change nothing here: every byte already takes the vector path, and
  // reductions the register hunks (kReduceStaged needs bulk copies: the launcher refuses it
  // before sm_90).
  __device__ VecMover(const MoverEnv& env, GroupShared* sh, unsigned char* /*dyn_smem*/, uint32_t /*flags*/)
      : MoverBase(env, sh) {}

  // Plain loads after the leader's acquire see the peer's data: the acquire invalidated the
  // SM's L1 and the barrier that broadcast the wait's outcome orders every thread after it.
  __device__ void after_acquire() {}

  __device__ void copy(const uintptr_t* dsts, int ndst, uintptr_t src, uint64_t bytes) {
    vec_copy(stage_dsts(dsts, ndst), ndst, src, bytes);
  }

  // Every thread's stores happen-before the barrier, which happens-before the leader's
  // release (cumulative at system scope).
  __device__ void before_release() { __syncthreads(); }

  template <class D, class Srcs>
  __device__ void reduce(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t nelem) {
    vec_reduce<D>(dst, stage_srcs(srcs, nsrc), nsrc, nelem);
  }
};

}  // namespace ultracomm::dev
