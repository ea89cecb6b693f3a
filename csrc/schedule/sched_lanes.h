// psched lane groups of host threads (sched_group.h): the CPU tests run the schedule builder's
// block and warp logic -- strided loops, barriers, block scans, atomic counts, candidate trees
// one per warp -- with real concurrency, and compare it byte for byte with the one-lane build.
// Test support: the builder itself never starts threads.
#pragma once
#include <atomic>
#include <barrier>
#include <cstdint>
#include <memory>
#include <thread>
#include <vector>

namespace ultracomm::psched {

struct LaneShared {
  LaneShared(int32_t lanes, int32_t warp_lanes) : block(lanes), vals(lanes), wvals(lanes) {
    for (int32_t w = 0; w < lanes / warp_lanes; ++w) warp.push_back(std::make_unique<std::barrier<>>(warp_lanes));
  }
  std::barrier<> block;
  std::vector<std::unique_ptr<std::barrier<>>> warp;
  std::vector<int64_t> vals;   // the block's reductions
  std::vector<int64_t> wvals;  // the warps' reductions (lane id -> value)
};

struct LaneWarp {
  LaneShared* sh;
  int32_t id;  // lane id in the block
  int32_t ww;  // lanes per warp
  int32_t lane() const { return id % ww; }
  int32_t width() const { return ww; }
  void sync() const { sh->warp[id / ww]->arrive_and_wait(); }
  int64_t max(int64_t v) const {
    sh->wvals[id] = v;
    sync();
    int64_t m = v;
    for (int32_t i = id - lane(); i < id - lane() + ww; ++i) m = sh->wvals[i] > m ? sh->wvals[i] : m;
    sync();  // nobody overwrites wvals before every lane has read them
    return m;
  }
};

struct LaneBlock {
  LaneShared* sh;
  int32_t id;
  int32_t n;
  int32_t ww;
  int32_t lane() const { return id; }
  int32_t width() const { return n; }
  void sync() const { sh->block.arrive_and_wait(); }
  int64_t max(int64_t v) const {
    sh->vals[id] = v;
    sync();
    int64_t m = v;
    for (int32_t i = 0; i < n; ++i) m = sh->vals[i] > m ? sh->vals[i] : m;
    sync();
    return m;
  }
  int64_t sum(int64_t v) const {
    int64_t t = 0;
    scan(v, t);
    return t;
  }
  int64_t scan(int64_t v, int64_t& total) const {
    sh->vals[id] = v;
    sync();
    int64_t before = 0;
    total = 0;
    for (int32_t i = 0; i < n; ++i) {
      before += i < id ? sh->vals[i] : 0;
      total += sh->vals[i];
    }
    sync();
    return before;
  }
  int32_t add(int32_t* p, int32_t v) const {
    return std::atomic_ref<int32_t>(*p).fetch_add(v, std::memory_order_relaxed);
  }
  void amax(int32_t* p, int32_t v) const {
    std::atomic_ref<int32_t> a(*p);
    int32_t cur = a.load(std::memory_order_relaxed);
    while (v > cur && !a.compare_exchange_weak(cur, v, std::memory_order_relaxed)) {
    }
  }
  int32_t warps() const { return n / ww; }
  int32_t warp_id() const { return id / ww; }
  LaneWarp sub() const { return LaneWarp{sh, id, ww}; }
};

// Runs f(group) on `lanes` threads in warps of `warp_lanes` (a divisor of lanes); returns every
// lane's result.
template <class F>
auto run_lanes(int32_t lanes, int32_t warp_lanes, F&& f) {
  LaneShared sh(lanes, warp_lanes);
  using R = decltype(f(LaneBlock{&sh, 0, lanes, warp_lanes}));
  std::vector<R> out(lanes);
  std::vector<std::thread> threads;
  for (int32_t i = 0; i < lanes; ++i)
    threads.emplace_back([&, i] { out[i] = f(LaneBlock{&sh, i, lanes, warp_lanes}); });
  for (auto& t : threads) t.join();
  return out;
}

}  // namespace ultracomm::psched
