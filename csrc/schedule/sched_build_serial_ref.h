// TEST ORACLE, not used by any build path: the one-thread schedule builder as committed before
// the builder became a lane-group (CTA) build (git show 7afa026:include/ultracomm/impl/sched_build.h),
// frozen in its own namespace.  `_core.build_schedule_portable_serial_ref` runs it so the tests
// can hold the parallel builder to the former one's bytes (tasks, refs, trees, digest).  Changed
// since: the digest (issue 33: the combinable digest of sched_write.h, computed here serially).
//
// The device control plane's schedule builder, written once: compiled by g++ for the host
// (`_core.build_schedule_portable`) and by nvcc (csrc/cuda/k_build.cu).  Same rules as interp.h:
// no allocation (one caller scratch buffer, scratch_words()), fixed capacities (check_problem),
// no exceptions (a Status), integers only -- so every rank and both builds give the same bytes.
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
// most spare capacity) hangs from the home's node (gateways first; if that fails, after the home
// node's replicas), the node's other replicas from the gateway's subtree.  Candidates are L = L0, L0+1, L0+2, L0+4, ... (L0 = the bytes lower bound in
// experts: max(most filled slots of a rank, most replicated experts homed on a rank,
// ceil(replicas / world))) until one reaches the least possible depth; per op the candidate
// with the least cost max(k, fixed) * B + depth * (min(chunk, B) + hop_bytes) wins (k: its
// busiest rank's children, fixed: the most filled slots of a rank), ties to the smaller L.
#pragma once
#include <cstdint>
#include <initializer_list>

#include "ultracomm/records/hd.h"
#include "ultracomm/records/task.h"

namespace ultracomm::psched_ref {

constexpr int32_t kMaxWorld = 1024;
constexpr int32_t kMaxSlots = 8;
constexpr int32_t kMaxExperts = 1 << 16;
constexpr int32_t kMaxDepth = 64;
constexpr uint64_t kMaxBytes = uint64_t(1) << 40;  // per expert and op; chunk counts stay < 2^31
constexpr uint32_t kDigestTag = 0x50b1d001u;       // first digest word: differs from the host builder's

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
  int32_t candidates;   // trees built (successful or not)
  int32_t lower_bound;  // L0, in experts
  int32_t cap[2];       // per op: the capacity L of the chosen tree
  int32_t busiest[2];   // per op: children of its busiest rank (k)
  int32_t depth[2];     // per op: the chosen tree's depth
  int64_t num_tasks[2];
  int64_t num_refs[2];
  uint64_t digest;
};

// ---------------------------------------------------------------- scratch layout (int64 words)

UC_INLINE int64_t words_i32(int64_t n) { return (n + 1) / 2; }

// Int32 arrays in the scratch, in this order (offsets in int32 units from the start).
struct View {
  int32_t* trees;      // [3][3][WS]: [work, multicast, reduce][parent_rank, parent_slot, depth]
  int32_t* rem;        // [W] spare capacity
  int32_t* duty;       // [W] replicated experts homed on the rank not yet hung
  int32_t* rep_begin;  // [E + 1] replicas of e: rep[rep_begin[e] .. rep_begin[e + 1]), slot id asc
  int32_t* rep;        // [WS]
  int32_t* order;      // [E] experts by (replicas desc, id asc)
  int32_t* cnt;        // [W + 2] counting-sort buckets
  int32_t* targets;    // [W] one expert's targets
  int32_t* senders;    // [W + 1] one expert's senders (slot id, or -1 - home for the master)
  int32_t* gateway;    // [W] per node: the current expert's gateway slot id (or -1)
  int32_t* height;     // [WS + E] reduce levels (slots, then masters)
  int32_t* kids;       // [WS] children of each slot in the tree being written
  uint64_t* keys;      // [E + S] this rank's senders (8-byte aligned)
};

// Tree t (0 work, 1 multicast, 2 reduce): parent_rank at [0, WS), parent_slot at [WS, 2 WS),
// depth at [2 WS, 3 WS).  (Pointer arithmetic, not an array of pointers: no local memory.)
UC_INLINE int32_t* tree_of(int32_t* trees, int64_t WS, int32_t t) { return trees + 3 * WS * t; }

