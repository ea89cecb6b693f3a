// What the host movers share: epoch flags as acquire/release atomics, the wait backoff, the
// clock, and the state of one rank's run (claim counter, abort word, first error).
#pragma once
#include <atomic>
#include <chrono>
#include <cstdint>
#include <mutex>
#include <thread>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#endif

#include "ultracomm/records/error_record.h"

namespace ultracomm::host {

inline uint64_t load_acquire(uintptr_t addr) {
#if defined(ULTRACOMM_MUTATE_RELAXED_ACQUIRE)  // mutation test: x86 hides it, TSan must not
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(addr), __ATOMIC_RELAXED);
#else
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(addr), __ATOMIC_ACQUIRE);
#endif
}
// A poll (leader_wait's spin); the wait acquires once after it saw the epoch.
inline uint64_t load_relaxed(uintptr_t addr) {
  return __atomic_load_n(reinterpret_cast<const uint64_t*>(addr), __ATOMIC_RELAXED);
}
inline void store_release(uintptr_t addr, uint64_t v) {
  __atomic_store_n(reinterpret_cast<uint64_t*>(addr), v, __ATOMIC_RELEASE);
}

inline uint64_t now_ns() {
  return static_cast<uint64_t>(
      std::chrono::duration_cast<std::chrono::nanoseconds>(std::chrono::steady_clock::now().time_since_epoch())
          .count());
}

// Backoff of a flag wait: 128 pauses, 32 yields, then sleeps doubling from 2 us to 200 us
// (a stalled peer costs little CPU; a prompt one is seen within a few hundred ns).
inline void relax(uint32_t spin) {
  if (spin < 128) {
#if defined(__x86_64__) || defined(__i386__)
    _mm_pause();
#elif defined(__aarch64__)
    asm volatile("yield" ::: "memory");
#endif
  } else if (spin < 160) {
    std::this_thread::yield();
  } else {
    const uint32_t k = spin - 160;
    std::this_thread::sleep_for(std::chrono::microseconds(k < 7 ? (2u << k) : 200u));
  }
}

inline uint64_t splitmix64(uint64_t& s) {
  uint64_t z = (s += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

// Sleeps a random 0..jitter_us before a task (testing: shakes the interleavings).
inline void jitter(uint64_t& rng, uint32_t jitter_us) {
  if (jitter_us == 0) return;
  const uint64_t us = splitmix64(rng) % (static_cast<uint64_t>(jitter_us) + 1);
  if (us) std::this_thread::sleep_for(std::chrono::microseconds(us));
}

// Shared by every worker group of one rank's operation.
struct RunState {
  explicit RunState(int64_t units) : num_units(units) {}
  const int64_t num_units;       // work units (tiles of tasks, interp.h) the claims hand out
  std::atomic<int64_t> next{0};  // the claim counter
  int64_t delay_unit = -1;       // testing (ExecArgs::delay_unit / delay_us)
  uint32_t delay_us = 0;
  std::atomic<bool> abort{false};
  // Optional word outside the run (ExecArgs::abort_word): nonzero stops every group as a
  // failure would, but records none (e.g. the split transport's bridge failed).
  const uint64_t* external = nullptr;
  std::mutex mu;
  bool failed = false;  // under mu
  ErrorRecord first{};  // under mu: the first failure

  bool stopped() const {
    return abort.load(std::memory_order_relaxed) ||
           (external != nullptr && __atomic_load_n(external, __ATOMIC_ACQUIRE) != 0);
  }
  int64_t claim() {
    if (stopped()) return -1;
    return next.fetch_add(1, std::memory_order_relaxed);
  }
  void fail(const ErrorRecord& r) {
    {
      std::lock_guard<std::mutex> g(mu);
      if (!failed) {
        failed = true;
        first = r;
      }
    }
    abort.store(true);
  }
};

}  // namespace ultracomm::host
