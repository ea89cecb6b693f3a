// UltraEP quota planner (see quota_search.h and python/ultracomm/planners/quota.py).
//
// Feasibility at a threshold T is a flow problem once the replicas are chosen: source ->
// hot rank h (cap L_h - T) -> h's expert e (cap its tokens) -> rank j holding a replica
// of e -> sink (cap T - L_j).  The slot limit (at most K replicas per rank) makes
// choosing the replicas a packing problem (bin covering reduces to it), so replicas are
// added one at a time -- the one that promises the most tokens, ties to the tightest fit
// -- and the max-flow reroutes tokens over the replicas already placed after each
// addition.  Promises are direct (hot rank -> expert -> receiver) while any direct
// candidate is left, then over the widest residual paths (rerouting included).  Cheap
// necessary conditions refuse hopeless thresholds first; when the greedy fails, the cover
// search (quota_cover.cpp) and, with more than one slot, a limited-discrepancy search
// retry within work budgets that the probes share (each at most 3/4 of what is left).
#include "quota_search.h"

#include <algorithm>
#include <cstddef>
#include <functional>

#include "flow_graph.h"
#include "quota_cover.h"

namespace ultracomm::planners {

namespace {

constexpr int kSource = 0, kSink = 1;
constexpr size_t kBranch = 3;  // choices tried per step by the search (best + runners-up)
constexpr int kMaxDiscrepancy = 3;
constexpr int kPerReceiver = 2;       // a receiver's runner-up expert is a choice too
constexpr int64_t kDfsBudget = 1000;  // most cover-search placements the depth-first part takes

// What one probe may spend of a budget that the probes of one search share: three
// quarters of what is left (all of it below 4), so the probes after a hard one still search.
int64_t probe_share(int64_t left) { return left < 4 ? left : left - left / 4; }

struct Cand {
  int64_t gain, left;  // promised tokens; spare left on the looser side (tightest fit first)
  int recv, exp;
  bool wide;  // promised over rerouting paths (else: the direct path, pushed as it is)
};

struct Key {  // an expert by node (0 without the restriction) and promise
  int64_t group, bs;
  int x;
  bool operator<(const Key& o) const {
    if (group != o.group) return group < o.group;
    if (bs != o.bs) return bs < o.bs;
    return x < o.x;
  }
};

bool better(const Cand& a, const Cand& b) {
  if (a.gain != b.gain) return a.gain > b.gain;
  if (a.left != b.left) return a.left < b.left;
  if (a.recv != b.recv) return a.recv < b.recv;
  return a.exp < b.exp;
}

class Feasibility {
 public:
  Feasibility(const QuotaInput& in, int64_t T) : in_(in), mt_(std::max<int64_t>(in.min_tokens, 1)) {
    const int64_t W = in.world, epr = in.experts_per_rank;
    for (int64_t r = 0; r < W; ++r) {
      const int64_t x = in.rank_load[r] - T;
      if (x >= mt_) hot_.push_back(static_cast<int>(r));
      if (-x >= mt_) recv_rank_.push_back(static_cast<int>(r));
    }
    for (int h : hot_)
      for (int64_t i = 0; i < epr; ++i) {
        const int64_t e = in.order[h * epr + i];
        if (in.expert_load[e] > 0) exp_id_.push_back(e);
      }
    const int nh = static_cast<int>(hot_.size()), nx = static_cast<int>(exp_id_.size());
    const int nr = static_cast<int>(recv_rank_.size());
    base_exp_ = 2 + nh;
    base_recv_ = base_exp_ + nx;
    g_.reset(base_recv_ + nr);
    for (int i = 0; i < nh; ++i) hot_arc_.push_back(g_.add_arc(kSource, 2 + i, in.rank_load[hot_[i]] - T));
    int i = 0;
    for (int x = 0; x < nx; ++x) {
      const int64_t home = exp_id_[x] / epr;
      while (hot_[i] != home) ++i;
      exp_home_.push_back(static_cast<int>(home));
      exp_hot_.push_back(i);
      exp_arc_.push_back(g_.add_arc(2 + i, base_exp_ + x, in.expert_load[exp_id_[x]]));
    }
    for (int j = 0; j < nr; ++j)
      recv_arc_.push_back(g_.add_arc(base_recv_ + j, kSink, T - in.rank_load[recv_rank_[j]]));
    g_.mark(start_);
  }