UC_INLINE int64_t scratch_i32(int32_t W, int32_t S, int32_t E) {
  const int64_t WS = int64_t(W) * S;
  return 9 * WS + 2 * int64_t(W) + (E + 1) + WS + E + (W + 2) + W + (W + 1) + W + (WS + E) + WS;
}
UC_INLINE int64_t scratch_words(int32_t W, int32_t S, int32_t E) {
  return words_i32(scratch_i32(W, S, E)) + int64_t(E) + S;
}

UC_INLINE View view(int64_t* s, int32_t W, int32_t S, int32_t E) {
  const int64_t WS = int64_t(W) * S;
  int32_t* p = reinterpret_cast<int32_t*>(s);
  View v;
  v.trees = p;
  p += 9 * WS;
  v.rem = p;
  p += W;
  v.duty = p;
  p += W;
  v.rep_begin = p;
  p += E + 1;
  v.rep = p;
  p += WS;
  v.order = p;
  p += E;
  v.cnt = p;
  p += W + 2;
  v.targets = p;
  p += W;
  v.senders = p;
  p += W + 1;
  v.gateway = p;
  p += W;
  v.height = p;
  p += WS + E;
  v.kids = p;
  v.keys = reinterpret_cast<uint64_t*>(s + words_i32(scratch_i32(W, S, E)));
  return v;
}

// Upper bounds of one op's lists on `rank` (what an arena slot must hold): every sender node
// of the rank (its homed experts and its slots) with every chunk; refs: every replica.
UC_INLINE int64_t chunks_of(uint64_t bytes, uint64_t chunk) { return int64_t((bytes + chunk - 1) / chunk); }

// ---------------------------------------------------------------- checks

UC_INLINE int32_t check_problem(const Problem& p) {
  if (p.world < 1 || p.world > kMaxWorld || p.slots < 0 || p.slots > kMaxSlots || p.num_experts < 0 ||
      p.num_experts > kMaxExperts)
    return kBadShape;
  if (p.chunk_bytes == 0 || p.chunk_bytes % 16 != 0 || p.weight_bytes > kMaxBytes || p.grad_bytes > kMaxBytes ||
      p.hop_bytes > kMaxBytes || p.max_depth < 1 || p.max_depth > kMaxDepth || p.rank < 0 || p.rank >= p.world)
    return kBadOption;
  for (int32_t r = 0; p.node_of && r < p.world; ++r)
    if (p.node_of[r] < 0 || p.node_of[r] >= p.world) return kBadNode;
  for (int32_t e = 0; e < p.num_experts; ++e)
    if (p.home_of[e] < 0 || p.home_of[e] >= p.world) return kBadPlan;
  const int32_t S = p.slots;
  for (int32_t r = 0; r < p.world; ++r)
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = p.slot_src[int64_t(r) * S + s];
      if (e == -1) continue;
      if (e < -1 || e >= p.num_experts || p.home_of[e] == r) return kBadPlan;
      for (int32_t s2 = 0; s2 < s; ++s2)
        if (p.slot_src[int64_t(r) * S + s2] == e) return kBadPlan;
    }
  return kOk;
}

// ---------------------------------------------------------------- preparation

// Replicas per expert (CSR), experts by replica count, homes' duties; returns L0 and sets
// `fixed` (most filled slots of a rank) and `total`.
UC_INLINE int32_t prepare(const Problem& p, const View& v, int32_t& fixed, int64_t& total) {
  const int32_t W = p.world, S = p.slots, E = p.num_experts;
  const int64_t WS = int64_t(W) * S;
  for (int32_t e = 0; e <= E; ++e) v.rep_begin[e] = 0;
  fixed = 0;
  total = 0;
  for (int32_t r = 0; r < W; ++r) {
    int32_t f = 0;
    for (int32_t s = 0; s < S; ++s) {
      const int32_t e = p.slot_src[int64_t(r) * S + s];
      if (e >= 0) {
        v.rep_begin[e + 1]++;
        ++f;
      }
    }
    fixed = f > fixed ? f : fixed;
    total += f;
  }
  for (int32_t e = 0; e < E; ++e) v.rep_begin[e + 1] += v.rep_begin[e];
  // fill rep (slot id ascending within an expert), using order[] as the cursor
  for (int32_t e = 0; e < E; ++e) v.order[e] = v.rep_begin[e];
  for (int64_t id = 0; id < WS; ++id) {
    const int32_t e = p.slot_src[id];
    if (e >= 0) v.rep[v.order[e]++] = static_cast<int32_t>(id);
  }
  // experts by (replicas desc, id asc): counting sort on W - replicas
  for (int32_t i = 0; i < W + 2; ++i) v.cnt[i] = 0;
  for (int32_t e = 0; e < E; ++e) v.cnt[W - (v.rep_begin[e + 1] - v.rep_begin[e]) + 1]++;
  for (int32_t i = 0; i < W + 1; ++i) v.cnt[i + 1] += v.cnt[i];
  for (int32_t e = 0; e < E; ++e) v.order[v.cnt[W - (v.rep_begin[e + 1] - v.rep_begin[e])]++] = e;
  int32_t once = 0;
  for (int32_t r = 0; r < W; ++r) v.duty[r] = 0;
  for (int32_t e = 0; e < E; ++e)
    if (v.rep_begin[e + 1] > v.rep_begin[e]) {
      const int32_t d = ++v.duty[p.home_of[e]];
      once = d > once ? d : once;
    }
  int64_t l0 = fixed > once ? fixed : once;
  const int64_t avg = (total + W - 1) / W;
  return static_cast<int32_t>(l0 > avg ? l0 : avg);
}

