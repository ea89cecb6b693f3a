// Min-max token quotas on a fixed replica placement (used by the lpt planner).
#pragma once
#include <cstdint>

namespace ultracomm::planners {

// n experts with several instances: el[n] tokens each; off[n + 1] / inst[off[n]]: the
// ranks of each expert's instances (CSR, home first); base[W]: tokens every rank computes
// anyway (experts with one instance).  Writes quota[off[n]] (tokens per instance, summing
// to el per expert) so that the most loaded rank is as light as any split allows, and
// returns that load.  Ties of the flow go to the earlier instance (the home).
int64_t balance_quotas(int64_t W, int64_t n, const int64_t* el, const int64_t* off, const int64_t* inst,
                       const int64_t* base, int64_t* quota);

}  // namespace ultracomm::planners
