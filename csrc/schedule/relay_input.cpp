// TreeInput from a validated plan (see relay_tree.h: prepare), split from relay_tree.cpp.
#include <algorithm>
#include <climits>
#include <cstddef>
#include <vector>

#include "schedule/relay_tree.h"
#include "ultracomm/records/task.h"

namespace ultracomm::detail {

void prepare(int32_t world, int32_t slots, int32_t num_experts, const int32_t* slot_src, const int32_t* home_of,
             const int32_t* node_of, double intra_bw, double inter_bw, TreeInput& out) {
  const int32_t W = world, S = slots, E = num_experts;
  const int64_t WS = int64_t(W) * S;
  out.world = W;
  out.slots = S;
  out.num_experts = E;
  out.intra_bw = intra_bw;
  out.inter_bw = inter_bw;
  out.node_of.assign(node_of, node_of + W);
  int32_t nn = 1;
  for (int32_t r = 0; r < W; ++r) nn = std::max(nn, node_of[r] + 1);
  out.num_nodes = nn;
  out.node_size.assign(nn, 0);
  for (int32_t r = 0; r < W; ++r) out.node_size[node_of[r]]++;
  int32_t used_nodes = 0;
  for (int32_t n = 0; n < nn; ++n) used_nodes += out.node_size[n] > 0;
  out.multi_node = used_nodes > 1;
  out.home_of.assign(home_of, home_of + E);

  // replicas per expert, rank ascending (CSR)
  out.rep_begin.assign(E + 1, 0);
  for (int64_t i = 0; i < WS; ++i)
    if (slot_src[i] >= 0) out.rep_begin[slot_src[i] + 1]++;
  for (int32_t e = 0; e < E; ++e) out.rep_begin[e + 1] += out.rep_begin[e];
  out.total_reps = out.rep_begin[E];
  out.rep.assign(out.total_reps, 0);
  {
    std::vector<int32_t> fill(out.rep_begin.begin(), out.rep_begin.end() - 1);
    for (int64_t i = 0; i < WS; ++i)
      if (slot_src[i] >= 0) out.rep[fill[slot_src[i]]++] = static_cast<int32_t>(i);
  }

  // groups by node: home node first, then remote nodes by (size desc, node asc)
  out.grp_begin.assign(E + 1, 0);
  out.grp_lo.clear();
  out.grp_hi.clear();
  const size_t max_groups = out.multi_node ? size_t(out.total_reps) : size_t(E);
  out.grp_lo.reserve(max_groups);
  out.grp_hi.reserve(max_groups);
  out.force_ok.assign(E, 0);
  out.multi.clear();
  out.single.clear();
  out.multi.reserve(E);
  out.single.reserve(E);
  std::vector<int32_t> cnt(nn, 0);
  std::vector<uint64_t> keys;
  std::vector<int32_t> old;
  for (int32_t e = 0; e < E; ++e) {
    const int32_t b = out.rep_begin[e], n = out.rep_begin[e + 1] - b;
    const int32_t hn = out.node_of[home_of[e]];
    out.grp_begin[e] = static_cast<int32_t>(out.grp_lo.size());
    if (n == 0) continue;
    if (!out.multi_node) {
      out.grp_lo.push_back(b);
      out.grp_hi.push_back(b + n);
    } else {
      for (int32_t i = 0; i < n; ++i) cnt[out.node_of[out.rep[b + i] / S]]++;
      keys.clear();
      for (int32_t i = 0; i < n; ++i) {
        const int32_t id = out.rep[b + i];
        const int32_t nd = out.node_of[id / S];
        const uint64_t remote = nd != hn;
        keys.push_back((remote << 62) | (uint64_t(remote ? (1 << 20) - cnt[nd] : 0) << 42) | (uint64_t(nd) << 21) |
                       uint64_t(id / S));
      }
      std::sort(keys.begin(), keys.end());
      for (int32_t i = 0; i < n; ++i) cnt[out.node_of[out.rep[b + i] / S]] = 0;
      // rewrite rep in key order; rank -> slot id via the old list (one slot per rank)
      old.assign(out.rep.begin() + b, out.rep.begin() + b + n);
      for (int32_t i = 0; i < n; ++i) {
        const int32_t rank = static_cast<int32_t>(keys[i] & ((1u << 21) - 1));
        const auto it = std::lower_bound(old.begin(), old.end(), rank * S);
        out.rep[b + i] = *it;
      }
      // home group (maybe empty), then one per remote node
      int32_t i = 0;
      while (i < n && out.node_of[out.rep[b + i] / S] == hn) ++i;
      out.grp_lo.push_back(b);
      out.grp_hi.push_back(b + i);
      while (i < n) {
        const int32_t nd = out.node_of[out.rep[b + i] / S];
        const int32_t j0 = i;
        while (i < n && out.node_of[out.rep[b + i] / S] == nd) ++i;
        out.grp_lo.push_back(b + j0);
        out.grp_hi.push_back(b + i);
      }
    }
    if (n == 1) {
      out.single.push_back(e);
    } else {
      // force can keep the home below n-1 direct children unless every replica must hang
      // directly off the home's node and the home is alone there.
      const int32_t g0 = out.grp_begin[e];
      const int32_t ng = static_cast<int32_t>(out.grp_lo.size()) - g0;
      const int32_t local = out.grp_hi[g0] - out.grp_lo[g0];
      bool ok = local >= 1 && n >= 2;
      for (int32_t g = g0 + 1; g < g0 + ng && !ok; ++g) ok = out.grp_hi[g] - out.grp_lo[g] >= 2;
      out.force_ok[e] = ok;
      out.multi.push_back(e);
    }
  }
  out.grp_begin[E] = static_cast<int32_t>(out.grp_lo.size());
  std::sort(out.multi.begin(), out.multi.end(), [&](int32_t a, int32_t b) {
    const int32_t na = out.rep_begin[a + 1] - out.rep_begin[a];
    const int32_t nb = out.rep_begin[b + 1] - out.rep_begin[b];
    return na != nb ? na > nb : a < b;
  });
  out.rank_of_id.resize(WS);
  out.slot_of_id.resize(WS);
  for (int32_t r = 0; r < W; ++r)
    for (int32_t s = 0; s < S; ++s) {
      out.rank_of_id[int64_t(r) * S + s] = r;
      out.slot_of_id[int64_t(r) * S + s] = s;
    }
  out.empty_parent.assign(WS, -1);
  out.empty_depth.assign(WS, 0);
}

}  // namespace ultracomm::detail