// ---------------------------------------------------------------- one candidate tree

// Hangs targets[0, n) (sorted by the caller) under senders[0, ns) breadth first; a sender is a
// slot id (or -1 - home for a master).  Targets become senders themselves, except those in
// [gw_lo, gw_hi) (gateways: they must not feed their home's node).  Returns the new sender
// count, or -1 if some target finds no sender with capacity within depth D.
UC_INLINE int32_t hang(const Problem& p, const View& v, int32_t* t, int64_t WS, int32_t ns, int32_t n, int32_t gw_lo,
                       int32_t gw_hi, int32_t D) {
  const int32_t S = p.slots;
  int32_t at = 0;  // the shallowest sender that may still have capacity (senders only fill up)
  for (int32_t i = 0; i < n; ++i) {
    const int32_t id = v.targets[i];
    bool found = false;
    int32_t snd = 0, srank = 0, sdepth = 0;
    while (at < ns) {
      snd = v.senders[at];
      srank = snd < 0 ? -1 - snd : snd / S;
      sdepth = snd < 0 ? 0 : t[2 * WS + snd];
      if (v.rem[srank] > 0) {
        found = true;
        break;
      }
      ++at;
    }
    if (!found || sdepth + 1 > D) return -1;
    v.rem[srank]--;
    t[id] = srank;
    t[WS + id] = snd < 0 ? kMaster : snd % S;
    t[2 * WS + id] = sdepth + 1;
    if (i < gw_lo || i >= gw_hi) v.senders[ns++] = id;
  }
  return ns;
}

// Sorts targets[0, n) by (spare capacity of the rank desc, slot id asc); insertion sort.
UC_INLINE void sort_targets(const Problem& p, const View& v, int32_t n, int32_t first) {
  const int32_t S = p.slots;
  for (int32_t i = first + 1; i < n; ++i) {
    const int32_t x = v.targets[i];
    const int32_t rx = v.rem[x / S];
    int32_t j = i - 1;
    while (j >= first) {
      const int32_t y = v.targets[j];
      const int32_t ry = v.rem[y / S];
      if (ry > rx || (ry == rx && y < x)) break;
      v.targets[j + 1] = y;
      --j;
    }
    v.targets[j + 1] = x;
  }
}