  // Necessary conditions, per node when replicas stay on it: the receivers' spare covers
  // the excess, and the replicas each hot rank needs at least -- as many as its fewest
  // experts, and as many as the fewest receivers, that hold its excess -- fit in the
  // receivers' slots.
  bool relaxation_ok() const {
    std::vector<int64_t> groups;
    for (int h : hot_) groups.push_back(group_of_rank(h));
    std::sort(groups.begin(), groups.end());
    groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
    for (int64_t grp : groups) {
      std::vector<int64_t> spare;
      for (int j = 0; j < static_cast<int>(recv_rank_.size()); ++j)
        if (group_of_rank(recv_rank_[j]) == grp) spare.push_back(g_.residual(recv_arc_[j]));
      std::sort(spare.begin(), spare.end(), std::greater<>());
      for (size_t j = 1; j < spare.size(); ++j) spare[j] += spare[j - 1];  // cumulative
      int64_t need_total = 0, slots_needed = 0;
      for (size_t h = 0; h < hot_.size(); ++h) {
        if (group_of_rank(hot_[h]) != grp) continue;
        const int64_t need = g_.residual(hot_arc_[h]) - (mt_ - 1);
        need_total += need;
        const auto by_recv = std::lower_bound(spare.begin(), spare.end(), need) - spare.begin();
        if (by_recv == static_cast<std::ptrdiff_t>(spare.size())) return false;
        int64_t by_exp = 0, got = 0;
        for (size_t x = 0; x < exp_id_.size() && got < need; ++x)
          if (exp_hot_[x] == static_cast<int>(h)) {  // hottest first
            got += in_.expert_load[exp_id_[x]];
            ++by_exp;
          }
        slots_needed += std::max<int64_t>(by_recv + 1, by_exp);
      }
      if (need_total > (spare.empty() ? 0 : spare.back())) return false;
      if (slots_needed > in_.slots * static_cast<int64_t>(spare.size())) return false;
    }
    return true;
  }

  // Greedy, then the bounded search; the replicas of the plan found, if any.
  bool solve(std::vector<QuotaReplica>& out, QuotaResult& stats) {
    if (!relaxation_ok()) {
      ++stats.pruned;
      return false;
    }
    // with one slot per rank the cover search goes first (the greedy rarely meets tight
    // thresholds there and costs as much); with more, only after the greedy failed
    bool ok = in_.slots != 1 && descend(0);
    const bool covered = !ok && stats.cover_budget_left > 0;
    if (covered) {
      ++stats.covered;
      // a probe spends at most three quarters of what is left, so that the looser
      // thresholds the search tries next still get a cover search
      const int64_t share = probe_share(stats.cover_budget_left);
      int64_t left = share;
      const CoverOutcome c = cover(left);
      stats.cover_budget_left -= share - left;
      ok = c == CoverOutcome::kFound;
      stats.cover_met += ok;
      // exhausting the cover search is a proof only with one slot and no minimum quota
      if (c == CoverOutcome::kRefuted && in_.slots == 1 && mt_ == 1) {
        ++stats.refuted;
        stats.steps += steps_;
        return false;
      }
    }
    // with one slot, the greedy only where the cover search did not run (after it, the
    // greedy met no planted load it had missed), and never the limited-discrepancy search
    // (it met none either; perf/planners.md)
    if (!ok && in_.slots == 1 && !covered) {
      g_.rollback(start_);
      ok = descend(0);
    }
    if (!ok && in_.slots > 1 && stats.budget_left > 0) {
      ++stats.searched;
      const int64_t share = probe_share(stats.budget_left);
      budget_ = share;
      for (int d = 1; d <= kMaxDiscrepancy && !ok && budget_ > 0; ++d) {
        g_.rollback(start_);
        searching_ = true;
        ok = descend(d);
      }
      stats.rescued += ok;
      stats.budget_left -= share - std::max<int64_t>(budget_, 0);
    }
    stats.steps += steps_;
    if (ok) ok = enforce_min_tokens();
    if (!ok) return false;
    out.clear();
    for (int x = 0; x < static_cast<int>(exp_id_.size()); ++x)
      for (int a : g_.out(base_exp_ + x))
        if (!(a & 1) && g_.flow(a) > 0) out.push_back({exp_id_[x], recv_rank_[g_.head(a) - base_recv_], g_.flow(a)});
    return true;
  }

 private:
  bool done() const {
    for (size_t h = 0; h < hot_.size(); ++h)
      if (g_.residual(hot_arc_[h]) >= mt_) return false;
    return true;
  }

  int recv_used(int j) const { return static_cast<int>(g_.out(base_recv_ + j).size()) - 1; }

  int64_t group_of_rank(int64_t r) const { return in_.node ? in_.node[r] : 0; }

  bool allowed(int x, int j) const {      // (node: checked by the caller's segment)
    for (int a : g_.out(base_recv_ + j))  // reverse arcs of the replicas on j
      if ((a & 1) && g_.head(a) == base_exp_ + x) return false;
    return true;
  }

