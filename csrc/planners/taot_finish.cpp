// TAOT's step after phase 2 in one call: pick out the matches, consolidate them, order each
// rank's slots by round, run the auction and scatter its moves into the plan.  Exact port of
// the numpy glue in _plan (python/ultracomm/planners/taot.py), which stays the reference
// (backend="numpy"); doing it here saves ~90 small numpy calls per plan.
#include <algorithm>
#include <cstdint>
#include <numeric>
#include <vector>

#include "taot.h"

namespace ultracomm::planners {

TaotFinish taot_finish(const TaotFinishIn& in, int32_t* slot_src, int64_t* slot_quota, int64_t* rep) {
  const int64_t W = in.W, E = in.E, K = in.K, nr = in.nr;
  TaotFinish out{};
  // matches, row-major over (candidate expert, cold rank): e_m ascends
  std::vector<int64_t> e_m, r_m, rnd_m, dem;
  for (int64_t e = 0; e < in.ne; ++e)
    for (int64_t r = 0; r < nr; ++r) {
      const int64_t i = e * nr + r;
      if (in.g[i] == 0) continue;
      e_m.push_back(in.ei[e]);
      r_m.push_back(in.ri[r]);
      rnd_m.push_back(in.rnd[i]);
      dem.push_back(in.g[i]);
    }
  int64_t n = static_cast<int64_t>(e_m.size());
  out.n_matches = n;
  out.consolidated = -1;
  if (n == 0) return out;
  if (in.consolidate && n > 1) {
    std::vector<int64_t> hm(n), room(W, 0), e_u(n), left;
    std::vector<uint8_t> inter(n), keep(n);
    for (int64_t p = 0; p < n; ++p) {
      hm[p] = in.home[e_m[p]];
      room[hm[p]] += dem[p];   // shed by the home ...
      room[r_m[p]] -= dem[p];  // ... taken by the slot's rank
      inter[p] = in.same[hm[p] * W + r_m[p]] ? 0 : 1;
      if (p == 0 || e_m[p] != e_m[p - 1]) left.push_back(in.el[e_m[p]]);
      e_u[p] = static_cast<int64_t>(left.size()) - 1;
      left.back() -= dem[p];
    }
    for (int64_t w = 0; w < W; ++w) room[w] = std::max<int64_t>(in.tgt - (in.L[w] - room[w]), 0);
    taot_consolidate(n, hm.data(), r_m.data(), e_u.data(), inter.data(), dem.data(), left.data(), room.data(),
                     keep.data());
    int64_t m = 0;
    for (int64_t p = 0; p < n; ++p) {
      if (!keep[p]) continue;
      e_m[m] = e_m[p], r_m[m] = r_m[p], rnd_m[m] = rnd_m[p], dem[m] = dem[p];
      ++m;
    }
    out.consolidated = n - m;
    n = m;
    e_m.resize(n), r_m.resize(n), rnd_m.resize(n), dem.resize(n);
  }
  // slots: per rank, in round order (stable, like np.lexsort((rnd_m, r_m)))
  std::vector<int64_t> o(n);
  std::iota(o.begin(), o.end(), 0);
  std::stable_sort(o.begin(), o.end(),
                   [&](int64_t a, int64_t b) { return r_m[a] != r_m[b] ? r_m[a] < r_m[b] : rnd_m[a] < rnd_m[b]; });
  std::vector<int64_t> se(n), sr(n), sk(n), A(n);
  for (int64_t j = 0; j < n; ++j) {
    se[j] = e_m[o[j]], sr[j] = r_m[o[j]], A[j] = dem[o[j]];
    sk[j] = (j > 0 && sr[j] == sr[j - 1]) ? sk[j - 1] + 1 : 0;
    slot_src[sr[j] * K + sk[j]] = static_cast<int32_t>(se[j]);
    slot_quota[sr[j] * K + sk[j]] = A[j];
  }
  // auction inputs: distinct experts ascending (marked), their loads, tie-broken bonus
  std::vector<int64_t> idx(E, -1), ue;
  for (int64_t j = 0; j < n; ++j) idx[se[j]] = 0;
  for (int64_t e = 0; e < E; ++e)
    if (idx[e] == 0) idx[e] = static_cast<int64_t>(ue.size()), ue.push_back(e);
  const int64_t U = static_cast<int64_t>(ue.size());
  std::vector<int64_t> inv(n), supply(W * U), X(W * n, 0);
  std::vector<double> bonus(W * n);
  for (int64_t j = 0; j < n; ++j) inv[j] = idx[se[j]];
  for (int64_t w = 0; w < W; ++w) {
    for (int64_t u = 0; u < U; ++u) supply[w * U + u] = in.load[w * E + ue[u]];
    for (int64_t j = 0; j < n; ++j) bonus[w * n + j] = in.bid[w * W + sr[j]];
  }
  const int64_t cap = in.has_cap ? in.auction_cap : W * U + n + 1;
  std::vector<int64_t> fin(in.L, in.L + W);
  for (int64_t j = 0; j < n; ++j) {
    fin[in.home[se[j]]] -= A[j];
    fin[sr[j]] += A[j];
  }
  out.worst = std::max<int64_t>(0, *std::max_element(fin.begin(), fin.end()));
  out.rounds = taot_auction(W, U, n, supply.data(), inv.data(), A.data(), bonus.data(), in.price_step, cap, X.data());
  for (int64_t w = 0; w < W; ++w)
    for (int64_t j = 0; j < n; ++j) rep[(w * W + sr[j]) * K + sk[j]] = X[w * n + j];
  return out;
}

}  // namespace ultracomm::planners
