// Reroute on the device: one source rank's token counts per expert instance, from the plan and
// the gathered loads, written once for g++ and nvcc (interp.h rules: no allocation, no
// exceptions, integers only).  The same split as csrc/planners/split.cpp (the host planners'
// split_slots): per expert, a rank holding an instance sends its own tokens there first, then
// the remainders go north-west corner (sources in rank order, instances in order).  Instance 0
// is the home copy, then the replicas by (rank, slot); the home's quota is the expert's tokens
// less its replicas' quotas.  Experts are independent: one thread (or loop iteration) each.
#pragma once
#include <cstdint>

#include "ultracomm/records/hd.h"

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
  int64_t* rem_ld = scratch;     // [W]
  int64_t* rem_q = scratch + W;  // [W] instances
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
    if (rem_ld[s] == 0) {
      ++s;
      continue;
    }
    if (rem_q[i] == 0) {
      ++i;
      continue;
    }
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
UC_HD inline void expert_table(const Plan& p, int32_t e, int32_t me, int32_t layout, int64_t* bounds, int64_t* columns,
                               int64_t* scratch) {
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

// ---------------------------------------------------------------- the same table, on lanes
//
// expert_table_lanes computes expert_table's row with a group of lanes (k_reroute.cu: a warp
// per expert; host tests: 1 to 32 host threads).  A Group G gives lane(), width(), sync(),
// sum(v) (every lane's v added, to every lane) and scan(v, &total) (the exclusive prefix of v
// over lanes below this one; total = sum(v)); loops that call them run the same trip count on
// every lane.  The north-west corner is computed in closed form: with every remainder >= 0 it
// gives source `me`'s interval [A, A + L) of the remainders in source order exactly the parts
// of the instances' intervals [B_i, B_i + Q_i) it overlaps -- the same numbers as the loop.
// Plans outside that domain (a negative load or quota, quotas above the expert's tokens, two
// instances on one rank) take expert_table itself on lane 0, so the row is expert_table's
// for every input.  inst: the group's int32 [world] (the slot of each replica instance);
// scratch: scratch_words(world) words for that fallback (may alias inst).

struct SerialLanes {  // one lane: the host build of expert_table_lanes
  UC_INLINE int32_t lane() const { return 0; }
  UC_INLINE int32_t width() const { return 1; }
  UC_INLINE void sync() const {}
  UC_INLINE int64_t sum(int64_t v) const { return v; }
  UC_INLINE int64_t scan(int64_t v, int64_t* total) const {
    *total = v;
    return 0;
  }
};

struct LaneInstance {
  int32_t rank;   // who holds it
  int64_t quota;  // tokens it computes (instance 0: the expert's tokens less its replicas')
  int64_t local;  // tokens its own rank sends it first: min(load of that rank, quota)
};

UC_HD inline LaneInstance lane_instance(const Plan& p, int32_t e, int32_t i, const int32_t* inst, int64_t home_quota) {
  const int32_t K = p.slots, E = p.experts();
  LaneInstance x;
  x.rank = i == 0 ? e / p.experts_per_rank : inst[i] / K;
  x.quota = i == 0 ? home_quota : p.slot_quota[inst[i]];
  const int64_t ld = p.loads[int64_t(x.rank) * E + e];
  x.local = ld < x.quota ? ld : x.quota;
  return x;
}

// Pass 1: the loads column (total, tokens of sources before `me`, me's own) and the replicas
// compacted into inst[1..n) in (rank, slot) order; returns n, or -1 when the plan is outside
// the closed form's domain.  *multi: some replica has a positive quota.
template <class G>
UC_HD int32_t lane_instances(const Plan& p, int32_t e, int32_t me, int32_t* inst, int64_t* v, bool* multi, const G& g) {
  const int32_t W = p.world, K = p.slots, E = p.experts(), home = e / p.experts_per_rank;
  int64_t total = 0, before = 0, own = 0, rep_q = 0, bad = 0, pos = 0;
  for (int32_t s = g.lane(); s < W; s += g.width()) {
    const int64_t x = p.loads[int64_t(s) * E + e];
    total += x;
    before += s < me ? x : 0;
    own += s == me ? x : 0;
    bad += x < 0 ? 1 : 0;
  }
  int32_t n = 1;
  int64_t any = 0;
  for (int64_t b = 0; b < int64_t(W) * K; b += g.width()) {  // same trip count on every lane
    const int64_t s = b + g.lane();
    const bool hit = s < int64_t(W) * K && p.slot_src[s] == e;
    int64_t cnt = 0;
    pos = g.scan(hit ? 1 : 0, &cnt);
    if (hit) {
      const int64_t q = p.slot_quota[s];
      rep_q += q;
      any += q > 0 ? 1 : 0;
      bad += (q < 0 || s / K == home || n + pos >= W) ? 1 : 0;
      if (n + pos < W) inst[n + pos] = static_cast<int32_t>(s);
    }
    n += static_cast<int32_t>(cnt);
  }
  g.sync();                                                       // inst written before any lane reads it
  for (int32_t i = 2 + g.lane(); i < n && i < W; i += g.width())  // two replicas on one rank
    bad += inst[i] / K == inst[i - 1] / K ? 1 : 0;
  v[0] = g.sum(total);
  v[1] = g.sum(before);
  v[2] = g.sum(own);
  v[3] = g.sum(rep_q);
  *multi = g.sum(any) > 0;
  bad = g.sum(bad);
  return (bad > 0 || v[3] > v[0]) ? -1 : n;
}

template <class G>
UC_HD void expert_table_lanes(const Plan& p, int32_t e, int32_t me, int32_t layout, int64_t* bounds, int64_t* columns,
                              int32_t* inst, int64_t* scratch, const G& g) {
  const int32_t W = p.world, K = p.slots, E = p.experts(), epr = p.experts_per_rank, home = e / epr;
  int64_t v[4];  // total, before, own, replicas' quotas
  bool multi = false;
  const int32_t n = lane_instances(p, e, me, inst, v, &multi, g);
  if (n < 0) {  // outside the closed form's domain: the loop itself
    g.sync();   // every lane is done with inst (scratch may alias it)
    if (g.lane() == 0) expert_table(p, e, me, layout, bounds, columns, scratch);
    g.sync();
    return;
  }
  const int64_t home_q = v[0] - v[3];
  // me's interval of the remainders after the locality step: A = remainders of the sources
  // before me, L = me's own
  int64_t sub_before = 0, sub_own = 0;
  for (int32_t i = g.lane(); multi && i < n; i += g.width()) {
    const LaneInstance x = lane_instance(p, e, i, inst, home_q);
    sub_before += x.rank < me ? x.local : 0;
    sub_own += x.rank == me ? x.local : 0;
  }
  const int64_t A = v[1] - g.sum(sub_before), L = v[2] - g.sum(sub_own);
  const int64_t home_col = layout == kEcho ? e : int64_t(home) * (epr + K) + e % epr;
  int64_t carry_q = 0, carry_c = 0;             // remainders and counts of the instances before this chunk
  for (int32_t b = 0; b < W; b += g.width()) {  // same trip count on every lane
    const int32_t i = b + g.lane();
    int64_t c = 0, rest = 0;
    int64_t col = home_col;
    if (i < n) {
      const LaneInstance x = lane_instance(p, e, i, inst, home_q);
      if (!multi) {
        c = i == 0 ? v[2] : 0;  // every token goes home
      } else {
        rest = x.quota - x.local;
        c = x.rank == me ? x.local : 0;
      }
      if (i > 0) {
        const int64_t s = inst[i], r = s / K, k = s % K;
        col = layout == kEcho ? E + r * K + k : r * (epr + K) + epr + k;
      }
    }
    int64_t tq = 0, tc = 0;
    const int64_t B = carry_q + g.scan(rest, &tq);
    if (multi) {  // overlap of [A, A + L) and [B, B + rest)
      const int64_t lo = A > B ? A : B, hi = (A + L) < (B + rest) ? (A + L) : (B + rest);
      c += hi > lo ? hi - lo : 0;
    }
    const int64_t before_c = g.scan(c, &tc);
    if (i < W) {
      bounds[i] = carry_c + before_c + c;
      columns[i] = col;
    }
    carry_q += tq;
    carry_c += tc;
  }
}

}  // namespace ultracomm::split
