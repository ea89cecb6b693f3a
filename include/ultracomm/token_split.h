// Reroute on the device: one source rank's token counts per expert instance, from the plan and
// the gathered loads, written once for g++ and nvcc (interp.h rules: no allocation, no
// exceptions, integers only).  The same split as csrc/planners/split.cpp (the host planners'
// split_slots): per expert, a rank holding an instance sends its own tokens there first, then
// the remainders go north-west corner (sources in rank order, instances in order).  Instance 0
// is the home copy, then the replicas by (rank, slot); the home's quota is the expert's tokens
// less its replicas' quotas.  Experts are independent: one thread (or loop iteration) each.
#pragma once
#include <cstdint>

#include "ultracomm/hd.h"

namespace ultracomm::split {

struct Plan {
  int32_t world, experts_per_rank, slots;
  const int32_t* loads;       // [world, E] tokens source s routes to expert e (int32: the exchanged counts)
  const int32_t* slot_src;    // [world, slots] expert of each replica slot (-1 empty)
  const int64_t* slot_quota;  // [world, slots] tokens each replica slot computes
  UC_HD int32_t experts() const { return world * experts_per_rank; }
};

// Scratch per expert: remainder per source and per instance (the instances are at most
// world: one home plus at most one replica per other rank).
UC_INLINE int64_t scratch_words(int32_t world) { return 2 * int64_t(world); }

// counts[i], i in [0, world): tokens source rank `me` sends to instance i of expert e (0 past
// the last instance); returns the number of instances.  scratch: scratch_words(world) words.
UC_HD inline int32_t expert_counts(const Plan& p, int32_t e, int32_t me, int64_t* counts, int64_t* scratch) {
  const int32_t W = p.world, K = p.slots, E = p.experts(), home = e / p.experts_per_rank;
  int64_t* rem_ld = scratch;      // [W]
  int64_t* rem_q = scratch + W;   // [W] instances
  int32_t n = 1;
  int64_t total = 0, rep_q = 0;
  for (int32_t s = 0; s < W; ++s) {
    rem_ld[s] = p.loads[int64_t(s) * E + e];
    total += rem_ld[s];
    counts[s] = 0;
  }
  for (int64_t s = 0; s < int64_t(W) * K; ++s)  // replicas in (rank, slot) order
    if (p.slot_src[s] == e) {
      rem_q[n++] = p.slot_quota[s];
      rep_q += p.slot_quota[s];
    }
  rem_q[0] = total - rep_q;
  bool multi = false;
  for (int32_t i = 1; i < n; ++i) multi = multi || rem_q[i] > 0;
  if (!multi) {  // every token goes home
    counts[0] = rem_ld[me];
    return n;
  }
  // locality first: a rank holding an instance sends its own tokens there
  int32_t i = 0;
  for (int64_t s = -1; s < int64_t(W) * K; ++s) {
    int32_t r;
    if (s < 0) {
      r = home;
    } else {
      if (p.slot_src[s] != e) continue;
      r = static_cast<int32_t>(s / K);
    }
    const int64_t x = rem_ld[r] < rem_q[i] ? rem_ld[r] : rem_q[i];
    if (r == me) counts[i] += x;
    rem_ld[r] -= x;
    rem_q[i] -= x;
    ++i;
  }
  // north-west corner on the remainders, up to source `me`
  int32_t s = 0;
  i = 0;
  while (s < W && s <= me && i < n) {
    if (rem_ld[s] == 0) { ++s; continue; }
    if (rem_q[i] == 0) { ++i; continue; }
    const int64_t x = rem_ld[s] < rem_q[i] ? rem_ld[s] : rem_q[i];
    if (s == me) counts[i] += x;
    rem_ld[s] -= x;
    rem_q[i] -= x;
  }
  return n;
}

enum Layout : int32_t { kEcho = 0, kPhysical = 1 };  // moe/reroute.py's column layouts

// One row of moe/reroute.py's RerouteTable for expert e and source `me`, padded to `world`
// instances: bounds[i] = cumulative counts (unused instances repeat the total, so a token rank
// never selects them), columns[i] = the rerouted map's column of instance i (unused: home's).
UC_HD inline void expert_table(const Plan& p, int32_t e, int32_t me, int32_t layout, int64_t* bounds,
                               int64_t* columns, int64_t* scratch) {
  const int32_t W = p.world, K = p.slots, E = p.experts(), epr = p.experts_per_rank, home = e / epr;
  const int32_t n = expert_counts(p, e, me, bounds, scratch);
  for (int32_t i = 1; i < W; ++i) bounds[i] += bounds[i - 1];
  const int64_t home_col = layout == kEcho ? e : int64_t(home) * (epr + K) + e % epr;
  for (int32_t i = 0; i < W; ++i) columns[i] = home_col;
  int32_t i = 1;
  for (int64_t s = 0; s < int64_t(W) * K && i < n; ++s)
    if (p.slot_src[s] == e) {
      const int64_t r = s / K, k = s % K;
      columns[i++] = layout == kEcho ? E + r * K + k : r * (epr + K) + epr + k;
    }
}

}  // namespace ultracomm::split
