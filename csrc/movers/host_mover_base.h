// HostMoverBase: what the two host movers (HostMover, BlockMover) share -- one rank's run state,
// the Mover members a group's leader calls (flags, clock, backoff, abort, first failure), all
// forwarding to host_flags.h, and the leader's claim with the test jitter.  Not a Mover by
// itself: each mover adds leader/sync/broadcast/claim/copy/reduce.  A plain base (no CRTP):
// nothing here calls back into the mover, and the calls stay non-virtual.
#pragma once
#include <cstdint>

#include "host_flags.h"
#include "ultracomm/impl/interp.h"

namespace ultracomm::host {

class HostMoverBase {
 public:
  uint64_t load_acquire(uintptr_t flag) { return host::load_acquire(flag); }
  uint64_t load_relaxed(uintptr_t flag) { return host::load_relaxed(flag); }
  void store_release(uintptr_t flag, uint64_t v) { host::store_release(flag, v); }
  // One fence then plain flag stores on the device; here each store is a release store and the
  // fence nothing (the same order, and ThreadSanitizer does not model standalone fences).
  // Peers whose plan this mover verified in this run (one mover object per worker and run).
  bool peer_known(int32_t r) const { return r >= 0 && r < kCache && (known_[r >> 6] >> (r & 63)) & 1; }
  void set_peer_known(int32_t r) {
    if (r >= 0 && r < kCache) known_[r >> 6] |= uint64_t(1) << (r & 63);
  }
  void fence_release() {}
  void store_after_fence(uintptr_t flag, uint64_t v) { host::store_release(flag, v); }
  uint64_t now_ns() { return host::now_ns(); }
  void relax(uint32_t spins) { host::relax(spins); }
  bool aborted() { return run_.stopped(); }  // a failure, or the caller's abort word
  // One tile of a split task done (interp.h): acq_rel, so the last one's release carries every
  // tile's copies; its worker resets the counter.
  bool retire(uintptr_t counter, uint32_t tiles) {
    auto* c = reinterpret_cast<uint32_t*>(counter);
    if (__atomic_add_fetch(c, 1u, __ATOMIC_ACQ_REL) != tiles) return false;
    __atomic_store_n(c, 0u, __ATOMIC_RELAXED);
    return true;
  }
  void fail(const ErrorRecord& r) { run_.fail(r); }

 protected:
  HostMoverBase(RunState& run, uint32_t jitter_us, uint64_t jitter_seed, bool portable_f16)
      : run_(run), rng_(jitter_seed), jitter_us_(jitter_us), portable_f16_(portable_f16) {}

  // One thread's share of a first_below scan: flags first, first + stride, ... below n; the first
  // one below the epoch, or n.  Acquire loads (on x86 a plain load, as a relaxed one; and what
  // ThreadSanitizer sees), so a share that came back complete is acquired flag by flag.
  static uint64_t scan_share(uintptr_t flags, uint64_t n, uint64_t epoch, uint64_t first, uint64_t stride) {
    for (uint64_t i = first; i < n; i += stride)
      if (host::load_acquire(flags + 8 * i) < epoch) return i;
    return n;
  }

  // The next work unit (-1 once aborted), after a random 0..jitter_us sleep before a real one.
  int64_t claim_task() {
    const int64_t i = run_.claim();
    if (i >= 0 && i < run_.num_units) jitter(rng_, jitter_us_);
    if (i == run_.delay_unit && run_.delay_us) std::this_thread::sleep_for(std::chrono::microseconds(run_.delay_us));
    return i;
  }

  static constexpr int32_t kCache = interp::kPeerCacheRanks;
  RunState& run_;
  uint64_t known_[kCache / 64] = {};
  uint64_t rng_;
  uint32_t jitter_us_;
  bool portable_f16_;
};

}  // namespace ultracomm::host