// Builds the tree of capacity L, depth limit D into tree[0]; false if it does not exist this way.
UC_INLINE bool build_tree(const Problem& p, const View& v, int32_t L, int32_t D, bool topo) {
  const int32_t W = p.world, S = p.slots, E = p.num_experts;
  const int64_t WS = int64_t(W) * S;
  int32_t* t = tree_of(v.trees, WS, 0);
  for (int64_t id = 0; id < WS; ++id) {
    t[id] = -1;
    t[WS + id] = -1;
    t[2 * WS + id] = 0;
  }
  for (int32_t r = 0; r < W; ++r) {
    v.rem[r] = L - v.duty[r];
    if (v.rem[r] < 0) return false;
  }
  for (int32_t r = 0; r < W; ++r) v.gateway[r] = -1;
  for (int32_t k = 0; k < E; ++k) {
    const int32_t e = v.order[k];
    const int32_t b = v.rep_begin[e], n = v.rep_begin[e + 1] - b;
    if (n == 0) break;  // the rest have no replicas either
    const int32_t h = p.home_of[e];
    v.rem[h]++;  // the duty kept for this expert
    v.senders[0] = -1 - h;
    if (!topo) {
      for (int32_t i = 0; i < n; ++i) v.targets[i] = v.rep[b + i];
      sort_targets(p, v, n, 0);
      if (hang(p, v, t, WS, 1, n, 0, 0, D) < 0) return false;
      continue;
    }
    // gateways: per remote node its replica with the most spare capacity (then lowest id)
    const int32_t hn = p.node_of[h];
    int32_t m = 0;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t id = v.rep[b + i], nd = p.node_of[id / S];
      if (nd == hn) {
        v.targets[m++] = id;
        continue;
      }
      const int32_t g = v.gateway[nd];
      if (g < 0 || v.rem[id / S] > v.rem[g / S]) v.gateway[nd] = id;
    }
    // gateways first (they lead deeper subtrees), each group sorted by spare capacity
    int32_t ng = 0;
    for (int32_t i = 0; i < n; ++i) {
      const int32_t id = v.rep[b + i];
      if (v.gateway[p.node_of[id / S]] == id) {
        // shift the home-node targets right by one to keep gateways in front
        for (int32_t j = m + ng; j > ng; --j) v.targets[j] = v.targets[j - 1];
        v.targets[ng++] = id;
      }
    }
    sort_targets(p, v, ng, 0);
    sort_targets(p, v, m + ng, ng);
    // gateways first; if that fails, the home node's replicas first (gateways may then hang
    // below them)
    bool ok = hang(p, v, t, WS, 1, m + ng, 0, ng, D) >= 0;
    if (!ok && ng > 0 && m > 0) {
      for (int32_t i = 0; i < m + ng; ++i) {  // undo: free the capacity the edges took
        const int32_t id = v.targets[i];
        if (t[id] >= 0) v.rem[t[id]]++;
        t[id] = -1;
        t[WS + id] = -1;
        t[2 * WS + id] = 0;
      }
      for (int32_t i = 0; i < m + ng; ++i) v.senders[i] = v.targets[i];  // rotate gateways to the end
      for (int32_t i = 0; i < m + ng; ++i) v.targets[i] = v.senders[i < m ? ng + i : i - m];
      v.senders[0] = -1 - h;
      ok = hang(p, v, t, WS, 1, m + ng, m, m + ng, D) >= 0;
    }
    if (!ok) return false;
    // each remote node: the rest of its replicas under its gateway's subtree
    for (int32_t i = 0; i < n; ++i) {
      const int32_t gid = v.rep[b + i], nd = p.node_of[gid / S];
      if (v.gateway[nd] != gid) continue;
      int32_t c = 0;
      for (int32_t j = 0; j < n; ++j) {
        const int32_t id = v.rep[b + j];
        if (id != gid && p.node_of[id / S] == nd) v.targets[c++] = id;
      }
      sort_targets(p, v, c, 0);
      v.senders[0] = gid;
      if (hang(p, v, t, WS, 1, c, 0, 0, D) < 0) return false;
    }
    for (int32_t i = 0; i < n; ++i) v.gateway[p.node_of[v.rep[b + i] / S]] = -1;
  }
  return true;
}

UC_INLINE uint64_t op_cost(uint64_t bytes, uint64_t chunk, uint64_t hop, int32_t k, int32_t fixed, int32_t depth) {
  const uint64_t c = chunk < bytes ? chunk : bytes;
  return uint64_t(k > fixed ? k : fixed) * bytes + uint64_t(depth) * (c + hop);
}

// ---------------------------------------------------------------- task lists

