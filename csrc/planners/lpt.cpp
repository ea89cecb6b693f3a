// EPLB within the fixed-home model (see lpt.h): per group of ranks (one group, or one per
// node when hierarchical), EPLB's replicate_experts hands the group's replica budget out
// one at a time to the expert with the highest load per instance, then EPLB's
// balanced_packing puts the replica instances, heaviest first, on the least loaded rank of
// the group with a free slot that may hold them; balance_quotas then splits each
// replicated expert's tokens to minimise the most loaded rank.
#include "lpt.h"

#include <algorithm>
#include <queue>
#include <set>
#include <utility>

#include "balance.h"

namespace ultracomm::planners {

namespace {

struct Share {  // el / count, compared exactly
  int64_t el, count;
  bool operator>(const Share& o) const {
    return static_cast<__int128>(el) * o.count > static_cast<__int128>(o.el) * count;
  }
  bool operator==(const Share& o) const {
    return static_cast<__int128>(el) * o.count == static_cast<__int128>(o.el) * count;
  }
};

// EPLB replicate_experts: instances per expert of `experts`, `budget` replicas.
void replicate(const std::vector<int64_t>& experts, const int64_t* el, int64_t budget, int64_t max_instances,
               int64_t mt, std::vector<int64_t>& count) {
  auto worse = [&](int64_t a, int64_t b) {  // heap order: highest share, then lowest id
    const Share sa{el[a], count[a]}, sb{el[b], count[b]};
    if (sa == sb) return a > b;
    return sb > sa;
  };
  std::priority_queue<int64_t, std::vector<int64_t>, decltype(worse)> heap(worse);
  for (int64_t e : experts)
    if (max_instances > 1 && el[e] >= 2 * mt) heap.push(e);
  for (int64_t placed = 0; placed < budget && !heap.empty(); ++placed) {
    const int64_t e = heap.top();
    heap.pop();
    const int64_t c = ++count[e];
    if (c < max_instances && el[e] / (c + 1) >= mt) heap.push(e);
  }
}

// The fixed-home count rule: with homes fixed a rank computes at least the home shares of
// its experts (sum of load / instances), however the replicas are packed, so each replica
// goes to the rank with the largest such sum, to its expert with the highest load per
// instance (ties: lower rank, lower expert).  EPLB's rule (replicate) looks at experts
// alone, which on rank-blocked loads leaves a rank of many equally hot experts without a
// replica (EP16, initial 3.0: 1.222 max:mean).
void replicate_by_rank(const std::vector<int64_t>& ranks, int64_t epr, const int64_t* el, int64_t budget,
                       int64_t max_instances, int64_t mt, std::vector<int64_t>& count) {
  auto eligible = [&](int64_t e) {
    return max_instances > 1 && el[e] >= 2 * mt && count[e] < max_instances && el[e] / (count[e] + 1) >= mt;
  };
  auto share_sum = [&](int64_t r) {
    double s = 0;
    for (int64_t e = r * epr; e < (r + 1) * epr; ++e) s += static_cast<double>(el[e]) / count[e];
    return s;
  };
  std::vector<double> est(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) est[i] = share_sum(ranks[i]);
  for (int64_t placed = 0; placed < budget; ++placed) {
    int64_t best_i = -1, best_e = -1;
    for (size_t i = 0; i < ranks.size(); ++i) {
      if (best_i >= 0 && !(est[i] > est[best_i])) continue;
      int64_t pick = -1;
      for (int64_t e = ranks[i] * epr; e < (ranks[i] + 1) * epr; ++e)
        if (eligible(e) && (pick < 0 || Share{el[e], count[e]} > Share{el[pick], count[pick]})) pick = e;
      if (pick >= 0) best_i = static_cast<int64_t>(i), best_e = pick;
    }
    if (best_e < 0) break;
    ++count[best_e];
    est[best_i] = share_sum(ranks[best_i]);
  }
}

// Steps 2 and 3 for the replica counts `count`.
LptResult place(const LptInput& in, const std::vector<int64_t>& grp, const std::vector<int64_t>& groups,
                const std::vector<int64_t>& count) {
  const int64_t W = in.world, epr = in.experts_per_rank, K = in.slots, E = W * epr;
  const int64_t* el = in.expert_load;
  LptResult res;
  res.slot_src.assign(static_cast<size_t>(W * K), -1);
  res.slot_quota.assign(static_cast<size_t>(W * K), 0);
  // 2. balanced packing: replica instances heaviest first (then expert, instance)
  std::vector<std::pair<int64_t, int64_t>> reps;  // (expert, instance)
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 1; i < count[e]; ++i) reps.push_back({e, i});
  std::stable_sort(reps.begin(), reps.end(), [&](const auto& a, const auto& b) {
    return Share{el[a.first], count[a.first]} > Share{el[b.first], count[b.first]};
  });
  std::vector<double> load(static_cast<size_t>(W), 0.0);
  for (int64_t e = 0; e < E; ++e) load[e / epr] += static_cast<double>(el[e]) / count[e];
  std::vector<std::set<std::pair<double, int64_t>>> open(groups.size());  // (load, rank)
  auto group_index = [&](int64_t r) { return std::lower_bound(groups.begin(), groups.end(), grp[r]) - groups.begin(); };
  if (K > 0)
    for (int64_t r = 0; r < W; ++r) open[group_index(r)].insert({load[r], r});
  std::vector<int64_t> used(static_cast<size_t>(W), 0);
  for (const auto& [e, i] : reps) {
    const int64_t home = e / epr;
    auto& cand = open[group_index(home)];
    auto it = cand.begin();
    for (; it != cand.end(); ++it) {  // least loaded rank that may hold e
      const int64_t r = it->second;
      if (r == home) continue;
      bool holds = false;
      for (int64_t k = 0; k < used[r]; ++k) holds |= res.slot_src[r * K + k] == e;
      if (!holds) break;
    }
    if (it == cand.end()) {
      ++res.dropped;
      continue;
    }
    const int64_t r = it->second;
    cand.erase(it);
    res.slot_src[r * K + used[r]++] = e;
    load[r] += static_cast<double>(el[e]) / count[e];
    if (used[r] < K) cand.insert({load[r], r});
  }
  // 3. min-max quotas for the placement (instances: home, then slots in rank order)
  std::vector<int64_t> first(static_cast<size_t>(E), -1), rep_e, off{0}, inst, where;
  std::vector<std::vector<int64_t>> slots_of;
  for (int64_t s = 0; s < W * K; ++s) {
    const int64_t e = res.slot_src[s];
    if (e < 0) continue;
    ++res.replicas;
    if (first[e] < 0) {
      first[e] = static_cast<int64_t>(rep_e.size());
      rep_e.push_back(e);
      slots_of.emplace_back();
    }
    slots_of[first[e]].push_back(s);
  }
  std::vector<int64_t> base(static_cast<size_t>(W), 0), rel;
  for (int64_t e = 0; e < E; ++e)
    if (first[e] < 0) base[e / epr] += el[e];
  for (size_t x = 0; x < rep_e.size(); ++x) {
    rel.push_back(el[rep_e[x]]);
    inst.push_back(rep_e[x] / epr);
    where.push_back(-1);
    for (int64_t s : slots_of[x]) {
      inst.push_back(s / K);
      where.push_back(s);
    }
    off.push_back(static_cast<int64_t>(inst.size()));
  }
  std::vector<int64_t> quota(inst.size());
  res.max_load = balance_quotas(W, static_cast<int64_t>(rep_e.size()), rel.data(), off.data(), inst.data(), base.data(),
                                quota.data());
  for (size_t i = 0; i < inst.size(); ++i)
    if (where[i] >= 0) {
      res.slot_quota[where[i]] = quota[i];
      res.idle += quota[i] == 0;
    }
  return res;
}

}  // namespace

