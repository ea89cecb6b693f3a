// Relay / reduce trees: one implementation for both operations (see relay_tree.h).
#include "schedule/relay_tree.h"

#include <algorithm>
#include <climits>
#include <cmath>
#include <cstddef>
#include <iterator>
#include <limits>

#include "ultracomm/records/task.h"

namespace ultracomm::detail {

void finish(const TreeInput& in, Tree& t) {
  t.t = 0;
  t.max_load = 0;
  for (int32_t r = 0; r < in.world; ++r) {
    t.t = std::max(t.t, t.load_intra[r] / in.intra_bw);
    if (in.multi_node) t.t = std::max(t.t, t.load_inter[r] / in.inter_bw);
    t.max_load = std::max<int64_t>(t.max_load, int64_t(t.load_intra[r]) + t.load_inter[r]);
  }
}

void direct_tree(const TreeInput& in, Tree& out) {
  const int32_t S = in.slots;
  out.parent_rank = in.empty_parent;
  out.parent_slot = in.empty_parent;
  out.depth = in.empty_depth;
  out.load_intra.assign(in.world, 0);
  out.load_inter.assign(in.world, 0);
  out.max_depth = 0;
  out.relayed = false;
  for (int32_t e = 0; e < in.num_experts; ++e) {
    const int32_t h = in.home_of[e];
    for (int32_t i = in.rep_begin[e]; i < in.rep_begin[e + 1]; ++i) {
      const int32_t id = in.rep[i];
      out.parent_rank[id] = h;
      out.parent_slot[id] = kMaster;
      out.depth[id] = 1;
      out.max_depth = 1;
      if (in.node_of[id / S] == in.node_of[h])
        out.load_intra[h]++;
      else
        out.load_inter[h]++;
    }
  }
  finish(in, out);
}

namespace {

constexpr int32_t kHome = -1;  // queue entry for the home's master copy

// Sends that every tree has, per rank and tier: each single-replica expert's edge and one send
// per replicated expert at its home (intra when the home's node holds a replica of it).
void mandatory_sends(const TreeInput& in, std::vector<int64_t>& mi, std::vector<int64_t>& mx) {
  mi.assign(in.world, 0);
  mx.assign(in.world, 0);
  for (int32_t e : in.single) {
    const int32_t h = in.home_of[e];
    (in.node_of[in.rank_of_id[in.rep[in.rep_begin[e]]]] == in.node_of[h] ? mi : mx)[h]++;
  }
  for (int32_t e : in.multi) {
    const int32_t g0 = in.grp_begin[e];
    (in.grp_hi[g0] > in.grp_lo[g0] ? mi : mx)[in.home_of[e]]++;
  }
}

// least d >= 1 with f + f^2 + ... + f^d >= n (f >= 1, n >= 1)
int32_t min_depth(int64_t f, int64_t n) {
  if (f <= 1) return static_cast<int32_t>(std::min<int64_t>(n, INT32_MAX));
  int64_t sum = 0, p = 1;
  int32_t d = 0;
  while (sum < n) {
    p *= f;
    sum += p;
    ++d;
  }
  return d;
}

// smallest f >= 1 with f + f^2 + ... + f^levels >= x
int64_t fanout(int64_t x, int32_t levels) {
  for (int64_t f = 1;; ++f) {
    int64_t sum = 0, p = 1;
    for (int32_t l = 0; l < levels && sum < x; ++l) {
      p *= f;
      sum += p;
    }
    if (sum >= x) return f;
  }
}

int64_t cap_of(double t, double bw, int64_t clamp) {
  const double v = t * bw;
  const double c = std::floor(v + 1e-9 * std::max(1.0, v));
  return c >= double(clamp) ? clamp : static_cast<int64_t>(c);
}

// Deterministic greedy for one capacity level t (seconds per expert byte-unit): every rank
// may send at most floor(t*intra_bw) experts over intra-node links and floor(t*inter_bw)
// over inter-node links.  No depth limit: the tree it builds is the shallowest this greedy
// can do, so "feasible with depth limit D" == "succeeds and depth <= D".
class Greedy {
 public:
  // mi / mx: mandatory_sends() of `in` (referenced, not copied)
  Greedy(const TreeInput& in, const std::vector<int64_t>& mi, const std::vector<int64_t>& mx)
      : in_(in), si_(in.world), sx_(in.world), st_(in.world), mi_(mi), mx_(mx) {
    // the part that does not depend on t: single-replica experts' edges (mandatory); mi_ / mx_
    // also hold the reservation of each home's one send per replicated expert
    base_.parent_rank = in.empty_parent;
    base_.parent_slot = in.empty_parent;
    base_.depth = in.empty_depth;
    base_.load_intra.assign(in.world, 0);
    base_.load_inter.assign(in.world, 0);
    base_.max_depth = 0;
    base_.relayed = false;
    for (int32_t e : in.single) {
      const int32_t id = in.rep[in.rep_begin[e]], h = in.home_of[e];
      base_.parent_rank[id] = h;
      base_.parent_slot[id] = kMaster;
      base_.depth[id] = 1;
      base_.max_depth = 1;
      if (in.node_of[in.rank_of_id[id]] == in.node_of[h])
        base_.load_intra[h]++;
      else
        base_.load_inter[h]++;
    }
    int32_t most = 0;
    for (int32_t e : in.multi) most = std::max(most, in.rep_begin[e + 1] - in.rep_begin[e]);
    keys_.resize(most);
    q_.resize(most + 1);
  }

