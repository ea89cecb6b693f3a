// UltraEP quota planner: threshold search with a flow-based feasibility test
// (see python/ultracomm/planners/quota.py for the algorithm and its limits).
#pragma once
#include <cstdint>
#include <vector>

namespace ultracomm::planners {

struct QuotaInput {
  int64_t world = 0, experts_per_rank = 0, slots = 0;
  int64_t min_tokens = 1;                // smallest replica quota; a rank may end min_tokens - 1 above T
  int64_t tol = 1;                       // the search stops once its bracket is within tol tokens
  int64_t budget = 0;                    // search steps (replica additions) beyond the greedy, per search
  int64_t cover_budget = 0;              // cover-search piece placements (quota_cover.h), per search
  const int64_t* rank_load = nullptr;    // [world] tokens homed on each rank
  const int64_t* expert_load = nullptr;  // [world * experts_per_rank]
  const int64_t* order = nullptr;        // [world * experts_per_rank] hottest first per rank
  const int64_t* node = nullptr;         // [world] node of each rank; null: no restriction
};

struct QuotaReplica {
  int64_t expert, rank, tokens;
};

struct QuotaResult {
  int64_t threshold = 0;          // the T met (every rank <= T + min_tokens - 1)
  int64_t probes = 0;             // feasibility tests run
  int64_t steps = 0;              // edge additions over all probes (greedy and search)
  int64_t pruned = 0;             // probes refused by the necessary conditions alone
  int64_t searched = 0;           // probes the greedy failed and the bounded search ran on
  int64_t rescued = 0;            // of those, probes the search turned feasible
  int64_t budget_left = 0;        // search steps not spent (probes share one budget)
  int64_t covered = 0;            // probes the greedy failed and the cover search ran on
  int64_t cover_met = 0;          // of those, probes it met
  int64_t refuted = 0;            // of those, probes it proved infeasible (one slot, min_tokens 1)
  int64_t cover_budget_left = 0;  // cover-search placements not spent
  std::vector<QuotaReplica> replicas;
};

// One feasibility test at threshold T; true and `out` filled when a plan was found.  The
// bounded search spends at most stats.budget_left steps and leaves the rest there.
bool quota_feasible(const QuotaInput& in, int64_t T, std::vector<QuotaReplica>& out, QuotaResult& stats);

// Gallop up from ceil(mean) in steps of tol, then bisect; the plan of the smallest feasible
// T found.
QuotaResult quota_search(const QuotaInput& in);

}  // namespace ultracomm::planners
