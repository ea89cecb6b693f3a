// TAOT phase 2 (column-first matching, with the refinements documented in taot.py) and
// phase 3 (Lagrangian auction) loops.
// Exact ports of the numpy reference implementations in
// python/ultracomm/planners/taot.py (same floating-point expressions, same
// tie-breaks), so both backends give identical integer outputs.
#include "taot.h"

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <stdexcept>
#include <vector>

namespace ultracomm::planners {

namespace {
constexpr double kNeg = -std::numeric_limits<double>::infinity();
}

void taot_matching(int64_t ne, int64_t nr, int64_t* sp_e, const int64_t* grp, int64_t* exc, int64_t* sp_r,
                   const double* stat, const uint8_t* allowed, int64_t K, int64_t n_inner, int64_t min_gain,
                   bool mutual, bool two_pass, int64_t* g, int64_t* rnd) {
  const int64_t mg = std::max<int64_t>(min_gain, 1);
  std::vector<uint8_t> lvl(allowed, allowed + ne * nr);
  std::vector<uint8_t> matched(static_cast<size_t>(nr));
  std::vector<int64_t> slots(static_cast<size_t>(nr), K);
  std::vector<int64_t> spill(static_cast<size_t>(ne));
  // each rank's proposal (best expert, its score) and the version of that expert's row it
  // was computed on: scores only fall within a round (spills, spares and allowances only
  // shrink), so while that row is unchanged no other expert can overtake it (nor tie it
  // with a lower id: it would have won the scan) and the proposal stands
  std::vector<int64_t> best_e(static_cast<size_t>(nr));
  std::vector<double> best_s(static_cast<size_t>(nr));
  std::vector<int64_t> best_v(static_cast<size_t>(nr));
  std::vector<int64_t> ver(static_cast<size_t>(ne), 0);  // bumped when a row's scores change
  std::vector<int64_t> eb_r(static_cast<size_t>(ne));    // each proposed expert's best rank
  std::vector<uint8_t> eb_ok(static_cast<size_t>(ne), 0);
  std::vector<double> win_s(static_cast<size_t>(ne));
  std::vector<int64_t> win_r(static_cast<size_t>(ne));
  std::vector<int64_t> winners, act_r, act_e, a_sp(static_cast<size_t>(nr)), proposed;
  // experts of each group (they share the group's cap)
  int64_t ng = 0;
  for (int64_t e = 0; e < ne; ++e) ng = std::max(ng, grp[e] + 1);
  std::vector<int64_t> gstart(static_cast<size_t>(ng + 1), 0), gmem(static_cast<size_t>(ne));
  for (int64_t e = 0; e < ne; ++e) ++gstart[grp[e] + 1];
  for (int64_t q = 0; q < ng; ++q) gstart[q + 1] += gstart[q];
  {
    std::vector<int64_t> pos(gstart.begin(), gstart.end() - 1);
    for (int64_t e = 0; e < ne; ++e) gmem[pos[grp[e]]++] = e;
  }
  winners.reserve(static_cast<size_t>(ne));
  act_r.reserve(static_cast<size_t>(nr));
  act_e.reserve(static_cast<size_t>(ne));
  const int64_t passes = two_pass ? 2 : 1;
  for (int64_t pass = 0; pass < passes; ++pass) {
    const uint8_t need = (two_pass && pass == 0) ? 2 : 1;
    for (int64_t k = 0; k < K; ++k) {
      for (int64_t r = 0; r < nr; ++r) {
        matched[r] = slots[r] <= 0;
        best_v[r] = -1;  // a new round: every proposal is scanned afresh
      }
      for (int64_t it = 0; it < n_inner; ++it) {
        act_r.clear();
        for (int64_t r = 0; r < nr; ++r)
          if (!matched[r] && sp_r[r] >= mg) act_r.push_back(r);
        act_e.clear();
        for (int64_t e = 0; e < ne; ++e) {
          spill[e] = std::min(sp_e[e], exc[grp[e]]);
          if (spill[e] >= mg) act_e.push_back(e);
        }
        if (act_r.empty() || act_e.empty()) break;
        const int64_t na = static_cast<int64_t>(act_r.size());
        for (int64_t j = 0; j < na; ++j) a_sp[j] = sp_r[act_r[j]];
        // proposals: rescan the ranks whose best expert's row changed
        for (int64_t j = 0; j < na; ++j) {
          const int64_t r = act_r[j];
          if (best_v[r] >= 0 && (best_e[r] < 0 || ver[best_e[r]] == best_v[r])) continue;
          double bs = kNeg;
          int64_t be = -1;
          for (const int64_t e : act_e) {
            const int64_t i = e * nr + r;
            if (lvl[i] < need) continue;
            const int64_t gain = std::min(spill[e], a_sp[j]);
            if (gain < mg) continue;
            const double s = static_cast<double>(gain) + stat[i];
            if (s > bs) {  // experts ascend: ties keep the lowest expert id
              bs = s;
              be = e;
            }
          }
          best_e[r] = be;
          best_s[r] = bs;
          best_v[r] = be < 0 ? 0 : ver[be];
        }
        for (const int64_t r : act_r)
          if (best_e[r] < 0) matched[r] = 1;  // no candidate left this round
        // each proposed expert's best rank (mutual acceptance)
        proposed.clear();
        if (mutual)
          for (const int64_t r : act_r) {
            const int64_t e = best_e[r];
            if (e < 0 || eb_ok[e]) continue;
            eb_ok[e] = 1;
            proposed.push_back(e);
            const int64_t se = spill[e];
            const uint8_t* lv = lvl.data() + e * nr;
            const double* st = stat + e * nr;
            double ebs = kNeg;
            int64_t ebr = -1;
            for (int64_t j = 0; j < na; ++j) {
              const int64_t q = act_r[j];
              if (lv[q] < need) continue;
              const int64_t gain = std::min(se, a_sp[j]);
              if (gain < mg) continue;
              const double s = static_cast<double>(gain) + st[q];
              if (s > ebs) {  // ranks ascend: ties keep the lowest rank
                ebs = s;
                ebr = q;
              }
            }
            eb_r[e] = ebr;
          }
        for (const int64_t e : proposed) eb_ok[e] = 0;
        std::fill(win_r.begin(), win_r.end(), -1);
        winners.clear();
        for (const int64_t r : act_r) {
          const int64_t e = best_e[r];
          if (e < 0) continue;
          if (mutual && eb_r[e] != r) continue;
          if (win_r[e] < 0) {
            winners.push_back(e);
            win_r[e] = r;
            win_s[e] = best_s[r];
          } else if (best_s[r] > win_s[e]) {
            win_r[e] = r;
            win_s[e] = best_s[r];
          }
        }
        if (winners.empty()) break;
        std::sort(winners.begin(), winners.end(), [&](int64_t a, int64_t b) {
          if (win_s[a] != win_s[b]) return win_s[a] > win_s[b];
          return a < b;
        });
        for (const int64_t e : winners) {
          const int64_t r = win_r[e];
          const int64_t amt = std::min(std::min(sp_e[e], exc[grp[e]]), sp_r[r]);
          if (amt < mg) continue;
          const int64_t i = e * nr + r;
          g[i] = amt;
          rnd[i] = pass * K + k;
          sp_e[e] -= amt;
          exc[grp[e]] -= amt;
          sp_r[r] -= amt;
          lvl[i] = 0;
          matched[r] = 1;
          --slots[r];
          for (int64_t m = gstart[grp[e]]; m < gstart[grp[e] + 1]; ++m) ++ver[gmem[m]];
        }
      }
    }
  }
}

int64_t taot_auction(int64_t R, int64_t U, int64_t S, int64_t* supply, const int64_t* inv, int64_t* A,
                     const double* bonus, double price_step, int64_t cap, int64_t* X) {
  // supply: [R, U] (modified); inv: [S] distinct-expert index of each slot; A: [S] demand
  // (modified); bonus: [R, S]; X: [R, S] (caller-zeroed).
  std::vector<int64_t> cnt(static_cast<size_t>(R), 0);
  std::vector<int64_t> served(static_cast<size_t>(R), 0);
  std::vector<double> price(static_cast<size_t>(R), 0.0);
  // transposed copies so the per-slot scan over ranks is contiguous
  std::vector<int64_t> supT(static_cast<size_t>(U * R));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t u = 0; u < U; ++u) supT[u * R + r] = supply[r * U + u];
  std::vector<double> bT(static_cast<size_t>(S * R));
  for (int64_t r = 0; r < R; ++r)
    for (int64_t s = 0; s < S; ++s) bT[s * R + r] = bonus[r * S + s];
  struct Pick {
    int64_t r;
    double b;
    int64_t s;
  };
  std::vector<Pick> picks, order(static_cast<size_t>(S));
  picks.reserve(static_cast<size_t>(S));
  std::vector<int64_t> head(static_cast<size_t>(R + 1));
  // Blocks of kBlock consecutive ranks (a node at 8 ranks per node).  Per slot, the blocks
  // in order of the slot's largest bonus in each (top); per expert and block, a bit mask of
  // the ranks still holding the expert's tokens.  A slot skips a block when its top less the
  // block's lowest price is below the best bid so far, and a rank when its top less the
  // rank's price is: no rank skipped can reach the best bid, nor tie it, so the pick is the
  // argmax of a scan of every rank (ties: lowest rank).  Once a block's top less the lowest
  // price of all is below the best bid, so are the later blocks'.  Prices (= price_step x
  // slots served) must not be negative: price_step >= 0.
  constexpr int64_t kBlock = 8;
  const bool by_price = price_step >= 0;
  const int64_t nb = (R + kBlock - 1) / kBlock;
  std::vector<double> bnd(static_cast<size_t>(S * nb), kNeg);  // slot's top bonus per block
  std::vector<int64_t> bord(static_cast<size_t>(S * nb));      // slot's blocks, top bonus first
  std::vector<uint8_t> has(static_cast<size_t>(U * nb), 0);    // ranks of the block with supply
  std::vector<double> bmin(static_cast<size_t>(nb), 0.0);      // lowest price in the block
  for (int64_t s = 0; s < S; ++s) {
    double* bs = bnd.data() + s * nb;
    for (int64_t r = 0; r < R; ++r) bs[r / kBlock] = std::max(bs[r / kBlock], bT[s * R + r]);
    int64_t* bo = bord.data() + s * nb;
    std::iota(bo, bo + nb, 0);
    std::stable_sort(bo, bo + nb, [&](int64_t a, int64_t b) { return bs[a] > bs[b]; });
  }
  for (int64_t u = 0; u < U; ++u)
    for (int64_t r = 0; r < R; ++r)
      if (supT[u * R + r] > 0) has[u * nb + r / kBlock] |= static_cast<uint8_t>(1u << (r % kBlock));
  double pmin = 0.0;  // the lowest price
  int64_t rounds = 0;
  while (rounds < cap) {
    picks.clear();
    bool active = false;
    for (int64_t s = 0; s < S; ++s) {
      if (A[s] <= 0) continue;
      active = true;
      const int64_t u = inv[s];
      int64_t br = -1;
      double bs = kNeg;
      const int64_t* sp = supT.data() + u * R;
      const double* bb = bT.data() + s * R;
      if (by_price) {
        const int64_t* bo = bord.data() + s * nb;
        const double* tops = bnd.data() + s * nb;
        const uint8_t* hu = has.data() + u * nb;
        for (int64_t i = 0; i < nb; ++i) {
          const int64_t blk = bo[i];
          const double top = tops[blk];
          if (top - pmin < bs) break;  // nor can any later block
          if (top - bmin[blk] < bs) continue;
          for (unsigned m = hu[blk]; m != 0; m &= m - 1) {
            const int64_t r = blk * kBlock + __builtin_ctz(m);
            if (top - price[r] < bs) continue;
            const double sc = bb[r] - price[r];
            if (sc > bs || (sc == bs && r < br)) {  // ties: lowest rank
              bs = sc;
              br = r;
            }
          }
        }
      } else {
        for (int64_t r = 0; r < R; ++r) {
          const double sc = sp[r] > 0 ? bb[r] - price[r] : kNeg;
          if (sc > bs) {  // first maximum: lowest rank on ties
            bs = sc;
            br = r;
          }
        }
      }
      if (br < 0) throw std::invalid_argument("auction demand exceeds the tokens of its expert");
      picks.push_back({br, bs, s});
    }
    if (!active) break;
    // every picked rank serves all slots that picked it: best net bonus, then lowest
    // slot.  Bucket the picks by rank (counting sort; slots ascend within a bucket),
    // then insertion-sort each (small) bucket by net bonus.
    std::fill(head.begin(), head.end(), 0);
    for (const Pick& p : picks) ++head[p.r + 1];
    for (int64_t r = 0; r < R; ++r) head[r + 1] += head[r];
    for (const Pick& p : picks) order[head[p.r]++] = p;  // head[r] -> end of bucket r
    int64_t lo = 0;
    for (int64_t r = 0; r < R; ++r) {
      const int64_t hi = head[r];
      for (int64_t a = lo + 1; a < hi; ++a) {
        const Pick x = order[a];
        int64_t b = a - 1;
        while (b >= lo && order[b].b < x.b) {  // stable: equal bonus keeps slot order
          order[b + 1] = order[b];
          --b;
        }
        order[b + 1] = x;
      }
      for (int64_t a = lo; a < hi; ++a) {
        const Pick& p = order[a];
        int64_t& sup = supT[inv[p.s] * R + p.r];
        const int64_t x = std::min(sup, A[p.s]);
        if (x <= 0) continue;
        X[p.r * S + p.s] += x;
        sup -= x;
        A[p.s] -= x;
        ++served[p.r];
        if (sup == 0)  // the rank no longer holds the expert's tokens
          has[inv[p.s] * nb + p.r / kBlock] &= static_cast<uint8_t>(~(1u << (p.r % kBlock)));
      }
      lo = hi;
    }
    for (int64_t r = 0; r < R; ++r) {
      if (served[r]) {
        cnt[r] += served[r];
        price[r] = price_step * static_cast<double>(cnt[r]);
      }
      served[r] = 0;
    }
    pmin = price[0];
    for (int64_t blk = 0; blk < nb; ++blk) {
      const int64_t lo = blk * kBlock, hi = std::min(R, lo + kBlock);
      bmin[blk] = *std::min_element(price.begin() + lo, price.begin() + hi);
      pmin = std::min(pmin, bmin[blk]);
    }
    ++rounds;
  }
  // cap reached: fill the rest in rank order (still exact)
  for (int64_t s = 0; s < S; ++s) {
    const int64_t u = inv[s];
    for (int64_t r = 0; r < R && A[s] > 0; ++r) {
      const int64_t x = std::min(supT[u * R + r], A[s]);
      X[r * S + s] += x;
      supT[u * R + r] -= x;
      A[s] -= x;
    }
  }
  for (int64_t r = 0; r < R; ++r)
    for (int64_t u = 0; u < U; ++u) supply[r * U + u] = supT[u * R + r];
  return rounds;
}

