// HostMover: one worker thread is one group (leader of itself).  Bytes move with memcpy,
// flags with acquire/release atomics; what the reference host executor always did.
#pragma once
#include <cstdint>
#include <cstring>

#include "host_mover_base.h"
#include "host_reduce.h"
#include "ultracomm/impl/interp.h"

namespace ultracomm::host {

class HostMover : public HostMoverBase {
 public:
  HostMover(RunState& run, uint32_t jitter_us, uint64_t jitter_seed, bool portable_f16)
      : HostMoverBase(run, jitter_us, jitter_seed, portable_f16) {}

  bool leader() const { return true; }
  void sync() {}
  template <class T>
  T broadcast(T v) {
    return v;
  }
  int64_t claim() { return claim_task(); }
  void after_acquire() {}  // the acquire load orders this thread's later reads
  // The group is this thread: it reads every flag.
  uint64_t first_below(uintptr_t flags, uint64_t n, uint64_t epoch) { return scan_share(flags, n, epoch, 0, 1); }
  void copy(const uintptr_t* dsts, int ndst, uintptr_t src, uint64_t bytes) {
    for (int j = 0; j < ndst; ++j)
      std::memcpy(reinterpret_cast<void*>(dsts[j]), reinterpret_cast<const void*>(src), bytes);
  }
  void before_release() {}  // the copying thread itself releases
  template <class D, class Srcs>
  void reduce(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t nelem) {
    reduce_range<D>(dst, srcs, nsrc, 0, nelem, portable_f16_);
  }
};
static_assert(interp::Mover<HostMover>);

}  // namespace ultracomm::host