// Writes rank p.rank's lists of one op from tree `tr` (parent_rank, parent_slot, depth).
UC_INLINE int32_t write_op(const Problem& p, const View& v, const int32_t* tb, bool mc, int32_t maxd, const OpOut& out,
                           int64_t& ntasks, int64_t& nrefs) {
  const int32_t W = p.world, S = p.slots, E = p.num_experts, r = p.rank;
  const int64_t WS = int64_t(W) * S;
  const int32_t* pr = tb;
  const int32_t* ps = tb + WS;
  const int32_t* dp = tb + 2 * WS;
  const uint64_t bytes = mc ? p.weight_bytes : p.grad_bytes;
  const int64_t chunks = chunks_of(bytes, p.chunk_bytes);
  for (int64_t id = 0; id < WS; ++id) v.kids[id] = 0;
  for (int64_t id = 0; id < WS; ++id)
    if (pr[id] >= 0 && ps[id] != kMaster) v.kids[int64_t(pr[id]) * S + ps[id]]++;
  // reduce: heights, deepest slots first (slots then masters in height[])
  if (!mc) {
    for (int64_t i = 0; i < WS + E; ++i) v.height[i] = 0;
    for (int32_t d = maxd; d >= 1; --d)
      for (int64_t id = 0; id < WS; ++id) {
        if (dp[id] != d) continue;
        const int64_t pn = ps[id] == kMaster ? WS + p.slot_src[id] : int64_t(pr[id]) * S + ps[id];
        const int32_t hh = v.height[id] + 1;
        if (v.height[pn] < hh) v.height[pn] = hh;
      }
  }
  // this rank's senders: key = level (16) | expert (31) | slot + 1 (17), as the host builder
  int32_t nk = 0;
  for (int32_t e = 0; e < E; ++e)
    if (p.home_of[e] == r && v.rep_begin[e + 1] > v.rep_begin[e])
      v.keys[nk++] = (uint64_t(mc ? 0 : v.height[WS + e]) << 48) | (uint64_t(e) << 17);
  for (int32_t s = 0; s < S; ++s) {
    const int64_t id = int64_t(r) * S + s;
    if (v.kids[id] > 0)
      v.keys[nk++] = (uint64_t(mc ? dp[id] : v.height[id]) << 48) | (uint64_t(p.slot_src[id]) << 17) | uint64_t(s + 1);
  }
  for (int32_t i = 1; i < nk; ++i) {
    const uint64_t x = v.keys[i];
    int32_t j = i - 1;
    while (j >= 0 && v.keys[j] > x) {
      v.keys[j + 1] = v.keys[j];
      --j;
    }
    v.keys[j + 1] = x;
  }
  ntasks = int64_t(nk) * chunks;
  nrefs = 0;
  if (chunks == 0) return kOk;  // nothing moves: no tasks and no refs (as the host builder)
  if (ntasks > out.task_cap) return kOverflow;
  for (int32_t k = 0; k < nk; ++k) {
    const int32_t slot = int32_t(v.keys[k] & 0x1ffff) - 1;
    const int32_t e = int32_t((v.keys[k] >> 17) & 0x7fffffff);
    const int64_t rb = nrefs;
    // refs: the sender's children by slot id = (rank, slot), once for all its chunks
    for (int64_t id = 0; id < WS; ++id) {
      if (p.slot_src[id] != e || pr[id] != r || ps[id] != slot) continue;
      if (nrefs >= out.ref_cap) return kOverflow;
      out.refs[nrefs++] = Ref{static_cast<int32_t>(id / S), static_cast<int32_t>(id % S)};
    }
    for (int64_t c = 0; c < chunks; ++c) {
      Task& tk = out.tasks[c * nk + k];
      tk = Task{};
      tk.kind = static_cast<uint8_t>(mc ? TaskKind::kCopy : TaskKind::kReduce);
      tk.level = static_cast<uint16_t>(v.keys[k] >> 48);
      tk.expert = e;
      tk.chunk = static_cast<int32_t>(c);
      tk.ref_begin = static_cast<int32_t>(rb);
      tk.ref_count = static_cast<int32_t>(nrefs - rb);
      tk.offset = uint64_t(c) * p.chunk_bytes;
      const uint64_t rest = bytes - tk.offset;
      tk.bytes = rest < p.chunk_bytes ? rest : p.chunk_bytes;
      tk.self = Ref{r, slot};
    }
  }
  return kOk;
}

// ---------------------------------------------------------------- the build

UC_INLINE void copy_tree(const Problem& p, const View& v, int32_t to) {
  const int64_t WS = int64_t(p.world) * p.slots;
  const int32_t* from = tree_of(v.trees, WS, 0);
  int32_t* dst = tree_of(v.trees, WS, to);
  for (int64_t i = 0; i < 3 * WS; ++i) dst[i] = from[i];
}