  // total_cap: per-rank bound on intra + inter sends together (bytes, not time).
  // depth_limit: no node deeper; nodes take only the fan-out that the remaining replicas
  // need to fit under the limit (spreading sends over more relays leaves spare capacity on
  // more ranks for later experts).  INT32_MAX: every node takes as many as it can.
  bool run(double t, bool force, int64_t total_cap, int32_t depth_limit, Tree& out) {
    depth_limit_ = depth_limit;
    const int32_t W = in_.world;
    const int64_t clamp = in_.total_reps + 1;
    const int64_t ci = cap_of(t, in_.intra_bw, clamp);
    const int64_t cx = in_.multi_node ? cap_of(t, in_.inter_bw, clamp) : 0;
    for (int32_t r = 0; r < W; ++r) {
      si_[r] = ci - mi_[r];
      sx_[r] = cx - mx_[r];
      st_[r] = total_cap - mi_[r] - mx_[r];
      if (si_[r] < 0 || sx_[r] < 0 || st_[r] < 0) return false;
    }
    out.parent_rank = base_.parent_rank;
    out.parent_slot = base_.parent_slot;
    out.depth = base_.depth;
    out.load_intra = base_.load_intra;
    out.load_inter = base_.load_inter;
    out.max_depth = base_.max_depth;
    out.relayed = false;
    out_ = &out;
    for (int32_t e : in_.multi)
      if (!expert(e, force)) return false;
    finish(in_, out);
    return true;
  }

 private:
  int32_t rank_of(int32_t node) const { return node == kHome ? home_ : in_.rank_of_id[node]; }
  int32_t depth_of(int32_t node) const { return node == kHome ? 0 : out_->depth[node]; }

  void attach(int32_t child, int32_t parent) {
    const int32_t pr = rank_of(parent);
    out_->parent_rank[child] = pr;
    out_->parent_slot[child] = parent == kHome ? kMaster : in_.slot_of_id[parent];
    const int32_t d = depth_of(parent) + 1;
    out_->depth[child] = d;
    out_->max_depth = std::max(out_->max_depth, d);
    if (parent != kHome)
      out_->relayed = true;
    else
      home_kids_++;
  }

  // members[lo, hi) of rep sorted into keys_[0, nkeys_) by (intra spare desc, slot id asc),
  // skipping `skip` (keys are distinct: any sort gives the same order)
  void sorted_members(int32_t lo, int32_t hi, int32_t skip) {
    uint64_t* k = keys_.data();
    size_t n = 0;
    for (int32_t i = lo; i < hi; ++i) {
      const int32_t id = in_.rep[i];
      if (id == skip) continue;
      k[n++] = (uint64_t(INT32_MAX - si_[in_.rank_of_id[id]]) << 32) | uint32_t(id);
    }
    nkeys_ = n;
    if (n > 24) {
      std::sort(k, k + n);
      return;
    }
    for (size_t i = 1; i < n; ++i) {
      const uint64_t v = k[i];
      size_t j = i;
      for (; j > 0 && k[j - 1] > v; --j) k[j] = k[j - 1];
      k[j] = v;
    }
  }

