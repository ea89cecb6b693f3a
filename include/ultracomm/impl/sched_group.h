// Lane groups of the schedule builder (sched_build.h): the builder is one source written over a
// *block* of lanes that holds *warps* of lanes, so the same code runs as one CUDA CTA
// (csrc/cuda/k_build.cu: 256 threads, 8 warps of 32), as one host thread (SerialGroup below:
// one lane, one warp of one lane -- the `_core` default) and as host threads standing in for
// lanes (csrc/schedule/sched_lanes.h, tests: 2, 8, 32 lanes in warps of 1..32).
//
// Block group G (every lane of the block calls each member, in the same order):
//   lane(), width()            this lane, lanes in the block
//   sync()                     barrier of the block (memory ordered: writes before are seen after)
//   max(v), sum(v)             int64 reductions, the result on every lane (a barrier inside)
//   scan(v, total)             exclusive prefix sum of v in lane order, and the sum (a barrier inside)
//   add(p, v) / amax(p, v)     atomic add / max on an int32 in the scratch (order-free: only
//                              counts and maxima are taken this way, never positions that matter)
//   warps(), warp_id(), sub()  the block's warps, this lane's, and its warp as a group S:
// Warp group S: lane(), width(), sync(), max(v) -- the same meaning within one warp.
//
// Nothing the builder writes depends on the lane count or on the order lanes run in: every
// position is computed from a total order (ranks by count, scans in lane order), atomics only
// count, and a value several lanes compute is the same on each.  The tests compare 1, 2, 8 and
// 32 host lanes byte for byte (tests/control/test_sched_build_lanes.py).
#pragma once
#include <cstdint>

#include "ultracomm/records/hd.h"

namespace ultracomm::psched {

// The host build: one lane that is its own warp.
struct SerialGroup {
  UC_INLINE int32_t lane() const { return 0; }
  UC_INLINE int32_t width() const { return 1; }
  UC_INLINE void sync() const {}
  UC_INLINE int64_t max(int64_t v) const { return v; }
  UC_INLINE int64_t sum(int64_t v) const { return v; }
  UC_INLINE int64_t scan(int64_t v, int64_t& total) const {
    total = v;
    return 0;
  }
  UC_INLINE int32_t add(int32_t* p, int32_t v) const {
    const int32_t old = *p;
    *p = old + v;
    return old;
  }
  UC_INLINE void amax(int32_t* p, int32_t v) const { *p = v > *p ? v : *p; }
  UC_INLINE int32_t warps() const { return 1; }
  UC_INLINE int32_t warp_id() const { return 0; }
  UC_INLINE SerialGroup sub() const { return *this; }
};

}  // namespace ultracomm::psched
