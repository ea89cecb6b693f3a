// The device control plane's quota planner (UltraEP's formulation), written once: compiled by
// g++ for the host executor and `_core.quota_device`, and by nvcc for k_quota.cu.  Same rules
// as interp.h: no allocation (the caller hands in one scratch buffer, scratch_words()), fixed
// capacities (checked by check_problem), no exceptions (a Status), integers only.
//
// What it solves: the smallest global per-rank token threshold T it can meet, with the quota
// of every expert instance (tokens it computes).  Hot ranks (home load above T), largest first,
// shed tokens of their experts to replicas on cold ranks (UltraEP's fixed-home model: a hot
// rank takes no replica), one piece per replica: the largest piece of one of its experts that
// some cold rank takes whole, on the tightest such rank; when none fits whole, the hottest
// expert's piece is split and its part goes to the largest spare.  A piece is at least
// min_tokens (a rank may end up to min_tokens - 1 above T).  With node_of given, replicas stay
// on the expert's home node.
//
// Parallel form, one source for every build (plan() below, over a Cta policy):
// * a probe (one threshold) runs on a Group of lanes; the receiver choice is a min-reduction
//   over ranks, so any lane count gives the same plan (the minimum of a total order does not
//   depend on the order it is taken in);
// * a search round schedules kProbes thresholds, increasing; `groups` probe groups split them
//   (the GPU: kProbes warps, one threshold each, at once; the host: one group, in turn).  Only
//   the smallest feasible threshold of a round moves the bracket, so a group stops at its first
//   feasible threshold and keeps that probe's state: the group that holds the new upper bound
//   copies its plan out -- no final re-probe of the winner;
// * the rounds are a function of the probes' answers only, so every build, lane count, group
//   count and rank computes the same plan, threshold and Result from the same loads (no
//   broadcast, no leader).
#pragma once
#include <cstdint>

#include "ultracomm/records/hd.h"