  // BFS from q_[qi..qn_): every queued node takes as many of keys_ (in order) as its intra
  // spare allows (the home also at most home_limit_ - home_kids_).  True if all attached.
  bool bfs(size_t qi) {
    size_t idx = 0;
    const size_t n = nkeys_;
    size_t level_end = qi;
    int32_t* pr = out_->parent_rank.data();
    int32_t* ps = out_->parent_slot.data();
    int32_t* dp = out_->depth.data();
    while (idx < n && qi < qn_) {
      if (qi >= level_end) level_end = qn_;
      const int32_t node = q_[qi++];
      const int32_t r = rank_of(node);
      int64_t k = std::min<int64_t>(std::min(si_[r], st_[r]), int64_t(n - idx));
      if (node == kHome) k = std::min<int64_t>(k, home_limit_ - home_kids_);
      const int32_t d = depth_of(node);
      const int32_t levels = depth_limit_ - d;
      if (levels <= 0) return false;
      if (depth_limit_ != INT32_MAX && levels > 1 && k > 1) {
        const int64_t left = int64_t(level_end - qi) + 1;
        k = std::min(k, fanout((int64_t(n - idx) + left - 1) / left, levels));
      }
      if (k <= 0) continue;
      // attach keys_[idx, idx + k) under node (see attach())
      const int32_t slot = node == kHome ? kMaster : in_.slot_of_id[node];
      for (int64_t j = 0; j < k; ++j) {
        const int32_t child = static_cast<int32_t>(keys_[idx++] & 0xffffffffu);
        pr[child] = r;
        ps[child] = slot;
        dp[child] = d + 1;
        q_[qn_++] = child;
      }
      out_->max_depth = std::max(out_->max_depth, d + 1);
      if (node != kHome)
        out_->relayed = true;
      else
        home_kids_ += k;
      si_[r] -= k;
      st_[r] -= k;
      out_->load_intra[r] += static_cast<int32_t>(k);
    }
    return idx == n;
  }

  bool expert(int32_t e, bool force) {
    home_ = in_.home_of[e];
    const int32_t nrep = in_.rep_begin[e + 1] - in_.rep_begin[e];
    const int32_t g0 = in_.grp_begin[e], g1 = in_.grp_begin[e + 1];
    if (in_.grp_hi[g0] > in_.grp_lo[g0])
      si_[home_]++;  // release the reservation
    else
      sx_[home_]++;
    st_[home_]++;
    home_limit_ = (force && in_.force_ok[e]) ? nrep - 1 : INT32_MAX;
    home_kids_ = 0;
    qn_ = 0;
    q_[qn_++] = kHome;
    sorted_members(in_.grp_lo[g0], in_.grp_hi[g0], -1);
    if (!bfs(0)) return false;
    const size_t home_tree = qn_;
    for (int32_t g = g0 + 1; g < g1; ++g) {
      // gateway: the member with the most intra spare (ties: lower rank)
      int32_t gw = -1;
      for (int32_t i = in_.grp_lo[g]; i < in_.grp_hi[g]; ++i) {
        const int32_t id = in_.rep[i];
        const int64_t sp = si_[in_.rank_of_id[id]];
        if (gw < 0 || sp > si_[in_.rank_of_id[gw]] || (sp == si_[in_.rank_of_id[gw]] && id < gw)) gw = id;
      }
      // feeder on the home's node: (inter spare desc, depth asc, rank asc), among the nodes
      // shallow enough for the gateway and (if the group has more members) one level below it
      const int32_t need = in_.grp_hi[g] - in_.grp_lo[g] > 1 ? 2 : 1;
      int32_t best = INT32_MIN;
      for (size_t i = 0; i < home_tree; ++i) {
        const int32_t node = q_[i];
        const int32_t r = rank_of(node);
        if (sx_[r] <= 0 || st_[r] <= 0 || int64_t(depth_of(node)) + need > depth_limit_) continue;
        if (node == kHome && home_kids_ >= home_limit_) continue;
        if (best == INT32_MIN) {
          best = node;
          continue;
        }
        const int32_t br = rank_of(best), d = depth_of(node), bd = depth_of(best);
        if (sx_[r] > sx_[br] || (sx_[r] == sx_[br] && (d < bd || (d == bd && r < br)))) best = node;
      }
      if (best == INT32_MIN) return false;
      attach(gw, best);
      sx_[rank_of(best)]--;
      st_[rank_of(best)]--;
      out_->load_inter[rank_of(best)]++;
      const size_t qs = qn_;
      q_[qn_++] = gw;
      sorted_members(in_.grp_lo[g], in_.grp_hi[g], gw);
      if (!bfs(qs)) return false;
    }
    return true;
  }

