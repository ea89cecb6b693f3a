// The schedule builder's task lists and digest on the block (sched_build.h includes this after the
// layout).  Every position is computed, not appended: senders ranked by their (distinct) keys,
// ref offsets by a block scan of the senders' child counts, a ref's place among its sender's
// children by how many of them have a lower slot id, task i = (chunk i / senders, sender
// i % senders).  So the lists are the one-thread builder's, byte for byte, for any lane count.
#pragma once
#include <cstdint>

#include "ultracomm/sched_build.h"

namespace ultracomm::psched {

UC_INLINE uint64_t fnv_word(uint64_t h, uint32_t w) { return (h ^ w) * 0x100000001b3ULL; }
UC_INLINE uint64_t fnv_u64(uint64_t h, uint64_t x) { return fnv_word(fnv_word(h, uint32_t(x)), uint32_t(x >> 32)); }

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
UC_INLINE int32_t write_op(const Problem& p, const View& v, int32_t op, int32_t maxd, const OpOut& out,
                           int64_t& ntasks, int64_t& nrefs, const G& g) {
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

// The digest of the inputs and both chosen trees: the FNV-1a chain of the one-thread builder,
// word for word (one lane; the other lanes wait at the caller's barrier).
UC_INLINE uint64_t digest(const Problem& p, const View& v) {
  const int32_t W = p.world, S = p.slots, E = p.num_experts;
  const int64_t WS = int64_t(W) * S;
  uint64_t h = 0xcbf29ce484222325ULL;
  h = fnv_word(h, kDigestTag);
  h = fnv_u64(h, uint64_t(W));
  h = fnv_u64(h, uint64_t(S));
  h = fnv_u64(h, uint64_t(E));
  h = fnv_u64(h, p.weight_bytes);
  h = fnv_u64(h, p.grad_bytes);
  h = fnv_u64(h, p.chunk_bytes);
  h = fnv_u64(h, p.hop_bytes);
  h = fnv_u64(h, uint64_t(p.max_depth));
  for (int64_t id = 0; id < WS; ++id) h = fnv_word(h, uint32_t(p.slot_src[id]));
  for (int32_t e = 0; e < E; ++e) h = fnv_word(h, uint32_t(p.home_of[e]));
  for (int32_t r = 0; r < W; ++r) h = fnv_word(h, uint32_t(p.node_of ? p.node_of[r] : 0));
  for (int32_t op = 0; op < 2; ++op) {  // parent_rank and parent_slot of both chosen trees
    const int32_t* tb = chosen(v, op);
    for (int64_t i = 0; i < 2 * WS; ++i) h = fnv_word(h, uint32_t(tb[i]));
  }
  return h;
}

}  // namespace ultracomm::psched
