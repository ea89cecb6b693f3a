// Local search on a relay / reduce tree (see relay_tree.h: repair_tree), split from
// relay_tree.cpp: the greedy builds a tree per capacity level, this lowers its bottleneck.
#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <utility>
#include <vector>

#include "schedule/relay_tree.h"
#include "ultracomm/records/task.h"

namespace ultracomm::detail {
namespace {

// Local search after the greedy: lowers the bottleneck (max over ranks of the tier time of
// the parent side) by re-parenting one subtree at a time, found as a short ejection chain
// (rank p sheds a child onto rank a, which sheds one onto b, ... until a rank with spare).
// A move keeps the tier of the edge (intra stays on the child's node; an inter edge is fed from
// the home's node), never makes the tree deeper than `dlim`, never hangs a node under its own
// subtree, and in force mode never gives the home nrep children.  Deterministic.
class Repair {
 public:
  explicit Repair(const TreeInput& in) : in_(in) {}

  // Returns true if `t` changed (then t is consistent: loads, depth, finish()).  Stops once the
  // bottleneck is at `floor_t` (no tree of the plan has a lower one).
  bool run(Tree& t, int32_t dlim, bool force, double floor_t) {
    const int32_t W = in_.world, S = in_.slots, E = in_.num_experts;
    const int64_t WS = int64_t(W) * S;
    if (dlim < 2 || in_.multi.empty()) return false;
    t_ = &t;
    force_ = force;
    dlim_ = dlim;
    if (int32_t(seen_.size()) != W) {
      seen_.assign(W, 0);
      stamp_ = 0;
    }
    pn_.assign(WS, -1);
    first_.assign(WS + E, -1);
    next_.assign(WS, -1);
    for (int64_t id = WS - 1; id >= 0; --id) {
      const int32_t p = t.parent_rank[id];
      if (p < 0) continue;
      const int64_t q = t.parent_slot[id] == kMaster ? WS + expert_of(id) : int64_t(p) * S + t.parent_slot[id];
      pn_[id] = q;
      next_[id] = first_[q];
      first_[q] = static_cast<int32_t>(id);
    }
    bool changed = false;
    const int32_t max_rounds = 4 * W + 16;
    for (int32_t round = 0; round < max_rounds; ++round) {
      double T = 0;
      for (int32_t r = 0; r < W; ++r) T = std::max(T, time_of(r, 0, 0));
      if (T <= 0 || T <= floor_t * (1 + 1e-12)) break;
      bool all = true;
      for (int32_t r = 0; r < W && all; ++r)
        if (time_of(r, 0, 0) >= T * (1 - 1e-12)) all = relieve(r, T);
      if (!all) break;
      changed = true;
    }
    if (!changed) return false;
    // rebuild parents, depth
    t.max_depth = 0;
    t.relayed = false;
    for (int64_t id = 0; id < WS; ++id) {
      if (pn_[id] < 0) continue;
      if (pn_[id] >= WS) {
        t.parent_rank[id] = in_.home_of[pn_[id] - WS];
        t.parent_slot[id] = kMaster;
      } else {
        t.parent_rank[id] = in_.rank_of_id[pn_[id]];
        t.parent_slot[id] = in_.slot_of_id[pn_[id]];
        t.relayed = true;
      }
      t.max_depth = std::max(t.max_depth, t.depth[id]);
    }
    finish(in_, t);
    return true;
  }

 private:
  int32_t expert_of(int64_t id) const { return slot_expert_[id]; }

 public:
  std::vector<int32_t> slot_expert_;  // [WS] expert of each filled slot (set by the caller)