void taot_consolidate(int64_t n, const int64_t* home, const int64_t* rank, const int64_t* expert, const uint8_t* inter,
                      int64_t* amt, int64_t* left, int64_t* room, uint8_t* keep) {
  // Exact port of consolidate_replicas (taot.py): replicas inter-node first, then smallest,
  // then index; a replica is dropped when its tokens fit into the other kept replicas of its
  // home's experts (in index order) and then the home's own room.
  std::vector<int64_t> order(static_cast<size_t>(n));
  std::iota(order.begin(), order.end(), 0);
  std::vector<int64_t> a0(amt, amt + n);
  std::sort(order.begin(), order.end(), [&](int64_t x, int64_t y) {
    if (inter[x] != inter[y]) return inter[x] > inter[y];
    if (a0[x] != a0[y]) return a0[x] < a0[y];
    return x < y;
  });
  for (int64_t q = 0; q < n; ++q) keep[q] = 1;
  std::vector<int64_t> others, caps;
  for (const int64_t p : order) {
    const int64_t h = home[p], a = amt[p], e = expert[p];
    others.clear();
    caps.clear();
    int64_t cap = room[h];
    for (int64_t q = 0; q < n; ++q) {
      if (q == p || !keep[q] || home[q] != h) continue;
      const int64_t c = std::min(room[rank[q]], left[expert[q]] + (expert[q] == e ? a : 0));
      others.push_back(q);
      caps.push_back(c);
      cap += c;
    }
    if (cap < a) continue;
    keep[p] = 0;
    left[e] += a;
    room[rank[p]] += a;
    int64_t rest = a;
    for (size_t j = 0; j < others.size() && rest > 0; ++j) {
      const int64_t q = others[j], eq = expert[q], rq = rank[q];
      const int64_t x = std::min(std::min(caps[j], rest), std::min(room[rq], left[eq]));
      if (x <= 0) continue;
      amt[q] += x;
      left[eq] -= x;
      room[rq] -= x;
      rest -= x;
    }
    room[h] -= rest;
    amt[p] = 0;
  }
}

}  // namespace ultracomm::planners
