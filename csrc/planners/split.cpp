// Exact integer token split over expert instances, in per-slot form (port of
// ultracomm.planners.base.split_tokens, the numpy reference).
#include "split.h"

#include <algorithm>
#include <cstring>
#include <vector>

namespace ultracomm::planners {

void split_slots(int64_t W, int64_t E, int64_t I, int64_t WK, const int64_t* load, const int64_t* inst_rank,
                 const int64_t* quota, const int64_t* inst_slot, int64_t* rep) {
  // rep: [W(src), WK] tokens each source sends to each replica slot, written completely.
  std::memset(rep, 0, sizeof(int64_t) * static_cast<size_t>(W * WK));
  std::vector<int64_t> rem_ld(static_cast<size_t>(W));
  std::vector<int64_t> rem_q(static_cast<size_t>(I));
  for (int64_t e = 0; e < E; ++e) {
    const int64_t* q = quota + e * I;
    const int64_t* ir = inst_rank + e * I;
    const int64_t* sl = inst_slot + e * I;
    bool multi = false;
    for (int64_t i = 1; i < I; ++i) multi |= q[i] > 0;
    if (!multi) continue;  // every token goes home
    for (int64_t s = 0; s < W; ++s) rem_ld[s] = load[s * E + e];
    // locality first: a rank holding an instance sends its own tokens there
    for (int64_t i = 0; i < I; ++i) {
      rem_q[i] = q[i];
      const int64_t r = ir[i];
      if (r < 0) continue;
      const int64_t x = std::min(rem_ld[r], q[i]);
      if (i > 0) rep[r * WK + sl[i]] += x;
      rem_ld[r] -= x;
      rem_q[i] -= x;
    }
    // north-west corner on the remainders (sources in rank order, instances in order)
    int64_t s = 0, i = 0;
    while (s < W && i < I) {
      if (rem_ld[s] == 0) {
        ++s;
        continue;
      }
      if (rem_q[i] == 0) {
        ++i;
        continue;
      }
      const int64_t x = std::min(rem_ld[s], rem_q[i]);
      if (i > 0) rep[s * WK + sl[i]] += x;
      rem_ld[s] -= x;
      rem_q[i] -= x;
    }
  }
}

}  // namespace ultracomm::planners
