// DeepSeek EPLB's rebalance_experts within the fixed-home model (see
// python/ultracomm/planners/lpt.py): replica counts, balanced packing, min-max quotas.
#pragma once
#include <cstdint>
#include <vector>

namespace ultracomm::planners {

enum class LptCountRule { kEplb, kRank, kBest };  // kBest: both, the plan with the lower max

struct LptInput {
  int64_t world = 0, experts_per_rank = 0, slots = 0;
  int64_t min_tokens = 1;                // no replica that leaves an instance fewer tokens (even split)
  int64_t budget = 0;                    // replicas to hand out (world * slots at most)
  const int64_t* expert_load = nullptr;  // [world * experts_per_rank]
  const int64_t* group = nullptr;        // [world] node of each rank (hierarchical) or null
  // replica counts: EPLB's rule, the fixed-home (rank) rule, or the better plan of both
  LptCountRule count_rule = LptCountRule::kBest;
};

struct LptResult {
  std::vector<int64_t> slot_src, slot_quota;  // [world * slots]; -1 / 0 where empty
  int64_t replicas = 0, dropped = 0, idle = 0, max_load = 0;
};

LptResult lpt_plan(const LptInput& in);

}  // namespace ultracomm::planners
