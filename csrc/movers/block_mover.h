// BlockMover: a worker group of T host threads with a barrier, imitating a CUDA block
// so that the device's control flow (leader waits and releases, the group learns outcomes by
// broadcast, copies and reductions split by thread index) runs, and is tested, on the CPU.
#pragma once
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include "group_barrier.h"
#include "host_mover_base.h"
#include "host_reduce.h"
#include "ultracomm/impl/interp.h"

namespace ultracomm::host {

// One per group: its barrier, the broadcast word and the first_below results, one per thread
// and two sets used in turn (the CUDA block's shared memory).
struct BlockGroup {
  explicit BlockGroup(int threads)
      : bar(threads), scan{std::vector<uint64_t>(threads), std::vector<uint64_t>(threads)} {}
  GroupBarrier bar;
  alignas(64) unsigned char word[16] = {};
  std::vector<uint64_t> scan[2];
};

class BlockMover : public HostMoverBase {
 public:
  BlockMover(RunState& run, BlockGroup& group, int tid, int threads, uint32_t jitter_us, uint64_t jitter_seed,
             bool portable_f16)
      : HostMoverBase(run, jitter_us, jitter_seed, portable_f16), g_(group), tid_(tid), threads_(threads) {}

  bool leader() const { return tid_ == 0; }
  void sync() { g_.bar.arrive_and_wait(); }
  // The leader writes, all read after a barrier, a second barrier keeps the next broadcast
  // from overwriting the word before everyone read it (__syncthreads twice on a device).
  template <class T>
  T broadcast(T v) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(BlockGroup::word));
    if (leader()) std::memcpy(g_.word, &v, sizeof(T));
    sync();
    T out;
    std::memcpy(&out, g_.word, sizeof(T));
    sync();
    return out;
  }
  int64_t claim() { return broadcast(leader() ? claim_task() : int64_t(0)); }  // the leader's claim, shared
  // The broadcast that reported the wait's outcome already ordered every thread after the
  // leader's acquire (barrier), as __syncthreads does on a device.
  void after_acquire() {}
  // Thread t reads flags t, t + T, ... (acquire loads) and writes its first one below the epoch;
  // after one barrier every thread takes the minimum.  The two result sets alternate: a call
  // writes its set only after every thread passed the previous call's barrier, so after every
  // read of the set two calls back.  Every share came back complete when n is returned: each
  // flag was acquired by its reader, whose barrier orders the whole group after it.
  uint64_t first_below(uintptr_t flags, uint64_t n, uint64_t epoch) {
    std::vector<uint64_t>& r = g_.scan[scan_turn_];
    scan_turn_ ^= 1;
    r[tid_] = scan_share(flags, n, epoch, static_cast<uint64_t>(tid_), static_cast<uint64_t>(threads_));
    sync();
    return *std::min_element(r.begin(), r.end());
  }
  // Thread t copies its 64-byte-aligned share of the segment to every destination.
  void copy(const uintptr_t* dsts, int ndst, uintptr_t src, uint64_t bytes) {
    const uint64_t part = align_up(ceil_div(bytes, static_cast<uint64_t>(threads_)), 64);
    const uint64_t lo = part * static_cast<uint64_t>(tid_);
    if (lo >= bytes) return;
    const uint64_t n = std::min(part, bytes - lo);
    for (int j = 0; j < ndst; ++j)
      std::memcpy(reinterpret_cast<void*>(dsts[j] + lo), reinterpret_cast<const void*>(src + lo), n);
  }
  // Every thread's copies happen before the leader's next release (barrier).
  void before_release() { sync(); }
  // Thread t reduces its share of the elements (multiples of 8): each output element is
  // written by one thread, in the same fp32 order as the host mover.
  template <class D, class Srcs>
  void reduce(uintptr_t dst, const Srcs& srcs, int nsrc, uint64_t nelem) {
    const uint64_t per = align_up(ceil_div(nelem, static_cast<uint64_t>(threads_)), 8);
    const uint64_t first = per * static_cast<uint64_t>(tid_);
    if (first >= nelem) return;
    reduce_range<D>(dst, srcs, nsrc, first, std::min(per, nelem - first), portable_f16_);
  }

 private:
  BlockGroup& g_;
  int tid_;
  int threads_;
  int scan_turn_ = 0;  // which of g_.scan the next first_below writes (the same in every thread)
};
static_assert(interp::Mover<BlockMover>);

}  // namespace ultracomm::host