  // Tokens each expert could still take from its hot rank (bs_) and each receiver could
  // still accept (bt_): directly, or (wide) over widest residual paths that reroute
  // tokens along the replicas placed so far.
  void promises(bool wide) {
    if (wide) {
      g_.widest_from(kSource, bs_);
      g_.widest_to(kSink, bt_);
      return;
    }
    bs_.assign(static_cast<size_t>(g_.nodes()), 0);
    bt_.assign(static_cast<size_t>(g_.nodes()), 0);
    for (size_t x = 0; x < exp_id_.size(); ++x)
      bs_[base_exp_ + x] = std::min(g_.residual(hot_arc_[exp_hot_[x]]), g_.residual(exp_arc_[x]));
    for (size_t j = 0; j < recv_rank_.size(); ++j) bt_[base_recv_ + j] = g_.residual(recv_arc_[j]);
  }

  // Up to kPerReceiver candidates of each receiver with a free slot (the tightest experts
  // that fill it, then the largest that fit), best `keep` first.  Direct promises first;
  // the widest paths only when those leave no candidate.
  void candidates(std::vector<Cand>& c, size_t keep) {
    for (bool wide : {false, true}) {
      if (wide) {  // the direct pushes left the flow below its maximum: reroute first
        g_.max_flow(kSource, kSink);
        if (done()) break;
      }
      promises(wide);
      sorted_.clear();
      for (int x = 0; x < static_cast<int>(exp_id_.size()); ++x)
        if (bs_[base_exp_ + x] >= mt_) sorted_.push_back({group_of_rank(exp_home_[x]), bs_[base_exp_ + x], x});
      std::sort(sorted_.begin(), sorted_.end());  // by node, promise, expert
      c.clear();
      for (int j = 0; j < static_cast<int>(recv_rank_.size()); ++j) {
        const int64_t bt = bt_[base_recv_ + j];
        if (bt < mt_ || recv_used(j) >= in_.slots) continue;
        const int64_t grp = group_of_rank(recv_rank_[j]);
        const auto lo = std::lower_bound(sorted_.begin(), sorted_.end(), Key{grp, 0, -1});
        const auto hi = std::lower_bound(lo, sorted_.end(), Key{grp + 1, 0, -1});
        const auto mid = std::lower_bound(lo, hi, Key{grp, bt, -1});
        int found = 0;
        for (auto k = mid; k != hi && found < kPerReceiver; ++k)
          if (allowed(k->x, j)) {
            c.push_back({bt, k->bs - bt, j, k->x, wide});
            ++found;
          }
        for (auto k = mid; k != lo && found < kPerReceiver;) {
          --k;
          if (allowed(k->x, j)) {
            c.push_back({k->bs, bt - k->bs, j, k->x, wide});
            ++found;
          }
        }
      }
      if (!c.empty()) break;
    }
    const size_t k = std::min(keep, c.size());
    std::partial_sort(c.begin(), c.begin() + static_cast<std::ptrdiff_t>(k), c.end(), better);
    c.resize(k);
  }

  void apply(const Cand& c) {
    const int arc = g_.add_arc(base_exp_ + c.exp, base_recv_ + c.recv, kFlowInf);
    if (!c.wide) {  // push the direct path source -> hot rank -> expert -> receiver -> sink
      const int x = c.exp;
      for (int a : {hot_arc_[exp_hot_[x]], exp_arc_[x], arc, recv_arc_[c.recv]}) g_.add_flow(a, c.gain);
    }
    g_.max_flow(kSource, kSink);  // reroute over the replicas placed so far
  }

  // Greedy from the current state, deviating to a runner-up at most `disc` times.
  bool descend(int disc) {
    std::vector<Cand> c;
    while (!done()) {
      if (searching_ && budget_-- <= 0) return false;
      ++steps_;
      candidates(c, disc > 0 ? kBranch : 1);
      if (c.empty()) return done();  // done once rerouted, or stuck
      if (disc > 0 && c.size() > 1) {
        FlowGraph::Mark m;
        g_.mark(m);
        for (size_t i = 1; i < c.size(); ++i) {
          apply(c[i]);
          if (descend(disc - 1)) return true;
          g_.rollback(m);
          if (budget_ <= 0) return false;
        }
      }
      apply(c[0]);
    }
    return true;
  }

