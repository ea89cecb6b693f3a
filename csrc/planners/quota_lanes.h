// Host threads standing in for the GPU's lanes and warps: the CPU tests run the device quota
// planner's parallel form (include/ultracomm/impl/quota_plan.h: strided loops, reductions, lane-0
// writes between barriers, probe groups splitting a round) with real concurrency and compare
// it with the one-thread build byte for byte.  Test support: the planner itself never starts
// threads.
#pragma once
#include <barrier>
#include <cstdint>
#include <memory>
#include <vector>

#include "ultracomm/impl/quota_plan.h"

namespace ultracomm::quota {

// What the lanes of one Group share: a barrier and one reduction word per lane.
struct ThreadShared {
  explicit ThreadShared(int32_t n) : bar(n), vals(n), vals2(n), sums(n) {}
  std::barrier<> bar;  // arrive_and_wait orders memory among the lanes, like __syncwarp
  std::vector<uint64_t> vals, vals2;
  std::vector<int64_t> sums;
};

// quota::Group over n host threads (lane `id`).
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
  void min2(uint64_t& a, uint64_t& b) const {
    sh->vals[id] = a;
    sh->vals2[id] = b;
    sync();
    for (int32_t i = 0; i < n; ++i)
      if (sh->vals[i] < a || (sh->vals[i] == a && sh->vals2[i] < b)) {
        a = sh->vals[i];
        b = sh->vals2[i];
      }
    sync();
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

// The shared part of a ThreadCta: `groups` groups of `lanes` threads, and all of them.
struct ThreadCtaShared {
  ThreadCtaShared(int32_t groups, int32_t lanes) : all(groups * lanes) {
    for (int32_t i = 0; i < groups; ++i) group.push_back(std::make_unique<ThreadShared>(lanes));
  }
  ThreadShared all;
  std::vector<std::unique_ptr<ThreadShared>> group;
};

// quota::Cta over host threads: thread `id` of groups x lanes is lane id % lanes of group
// id / lanes (the GPU: warp threadIdx / 32, lane threadIdx % 32).
struct ThreadCta {
  ThreadCtaShared* sh;
  int32_t id, groups_, lanes_;
  int32_t group() const { return id / lanes_; }
  int32_t groups() const { return groups_; }
  ThreadGroup lanes() const { return {sh->group[group()].get(), id % lanes_, lanes_}; }
  ThreadGroup all() const { return {&sh->all, id, groups_ * lanes_}; }
};

}  // namespace ultracomm::quota