  const TreeInput& in_;
  int32_t depth_limit_ = INT32_MAX;
  std::vector<int64_t> si_, sx_, st_;
  const std::vector<int64_t>& mi_;  // mandatory sends per rank (intra, inter)
  const std::vector<int64_t>& mx_;
  Tree base_;
  std::vector<uint64_t> keys_;  // [most replicas]; the members being attached: [0, nkeys_)
  size_t nkeys_ = 0;
  std::vector<int32_t> q_;  // [most replicas + 1]; BFS queue of one expert: [0, qn_)
  size_t qn_ = 0;
  Tree* out_ = nullptr;
  int32_t home_ = 0;
  int64_t home_limit_ = 0, home_kids_ = 0;
};

}  // namespace

// Smallest i in [lo, hi) with ok(i), assuming ok is monotone; -1 if none.  Gallops up from lo
// (the optimum is usually close to the lower end), then bisects the last gap.  The last
// successful probe is the returned index.
template <class Ok>
std::ptrdiff_t smallest_feasible(size_t lo, size_t hi, Ok&& ok) {
  std::ptrdiff_t found = -1;
  size_t a = lo, b = hi;
  for (size_t i = lo, step = 1; i < hi; i = std::min(i + step, hi - 1), step *= 2) {
    if (ok(i)) {
      found = static_cast<std::ptrdiff_t>(i);
      b = i;
      break;
    }
    a = i + 1;
    if (i == hi - 1) break;
  }
  while (found >= 0 && a < b) {
    const size_t mid = a + (b - a) / 2;
    if (ok(mid)) {
      found = static_cast<std::ptrdiff_t>(mid);
      b = mid;
    } else {
      a = mid + 1;
    }
  }
  return found;
}

std::vector<Tree> relay_candidates(const TreeInput& in, int32_t max_depth, bool force, const Tree& direct,
                                   const Pick* pick) {
  std::vector<Tree> res;
  if (in.multi.empty() || max_depth < 2) return res;
  const int32_t W = in.world;
  const double ibw = in.intra_bw, xbw = in.inter_bw;
  // lower end: mandatory sends (single-replica edges + one per replicated expert) and the average
  std::vector<int64_t> mi, mx;
  mandatory_sends(in, mi, mx);
  double t_lb = 0;
  for (int32_t r = 0; r < W; ++r) {
    t_lb = std::max(t_lb, mi[r] / ibw);
    if (in.multi_node) t_lb = std::max(t_lb, mx[r] / xbw);
  }
  const double avg = double((in.total_reps + W - 1) / W);
  t_lb = std::max(t_lb, avg / (in.multi_node ? ibw + xbw : ibw));
  double t_hi = direct.t;
  if (force) {
    t_hi = double(in.total_reps) / ibw;
    if (in.multi_node) t_hi = std::max(t_hi, double(in.total_reps) / xbw);
  }
  // candidate capacity levels: k/intra_bw and (multi node) k/inter_bw in [t_lb, t_hi]
  const int64_t clamp = in.total_reps + 1;
  std::vector<double> ts;
  auto add = [&](double bw) {
    const int64_t k0 = std::max<int64_t>(1, static_cast<int64_t>(std::floor(t_lb * bw)));
    const int64_t k1 = cap_of(t_hi, bw, clamp);
    const size_t n0 = ts.size();
    for (int64_t k = k0; k <= k1; ++k) {
      const double t = double(k) / bw;
      if (t >= t_lb * (1 - 1e-12)) ts.push_back(t);
    }
    std::inplace_merge(ts.begin(), ts.begin() + static_cast<std::ptrdiff_t>(n0), ts.end());
  };
  add(ibw);
  if (in.multi_node) add(xbw);
  ts.erase(std::unique(ts.begin(), ts.end()), ts.end());
  if (ts.empty()) return res;
  const size_t nt = ts.size();

  Greedy g(in, mi, mx);
  Tree scratch;
  // Without force on one node, no rank may send more experts in total than the direct tree's
  // busiest rank.  With several nodes the tiers differ in speed and "max egress" is the time
  // bound t <= direct.t (a topology-aware tree may shift cheap intra sends onto a rank).
  const int64_t total_cap = (force || in.multi_node) ? clamp : direct.max_load;
  // No tree of depth <= D exists below capacity level lo_for(D): the expert with the most
  // replicas n needs a node with fanout(n, D) children, and a rank sends at most
  // cap(t, intra) + cap(t, inter) (and total_cap) copies.
  const int32_t most = in.rep_begin[in.multi[0] + 1] - in.rep_begin[in.multi[0]];
  auto lo_for = [&](int32_t D) {
    const int64_t f = fanout(most, D);
    size_t i = 0;
    while (i < nt &&
           std::min(total_cap, cap_of(ts[i], ibw, clamp) + (in.multi_node ? cap_of(ts[i], xbw, clamp) : 0)) < f)
      ++i;
    return i;
  };
  // Two greedy policies: "take-max" (every node takes as many children as it can; its tree
  // does not depend on D, so feasible(t, D) == depth(tree(t)) <= D and one pass over D
  // suffices; each level is run at most once) and "fan-out" (nodes take only the fan-out
  // needed to fit under D, which spreads sends over more relays; not monotone in D, so
  // searched per D).  Both kinds of results are candidates; the caller picks by predicted time.
  // Pruning by the caller's cost (one node): the best cost per op of the candidates so far,
  // and whether a search over levels [lo, hi) could beat it for some op (a tree at level i
  // sends k_i experts from its busiest rank and, with fan-out <= k_i, is at least as deep as
  // the most-replicated expert needs).
  const bool prune = pick != nullptr && !in.multi_node;
  constexpr double kInf = std::numeric_limits<double>::infinity();
  double best_cost[2] = {kInf, kInf};
  auto cost = [&](int64_t k, int32_t d, int op) {
    return double(std::max(k, pick->fixed)) * pick->unit[op] + double(d) * pick->hop[op];
  };
  auto note = [&](const Tree& t) {
    if (!prune) return;
    for (int op = 0; op < pick->ops; ++op) best_cost[op] = std::min(best_cost[op], cost(t.max_load, t.max_depth, op));
  };
  // narrows [lo_i, hi_i) to the levels whose trees could cost less; false if there are none
  auto may_improve = [&](size_t& lo_i, size_t& hi_i) {
    if (!prune) return lo_i < hi_i;
    size_t a = hi_i, b = lo_i;
    for (size_t i = lo_i; i < hi_i; ++i) {
      const int64_t k = cap_of(ts[i], ibw, clamp);
      const int32_t d = min_depth(k, most);
      for (int op = 0; op < pick->ops; ++op)
        if (cost(k, d, op) < best_cost[op] * (1 - 1e-9)) {
          a = std::min(a, i);
          b = i + 1;
        }
    }
    lo_i = a;
    hi_i = b;
    return a < b;
  };
  std::vector<int32_t> tm_depth(nt, -2);  // take-max at ts[i]: -2 not run, -1 failed, else depth
  std::vector<Tree> tm_tree(nt);          // its tree, kept until taken
  // trees no longer needed, whose buffers the next runs reuse (a run into an empty tree allocates)
  std::vector<Tree> spare;
  auto refill = [&] {
    if (scratch.parent_rank.capacity() == 0 && !spare.empty()) {
      scratch = std::move(spare.back());
      spare.pop_back();
    }
  };
  auto retire = [&](size_t a, size_t b) {  // take-max trees at levels [a, b) are never taken
    for (size_t i = a; i < b; ++i)
      if (tm_tree[i].parent_rank.capacity() > 0) spare.push_back(std::move(tm_tree[i]));
  };
  std::vector<std::pair<int32_t, size_t>> found_at;  // (depth, level index) of every candidate
  size_t lo = 0;
  int32_t D = max_depth;
  while (D >= 2 && lo < nt) {  // take-max
    size_t lo_d = std::max(lo, lo_for(D)), hi_d = nt;
    if (!may_improve(lo_d, hi_d)) break;
    const std::ptrdiff_t found = smallest_feasible(lo_d, hi_d, [&](size_t i) {
      if (tm_depth[i] == -2) {
        refill();
        const bool ok = g.run(ts[i], force, total_cap, INT32_MAX, scratch);
        tm_depth[i] = ok ? scratch.max_depth : -1;
        if (ok) std::swap(tm_tree[i], scratch);
      }
      return tm_depth[i] >= 0 && tm_depth[i] <= D;
    });
    if (found < 0) break;
    const int32_t d = tm_depth[found];
    found_at.emplace_back(d, static_cast<size_t>(found));
    note(tm_tree[found]);
    res.push_back(std::move(tm_tree[found]));
    retire(lo, static_cast<size_t>(found));
    lo = static_cast<size_t>(found) + 1;
    D = std::min(D, d) - 1;
  }
  retire(0, nt);
  // fan-out, per depth limit (2..6 and max_depth), only below the lowest level of any
  // candidate found so far that is no deeper than the limit (a deeper limit at the same level
  // only adds depth to the path fill), and not over levels where the previous limit found
  // nothing (a deeper limit rarely succeeds where a shallower one failed)
  size_t miss_lo = nt, miss_hi = 0;  // levels [miss_lo, miss_hi) failed for the previous limit
  for (int32_t d = 2; d <= max_depth; ++d) {
    if (d > 6 && d != max_depth) continue;
    size_t hi = nt;
    for (const auto& [dd, idx] : found_at)
      if (dd <= d) hi = std::min(hi, idx);
    size_t lo_d = lo_for(d);
    if (lo_d >= hi || !may_improve(lo_d, hi) || (miss_lo <= lo_d && hi <= miss_hi)) continue;
    miss_lo = lo_d;
    miss_hi = hi;
    Tree best;
    const std::ptrdiff_t found = smallest_feasible(lo_d, hi, [&](size_t i) {
      refill();
      if (!g.run(ts[i], force, total_cap, d, scratch) || scratch.max_depth > d) return false;
      std::swap(best, scratch);
      return true;
    });
    if (found < 0) continue;
    miss_lo = nt;
    miss_hi = 0;
    found_at.emplace_back(best.max_depth, static_cast<size_t>(found));
    note(best);
    res.push_back(std::move(best));
  }
  // local search on the candidate with the lowest bottleneck (ties: shallowest), unless it
  // is at the lowest level already; on the direct tree where the greedy found nothing
  const size_t n0 = res.size();
  size_t bi = n0;
  for (size_t i = 0; i < n0; ++i)
    if (bi == n0 || res[i].t < res[bi].t * (1 - 1e-12) ||
        (res[i].t <= res[bi].t * (1 + 1e-12) && res[i].max_depth < res[bi].max_depth))
      bi = i;
  const auto above_bound = [&](const Tree& t) { return t.t > ts[0] * (1 + 1e-12); };
  const bool fix_best = bi < n0 && above_bound(res[bi]);
  const bool fix_direct = !force && n0 == 0 && above_bound(direct);
  if (fix_best || fix_direct) {
    Tree t = fix_best ? res[bi] : direct;
    if (repair_tree(in, t, max_depth, force, ts[0])) res.push_back(std::move(t));
  }
  // shallowest first; equal depth: lower t first; then drop exact duplicates
  std::stable_sort(res.begin(), res.end(), [](const Tree& a, const Tree& b) {
    return a.max_depth != b.max_depth ? a.max_depth < b.max_depth : a.t < b.t;
  });
  std::vector<Tree> uniq;
  for (Tree& t : res) {
    bool dup = false;
    for (const Tree& u : uniq)
      if (u.max_depth == t.max_depth && u.parent_rank == t.parent_rank && u.parent_slot == t.parent_slot) dup = true;
    if (!dup) uniq.push_back(std::move(t));
  }
  return uniq;
}

}  // namespace ultracomm::detail
