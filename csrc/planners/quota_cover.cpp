// Cover search (see quota_cover.h).
//
// Hot ranks are taken largest need first.  For each, the search picks receivers in
// decreasing spare (a combination: indices increase, so each set is tried once; receivers
// of equal spare and slots are interchangeable and tried once per level) and, for each,
// one of the hot rank's experts (largest remaining cap first, equal caps once), until the
// need is covered.  A piece takes min(receiver's spare, need left, expert's cap); a
// receiver whose slots run out wastes the spare it has left.  Every cover wastes at most
// slack = total spare - total need, so a branch that wastes more is cut -- the pruning
// that makes tight instances (receivers filled exactly) tractable.
//
// Completeness with one slot per receiver: each receiver then serves one expert of one
// hot rank, and a hot rank sheds min(need, sum over its experts of min(cap, spare of its
// receivers)); taking each piece as large as it can be loses nothing, and of any cover the
// shortest prefix (in the search's receiver order) that covers is tried, leaving the rest
// of its receivers free for others.  So exhausting the search proves that no placement
// meets the threshold.  With more slots a receiver's spare is split between hot ranks at
// the search's choice (a partial piece only at a hot rank's last receiver), which is not
// every split: the search is a heuristic there and never refutes.
#include "quota_cover.h"

#include <algorithm>

namespace ultracomm::planners {

namespace {

class Cover {
 public:
  Cover(const CoverProblem& p, int64_t& budget, const std::function<bool(const std::vector<CoverPiece>&)>& accept,
        std::vector<CoverPiece>& pieces)
      : p_(p),
        budget_(budget),
        accept_(accept),
        pieces_(pieces),
        spare_(p.spare),
        slots_(p.slots),
        cap_(p.cap),
        mt_(std::max<int64_t>(p.min_tokens, 1)) {
    int64_t total_need = 0, total_spare = 0;
    for (int64_t n : p.need) total_need += std::max<int64_t>(n, 0);
    for (size_t j = 0; j < spare_.size(); ++j) {
      if (slots_[j] > 0 && spare_[j] >= mt_) {
        total_spare += spare_[j];
      } else {
        spare_[j] = 0;  // cannot take a piece
      }
    }
    slack_ = total_spare - total_need;
    for (size_t h = 0; h < p.need.size(); ++h) order_.push_back(static_cast<int>(h));
    std::stable_sort(order_.begin(), order_.end(), [&](int a, int b) { return p.need[a] > p.need[b]; });
    cand_.resize(order_.size());
    suffix_.resize(order_.size());
  }

  CoverOutcome run() {
    pieces_.clear();
    if (slack_ < 0) return CoverOutcome::kRefuted;
    const int r = hot(0);
    if (r > 0) return CoverOutcome::kFound;
    return r < 0 ? CoverOutcome::kOutOfBudget : CoverOutcome::kRefuted;
  }

 private:
  // 1: covered (and accepted), 0: no cover below this node, -1: out of budget.
  int hot(size_t pos) {
    if (pos == order_.size()) return accept_(pieces_) ? 1 : 0;
    const int h = order_[pos];
    if (p_.need[h] <= 0) return hot(pos + 1);
    std::vector<int>& c = cand_[pos];
    c.clear();
    for (int j = 0; j < static_cast<int>(spare_.size()); ++j)
      if (slots_[j] > 0 && spare_[j] >= mt_ && p_.recv_group[j] == p_.hot_group[h]) c.push_back(j);
    std::sort(c.begin(), c.end(), [&](int a, int b) {
      if (spare_[a] != spare_[b]) return spare_[a] > spare_[b];
      if (slots_[a] != slots_[b]) return slots_[a] > slots_[b];
      return a < b;
    });
    std::vector<int64_t>& suf = suffix_[pos];
    suf.assign(c.size() + 1, 0);
    for (size_t i = c.size(); i-- > 0;) suf[i] = suf[i + 1] + spare_[c[i]];
    return piece(pos, 0, p_.need[h]);
  }

