// TAOT planner loops (see taot.cpp).
#pragma once
#include <cstdint>
#include <vector>

namespace ultracomm::planners {

// Phase 2 on the compacted problem: ne candidate experts x nr cold ranks.  sp_e: per-expert
// cap; grp / exc: each expert's group and the groups' shared caps (the home rank's excess);
// the spill of e is min(sp_e[e], exc[grp[e]]).  See column_first_matching in taot.py.
void taot_matching(int64_t ne, int64_t nr, int64_t* sp_e, const int64_t* grp, int64_t* exc, int64_t* sp_r,
                   const double* stat, const uint8_t* allowed, int64_t K, int64_t n_inner, int64_t min_gain,
                   bool mutual, bool two_pass, int64_t* g, int64_t* rnd);

int64_t taot_auction(int64_t R, int64_t U, int64_t S, int64_t* supply, const int64_t* inv, int64_t* A,
                     const double* bonus, double price_step, int64_t cap, int64_t* X);

// Refinement after phase 2: drop replicas whose tokens fit elsewhere (see
// consolidate_replicas in taot.py).  amt / left / room are updated, keep[n] written.
void taot_consolidate(int64_t n, const int64_t* home, const int64_t* rank, const int64_t* expert, const uint8_t* inter,
                      int64_t* amt, int64_t* left, int64_t* room, uint8_t* keep);

// The step after phase 2 (taot_finish.cpp): matches -> consolidation -> slots in round order
// -> auction -> plan.  g / rnd: taot_matching's [ne, nr] outputs on candidate experts ei and
// cold ranks ri; same: [W, W] 1 within a node; load: [W, E]; bid: [W, W] auction bonus.
struct TaotFinishIn {
  int64_t W, E, K, ne, nr;
  const int64_t *g, *rnd, *ei, *ri, *home, *el, *L;
  const uint8_t* same;
  const int64_t* load;
  const double* bid;
  int64_t tgt;
  bool consolidate;
  double price_step;
  bool has_cap;  // else the auction runs until every demand is met
  int64_t auction_cap;
};
struct TaotFinish {
  int64_t n_matches, consolidated, rounds, worst;  // consolidated: -1 when it did not run
};
// slot_src [W, K] (caller: -1), slot_quota [W, K] and rep [W, W, K] (caller: 0).
TaotFinish taot_finish(const TaotFinishIn& in, int32_t* slot_src, int64_t* slot_quota, int64_t* rep);

// Everything after phase 1 (taot_run.cpp): the compacted phase-2 inputs, taot_matching,
// taot_finish, and the plan's quotas.  excess / spare: [W] (hot ranks shed down to, cold
// ranks fill up to the target); flow: phase 1's [W, W]; Brr: [W, W] topology preference.
struct TaotRunIn {
  int64_t W, E, epr, K;
  const int64_t *load, *el, *L, *home, *excess, *spare;
  const double *flow, *Brr, *bid;
  const uint8_t* same;
  int64_t tgt, mg;
  double alpha;
  bool dynamic_spill, mutual, two_pass, consolidate;
  double price_step;
  bool has_cap;
  int64_t auction_cap;
};
struct TaotRun {
  TaotFinish fin;     // n_matches 0: no replica (the outputs are as the caller set them)
  int64_t instances;  // columns of quota
};
// slot_src / slot_quota / rep as taot_finish; quota: [E, instances] int64 (instance 0: home).
TaotRun taot_run(const TaotRunIn& in, int32_t* slot_src, int64_t* slot_quota, int64_t* rep,
                 std::vector<int64_t>& quota);

}  // namespace ultracomm::planners
