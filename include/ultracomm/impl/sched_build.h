// The device control plane's schedule builder, written once over a lane group (sched_group.h):
// compiled by g++ for the host (`_core.build_schedule_portable`, one lane by default, host threads
// as lanes in tests) and by nvcc for one CTA (csrc/cuda/k_build.cu: 256 threads, 8 warps).  Same
// rules as interp.h: no allocation (one caller scratch buffer, scratch_words(); the kernel puts it
// in shared memory when launch_shape() says it fits), fixed capacities (check_shape), no
// exceptions (a Status), integers only -- so every rank, every lane count and both builds give
// the same bytes.
//
// Output: this rank's multicast and reduce task lists (Task / Ref of task.h, the format
// csrc/schedule/schedule_builder.cpp emits and interp.h runs: per rank sorted by (chunk, level, expert,
// slot); a sender's refs are its children by (rank, slot), stored once for all its chunks;
// multicast level = the sender's depth, reduce level = its height) and a digest of the inputs
// and both trees, equal on every rank for the same plan.
//
// Trees (not the host's galloping search + local repair; a simpler deterministic one).  A
// candidate fixes a per-rank capacity L (children a rank may have over all experts; each home
// keeps one unit per replicated expert it homes) and a depth limit D.  Experts, most replicas
// first, hang their replicas breadth first: targets by spare capacity (most first, then slot
// id), each under the shallowest sender of the expert that still has capacity.  With node_of
// (and D >= 2) the topology rule holds: per remote node one gateway (its replica with the
// most spare capacity, then lowest id) hangs from the home's node (gateways first; if that
// fails, after the home node's replicas), the node's other replicas from the gateway's subtree.
// Candidates are L = L0, L0+1, L0+2, L0+4, ... (L0 = the bytes lower bound in experts: max(most
// filled slots of a rank, most replicated experts homed on a rank, ceil(replicas / world)))
// until one reaches the least possible depth; per op the candidate with the least cost
// max(k, fixed) * B + depth * (min(chunk, B) + hop_bytes) wins (k: its busiest rank's children,
// fixed: the most filled slots of a rank), ties to the smaller L.
//
// Parallel form (the same result for any lanes; tests/control/test_sched_build_lanes.py checks 1, 2, 8
// and 32 host lanes against the one-lane build and against the former one-thread builder):
//  - inputs staged into the scratch, problem checks as block reductions;
//  - replicas per expert by atomic counts + a block scan (CSR), filled in any order: nothing
//    below reads a replica list in its stored order (targets are sorted by a total order, a
//    gateway is the best of its node by (spare desc, id asc), refs are ranked by id);
//  - experts by (replicas desc, id asc) ranked by counting (position = keys below it);
//  - candidate trees concurrently, one per warp (sched_tree.h): a round of G warps builds
//    candidates i .. i + G - 1 and every lane replays the one-thread order of decisions over
//    them (cost, ties to the earlier, stop at the least depth), so the chosen trees and the
//    `candidates` count are the one-thread builder's;
//  - task lists (sched_write.h): child counts and reduce heights by atomics level by level,
//    senders ranked by key, ref offsets by a block scan, each ref at its rank among its
//    sender's children, tasks written one per lane (coalesced);
//  - the digest (sched_write.h): a sum mod 2^64 of one mixed term per digested field (inputs and
//    both chosen trees), each lane summing a strided share and a block sum combining them, so
//    every lane count -- and the host's one lane -- gets the same value; any single-field change
//    changes it.
#pragma once
#include <cstdint>

#include "ultracomm/records/hd.h"
#include "ultracomm/impl/sched_group.h"
#include "ultracomm/records/task.h"