  bool same(const std::vector<int>& c, size_t i) const {
    return spare_[c[i]] == spare_[c[i - 1]] && slots_[c[i]] == slots_[c[i - 1]];
  }

  // Pieces for hot rank order_[pos] from candidates start.. (need_left > 0 tokens left).
  int piece(size_t pos, size_t start, int64_t need_left) {
    const int h = order_[pos];
    const std::vector<int>& c = cand_[pos];
    if (suffix_[pos][start] < need_left) return 0;
    int64_t caps = 0;
    std::vector<int> exps;
    for (int x : p_.hot_experts[h])
      if (cap_[x] >= mt_) {
        caps += cap_[x];
        exps.push_back(x);
      }
    if (caps < need_left) return 0;
    std::stable_sort(exps.begin(), exps.end(), [&](int a, int b) { return cap_[a] > cap_[b]; });
    // receivers that complete the need alone, tightest first, then the others, largest first
    const size_t p = static_cast<size_t>(std::partition_point(c.begin() + static_cast<std::ptrdiff_t>(start), c.end(),
                                                              [&](int j) { return spare_[j] >= need_left; }) -
                                         c.begin());
    for (size_t step = 0; step < c.size() - start; ++step) {
      const size_t i = step < p - start ? p - 1 - step : start + step;  // p-1 .. start, p ..
      if (i > start && same(c, i)) continue;                            // an equal receiver is tried at i - 1
      const int j = c[i];
      // one slot left and the largest expert covers the need: the spare beyond the need is
      // lost whatever the expert, so a receiver too large for the slack is cut unexplored
      if (slots_[j] == 1 && cap_[exps[0]] >= need_left && spare_[j] - need_left > slack_ - waste_) continue;
      for (size_t k = 0; k < exps.size(); ++k) {
        const int x = exps[k];
        if (k > 0 && cap_[x] == cap_[exps[k - 1]]) continue;
        if (--budget_ < 0) return -1;
        const int64_t a = std::min({spare_[j], need_left, cap_[x]});
        spare_[j] -= a;
        slots_[j] -= 1;
        cap_[x] -= a;
        const int64_t lost = (slots_[j] == 0 || spare_[j] < mt_) ? spare_[j] : 0;
        waste_ += lost;
        int r = 0;
        if (waste_ <= slack_) {
          pieces_.push_back({x, j, a});
          r = need_left - a <= 0 ? hot(pos + 1) : piece(pos, i + 1, need_left - a);
          if (r == 0) pieces_.pop_back();
        }
        waste_ -= lost;
        cap_[x] += a;
        slots_[j] += 1;
        spare_[j] += a;
        if (r != 0) return r;
      }
    }
    return 0;
  }

