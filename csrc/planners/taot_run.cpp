// TAOT after phase 1 in one call: the compacted phase-2 inputs (candidate experts, cold
// ranks, score terms, allowance levels), the matching, taot_finish, and the plan's instance
// numbering and quotas.  Exact port of the numpy glue in _plan and base.build_result
// (python/ultracomm/planners/taot.py, base.py), which stays the reference (backend="numpy");
// the floating-point score terms are the same IEEE operations in the same order (the build
// turns off FMA contraction), so the matching sees bit-identical scores.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <stdexcept>
#include <vector>

#include "taot.h"

namespace ultracomm::planners {

namespace {

// spill_of (taot.py): per rank, experts by ascending load (stable), the excess over target
// of the cumulative load, differenced.
std::vector<int64_t> paper_spill(const int64_t* el, int64_t W, int64_t epr, int64_t target) {
  std::vector<int64_t> out(static_cast<size_t>(W * epr)), o(static_cast<size_t>(epr));
  for (int64_t w = 0; w < W; ++w) {
    const int64_t* x = el + w * epr;
    std::iota(o.begin(), o.end(), 0);
    std::stable_sort(o.begin(), o.end(), [&](int64_t a, int64_t b) { return x[a] < x[b]; });
    int64_t cum = 0, prev = 0;
    for (int64_t k = 0; k < epr; ++k) {
      cum += x[o[k]];
      const int64_t sig = std::max<int64_t>(cum - target, 0);
      out[w * epr + o[k]] = sig - prev;
      prev = sig;
    }
  }
  return out;
}

}  // namespace

TaotRun taot_run(const TaotRunIn& in, int32_t* slot_src, int64_t* slot_quota, int64_t* rep,
                 std::vector<int64_t>& quota) {
  const int64_t W = in.W, E = in.E, K = in.K, mg = in.mg;
  TaotRun out{};
  out.fin.consolidated = -1;
  // candidate experts (of hot ranks) and their caps; cold ranks with room for a match
  std::vector<int64_t> ei, cap, ri, grp, exc;
  if (in.dynamic_spill) {
    for (int64_t e = 0; e < E; ++e)
      if (in.excess[in.home[e]] >= mg && in.el[e] >= mg) ei.push_back(e), cap.push_back(in.el[e]);
  } else {
    const std::vector<int64_t> sp = paper_spill(in.el, W, in.epr, in.tgt - mg + 1);
    for (int64_t e = 0; e < E; ++e)
      if (sp[e] > 0) ei.push_back(e), cap.push_back(sp[e]);
  }
  for (int64_t w = 0; w < W; ++w)
    if (in.spare[w] >= mg) ri.push_back(w);
  const int64_t ne = static_cast<int64_t>(ei.size()), nr = static_cast<int64_t>(ri.size());
  if (ne == 0 || nr == 0) return out;
  // groups sharing a cap: the home ranks (dynamic spill) or each expert alone
  for (int64_t i = 0; i < ne; ++i) {
    if (!in.dynamic_spill) {
      grp.push_back(i), exc.push_back(cap[i]);
    } else {
      if (i == 0 || in.home[ei[i]] != in.home[ei[i - 1]]) exc.push_back(in.excess[in.home[ei[i]]]);
      grp.push_back(static_cast<int64_t>(exc.size()) - 1);
    }
  }
  // score terms alpha * B + 0.1 * alpha * (flow / home's excess), as numpy evaluates them
  const double a_hint = 0.1 * in.alpha;
  std::vector<double> stat(static_cast<size_t>(ne * nr));
  std::vector<uint8_t> allowed(static_cast<size_t>(ne * nr));
  std::vector<int64_t> sp_r(static_cast<size_t>(nr));
  for (int64_t j = 0; j < nr; ++j) sp_r[j] = in.spare[ri[j]];
  for (int64_t i = 0; i < ne; ++i) {
    const int64_t h = in.home[ei[i]];
    const double den = std::max(static_cast<double>(in.excess[h]), 1e-9);
    for (int64_t j = 0; j < nr; ++j) {
      const int64_t r = ri[j];
      const double hint = in.flow[h * W + r] / den;
      const double b = in.alpha * in.Brr[h * W + r];
      const double t = a_hint * hint;
      stat[i * nr + j] = b + t;
      const uint8_t ok = h != r ? 1 : 0;  // 2: also in the intra-node pass
      allowed[i * nr + j] = static_cast<uint8_t>(ok + (in.two_pass ? (ok & in.same[h * W + r]) : 0));
    }
  }
  std::vector<int64_t> g(static_cast<size_t>(ne * nr), 0), rnd(static_cast<size_t>(ne * nr), -1);
  taot_matching(ne, nr, cap.data(), grp.data(), exc.data(), sp_r.data(), stat.data(), allowed.data(), K, nr, mg,
                in.mutual, in.two_pass, g.data(), rnd.data());
  const TaotFinishIn fin{
      W,     E,    K,       ne,      nr,     g.data(), rnd.data(),     ei.data(),     ri.data(),  in.home,
      in.el, in.L, in.same, in.load, in.bid, in.tgt,   in.consolidate, in.price_step, in.has_cap, in.auction_cap};
  out.fin = taot_finish(fin, slot_src, slot_quota, rep);
  if (out.fin.n_matches == 0) return out;
  // instances (base.instance_index): an expert's replicas in (rank, slot) order, 1, 2, ...;
  // quotas (base.build_result): the slot's, the home's the rest
  std::vector<int64_t> nrep(static_cast<size_t>(E), 0), inst(static_cast<size_t>(W * K), 0);
  int64_t I = 1;
  for (int64_t s = 0; s < W * K; ++s)
    if (slot_src[s] >= 0) I = std::max(I, 1 + (inst[s] = ++nrep[slot_src[s]]));
  quota.assign(static_cast<size_t>(E * I), 0);
  for (int64_t s = 0; s < W * K; ++s)
    if (slot_src[s] >= 0) quota[slot_src[s] * I + inst[s]] = slot_quota[s];
  for (int64_t e = 0; e < E; ++e) {
    int64_t q = in.el[e];
    for (int64_t i = 1; i < I; ++i) q -= quota[e * I + i];
    if (q < 0) throw std::logic_error("taot: replica quotas exceed an expert's load");
    quota[e * I] = q;
  }
  out.instances = I;
  return out;
}

}  // namespace ultracomm::planners