// One thread builds everything (the device kernel runs it on one lane: the builder is a short
// sequential pass over W * S slots per candidate).
UC_INLINE Result build(const Problem& p, int64_t* scratch, const OpOut& mc_out, const OpOut& rd_out) {
  Result res{};
  res.status = check_problem(p);
  if (res.status != kOk) return res;
  const int32_t W = p.world, S = p.slots, E = p.num_experts;
  const int64_t WS = int64_t(W) * S;
  const View v = view(scratch, W, S, E);
  int32_t fixed = 0;
  int64_t total = 0;
  const int32_t l0 = prepare(p, v, fixed, total);
  res.lower_bound = l0;
  bool multi = false;
  for (int32_t r = 1; p.node_of && r < W; ++r) multi = multi || p.node_of[r] != p.node_of[0];
  const bool topo = multi && p.max_depth >= 2;
  // least depth any tree can have: 1, or 2 when an expert has a replica off its home's node
  int32_t least = total > 0 ? 1 : 0;
  for (int64_t id = 0; topo && id < WS; ++id) {
    const int32_t e = p.slot_src[id];
    if (e >= 0 && p.node_of[id / S] != p.node_of[p.home_of[e]]) least = 2;
  }
  int32_t maxduty = 0;
  for (int32_t r = 0; r < W; ++r) maxduty = v.duty[r] > maxduty ? v.duty[r] : maxduty;
  const int64_t lmax = total + maxduty;  // always succeeds: every home can take all its replicas
  uint64_t best[2] = {~uint64_t(0), ~uint64_t(0)};
  int64_t step = 0;
  for (int64_t L = l0;; L = l0 + step) {
    if (L > lmax) L = lmax;
    res.candidates++;
    if (build_tree(p, v, static_cast<int32_t>(L), p.max_depth, topo)) {
      int32_t k = 0, d = 0;
      for (int32_t r = 0; r < W; ++r) k = int32_t(L) - v.rem[r] > k ? int32_t(L) - v.rem[r] : k;
      for (int64_t id = 0; id < WS; ++id) d = v.trees[2 * WS + id] > d ? v.trees[2 * WS + id] : d;
      UC_UNROLL
      for (int32_t op = 0; op < 2; ++op) {
        const uint64_t c = op_cost(op == 0 ? p.weight_bytes : p.grad_bytes, p.chunk_bytes, p.hop_bytes, k, fixed, d);
        if (c < best[op]) {
          best[op] = c;
          res.cap[op] = static_cast<int32_t>(L);
          res.busiest[op] = k;
          res.depth[op] = d;
          copy_tree(p, v, 1 + op);
        }
      }
      if (d <= least) break;  // a larger L cannot lower the depth, and only adds link time
    }
    if (L >= lmax) break;
    step = step == 0 ? 1 : 2 * step;
  }
  res.status = write_op(p, v, tree_of(v.trees, WS, 1), true, res.depth[0], mc_out, res.num_tasks[0], res.num_refs[0]);
  if (res.status != kOk) return res;
  res.status = write_op(p, v, tree_of(v.trees, WS, 2), false, res.depth[1], rd_out, res.num_tasks[1], res.num_refs[1]);
  if (res.status != kOk) return res;
  // the digest: since issue 33 the combinable one of sched_write.h, evaluated here the plain
  // way (one uint64 sum in index order), not the former FNV-1a chain
  const auto mix = [](uint64_t z) {
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
    return z ^ (z >> 31);
  };
  const auto term = [&mix](uint64_t seg, int64_t i, int32_t w) {
    return mix((seg << 56) | (uint64_t(i) << 32) | uint64_t(uint32_t(w)));
  };
  uint64_t sum = 0;
  for (int64_t id = 0; id < WS; ++id) sum += term(1, id, p.slot_src[id]);
  for (int32_t e = 0; e < E; ++e) sum += term(2, e, p.home_of[e]);
  for (int32_t r = 0; r < W; ++r) sum += term(3, r, p.node_of ? p.node_of[r] : 0);
  for (int32_t op = 1; op <= 2; ++op) {  // parent_rank and parent_slot of both chosen trees
    const int32_t* tb = tree_of(v.trees, WS, op);
    for (int64_t i = 0; i < 2 * WS; ++i) sum += term(3 + uint64_t(op), i, tb[i]);
  }
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  for (uint64_t x : {uint64_t(kDigestTag), uint64_t(W), uint64_t(S), uint64_t(E), p.weight_bytes, p.grad_bytes,
                     p.chunk_bytes, p.hop_bytes, uint64_t(p.max_depth)})
    h = mix(h ^ x);
  h = mix(h ^ mix(sum));
  res.digest = h;
  return res;
}

}  // namespace ultracomm::psched_ref