 private:
  int32_t rank_node(int64_t q) const {
    const int64_t WS = int64_t(in_.world) * in_.slots;
    return q >= WS ? in_.home_of[q - WS] : in_.rank_of_id[q];
  }
  int32_t depth_node(int64_t q) const {
    const int64_t WS = int64_t(in_.world) * in_.slots;
    return q >= WS ? 0 : t_->depth[q];
  }
  double time_of(int32_t r, int32_t di, int32_t dx) const {
    double v = (t_->load_intra[r] + di) / in_.intra_bw;
    if (in_.multi_node) v = std::max(v, (t_->load_inter[r] + dx) / in_.inter_bw);
    return v;
  }
  int32_t height(int32_t c) const {
    int32_t h = 0;
    for (int32_t k = first_[c]; k >= 0; k = next_[k]) h = std::max(h, 1 + height(k));
    return h;
  }
  bool in_subtree(int64_t q, int32_t c) const {
    const int64_t WS = int64_t(in_.world) * in_.slots;
    while (q >= 0 && q < WS) {
      if (q == c) return true;
      q = pn_[q];
    }
    return false;
  }
  void unlink(int32_t c) {
    const int64_t p = pn_[c];
    if (first_[p] == c) {
      first_[p] = next_[c];
    } else {
      int32_t k = first_[p];
      while (next_[k] != c) k = next_[k];
      next_[k] = next_[c];
    }
    next_[c] = -1;
  }
  void link(int32_t c, int64_t q) {
    // keep sibling lists sorted by id (determinism of later scans)
    pn_[c] = q;
    if (first_[q] < 0 || first_[q] > c) {
      next_[c] = first_[q];
      first_[q] = c;
    } else {
      int32_t k = first_[q];
      while (next_[k] >= 0 && next_[k] < c) k = next_[k];
      next_[c] = next_[k];
      next_[k] = c;
    }
  }
  void set_depth(int32_t c, int32_t d) {
    t_->depth[c] = d;
    for (int32_t k = first_[c]; k >= 0; k = next_[k]) set_depth(k, d + 1);
  }
  void apply(int32_t c, int64_t q) {
    const int32_t pr = rank_node(pn_[c]), qr = rank_node(q);
    const bool inter = in_.multi_node && in_.node_of[pr] != in_.node_of[in_.rank_of_id[c]];
    (inter ? t_->load_inter : t_->load_intra)[pr]--;
    (inter ? t_->load_inter : t_->load_intra)[qr]++;
    unlink(c);
    link(c, q);
    set_depth(c, depth_node(q) + 1);
  }
  int32_t home_kids(int32_t e) const {
    const int64_t WS = int64_t(in_.world) * in_.slots;
    int32_t n = 0;
    for (int32_t k = first_[WS + e]; k >= 0; k = next_[k]) ++n;
    return n;
  }
  // q (a node of expert e) may become the parent of c: tier, depth, no cycle, force rule.
  bool valid_parent(int32_t c, int32_t e, int64_t q, bool inter, int32_t h) const {
    const int64_t WS = int64_t(in_.world) * in_.slots;
    if (q == pn_[c] || q == c) return false;
    if (q < WS && pn_[q] < 0) return false;
    const int32_t qn = in_.node_of[rank_node(q)];
    if (in_.multi_node && (inter ? qn != in_.node_of[in_.home_of[e]] : qn != in_.node_of[in_.rank_of_id[c]]))
      return false;
    if (depth_node(q) + 1 + h > dlim_) return false;
    if (q < WS && in_subtree(q, c)) return false;
    if (q >= WS && force_ && in_.force_ok[e] && home_kids(e) + 1 > in_.rep_begin[e + 1] - in_.rep_begin[e] - 1)
      return false;
    return true;
  }
  // Best new parent of child c (expert e) on a rank other than `avoid`, with the rank's time
  // after the move below `below` (or any rank when below < 0: chain step).  -1 if none.
  int64_t best_parent(int32_t c, int32_t e, int32_t avoid, double below, bool inter, int32_t h,
                      int32_t want_rank) const {
    const int64_t WS = int64_t(in_.world) * in_.slots;
    const int32_t hn = in_.node_of[in_.home_of[e]], cn = in_.node_of[in_.rank_of_id[c]];
    int64_t best = -1;
    double bt = 0;
    int32_t bd = 0;
    const double lim = below * (1 - 1e-12);
    // cheap filters first (rank, time, order against the best so far), then the tree walks
    auto consider = [&](int64_t q) {
      if (q == pn_[c]) return;
      const int32_t qr = rank_node(q);
      if (qr == avoid || (want_rank >= 0 && qr != want_rank)) return;
      const double tq = time_of(qr, inter ? 0 : 1, inter ? 1 : 0);
      if (below >= 0 && !(tq < lim)) return;
      const int32_t d = depth_node(q);
      if (d + 1 + h > dlim_) return;
      if (best >= 0 && !(tq < bt || (tq == bt && (d < bd || (d == bd && q < best))))) return;
      if (q < WS && pn_[q] < 0) return;  // not in the tree (cannot happen for replicas)
      const int32_t qn = in_.node_of[qr];
      if (in_.multi_node && (inter ? qn != hn : qn != cn)) return;
      if (q < WS && in_subtree(q, c)) return;
      if (q >= WS && force_ && in_.force_ok[e] && home_kids(e) + 1 > in_.rep_begin[e + 1] - in_.rep_begin[e] - 1)
        return;
      best = q;
      bt = tq;
      bd = d;
    };
    consider(WS + e);
    for (int32_t i = in_.rep_begin[e]; i < in_.rep_begin[e + 1]; ++i) consider(in_.rep[i]);
    return best;
  }
  // children of rank r's sending nodes whose edge is on the binding tier of r at time T
  // (tier -1: the tiers at T; 0 / 1: intra / inter edges only)
  void movable(int32_t r, double T, int32_t tier, std::vector<int32_t>& out) const {
    const int64_t WS = int64_t(in_.world) * in_.slots;
    out.clear();
    bool bi = t_->load_intra[r] / in_.intra_bw >= T * (1 - 1e-12);
    bool bx = in_.multi_node && t_->load_inter[r] / in_.inter_bw >= T * (1 - 1e-12);
    if (tier >= 0) {
      bi = tier == 0;
      bx = tier == 1;
    }
    auto scan = [&](int64_t q) {
      for (int32_t k = first_[q]; k >= 0; k = next_[k]) {
        const bool inter = in_.multi_node && in_.node_of[r] != in_.node_of[in_.rank_of_id[k]];
        if (inter ? bx : bi) out.push_back(k);
      }
    };
    for (int32_t i = hb_[r]; i < hb_[r + 1]; ++i) scan(WS + hx_[i]);
    for (int32_t s = 0; s < in_.slots; ++s) scan(int64_t(r) * in_.slots + s);
  }