namespace ultracomm::psched {

constexpr int32_t kMaxWorld = 1024;
constexpr int32_t kMaxSlots = 8;
constexpr int32_t kMaxExperts = 1 << 16;
constexpr int32_t kMaxDepth = 64;
constexpr uint64_t kMaxBytes = uint64_t(1) << 40;  // per expert and op; chunk counts stay < 2^31
constexpr uint32_t kDigestTag = 0x50b1d001u;       // first digest word: differs from the host builder's
constexpr int32_t kMaxWarps = 8;                   // candidate trees built at once (warps of the CTA)
constexpr int32_t kBlockThreads = 32 * kMaxWarps;  // the kernel's CTA
constexpr int64_t kSmemBudget = 46 * 1024;         // dynamic shared memory the kernel may take (no opt-in)

enum Status : int32_t {
  kOk = 0,
  kBadShape = 1,   // world / slots / experts outside [1, capacity] (slots may be 0)
  kBadPlan = 2,    // slot_src / home_of: out of range, replica at home, expert twice on a rank
  kBadOption = 3,  // chunk_bytes not a positive multiple of 16, bytes > kMaxBytes, max_depth, rank
  kBadNode = 4,    // node_of[r] outside [0, world)
  kOverflow = 5,   // the task or ref output is smaller than this rank's lists
};

struct Problem {
  int32_t world;
  int32_t slots;  // replica slots per rank
  int32_t num_experts;
  int32_t max_depth;  // tree depth limit (1 = direct)
  int32_t rank;       // whose task lists to write
  int32_t reserved;
  const int32_t* slot_src;  // [world * slots] expert of each replica slot, -1 empty
  const int32_t* home_of;   // [num_experts] home rank of each expert
  const int32_t* node_of;   // [world] node of each rank; nullptr: one node
  uint64_t weight_bytes;    // one expert's weights (multicast), slot layout
  uint64_t grad_bytes;      // one expert's grads (reduce)
  uint64_t chunk_bytes;     // multiple of 16
  uint64_t hop_bytes;       // cost model: per-hop latency as bytes of link time
};

// Caller memory for one op's lists.
struct OpOut {
  Task* tasks;
  int64_t task_cap;
  Ref* refs;
  int64_t ref_cap;
};

struct Result {
  int32_t status;
  int32_t candidates;   // trees the one-thread order builds (successful or not)
  int32_t lower_bound;  // L0, in experts
  int32_t cap[2];       // per op: the capacity L of the chosen tree
  int32_t busiest[2];   // per op: children of its busiest rank (k)
  int32_t depth[2];     // per op: the chosen tree's depth
  int64_t num_tasks[2];
  int64_t num_refs[2];
  uint64_t digest;
};

// ---------------------------------------------------------------- scratch layout
//
// int64 words: kBlockWords block words, then int32 arrays (offsets below), then the uint64 keys.
//   block  [8] int64: unused (was the digest);  misc [8] int32: 0 experts with replicas, 1 senders (counters)
//   src [WS], home [E], node [W]   the problem's arrays, staged
//   trees [2][3][WS]               chosen trees: [multicast, reduce][parent_rank, parent_slot, depth]
//   rep_begin [E + 1], rep [WS]    replicas of e: rep[rep_begin[e] .. rep_begin[e + 1]), any order
//   order [NX]                     experts with replicas by (replicas desc, id asc); NX = min(E, WS)
//   duty [W]                       replicated experts homed on the rank
//   height [WS + E]                reduce levels (slots, then masters); prepare's cursor and key list;
//                                  write_op's sender index of each master (E) and own slot (S)
//   kids [WS]                      children of each slot in the tree being written
//   sref [NX + S + 1]              per sender of this rank: end of its refs
//   per candidate warp (G of them): tree [3 WS], rem [W], gateway [W], targets [W], senders [W + 1],
//                                  tmp [W] (sort output), words [8] (flags and counts of the warp)
//   keys (uint64) [2 (NX + S)]     this rank's senders: sorted, then unsorted

constexpr int64_t kBlockWords = 8;
constexpr int64_t kWarpWords = 8;

UC_INLINE int64_t words_i32(int64_t n) { return (n + 1) / 2; }
UC_INLINE int64_t nx_of(int32_t W, int32_t S, int32_t E) {
  const int64_t WS = int64_t(W) * S;
  return E < WS ? E : WS;
}
UC_INLINE int64_t warp_i32(int32_t W, int32_t S) { return 3 * int64_t(W) * S + 5 * int64_t(W) + 1 + kWarpWords; }
UC_INLINE int64_t block_i32(int32_t W, int32_t S, int32_t E) {
  const int64_t WS = int64_t(W) * S, NX = nx_of(W, S, E);
  return 8 + (WS + E + W) + 6 * WS + (E + 1) + WS + NX + W + (WS + E) + WS + (NX + S + 1);
}
UC_INLINE int64_t scratch_i32(int32_t W, int32_t S, int32_t E, int32_t warps) {
  return block_i32(W, S, E) + int64_t(warps) * warp_i32(W, S);
}
// Scratch of a build with `warps` candidate warps (the default: the kernel's most).
UC_INLINE int64_t scratch_words(int32_t W, int32_t S, int32_t E, int32_t warps = kMaxWarps) {
  return kBlockWords + words_i32(scratch_i32(W, S, E, warps)) + 2 * (nx_of(W, S, E) + S);
}

struct View {
  int64_t* block;
  int32_t* misc;
  int32_t* src;
  int32_t* home;
  int32_t* node;
  int32_t* trees;
  int32_t* rep_begin;
  int32_t* rep;
  int32_t* order;
  int32_t* duty;
  int32_t* height;
  int32_t* kids;
  int32_t* sref;
  int32_t* warp0;  // first candidate warp's area (warp_i32 ints each)
  uint64_t* keys;  // sorted [NX + S], then unsorted [NX + S]
  int32_t W, S, E, warps;
};

// One candidate warp's area.
struct Work {
  int32_t* tree;     // [3 WS] parent_rank, parent_slot, depth
  int32_t* rem;      // [W] spare capacity
  int32_t* gateway;  // [W] per node: the current expert's gateway slot id (or -1)
  int32_t* targets;  // [W] one expert's targets
  int32_t* senders;  // [W + 1] one expert's senders (slot id, or -1 - home for the master)
  int32_t* tmp;      // [W] the sort's output
  int32_t* words;    // [kWarpWords] 0 hang ok, 1 home-node targets, 2 gateways, 3 node targets,
                     //               4 tree ok, 5 busiest, 6 depth
};

UC_INLINE View view(int64_t* s, int32_t W, int32_t S, int32_t E, int32_t warps = kMaxWarps) {
  const int64_t WS = int64_t(W) * S, NX = nx_of(W, S, E);
  View v;
  v.block = s;
  int32_t* p = reinterpret_cast<int32_t*>(s + kBlockWords);
  v.misc = p;
  p += 8;
  v.src = p;
  p += WS;
  v.home = p;
  p += E;
  v.node = p;
  p += W;
  v.trees = p;
  p += 6 * WS;
  v.rep_begin = p;
  p += E + 1;
  v.rep = p;
  p += WS;
  v.order = p;
  p += NX;
  v.duty = p;
  p += W;
  v.height = p;
  p += WS + E;
  v.kids = p;
  p += WS;
  v.sref = p;
  p += NX + S + 1;
  v.warp0 = p;
  v.keys = reinterpret_cast<uint64_t*>(s + kBlockWords + words_i32(scratch_i32(W, S, E, warps)));
  v.W = W;
  v.S = S;
  v.E = E;
  v.warps = warps;
  return v;
}

UC_INLINE Work work(const View& v, int32_t w) {
  const int64_t WS = int64_t(v.W) * v.S;
  int32_t* p = v.warp0 + int64_t(w) * warp_i32(v.W, v.S);
  Work k;
  k.tree = p;
  p += 3 * WS;
  k.rem = p;
  p += v.W;
  k.gateway = p;
  p += v.W;
  k.targets = p;
  p += v.W;
  k.senders = p;
  p += v.W + 1;
  k.tmp = p;
  p += v.W;
  k.words = p;
  return k;
}

// The chosen tree of op (0 multicast, 1 reduce): parent_rank at [0, WS), parent_slot at
// [WS, 2 WS), depth at [2 WS, 3 WS).
UC_INLINE int32_t* chosen(const View& v, int32_t op) { return v.trees + 3 * int64_t(v.W) * v.S * op; }

// Candidate warps of a build on group g (`warps` > 0: at most that many).
template <class G>
UC_INLINE int32_t candidate_warps(const G& g, int32_t warps) {
  int32_t n = g.warps() < kMaxWarps ? g.warps() : kMaxWarps;
  if (warps > 0 && warps < n) n = warps;
  return n;
}

// The kernel's launch: one CTA of kBlockThreads; the scratch in dynamic shared memory with as many
// candidate warps (8, 4, 2, 1) as fit kSmemBudget, else in the caller's global scratch with 8.
struct LaunchShape {
  int32_t threads;
  int32_t warps;       // candidate warps
  int64_t smem_bytes;  // dynamic shared memory; 0: the scratch stays in global memory
};
UC_INLINE LaunchShape launch_shape(int32_t W, int32_t S, int32_t E) {
  LaunchShape ls{kBlockThreads, kMaxWarps, 0};
  if (W < 1 || W > kMaxWorld || S < 0 || S > kMaxSlots || E < 0 || E > kMaxExperts) return ls;
  for (int32_t g = kMaxWarps; g >= 1; g /= 2) {
    const int64_t b = 8 * scratch_words(W, S, E, g);
    if (b <= kSmemBudget) return LaunchShape{kBlockThreads, g, b};
  }
  return ls;
}

UC_INLINE int64_t chunks_of(uint64_t bytes, uint64_t chunk) { return int64_t((bytes + chunk - 1) / chunk); }

// ---------------------------------------------------------------- block helpers

// In-place inclusive prefix sum of a[0, n) on the block: each lane a contiguous run, the runs'
// offsets by a scan in lane order.  Ends with a barrier.
template <class G>
UC_INLINE void scan_inclusive(int32_t* a, int64_t n, const G& g) {
  const int64_t per = (n + g.width() - 1) / g.width();
  const int64_t lo = per * g.lane(), hi = lo + per < n ? lo + per : n;
  int64_t s = 0;
  for (int64_t i = lo; i < hi; ++i) s += a[i];
  int64_t total = 0;
  int64_t run = g.scan(s, total);
  for (int64_t i = lo; i < hi; ++i) {
    run += a[i];
    a[i] = static_cast<int32_t>(run);
  }
  g.sync();
}

// ---------------------------------------------------------------- checks

UC_INLINE int32_t check_shape(const Problem& p) {
  if (p.world < 1 || p.world > kMaxWorld || p.slots < 0 || p.slots > kMaxSlots || p.num_experts < 0 ||
      p.num_experts > kMaxExperts)
    return kBadShape;
  if (p.chunk_bytes == 0 || p.chunk_bytes % 16 != 0 || p.weight_bytes > kMaxBytes || p.grad_bytes > kMaxBytes ||
      p.hop_bytes > kMaxBytes || p.max_depth < 1 || p.max_depth > kMaxDepth || p.rank < 0 || p.rank >= p.world)
    return kBadOption;
  return kOk;
}

// The problem with its arrays staged into the scratch (coalesced copies; read many times below).
template <class G>
UC_INLINE Problem stage(const Problem& p, const View& v, const G& g) {
  const int64_t WS = int64_t(p.world) * p.slots;
  for (int64_t i = g.lane(); i < WS; i += g.width()) v.src[i] = p.slot_src[i];
  for (int32_t e = g.lane(); e < p.num_experts; e += g.width()) v.home[e] = p.home_of[e];
  for (int32_t r = g.lane(); p.node_of && r < p.world; r += g.width()) v.node[r] = p.node_of[r];
  g.sync();
  Problem q = p;
  q.slot_src = v.src;
  q.home_of = v.home;
  q.node_of = p.node_of ? v.node : nullptr;
  return q;
}

// node_of, home_of and slot_src (the one-thread order of statuses: kBadNode before kBadPlan).
template <class G>
UC_INLINE int32_t check_plan(const Problem& p, const G& g) {
  const int32_t W = p.world, S = p.slots, E = p.num_experts;
  int64_t bad_node = 0, bad_plan = 0;
  for (int32_t r = g.lane(); p.node_of && r < W; r += g.width())
    bad_node |= (p.node_of[r] < 0 || p.node_of[r] >= W) ? 1 : 0;
  for (int32_t e = g.lane(); e < E; e += g.width()) bad_plan |= (p.home_of[e] < 0 || p.home_of[e] >= W) ? 1 : 0;
  for (int64_t id = g.lane(); id < int64_t(W) * S; id += g.width()) {
    const int32_t e = p.slot_src[id], r = static_cast<int32_t>(id / S), s = static_cast<int32_t>(id % S);
    if (e == -1) continue;
    if (e < -1 || e >= E || p.home_of[e] == r) bad_plan = 1;
    for (int32_t s2 = 0; s2 < s; ++s2) bad_plan |= p.slot_src[int64_t(r) * S + s2] == e ? 1 : 0;
  }
  bad_node = g.max(bad_node);
  bad_plan = g.max(bad_plan);
  return bad_node ? kBadNode : bad_plan ? kBadPlan : kOk;
}

// Every check on one lane, on the caller's arrays (the host's check before it builds).
UC_INLINE int32_t check_problem(const Problem& p) {
  const int32_t st = check_shape(p);
  return st != kOk ? st : check_plan(p, SerialGroup{});
}

// ---------------------------------------------------------------- preparation

struct Prepared {
  int32_t l0;     // the lower bound L0
  int32_t fixed;  // most filled slots of a rank
  int64_t total;  // replicas
  int32_t once;   // most replicated experts homed on a rank
  int32_t nx;     // experts with replicas
};

// Replicas per expert (CSR), experts by replica count, homes' duties, L0.
template <class G>
UC_INLINE Prepared prepare(const Problem& p, const View& v, const G& g) {
  const int32_t W = p.world, S = p.slots, E = p.num_experts;
  const int64_t WS = int64_t(W) * S;
  int32_t* cursor = v.height;    // [E]
  int32_t* list = v.height + E;  // [NX] keys of the experts with replicas, any order
  for (int32_t e = g.lane(); e <= E; e += g.width()) v.rep_begin[e] = 0;
  for (int32_t r = g.lane(); r < W; r += g.width()) v.duty[r] = 0;
  if (g.lane() == 0) v.misc[0] = 0;
  g.sync();
  int64_t fixed = 0, total = 0;
  for (int32_t r = g.lane(); r < W; r += g.width()) {
    int64_t f = 0;
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = p.slot_src[int64_t(r) * S + s];
      if (e >= 0) {
        g.add(&v.rep_begin[e + 1], 1);
        ++f;
      }
    }
    fixed = f > fixed ? f : fixed;
    total += f;
  }
  Prepared pr{};
  pr.fixed = static_cast<int32_t>(g.max(fixed));  // the reductions' barriers order the counts before the scan
  pr.total = g.sum(total);
  scan_inclusive(v.rep_begin + 1, E, g);
  for (int32_t e = g.lane(); e < E; e += g.width()) {
    cursor[e] = v.rep_begin[e];
    const int32_t n = v.rep_begin[e + 1] - v.rep_begin[e];
    if (n > 0) {
      g.add(&v.duty[p.home_of[e]], 1);
      list[g.add(&v.misc[0], 1)] = ((W - n) << 16) | e;  // (replicas desc, id asc): W - n < 2^15, e < 2^16
    }
  }
  g.sync();
  for (int64_t id = g.lane(); id < WS; id += g.width()) {
    const int32_t e = p.slot_src[id];
    if (e >= 0) v.rep[g.add(&cursor[e], 1)] = static_cast<int32_t>(id);
  }
  int64_t once = 0;
  for (int32_t r = g.lane(); r < W; r += g.width()) once = v.duty[r] > once ? v.duty[r] : once;
  pr.once = static_cast<int32_t>(g.max(once));
  pr.nx = v.misc[0];
  for (int32_t i = g.lane(); i < pr.nx; i += g.width()) {  // rank by counting: keys are distinct
    const int32_t x = list[i];
    int32_t pos = 0;
    for (int32_t j = 0; j < pr.nx; ++j) pos += list[j] < x ? 1 : 0;
    v.order[pos] = x & 0xffff;
  }
  g.sync();
  const int64_t l0 = pr.fixed > pr.once ? pr.fixed : pr.once;
  const int64_t avg = (pr.total + W - 1) / W;
  pr.l0 = static_cast<int32_t>(l0 > avg ? l0 : avg);
  return pr;
}

