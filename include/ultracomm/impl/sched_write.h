// The schedule builder's task lists and digest on the block (sched_build.h includes this after the
// layout).  Every position is computed, not appended: senders ranked by their (distinct) keys,
// ref offsets by a block scan of the senders' child counts, a ref's place among its sender's
// children by how many of them have a lower slot id, task i = (chunk i / senders, sender
// i % senders).  So the lists are the one-thread builder's, byte for byte, for any lane count.
// The digest is a sum of mixed terms, one per field (below): the same for any lane count.
#pragma once
#include <cstdint>

#include "ultracomm/impl/sched_build.h"

namespace ultracomm::psched {

// Sender key, as the host builder: level (16) | expert (31) | slot + 1 (17; 0 = the master).
UC_INLINE uint64_t sender_key(int32_t level, int32_t e, int32_t slot) {
  return (uint64_t(level) << 48) | (uint64_t(e) << 17) | uint64_t(slot + 1);
}

// Child counts and (reduce) heights of the chosen tree of op: kids[slot] its children that are
// slots; height[slot], height[WS + e] (master) the reduce level.
template <class G>
UC_INLINE void tree_counts(const Problem& p, const View& v, const int32_t* tb, bool mc, int32_t maxd, const G& g) {
  const int32_t S = p.slots, E = p.num_experts;
  const int64_t WS = int64_t(p.world) * S;
  const int32_t* pr = tb;
  const int32_t* ps = tb + WS;
  const int32_t* dp = tb + 2 * WS;
  g.sync();  // the previous op's lanes are done with kids, height and the keys
  for (int64_t id = g.lane(); id < WS; id += g.width()) v.kids[id] = 0;
  for (int64_t i = g.lane(); !mc && i < WS + E; i += g.width()) v.height[i] = 0;
  if (g.lane() == 0) v.misc[1] = 0;
  g.sync();
  for (int64_t id = g.lane(); id < WS; id += g.width())
    if (pr[id] >= 0 && ps[id] != kMaster) g.add(&v.kids[int64_t(pr[id]) * S + ps[id]], 1);
  // reduce: heights level by level, deepest first (a level's heights are final before it is read)
  for (int32_t d = mc ? 0 : maxd; d >= 1; --d) {
    for (int64_t id = g.lane(); id < WS; id += g.width()) {
      if (dp[id] != d) continue;
      const int64_t pn = ps[id] == kMaster ? WS + p.slot_src[id] : int64_t(pr[id]) * S + ps[id];
      g.amax(&v.height[pn], v.height[id] + 1);
    }
    g.sync();
  }
  g.sync();
}

// This rank's senders, sorted by key into keys[0, nk); returns nk.
template <class G>
UC_INLINE int32_t rank_senders(const Problem& p, const View& v, const int32_t* tb, bool mc, const G& g) {
  const int32_t S = p.slots, E = p.num_experts, r = p.rank;
  const int64_t WS = int64_t(p.world) * S;
  uint64_t* raw = v.keys + (nx_of(p.world, S, E) + S);
  for (int32_t e = g.lane(); e < E; e += g.width())
    if (p.home_of[e] == r && v.rep_begin[e + 1] > v.rep_begin[e])
      raw[g.add(&v.misc[1], 1)] = sender_key(mc ? 0 : v.height[WS + e], e, -1);
  for (int32_t s = g.lane(); s < S; s += g.width()) {
    const int64_t id = int64_t(r) * S + s;
    if (v.kids[id] > 0) raw[g.add(&v.misc[1], 1)] = sender_key(mc ? tb[2 * WS + id] : v.height[id], p.slot_src[id], s);
  }
  g.sync();
  const int32_t nk = v.misc[1];
  for (int32_t i = g.lane(); i < nk; i += g.width()) {  // keys are distinct: rank by counting
    const uint64_t x = raw[i];
    int32_t pos = 0;
    for (int32_t j = 0; j < nk; ++j) pos += raw[j] < x ? 1 : 0;
    v.keys[pos] = x;
  }
  g.sync();
  return nk;
}

// Writes rank p.rank's lists of op (0 multicast, 1 reduce) from its chosen tree.
template <class G>
UC_INLINE int32_t write_op(const Problem& p, const View& v, int32_t op, int32_t maxd, const OpOut& out, int64_t& ntasks,
                           int64_t& nrefs, const G& g) {
  const int32_t S = p.slots, E = p.num_experts, r = p.rank;
  const int64_t WS = int64_t(p.world) * S;
  const bool mc = op == 0;
  const int32_t* tb = chosen(v, op);
  const int32_t* pr = tb;
  const int32_t* ps = tb + WS;
  const uint64_t bytes = mc ? p.weight_bytes : p.grad_bytes;
  const int64_t chunks = chunks_of(bytes, p.chunk_bytes);
  tree_counts(p, v, tb, mc, maxd, g);
  const int32_t nk = rank_senders(p, v, tb, mc, g);
  ntasks = int64_t(nk) * chunks;
  nrefs = 0;
  if (chunks == 0) return kOk;  // nothing moves: no tasks and no refs (as the host builder)
  if (ntasks > out.task_cap) return kOverflow;
  // each sender: its index (masters by expert, own slots by slot; height[] is free again) and refs
  int32_t* k_master = v.height;
  int32_t* k_slot = v.height + E;
  for (int32_t k = g.lane(); k < nk; k += g.width()) {
    const int32_t slot = int32_t(v.keys[k] & 0x1ffff) - 1;
    const int32_t e = int32_t((v.keys[k] >> 17) & 0x7fffffff);
    int32_t c = 0;
    if (slot < 0) {
      k_master[e] = k;
      for (int32_t i = v.rep_begin[e]; i < v.rep_begin[e + 1]; ++i) c += ps[v.rep[i]] == kMaster ? 1 : 0;
    } else {
      k_slot[slot] = k;
      c = v.kids[int64_t(r) * S + slot];
    }
    v.sref[k] = c;
  }
  g.sync();
  scan_inclusive(v.sref, nk, g);
  nrefs = nk > 0 ? v.sref[nk - 1] : 0;
  if (nrefs > out.ref_cap) return kOverflow;
  // refs: a sender's children by slot id = (rank, slot), once for all its chunks
  for (int64_t id = g.lane(); id < WS; id += g.width()) {
    if (pr[id] != r) continue;
    const int32_t e = p.slot_src[id], q = ps[id];
    const int32_t k = q == kMaster ? k_master[e] : k_slot[q];
    int64_t pos = k > 0 ? v.sref[k - 1] : 0;
    for (int32_t i = v.rep_begin[e]; i < v.rep_begin[e + 1]; ++i) {
      const int32_t c = v.rep[i];
      pos += (c < id && pr[c] == r && ps[c] == q) ? 1 : 0;
    }
    out.refs[pos] = Ref{static_cast<int32_t>(id / S), static_cast<int32_t>(id % S)};
  }
  // tasks: task i is chunk i / nk of sender i % nk
  for (int64_t i = g.lane(); i < ntasks; i += g.width()) {
    const int64_t c = i / nk;
    const int32_t k = static_cast<int32_t>(i % nk);
    const uint64_t key = v.keys[k];
    Task tk{};
    tk.kind = static_cast<uint8_t>(mc ? TaskKind::kCopy : TaskKind::kReduce);
    tk.level = static_cast<uint16_t>(key >> 48);
    tk.expert = int32_t((key >> 17) & 0x7fffffff);
    tk.chunk = static_cast<int32_t>(c);
    tk.ref_begin = k > 0 ? v.sref[k - 1] : 0;
    tk.ref_count = v.sref[k] - tk.ref_begin;
    tk.offset = uint64_t(c) * p.chunk_bytes;
    const uint64_t rest = bytes - tk.offset;
    tk.bytes = rest < p.chunk_bytes ? rest : p.chunk_bytes;
    tk.self = Ref{r, int32_t(key & 0x1ffff) - 1};
    out.tasks[i] = tk;
  }
  return kOk;
}

// ---------------------------------------------------------------- the digest
//
// What ranks compare to check they run the same plan (each publishes it beside its ready flag):
// a digest of the inputs and both chosen trees -- everything every rank's lists are derived
// from, so it is the same on every rank (the lists themselves differ per rank).  A combinable
// hash, so the block computes it in parallel and the value does not depend on the lane count or
// order: each digested field is one term mix64(key) with key = (segment << 56) | (index << 32) |
// the field's 32-bit word -- segment 1 slot_src[id], 2 home_of[e], 3 node_of[r] (0 without
// node_of), 4 / 5 the multicast / reduce tree's parent_rank[id] at index id and parent_slot[id]
// at WS + id (indices < 2^17 < 2^24: keys are distinct) -- and the terms are added mod 2^64
// (associative and commutative: each lane sums a strided share, a block sum adds the shares).
// The header words (tag, world, slots, experts, the byte sizes, chunk, hop, max_depth) go
// through a chain of mix64, and digest = mix64(header ^ mix64(sum)).
//
// Sensitivity: mix64 is a bijection of uint64 (xor-shifts and odd multipliers), so changing one
// field changes its key, its term and the sum (by mix64(k') - mix64(k) != 0), and each step after
// it is a bijection of its input: ANY single-field change gives another digest, by construction.
// Several changes collide with probability ~2^-64 (a structured, not a keyed, hash: it detects
// mismatched plans, it does not authenticate them).  tests/control/test_sched_build_lanes.py checks it
// against an independent Python evaluation, over lane counts 1..32 and the CTA's 256, and flips
// every field.  (Before issue 33 this was an FNV-1a chain on one lane; digests of builds before
// and after the change differ -- ranks must run one build of ultracomm, as for any plan format.)

// splitmix64's finalizer: a bijection of uint64.
UC_INLINE uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

enum DigestSegment : uint32_t { kSegSlotSrc = 1, kSegHome = 2, kSegNode = 3, kSegTree = 4 /* + op */ };

UC_INLINE uint64_t digest_term(uint32_t seg, int64_t index, int32_t word) {
  return mix64((uint64_t(seg) << 56) | (uint64_t(index) << 32) | uint64_t(uint32_t(word)));
}

UC_INLINE void digest_add(int64_t half[2], uint64_t t) {
  half[0] += int64_t(t & 0xffffffffu);
  half[1] += int64_t(t >> 32);
}

// The header's chain (every lane computes it: a few words).
UC_INLINE uint64_t digest_header(const Problem& p) {
  const uint64_t words[9] = {uint64_t(kDigestTag),    uint64_t(p.world), uint64_t(p.slots),
                             uint64_t(p.num_experts), p.weight_bytes,    p.grad_bytes,
                             p.chunk_bytes,           p.hop_bytes,       uint64_t(p.max_depth)};
  uint64_t h = 0x9e3779b97f4a7c15ULL;
  UC_UNROLL
  for (int i = 0; i < 9; ++i) h = mix64(h ^ words[i]);
  return h;
}

// The digest on block g (every lane calls it and gets the value).  trees[op]: parent_rank [WS]
// then parent_slot [WS] of op's tree (chosen(v, op) in a build).  The sum mod 2^64 is taken as
// two exact int64 sums of the terms' 32-bit halves (< 2^17 terms each < 2^32: no overflow), so
// the group's int64 reductions serve and no lane ever overflows a signed integer.
template <class G>
UC_INLINE uint64_t digest(const Problem& p, const int32_t* const trees[2], const G& g) {
  const int32_t W = p.world, S = p.slots, E = p.num_experts;
  const int64_t WS = int64_t(W) * S;
  int64_t half[2] = {0, 0};  // low, high 32 bits
  for (int64_t id = g.lane(); id < WS; id += g.width()) digest_add(half, digest_term(kSegSlotSrc, id, p.slot_src[id]));
  for (int64_t e = g.lane(); e < E; e += g.width()) digest_add(half, digest_term(kSegHome, e, p.home_of[e]));
  for (int64_t r = g.lane(); r < W; r += g.width())
    digest_add(half, digest_term(kSegNode, r, p.node_of ? p.node_of[r] : 0));
  UC_UNROLL
  for (uint32_t op = 0; op < 2; ++op)
    for (int64_t i = g.lane(); i < 2 * WS; i += g.width())
      digest_add(half, digest_term(kSegTree + op, i, trees[op][i]));
  const int64_t lo = g.sum(half[0]);
  const int64_t hi = g.sum(half[1]);
  const uint64_t sum = uint64_t(lo) + (uint64_t(hi) << 32);
  return mix64(digest_header(p) ^ mix64(sum));
}

// The digest of a finished build's chosen trees.
template <class G>
UC_INLINE uint64_t digest(const Problem& p, const View& v, const G& g) {
  const int32_t* const trees[2] = {chosen(v, 0), chosen(v, 1)};
  return digest(p, trees, g);
}

}  // namespace ultracomm::psched
