// A quota::Group of host threads: the CPU tests run the device planner's multi-lane logic
// (strided loops, reductions, lane-0 writes between barriers) with real concurrency, and
// compare it with the one-lane build.  Test support: the planner itself never starts threads.
#pragma once
#include <barrier>
#include <cstdint>
#include <vector>

namespace ultracomm::quota {

struct ThreadShared {
  explicit ThreadShared(int32_t n) : bar(n), vals(n), sums(n) {}
  std::barrier<> bar;
  std::vector<uint64_t> vals;
  std::vector<int64_t> sums;
};

struct ThreadGroup {
  ThreadShared* sh;
  int32_t id;
  int32_t n;
  int32_t lane() const { return id; }
  int32_t width() const { return n; }
  void sync() const { sh->bar.arrive_and_wait(); }
  uint64_t min(uint64_t v) const {
    sh->vals[id] = v;
    sync();
    uint64_t m = sh->vals[0];
    for (int32_t i = 1; i < n; ++i) m = sh->vals[i] < m ? sh->vals[i] : m;
    sync();  // nobody overwrites vals before every lane has read them
    return m;
  }
  int64_t sum(int64_t v) const {
    sh->sums[id] = v;
    sync();
    int64_t s = 0;
    for (int32_t i = 0; i < n; ++i) s += sh->sums[i];
    sync();
    return s;
  }
};

}  // namespace ultracomm::quota