 public:
  std::vector<int32_t> hb_, hx_;  // experts by home (CSR), set by the caller

 private:
  // Ejection chain from busy rank p: BFS over ranks, up to kChain moves.
  bool relieve(int32_t p, double T) {
    const int64_t WS = int64_t(in_.world) * in_.slots;
    constexpr int kChain = 3;
    constexpr size_t kStates = 16;  // bounded search: build time matters more than the last unit
    st_.clear();
    st_.push_back({p, -1, -1, -1, -1});
    if (++stamp_ == 0) {
      std::fill(seen_.begin(), seen_.end(), 0);
      stamp_ = 1;
    }
    seen_[p] = stamp_;
    size_t lo = 0;
    for (int lvl = 0; lvl < kChain; ++lvl) {
      const size_t hi = st_.size();
      for (size_t i = lo; i < hi; ++i) {
        const int32_t r = st_[i].rank;
        movable(r, T, st_[i].tier, kids_);
        for (const int32_t c : kids_) {
          const int32_t e = slot_expert_[c];
          const bool inter = in_.multi_node && in_.node_of[r] != in_.node_of[in_.rank_of_id[c]];
          const int32_t h = height(c);
          const int64_t q = best_parent(c, e, r, T, inter, h, -1);
          if (q >= 0) {  // terminal: apply the chain back to front
            moves_.clear();
            moves_.emplace_back(c, q);
            for (size_t j = i; st_[j].prev >= 0; j = size_t(st_[j].prev)) moves_.emplace_back(st_[j].child, st_[j].q);
            return apply_chain();
          }
          if (lvl + 1 == kChain) continue;
          // chain step: a parent on a rank that is busy (at T after +1) but not yet visited.
          // A rank holds at most one node of expert e (its master or one replica), so the
          // candidates are the nodes of e themselves: one pass, no per-rank search.
          for (int32_t ri = in_.rep_begin[e] - 1; ri < in_.rep_begin[e + 1] && st_.size() < kStates; ++ri) {
            const int64_t q2 = ri < in_.rep_begin[e] ? WS + e : int64_t(in_.rep[ri]);
            const int32_t qr = rank_node(q2);
            if (seen_[qr] == stamp_ || qr == r || !valid_parent(c, e, q2, inter, h)) continue;
            seen_[qr] = stamp_;
            st_.push_back({qr, static_cast<int32_t>(i), c, inter ? 1 : 0, q2});
          }
        }
      }
      lo = hi;
      if (lo == st_.size()) break;
    }
    return false;
  }
  bool apply_chain() {
    // moves_[0] ends on a rank with spare; moves_[k] feeds the rank moves_[k-1] sheds from.
    undo_.clear();
    for (const auto& [c, q] : moves_) {
      const int32_t h = height(c);
      if (in_subtree(q, c) || depth_node(q) + 1 + h > dlim_) {
        for (auto it = undo_.rbegin(); it != undo_.rend(); ++it) apply(it->first, it->second);
        return false;
      }
      undo_.emplace_back(c, pn_[c]);
      apply(c, q);
    }
    return true;
  }

  const TreeInput& in_;
  Tree* t_ = nullptr;
  bool force_ = false;
  int32_t dlim_ = 0;
  std::vector<int64_t> pn_;
  std::vector<int32_t> first_, next_;
  // relieve() scratch, reused across calls (no allocation per attempt)
  struct St {
    int32_t rank, prev, child, tier;
    int64_t q;
  };
  std::vector<St> st_;
  std::vector<uint32_t> seen_;
  uint32_t stamp_ = 0;
  std::vector<int32_t> kids_;
  std::vector<std::pair<int32_t, int64_t>> moves_, undo_;
};

}  // namespace

bool repair_tree(const TreeInput& in, Tree& t, int32_t dlim, bool force, double floor_t) {
  const int32_t W = in.world, S = in.slots;
  Repair rp(in);
  rp.slot_expert_.assign(int64_t(W) * S, -1);
  for (int32_t e = 0; e < in.num_experts; ++e)
    for (int32_t i = in.rep_begin[e]; i < in.rep_begin[e + 1]; ++i) rp.slot_expert_[in.rep[i]] = e;
  rp.hb_.assign(W + 1, 0);
  rp.hx_.assign(in.num_experts, 0);
  for (int32_t e = 0; e < in.num_experts; ++e) rp.hb_[in.home_of[e] + 1]++;
  for (int32_t r = 0; r < W; ++r) rp.hb_[r + 1] += rp.hb_[r];
  {
    std::vector<int32_t> fill(rp.hb_.begin(), rp.hb_.end() - 1);
    for (int32_t e = 0; e < in.num_experts; ++e) rp.hx_[fill[in.home_of[e]]++] = e;
  }
  return rp.run(t, dlim, force, floor_t);
}

}  // namespace ultracomm::detail