  // The cover search (quota_cover.cpp) from the start state; a cover found is pushed as
  // it is (each hot rank's flow then covers its need) and the max-flow adds what it can.
  CoverOutcome cover(int64_t& budget) {
    g_.rollback(start_);
    CoverProblem p;
    p.min_tokens = mt_;
    for (size_t h = 0; h < hot_.size(); ++h) {
      p.need.push_back(g_.residual(hot_arc_[h]) - (mt_ - 1));
      p.hot_group.push_back(group_of_rank(hot_[h]));
    }
    p.hot_experts.resize(hot_.size());
    for (int x = 0; x < static_cast<int>(exp_id_.size()); ++x) {
      p.hot_experts[exp_hot_[x]].push_back(x);
      p.cap.push_back(in_.expert_load[exp_id_[x]]);
    }
    for (size_t j = 0; j < recv_rank_.size(); ++j) {
      p.spare.push_back(g_.residual(recv_arc_[j]));
      p.slots.push_back(in_.slots);
      p.recv_group.push_back(group_of_rank(recv_rank_[j]));
    }
    std::vector<CoverPiece> pieces;
    const auto accept = [&](const std::vector<CoverPiece>& ps) {
      g_.rollback(start_);
      for (const CoverPiece& c : ps) {
        const int arc = g_.add_arc(base_exp_ + c.expert, base_recv_ + c.recv, kFlowInf);
        for (int a : {hot_arc_[exp_hot_[c.expert]], exp_arc_[c.expert], arc, recv_arc_[c.recv]})
          g_.add_flow(a, c.tokens);
      }
      g_.max_flow(kSource, kSink);
      return done();
    };
    // the depth-first search first (a small share: it proves small cases infeasible), then
    // with one slot the local search
    int64_t dfs_budget = std::min<int64_t>(budget / 4, kDfsBudget);
    budget -= dfs_budget;
    CoverOutcome out = cover_search(p, dfs_budget, accept, pieces);
    budget += dfs_budget;
    if (out == CoverOutcome::kOutOfBudget && in_.slots == 1 && cover_local(p, budget, accept, pieces))
      out = CoverOutcome::kFound;
    return out;
  }

  // Replicas below min_tokens are dropped and the flow recomputed on the rest; fails if
  // that leaves a rank min_tokens or more above T.
  bool enforce_min_tokens() {
    for (int round = 0; round < 16; ++round) {
      bool small = false;
      for (int x = 0; x < static_cast<int>(exp_id_.size()) && !small; ++x)
        for (int a : g_.out(base_exp_ + x))
          if (!(a & 1) && g_.flow(a) > 0 && g_.flow(a) < mt_) small = true;
      if (!small) return done();
      std::vector<std::pair<int, int>> keep;
      for (int x = 0; x < static_cast<int>(exp_id_.size()); ++x)
        for (int a : g_.out(base_exp_ + x))
          if (!(a & 1) && g_.flow(a) >= mt_) keep.push_back({base_exp_ + x, g_.head(a)});
      g_.rollback(start_);
      for (auto [u, v] : keep) g_.add_arc(u, v, kFlowInf);
      g_.max_flow(kSource, kSink);
    }
    return false;
  }

  const QuotaInput& in_;
  const int64_t mt_;
  std::vector<int> hot_, recv_rank_, hot_arc_, exp_home_, exp_hot_, exp_arc_, recv_arc_;
  std::vector<int64_t> exp_id_;
  int base_exp_ = 0, base_recv_ = 0;
  FlowGraph g_;
  FlowGraph::Mark start_;
  std::vector<int64_t> bs_, bt_;
  std::vector<Key> sorted_;
  int64_t budget_ = 0, steps_ = 0;
  bool searching_ = false;
};

}  // namespace

bool quota_feasible(const QuotaInput& in, int64_t T, std::vector<QuotaReplica>& out, QuotaResult& stats) {
  ++stats.probes;
  if (in.slots <= 0) {
    for (int64_t r = 0; r < in.world; ++r)
      if (in.rank_load[r] - T >= std::max<int64_t>(in.min_tokens, 1)) return false;
    out.clear();
    return true;
  }
  Feasibility f(in, T);
  return f.solve(out, stats);
}

QuotaResult quota_search(const QuotaInput& in) {
  QuotaResult res;
  res.budget_left = in.budget;
  res.cover_budget_left = in.cover_budget;
  int64_t total = 0, hi = 0;
  for (int64_t r = 0; r < in.world; ++r) {
    total += in.rank_load[r];
    hi = std::max(hi, in.rank_load[r]);
  }
  const int64_t tol = std::max<int64_t>(in.tol, 1);
  int64_t lo = (total + in.world - 1) / in.world - 1;  // ceil(mean) - 1: infeasible
  std::vector<QuotaReplica> cur;
  if (hi - lo > tol && in.slots > 0) {
    for (int64_t d = tol;; d *= 2) {  // gallop
      const int64_t T = lo + d;
      if (T >= hi) break;
      if (quota_feasible(in, T, cur, res)) {
        hi = T;
        res.replicas = cur;
        break;
      }
      lo = T;
    }
    while (hi - lo > tol) {  // bisect
      const int64_t T = lo + (hi - lo) / 2;
      if (quota_feasible(in, T, cur, res)) {
        hi = T;
        res.replicas = cur;
      } else {
        lo = T;
      }
    }
  }
  res.threshold = hi;
  return res;
}

}  // namespace ultracomm::planners