UC_INLINE uint64_t op_cost(uint64_t bytes, uint64_t chunk, uint64_t hop, int32_t k, int32_t fixed, int32_t depth) {
  const uint64_t c = chunk < bytes ? chunk : bytes;
  return uint64_t(k > fixed ? k : fixed) * bytes + uint64_t(depth) * (c + hop);
}

}  // namespace ultracomm::psched

#include "ultracomm/impl/sched_tree.h"
#include "ultracomm/impl/sched_write.h"

namespace ultracomm::psched {

// ---------------------------------------------------------------- the candidate search

// Capacity of candidate i: L0, L0 + 1, L0 + 2, L0 + 4, ..., at most lmax.
UC_INLINE int64_t candidate_cap(int64_t l0, int64_t lmax, int64_t i) {
  const int64_t L = i == 0 ? l0 : l0 + (int64_t(1) << (i - 1 < 62 ? i - 1 : 62));
  return L > lmax ? lmax : L;
}

struct Search {
  int32_t fixed, least, nx;
  int64_t l0, lmax;
  bool topo;
};

// Rounds of `warps` candidates, one per warp; after each round every lane replays the
// one-thread order over its candidates (so `res` and the chosen trees are the one-thread
// builder's) and the round's winners are copied to chosen(v, op).
template <class G>
UC_INLINE void search(const Problem& p, const View& v, const Search& sc, Result& res, const G& g) {
  const int64_t WS = int64_t(p.world) * p.slots;
  int64_t last = 0;  // the candidate at lmax ends the sequence
  while (candidate_cap(sc.l0, sc.lmax, last) < sc.lmax) ++last;
  uint64_t best[2] = {~uint64_t(0), ~uint64_t(0)};
  const int32_t wid = g.warp_id();
  for (int64_t base = 0;; base += v.warps) {
    if (wid < v.warps) {
      const auto s = g.sub();
      const Work w = work(v, wid);
      const int64_t i = base + wid;
      int64_t ok = 0, k = 0, d = 0;
      if (i <= last) {
        const int32_t L = static_cast<int32_t>(candidate_cap(sc.l0, sc.lmax, i));
        ok = build_tree(p, v, w, L, p.max_depth, sc.topo, sc.nx, s) ? 1 : 0;
        if (ok) {
          for (int32_t r = s.lane(); r < p.world; r += s.width()) k = L - w.rem[r] > k ? L - w.rem[r] : k;
          for (int64_t id = s.lane(); id < WS; id += s.width()) d = w.tree[2 * WS + id] > d ? w.tree[2 * WS + id] : d;
          k = s.max(k);
          d = s.max(d);
        }
      }
      if (s.lane() == 0) {
        w.words[4] = static_cast<int32_t>(ok);
        w.words[5] = static_cast<int32_t>(k);
        w.words[6] = static_cast<int32_t>(d);
      }
    }
    g.sync();
    bool stop = false;
    int32_t take[2] = {-1, -1};
    for (int32_t j = 0; j < v.warps && !stop; ++j) {
      const int64_t i = base + j;
      if (i > last) break;
      res.candidates = static_cast<int32_t>(i + 1);
      const Work w = work(v, j);
      if (w.words[4]) {
        const int32_t k = w.words[5], d = w.words[6];
        UC_UNROLL
        for (int32_t op = 0; op < 2; ++op) {
          const uint64_t c =
              op_cost(op == 0 ? p.weight_bytes : p.grad_bytes, p.chunk_bytes, p.hop_bytes, k, sc.fixed, d);
          if (c < best[op]) {
            best[op] = c;
            res.cap[op] = static_cast<int32_t>(candidate_cap(sc.l0, sc.lmax, i));
            res.busiest[op] = k;
            res.depth[op] = d;
            take[op] = j;
          }
        }
        if (d <= sc.least) stop = true;  // a larger L cannot lower the depth, and only adds link time
      }
      if (i >= last) stop = true;
    }
    stop = stop || base + v.warps > last;
    UC_UNROLL
    for (int32_t op = 0; op < 2; ++op) {
      if (take[op] < 0) continue;
      const int32_t* from = work(v, take[op]).tree;
      int32_t* to = chosen(v, op);
      for (int64_t x = g.lane(); x < 3 * WS; x += g.width()) to[x] = from[x];
    }
    g.sync();  // the copies are done before the next round rebuilds the warps' trees
    if (stop) break;
  }
}

// ---------------------------------------------------------------- the build

// The whole build on block g (every lane calls it and gets the same Result).  scratch:
// scratch_words(W, S, E, warps) words; `warps` > 0 caps the candidate warps (the kernel's
// launch_shape), 0 takes all of g's (at most kMaxWarps).  On kOk the chosen trees are
// chosen(view(scratch, W, S, E, candidate_warps(g, warps)), op).
template <class G>
UC_INLINE Result build(const Problem& p0, int64_t* scratch, const OpOut& mc_out, const OpOut& rd_out, const G& g,
                       int32_t warps = 0) {
  Result res{};
  res.status = check_shape(p0);
  if (res.status != kOk) return res;
  const int32_t W = p0.world, S = p0.slots, E = p0.num_experts;
  const int64_t WS = int64_t(W) * S;
  const View v = view(scratch, W, S, E, candidate_warps(g, warps));
  const Problem p = stage(p0, v, g);
  res.status = check_plan(p, g);
  if (res.status != kOk) return res;
  const Prepared pr = prepare(p, v, g);
  res.lower_bound = pr.l0;
  int64_t multi = 0;
  for (int32_t r = g.lane(); p.node_of && r < W; r += g.width()) multi |= p.node_of[r] != p.node_of[0] ? 1 : 0;
  const bool topo = g.max(multi) != 0 && p.max_depth >= 2;
  // least depth any tree can have: 1, or 2 when an expert has a replica off its home's node
  int64_t least = pr.total > 0 ? 1 : 0;
  for (int64_t id = g.lane(); topo && id < WS; id += g.width()) {
    const int32_t e = p.slot_src[id];
    if (e >= 0 && p.node_of[id / S] != p.node_of[p.home_of[e]]) least = 2;
  }
  Search sc{};
  sc.fixed = pr.fixed;
  sc.least = static_cast<int32_t>(g.max(least));
  sc.nx = pr.nx;
  sc.l0 = pr.l0;
  sc.lmax = pr.total + pr.once;  // always succeeds: every home can take all its replicas
  sc.topo = topo;
  search(p, v, sc, res, g);
  res.status = write_op(p, v, 0, res.depth[0], mc_out, res.num_tasks[0], res.num_refs[0], g);
  if (res.status != kOk) return res;
  res.status = write_op(p, v, 1, res.depth[1], rd_out, res.num_tasks[1], res.num_refs[1], g);
  if (res.status != kOk) return res;
  res.digest = digest(p, v, g);  // every lane: a block sum of the lanes' terms (sched_write.h)
  return res;
}

// The one-lane build (the host's default).
UC_INLINE Result build(const Problem& p, int64_t* scratch, const OpOut& mc_out, const OpOut& rd_out) {
  return build(p, scratch, mc_out, rd_out, SerialGroup{});
}

}  // namespace ultracomm::psched