LptResult lpt_plan(const LptInput& in) {
  const int64_t W = in.world, epr = in.experts_per_rank, E = W * epr;
  const int64_t mt = std::max<int64_t>(in.min_tokens, 1);
  std::vector<int64_t> grp(static_cast<size_t>(W), 0);
  if (in.group) grp.assign(in.group, in.group + W);
  std::vector<int64_t> groups(grp);
  std::sort(groups.begin(), groups.end());
  groups.erase(std::unique(groups.begin(), groups.end()), groups.end());
  // 1. replica counts per group (budget shared by the group's ranks), by either rule
  auto counts = [&](bool by_rank) {
    std::vector<int64_t> count(static_cast<size_t>(E), 1);
    for (int64_t g : groups) {
      std::vector<int64_t> experts, members;
      for (int64_t r = 0; r < W; ++r)
        if (grp[r] == g) {
          members.push_back(r);
          for (int64_t i = 0; i < epr; ++i) experts.push_back(r * epr + i);
        }
      const int64_t ranks = static_cast<int64_t>(members.size());
      const int64_t share = groups.size() > 1 ? in.budget * ranks / W : in.budget;
      if (by_rank)
        replicate_by_rank(members, epr, in.expert_load, share, ranks, mt, count);
      else
        replicate(experts, in.expert_load, share, ranks, mt, count);
    }
    return count;
  };
  if (in.count_rule != LptCountRule::kBest) return place(in, grp, groups, counts(in.count_rule == LptCountRule::kRank));
  const std::vector<int64_t> by_expert = counts(false), by_rank = counts(true);
  LptResult a = place(in, grp, groups, by_expert);
  if (by_rank == by_expert) return a;  // place() is a function of the counts: the same plan
  LptResult b = place(in, grp, groups, by_rank);
  return b.max_load < a.max_load ? b : a;  // ties: EPLB's rule
}

}  // namespace ultracomm::planners