namespace ultracomm::quota {

constexpr int32_t kMaxWorld = 1024;  // rank ids fit the key's low 10 bits
constexpr int32_t kMaxExperts = 1 << 16;
constexpr int32_t kMaxSlots = 8;
constexpr int64_t kMaxTokens = int64_t(1) << 48;  // planners/base.MAX_LOAD_TOTAL
constexpr int32_t kProbes = 8;                    // thresholds per search round (warps of the kernel)

enum Status : int32_t {
  kOk = 0,
  kBadShape = 1,   // world / experts_per_rank / slots out of [1, capacity]
  kBadLoad = 2,    // a negative expert load, or a total above kMaxTokens
  kBadOption = 3,  // min_tokens outside [1, kMaxTokens], tol outside [0, kMaxTokens], eps_bp outside [0, 10000]
  kBadNode = 4,    // node_of[r] < 0
};

struct Problem {
  int32_t world;
  int32_t experts_per_rank;    // expert e lives on rank e / experts_per_rank
  int32_t slots;               // replica slots per rank (0: nothing to place)
  int64_t min_tokens;          // smallest piece a replica may take (>= 1)
  int64_t tol;                 // the search stops when the bracket is within tol tokens; 0: from eps_bp
  int32_t eps_bp;              // tol = max(1, floor(mean) * eps_bp / 10000) when tol is 0
  const int64_t* expert_load;  // [E] tokens of each expert, summed over source ranks
  const int32_t* node_of;      // [world] node of each rank; nullptr: replicas go anywhere
  UC_HD int32_t experts() const { return world * experts_per_rank; }
};

// Views of the caller's scratch (int64 words): the problem's derived data, shared by the
// probes, and per probe lane group the mutable state of one probe and its plan.
struct Shared {
  int64_t* rank_load;     // [world] home load of each rank
  int32_t* rank_order;    // [world] ranks by home load, largest first, ties lower rank
  int32_t* expert_order;  // [E] per rank, its experts hottest first, ties lower id
};
struct ProbeState {
  int64_t* spare;  // [world] T - load of a receiver; -1 for a hot rank
  int32_t* free;   // [world] free replica slots
  int32_t* held;   // [world] expert of the rank's newest replica (-1)
  int32_t* src;    // [world * slots] expert held by each slot (-1 empty)
  int64_t* quota;  // [world * slots] tokens each slot computes
  int64_t* avail;  // [E] tokens of each expert not yet given to a replica
};

// The plan: slot s of rank r (index r * slots + s) holds a replica of expert src (-1: empty)
// computing quota tokens; slots fill in the order placed.
struct Plan {
  int32_t* src;    // [world * slots]
  int64_t* quota;  // [world * slots]
};

struct Result {
  int32_t status;
  int32_t probes;     // thresholds the search scheduled (a build may skip those above a
                      // round's first feasible one: they cannot move the bracket)
  int32_t rounds;     // search rounds
  int32_t replicas;   // slots filled
  int64_t threshold;  // the T met
};

// ---------------------------------------------------------------- scratch layout (int64 words)

UC_INLINE int64_t words_i32(int64_t n) { return (n + 1) / 2; }
UC_INLINE int64_t shared_words(int32_t W, int32_t E) { return W + words_i32(W) + words_i32(E); }
UC_INLINE int64_t probe_words(int32_t W, int32_t E, int32_t K) {
  return W + 2 * words_i32(W) + words_i32(int64_t(W) * K) + int64_t(W) * K + E;
}
// Scratch for `groups` probe groups (each keeps its own state: kProbes on the GPU, 1 on the host).
UC_INLINE int64_t scratch_words(int32_t W, int32_t E, int32_t K, int32_t groups) {
  return shared_words(W, E) + int64_t(groups) * probe_words(W, E, K);
}
// The GPU kernel's state when it all lives in shared memory: expert_load [E] and node_of [W]
// staged, then scratch_words(W, E, K, kProbes).  EP64 (W 64, E 256, K 2): 256 + 32 + 224 +
// 8 x 576 words = 5,120 words, 40 KB (a probe's state is 576 words = 4.6 KB).
UC_INLINE int64_t smem_words(int32_t W, int32_t E, int32_t K) {
  return E + words_i32(W) + scratch_words(W, E, K, kProbes);
}

UC_INLINE Shared shared_view(int64_t* s, int32_t W, int32_t E) {
  Shared v;
  v.rank_load = s;
  v.rank_order = reinterpret_cast<int32_t*>(s + W);
  v.expert_order = reinterpret_cast<int32_t*>(s + W + words_i32(W));
  (void)E;
  return v;
}
UC_INLINE ProbeState probe_view(int64_t* s, int32_t W, int32_t E, int32_t K, int32_t group) {
  int64_t* p = s + shared_words(W, E) + int64_t(group) * probe_words(W, E, K);
  ProbeState v;
  v.spare = p;
  v.free = reinterpret_cast<int32_t*>(p + W);
  v.held = reinterpret_cast<int32_t*>(p + W + words_i32(W));
  v.src = reinterpret_cast<int32_t*>(p + W + 2 * words_i32(W));
  v.quota = p + W + 2 * words_i32(W) + words_i32(int64_t(W) * K);
  v.avail = v.quota + int64_t(W) * K;
  return v;
}

UC_INLINE int32_t check_problem(const Problem& p) {
  if (p.world < 1 || p.world > kMaxWorld || p.experts_per_rank < 1 || p.slots < 0 || p.slots > kMaxSlots ||
      int64_t(p.world) * p.experts_per_rank > kMaxExperts)
    return kBadShape;
  if (p.min_tokens < 1 || p.min_tokens > kMaxTokens || p.tol < 0 || p.tol > kMaxTokens || p.eps_bp < 0 ||
      p.eps_bp > 10000)
    return kBadOption;
  return kOk;
}

// ---------------------------------------------------------------- groups of lanes
//
// A Group runs one probe: lane() in [0, width()), sync() a barrier of the group (and a memory
// fence among its lanes), and min() / sum() return the minimum / sum of every lane's value to
// every lane; min2(a, b) leaves in every lane's (a, b) the lexicographic minimum of all lanes'
// pairs (probe groups only).  Writes to shared state happen on lane 0 between syncs.
//
// A Cta runs the whole search: groups() probe groups (group() is this thread's), each a Group
// (lanes()), and all() -- every thread as one Group -- for the derived data, the plan's
// clearing and the bracket's moves between rounds.  The GPU: kProbes warps of 32 lanes
// (k_quota.cu); the host: SerialCta, or host threads (csrc/planners/quota_lanes.h, tests).

struct SerialGroup {  // the host build: one lane
  UC_INLINE int32_t lane() const { return 0; }
  UC_INLINE int32_t width() const { return 1; }
  UC_INLINE void sync() const {}
  UC_INLINE uint64_t min(uint64_t v) const { return v; }
  UC_INLINE void min2(uint64_t&, uint64_t&) const {}
  UC_INLINE int64_t sum(int64_t v) const { return v; }
};

struct SerialCta {  // the host build: one group of one lane probes a round's thresholds in turn
  UC_INLINE int32_t group() const { return 0; }
  UC_INLINE int32_t groups() const { return 1; }
  UC_INLINE SerialGroup lanes() const { return {}; }
  UC_INLINE SerialGroup all() const { return {}; }
};

// ---------------------------------------------------------------- derived data (any lanes)

// Rank order and per-rank expert order by counting (each position is computed independently, so
// lanes split the work with no sort): position of x = how many items come before it.
template <class G>
UC_INLINE int32_t prepare(const Problem& p, Shared sh, const G& g) {
  const int32_t W = p.world, epr = p.experts_per_rank, E = p.experts();
  bool bad = false;
  for (int32_t r = g.lane(); r < W; r += g.width()) {
    int64_t L = 0;  // each term <= kMaxTokens and checked after each add: no overflow
    for (int32_t j = 0; j < epr; ++j) {
      const int64_t x = p.expert_load[int64_t(r) * epr + j];
      bad = bad || x < 0 || x > kMaxTokens;
      L += (x < 0 || x > kMaxTokens) ? 0 : x;
      bad = bad || L > kMaxTokens;
      L = L > kMaxTokens ? kMaxTokens : L;
    }
    bad = bad || (p.node_of && p.node_of[r] < 0);
    sh.rank_load[r] = L;
  }
  const bool any_bad = g.min(bad ? 0u : 1u) == 0;
  g.sync();
  int64_t total = 0;  // <= kMaxWorld * kMaxTokens: fits
  for (int32_t r = g.lane(); r < W; r += g.width()) total += sh.rank_load[r];
  total = g.sum(total);
  if (any_bad || total > kMaxTokens) {  // every lane names the same problem: loads, then nodes
    for (int32_t e = 0; e < E; ++e)
      if (p.expert_load[e] < 0 || p.expert_load[e] > kMaxTokens) return kBadLoad;
    for (int32_t r = 0; p.node_of && r < W; ++r)
      if (p.node_of[r] < 0) return kBadNode;
    return kBadLoad;  // the total is above kMaxTokens
  }
  for (int32_t r = g.lane(); r < W; r += g.width()) {
    const int64_t L = sh.rank_load[r];
    int32_t pos = 0;
    for (int32_t q = 0; q < W; ++q) {
      const int64_t Lq = sh.rank_load[q];
      pos += (Lq > L || (Lq == L && q < r)) ? 1 : 0;
    }
    sh.rank_order[pos] = r;
  }
  for (int32_t e = g.lane(); e < E; e += g.width()) {
    const int32_t base = (e / epr) * epr;
    const int64_t x = p.expert_load[e];
    int32_t pos = 0;
    for (int32_t q = base; q < base + epr; ++q) {
      const int64_t y = p.expert_load[q];
      pos += (y > x || (y == x && q < e)) ? 1 : 0;
    }
    sh.expert_order[base + pos] = e;
  }
  g.sync();
  return kOk;
}

// ---------------------------------------------------------------- one probe

constexpr uint64_t kNoReceiver = ~uint64_t(0);

// Key of receiver r for a piece of `need` tokens (smaller is better): class 0 = its spare
// takes the whole piece (tightest first), class 1 = it does not (largest spare first); the
// low 10 bits are the rank, so ties go to the lower rank and the key names the winner.
UC_INLINE uint64_t receiver_key(int64_t spare, int64_t need, int32_t r) {
  const uint64_t fits = spare >= need ? 0u : 1u;
  const uint64_t v = fits == 0 ? static_cast<uint64_t>(spare) : static_cast<uint64_t>(kMaxTokens - spare);
  return (fits << 59) | (v << 10) | static_cast<uint64_t>(r);
}

UC_INLINE bool can_receive(const Problem& p, ProbeState st, int32_t r, int32_t e, int32_t hnode) {
  return st.spare[r] >= p.min_tokens && st.free[r] > 0 && st.held[r] != e && (!p.node_of || p.node_of[r] == hnode);
}

// Can T be met?  Fills st.src / st.quota with the replicas (slot order = order placed).
// Each step of a hot rank h places one piece: the largest piece min(avail[e], excess) of one
// of h's experts that some receiver takes whole (ties: the hotter expert), on the receiver
// that fits it best; when no piece fits whole, the hottest expert's piece is split, its part
// going to the largest spare.
template <class G>
UC_INLINE bool probe(const Problem& p, Shared sh, ProbeState st, int64_t T, const G& g) {
  const int32_t W = p.world, epr = p.experts_per_rank, K = p.slots;
  // this lane's first (expert, receiver) pair and the stride, as (j, r) steps: lane = j0 * W + r0
  const int32_t j0 = g.lane() / W, r0 = g.lane() % W, dj = g.width() / W, dr = g.width() % W;
  for (int32_t r = g.lane(); r < W; r += g.width()) {
    const int64_t L = sh.rank_load[r];
    st.spare[r] = L > T ? -1 : T - L;
    st.free[r] = K;
    st.held[r] = -1;
  }
  for (int64_t i = g.lane(); i < int64_t(W) * K; i += g.width()) {
    st.src[i] = -1;
    st.quota[i] = 0;
  }
  for (int32_t e = g.lane(); e < p.experts(); e += g.width()) st.avail[e] = p.expert_load[e];
  g.sync();
  for (int32_t idx = 0; idx < W; ++idx) {
    const int32_t h = sh.rank_order[idx];
    const int64_t L = sh.rank_load[h];
    if (L <= T) break;  // the rest are cold
    int64_t excess = L - T;
    const int32_t hnode = p.node_of ? p.node_of[h] : 0;
    const int32_t* mine = sh.expert_order + int64_t(h) * epr;  // hottest first
    while (excess >= p.min_tokens) {
      // One pass over the (expert j, receiver r) pairs: the largest piece min(avail, excess)
      // that some receiver takes whole, ties the hotter expert, on the tightest such receiver,
      // ties the lower rank -- the lexicographic minimum of (piece key, receiver key), piece
      // key = (kMaxTokens - piece) << 16 | j (j < 2^16), receiver key = spare << 10 | r.
      // Pair i = j * W + r of the flat range, lane-strided without a division per pair.
      uint64_t best = kNoReceiver, best_r = kNoReceiver;
      for (int32_t j = j0, r = r0; j < epr;) {
        const int32_t e = mine[j];
        const int64_t a = st.avail[e];
        const int64_t need = a < excess ? a : excess;
        const int64_t sp = st.spare[r];
        if (need >= p.min_tokens && sp >= need && can_receive(p, st, r, e, hnode)) {
          const uint64_t k = (static_cast<uint64_t>(kMaxTokens - need) << 16) | static_cast<uint64_t>(j);
          const uint64_t kr = (static_cast<uint64_t>(sp) << 10) | static_cast<uint64_t>(r);
          if (k < best || (k == best && kr < best_r)) {
            best = k;
            best_r = kr;
          }
        }
        r += dr;
        j += dj;
        if (r >= W) {
          r -= W;
          j += 1;
        }
      }
      g.min2(best, best_r);
      int32_t e = -1;
      uint64_t rk = best_r;
      if (best != kNoReceiver) {
        e = mine[best & 0xffffu];
      } else {  // nothing fits whole: split the hottest expert left onto the largest spare
        for (int32_t jj = 0; jj < epr && e < 0; ++jj)
          if (st.avail[mine[jj]] >= p.min_tokens) e = mine[jj];
        if (e < 0) return false;
        const int64_t need = st.avail[e] < excess ? st.avail[e] : excess;
        rk = kNoReceiver;
        for (int32_t r = g.lane(); r < W; r += g.width()) {
          const uint64_t k = can_receive(p, st, r, e, hnode) ? receiver_key(st.spare[r], need, r) : kNoReceiver;
          rk = k < rk ? k : rk;
        }
        rk = g.min(rk);
        if (rk == kNoReceiver) return false;
      }
      const int64_t need = st.avail[e] < excess ? st.avail[e] : excess;
      const int32_t r = static_cast<int32_t>(rk & 1023u);
      const int64_t s = st.spare[r];
      const int64_t amt = s < need ? s : need;
      g.sync();  // every lane has read spare / avail before lane 0 changes them
      if (g.lane() == 0) {
        const int64_t slot = int64_t(r) * K + (K - st.free[r]);
        st.src[slot] = e;
        st.quota[slot] = amt;
        st.spare[r] = s - amt;
        st.free[r] -= 1;
        st.held[r] = e;
        st.avail[e] -= amt;
      }
      g.sync();
      excess -= amt;
    }
  }
  return true;
}

// ---------------------------------------------------------------- the threshold search
//
// The bracket (lo, hi]: lo is known infeasible, hi feasible (T = the largest home load needs
// no replica: its plan is the empty one).  lb = ceil(mean) bounds every T from below; tol =
// p.tol, or max(1, floor(mean) * eps_bp / 10000) -- integers only, so every build derives the
// same tol -- is the width at which the search stops.  Round 0 gallops up from lb - 1:
// thresholds lb - 1 + tol * 2^i, so its first probe is the lower bound x (1 + eps) (UltraEP's
// "fast T oracle"): when that one is feasible the bracket is (lb - 1, lb - 1 + tol], done in
// one round (the common case on the evaluation loads), and the host build has run one probe.
// Later rounds split (lo, hi) evenly into kProbes + 1 parts.  After each round hi = the smallest
// feasible threshold probed, lo = the largest infeasible one below it.  The search ends when
// hi - lo <= tol; the plan is hi's, kept from the probe that found it.

struct Bracket {
  int64_t lo, hi, tol;
  int32_t round;
};

UC_INLINE Bracket start_bracket(const Problem& p, Shared sh) {
  int64_t total = 0, mx = 0;
  for (int32_t r = 0; r < p.world; ++r) {
    total += sh.rank_load[r];
    mx = sh.rank_load[r] > mx ? sh.rank_load[r] : mx;
  }
  const int64_t lb = (total + p.world - 1) / p.world;
  // integers only, so every build derives the same tol: floor(mean) <= 2^48, eps_bp <= 10^4
  int64_t tol = p.tol > 0 ? p.tol : (total / p.world) * p.eps_bp / 10000;
  tol = tol < 1 ? 1 : tol;
  Bracket b{lb - 1, mx, tol, 0};
  if (b.lo >= b.hi) b.lo = b.hi - 1;  // balanced already: T = mx, nothing to move
  return b;
}

UC_INLINE bool search_done(const Bracket& b) { return b.hi - b.lo <= b.tol; }

UC_INLINE int64_t raw_threshold(const Bracket& b, int32_t i) {
  if (b.round == 0) return b.lo + (b.tol << i);           // tol <= 2^48, i < 8: no overflow
  return b.lo + (b.hi - b.lo) * (i + 1) / (kProbes + 1);  // span <= 2^48: no overflow
}

// Threshold i of this round, or 0 where slot i probes nothing (outside (lo, hi), or the same
// threshold as slot i - 1 when the bracket is narrower than kProbes + 1).  The non-zero
// thresholds of a round increase with i.
UC_INLINE int64_t round_threshold(const Bracket& b, int32_t i) {
  const int64_t t = raw_threshold(b, i);
  if (t <= b.lo || t >= b.hi) return 0;
  if (i > 0 && raw_threshold(b, i - 1) == t) return 0;
  return t;
}

// Thresholds this round schedules (Result::probes counts these, whether a build ran them all).
UC_INLINE int32_t scheduled(const Bracket& b) {
  int32_t n = 0;
  for (int32_t i = 0; i < kProbes; ++i) n += round_threshold(b, i) ? 1 : 0;
  return n;
}

// The next bracket from this round's thresholds t[i] (0 = not probed) and results ok[i].  Only
// the smallest feasible t and the infeasible ones below it matter: a build may leave every
// slot above its first feasible one unprobed (t = 0) and get the same bracket.
UC_INLINE void next_bracket(Bracket& b, const int64_t* t, const int32_t* ok) {
  int64_t hi = b.hi, lo = b.lo;
  for (int32_t i = 0; i < kProbes; ++i)
    if (t[i] && ok[i] && t[i] < hi) hi = t[i];
  for (int32_t i = 0; i < kProbes; ++i)
    if (t[i] && !ok[i] && t[i] > lo && t[i] < hi) lo = t[i];
  b.lo = lo;
  b.hi = hi;
  b.round += 1;
}

// What the probe groups share between rounds (the GPU: __shared__; the host: the caller's),
// written by a group's lane 0 or all()'s lane 0 between barriers of all().
struct Round {
  Bracket b;
  int64_t t[kProbes];   // this round's thresholds probed (0: not probed)
  int32_t ok[kProbes];  // 1: t[i] was feasible
  int32_t probes;       // Result::probes so far
  int32_t replicas;     // replicas of the plan kept (hi's)
};

// Copy a group's probe state (the plan of the new hi) to `out`; returns its replicas to every lane.
template <class G>
UC_INLINE int32_t keep_plan(const Problem& p, ProbeState st, Plan out, const G& g) {
  int64_t n = 0;
  for (int64_t i = g.lane(); i < int64_t(p.world) * p.slots; i += g.width()) {
    out.src[i] = st.src[i];
    out.quota[i] = st.quota[i];
    n += st.src[i] >= 0 ? 1 : 0;
  }
  n = g.sum(n);
  g.sync();  // every lane has read st before the group's next probe resets it
  return static_cast<int32_t>(n);
}

// The whole search, run by every thread of the Cta `c`.  scratch: scratch_words(W, E, K,
// c.groups()) words (may be shared memory); `out` [W * K] gets the plan, `rd` is the groups'
// shared round state.  Every thread returns the same Result; on kOk the plan is in `out` (on a
// bad status `out` is untouched).
//
// Per round: group g probes the round's thresholds g, g + groups, ... in order and stops at
// its first feasible one (the thresholds increase, so later ones cannot lower hi), keeping
// that probe's state; after a barrier all()'s lane 0 moves the bracket, and after another the
// group whose threshold became hi copies its state to `out` while the others start the next
// round.  No threshold is probed twice and the plan needs no final probe.
template <class C>
UC_HD Result plan(const Problem& p, int64_t* scratch, Plan out, Round& rd, const C& c) {
  const auto all = c.all();
  const auto g = c.lanes();
  int32_t status = check_problem(p);
  if (status != kOk) return Result{status, 0, 0, 0, 0};  // same on every thread: no barrier needed
  const int32_t W = p.world, E = p.experts(), K = p.slots;
  const Shared sh = shared_view(scratch, W, E);
  status = prepare(p, sh, all);  // ends with a barrier of all(); the same status on every thread
  if (status != kOk) return Result{status, 0, 0, 0, 0};
  for (int64_t i = all.lane(); i < int64_t(W) * K; i += all.width()) {  // hi = max home load: no replica
    out.src[i] = -1;
    out.quota[i] = 0;
  }
  if (all.lane() == 0) {
    rd.b = start_bracket(p, sh);
    rd.probes = 0;
    rd.replicas = 0;
  }
  all.sync();
  const ProbeState st = probe_view(scratch, W, E, K, c.group());
  while (!search_done(rd.b)) {
    const Bracket b = rd.b;  // rd.b changes only between the two barriers below
    int64_t held = 0;        // the feasible threshold whose plan st holds (0: none)
    for (int32_t w = c.group(); w < kProbes; w += c.groups()) {
      const int64_t t = held ? 0 : round_threshold(b, w);
      const bool ok = t != 0 && probe(p, sh, st, t, g);
      held = ok ? t : held;
      if (g.lane() == 0) {
        rd.t[w] = t;
        rd.ok[w] = ok ? 1 : 0;
      }
    }
    all.sync();
    if (all.lane() == 0) {
      rd.probes += scheduled(b);
      next_bracket(rd.b, rd.t, rd.ok);
    }
    all.sync();
    if (held != 0 && held == rd.b.hi) {  // thresholds are distinct: one group at most
      const int32_t n = keep_plan(p, st, out, g);
      if (g.lane() == 0) rd.replicas = n;
    }
  }
  all.sync();  // the kept plan and rd.replicas are visible to every thread
  return Result{kOk, rd.probes, rd.b.round, rd.replicas, rd.b.hi};
}

}  // namespace ultracomm::quota