  const CoverProblem& p_;
  int64_t& budget_;
  const std::function<bool(const std::vector<CoverPiece>&)>& accept_;
  std::vector<CoverPiece>& pieces_;
  std::vector<int64_t> spare_, slots_, cap_;
  const int64_t mt_;
  int64_t slack_ = 0, waste_ = 0;
  std::vector<int> order_;
  std::vector<std::vector<int>> cand_;
  std::vector<std::vector<int64_t>> suffix_;
};

}  // namespace

CoverOutcome cover_search(const CoverProblem& p, int64_t& budget,
                          const std::function<bool(const std::vector<CoverPiece>&)>& accept,
                          std::vector<CoverPiece>& pieces) {
  Cover c(p, budget, accept, pieces);
  const CoverOutcome out = c.run();
  budget = std::max<int64_t>(budget, 0);
  return out;
}

bool cover_local(const CoverProblem& p, int64_t& budget,
                 const std::function<bool(const std::vector<CoverPiece>&)>& accept, std::vector<CoverPiece>& pieces) {
  // State: the expert each receiver holds (-1: none).  A hot rank sheds
  // sum over its experts of min(cap, spare of the receivers holding it); `gap` is what it
  // still misses.  Only a move that adds spare to an expert of a short hot rank with room
  // left can lower the total, so only those are scanned.
  const int64_t mt = std::max<int64_t>(p.min_tokens, 1);
  const int H = static_cast<int>(p.need.size()), X = static_cast<int>(p.cap.size());
  std::vector<int> hot_of(static_cast<size_t>(X), -1);
  for (int h = 0; h < H; ++h)
    for (int x : p.hot_experts[h]) hot_of[x] = h;
  std::vector<int> recv;  // usable receivers, largest spare first
  for (int j = 0; j < static_cast<int>(p.spare.size()); ++j)
    if (p.slots[j] > 0 && p.spare[j] >= mt) recv.push_back(j);
  std::stable_sort(recv.begin(), recv.end(), [&](int a, int b) { return p.spare[a] > p.spare[b]; });
  const int R = static_cast<int>(recv.size());
  std::vector<int> at(static_cast<size_t>(R), -1);
  std::vector<int64_t> got(static_cast<size_t>(X), 0), shed(static_cast<size_t>(H), 0);
  auto sp = [&](int i) { return p.spare[recv[i]]; };
  auto gap = [&](int h, int64_t c) { return h < 0 ? 0 : std::max<int64_t>(p.need[h] - c, 0); };
  auto eff = [&](int x, int64_t g) { return std::min(g, p.cap[x]); };
  // change of the total gap when expert x's receivers' spare changes by d
  auto delta = [&](int x, int64_t d) {
    if (x < 0) return int64_t{0};
    const int h = hot_of[x];
    return gap(h, shed[h] + eff(x, got[x] + d) - eff(x, got[x])) - gap(h, shed[h]);
  };
  std::vector<std::vector<int>> members(static_cast<size_t>(X));  // receivers holding x
  auto set = [&](int i, int x) {
    if (at[i] >= 0) {
      const int y = at[i];
      members[y].erase(std::find(members[y].begin(), members[y].end(), i));
      shed[hot_of[y]] += eff(y, got[y] - sp(i)) - eff(y, got[y]);
      got[y] -= sp(i);
    }
    at[i] = x;
    if (x >= 0) {
      members[x].push_back(i);
      shed[hot_of[x]] += eff(x, got[x] + sp(i)) - eff(x, got[x]);
      got[x] += sp(i);
    }
  };
  auto group_ok = [&](int i, int x) { return x < 0 || p.recv_group[recv[i]] == p.hot_group[hot_of[x]]; };
  for (int i = 0; i < R; ++i) {  // start: each to the expert whose hot rank gains the most
    int best = -1;
    int64_t bd = 0;
    for (int x = 0; x < X; ++x)
      if (group_ok(i, x)) {
        const int64_t d = delta(x, sp(i));
        if (d < bd) bd = d, best = x;
      }
    set(i, best);
  }
  uint64_t rng = 0x9E3779B97F4A7C15ull;
  auto next = [&](uint64_t n) {  // xorshift64*
    rng ^= rng >> 12;
    rng ^= rng << 25;
    rng ^= rng >> 27;
    return (rng * 0x2545F4914F6CDD1Dull) % n;
  };
  std::vector<int> short_x;
  std::vector<int64_t> tabu_until(static_cast<size_t>(R), 0);
  std::vector<int64_t> out_d(static_cast<size_t>(R)), spv(static_cast<size_t>(R)), rgrp(static_cast<size_t>(R));
  std::vector<int> hot_at(static_cast<size_t>(R));  // hot rank of each receiver's expert
  for (int j = 0; j < R; ++j) spv[j] = sp(j), rgrp[j] = p.recv_group[recv[j]];
  int64_t iter = 0;
  constexpr int64_t kFlowInfLocal = int64_t{1} << 62;
  while (budget > 0 && R > 0) {
    int64_t D = 0;
    for (int h = 0; h < H; ++h) D += gap(h, shed[h]);
    if (D == 0) {  // covered: pieces in receiver order, the flow decides
      std::vector<int64_t> left(p.need), cap(p.cap);
      pieces.clear();
      for (int i = 0; i < R; ++i) {
        const int x = at[i];
        if (x < 0) continue;
        const int64_t a = std::min({sp(i), left[hot_of[x]], cap[x]});
        if (a < mt) continue;
        pieces.push_back({x, recv[i], a});
        left[hot_of[x]] -= a;
        cap[x] -= a;
      }
      if (accept(pieces)) return true;
    }
    short_x.clear();
    for (int x = 0; x < X; ++x)
      if (got[x] < p.cap[x] && gap(hot_of[x], shed[hot_of[x]]) > 0) short_x.push_back(x);
    // tabu search: the best move or swap that brings spare to an expert with room of a short
    // hot rank, even a worsening one, never moving a receiver moved in the last few steps
    // (unless it covers everything)
    ++iter;
    int64_t best = kFlowInfLocal;
    int bi = -1, bj = -1, bx = -1;
    auto consider = [&](int64_t d, int i, int j, int x) {
      const bool tabu = tabu_until[i] > iter || (j >= 0 && tabu_until[j] > iter);
      if ((tabu && D + d > 0) || d > best || (d == best && next(2))) return;
      best = d, bi = i, bj = j, bx = x;
    };
    // what each receiver's leaving its expert changes (the same for every x), and per x
    // the terms of delta(x, t) that do not depend on t: the scan is most of the time
    for (int j = 0; j < R; ++j) {
      out_d[j] = delta(at[j], -sp(j));
      hot_at[j] = at[j] < 0 ? -1 : hot_of[at[j]];
    }
    for (int x : short_x) {
      const int hx = hot_of[x];
      const int64_t gx = got[x], cx = p.cap[x], sh = shed[hx] - std::min(gx, cx);
      const int64_t gap0 = gap(hx, shed[hx]), grp = p.hot_group[hx];
      auto into_x = [&](int64_t d) { return gap(hx, sh + std::min(gx + d, cx)) - gap0; };
      // into_x only falls as d grows: no move into x does better than lb; a move that
      // cannot reach the best so far is skipped (consider would reject it unchanged)
      const int64_t lb = gap(hx, sh + cx) - gap0;
      for (int j = 0; j < R; ++j) {                       // j moves to x, or swaps with a smaller i at x
        if (hot_at[j] == hx || rgrp[j] != grp) continue;  // (j at x: the same hot rank)
        const int y = at[j];
        const int64_t t = spv[j];
        if (out_d[j] + lb <= best) consider(out_d[j] + into_x(t), j, -1, x);
        if (lb > best) continue;  // a swap adds delta(y, < 0) >= 0 to into_x >= lb
        for (int i : members[x]) {
          if (spv[i] >= t || !group_ok(i, y)) continue;
          consider(into_x(t - spv[i]) + delta(y, spv[i] - t), i, j, -1);
        }
      }
      budget -= R;
    }
    if (bi < 0) {  // every move is tabu: forget them (none at all: give up)
      if (std::all_of(tabu_until.begin(), tabu_until.end(), [&](int64_t u) { return u <= iter; })) break;
      std::fill(tabu_until.begin(), tabu_until.end(), 0);
      continue;
    }
    const int tenure = 3 + static_cast<int>(next(8));
    tabu_until[bi] = iter + tenure;
    if (bj < 0) {
      set(bi, bx);
    } else {
      tabu_until[bj] = iter + tenure;
      const int x = at[bi], y = at[bj];
      set(bi, y);
      set(bj, x);
    }
  }
  budget = std::max<int64_t>(budget, 0);
  return false;
}

}  // namespace ultracomm::planners
