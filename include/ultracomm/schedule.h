// Schedule builder: ReplicaPlan + expert byte sizes + domain topology + config -> per-rank
// task lists for multicast (weights) and reduction (grads).  Pure function of its inputs:
// the same inputs give a byte-identical Schedule on every rank.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "ultracomm/task.h"

namespace ultracomm {

struct BuildInput {
  int32_t world = 0;
  int32_t slots_per_rank = 0;
  int32_t num_experts = 0;
  std::vector<int32_t> slot_src;  // [world * slots_per_rank], logical expert or -1
  std::vector<int32_t> home_of;   // [num_experts]
  std::vector<int32_t> node_of;   // [world]; all zeros for one node
  uint64_t weight_bytes = 0;      // one expert's weights, slot layout
  uint64_t grad_bytes = 0;        // one expert's grads, slot layout
  uint64_t chunk_bytes = 1 << 20; // multiple of 16
  RelayMode relay_mode = RelayMode::kAuto;
  int32_t max_depth = 4;          // max tree depth (1 = direct)
  double intra_bw = 370e9;        // bytes/s per rank per direction within a node
  double inter_bw = 50e9;         // bytes/s per rank per direction across nodes
};

// Per operation: the tree (parent of every replica slot) and per-rank task lists.
struct OpSchedule {
  // parent of replica slot (r, s) in the tree, flattened [world * slots]:
  // the rank it receives from (multicast) / sends its (partial) grad to (reduce); -1 for empty slots.
  std::vector<int32_t> parent_rank;
  std::vector<int32_t> parent_slot;  // kMaster when the parent is the home's master
  std::vector<int32_t> depth;        // depth of the slot in its expert's tree (1 = child of home); 0 empty
  std::vector<std::vector<Task>> tasks;  // [world]
  std::vector<std::vector<Ref>> refs;    // [world]
  // stats
  std::vector<uint64_t> egress;   // [world] bytes sent (multicast) / read from it by peers (reduce)
  std::vector<uint64_t> ingress;  // [world] bytes received / pulled
  std::vector<uint64_t> inter_egress, inter_ingress;  // [world] the cross-node part of the above
  int32_t max_depth = 0;
  uint64_t lower_bound_bytes = 0;  // max(max ingress, max must-send-once, ceil(total / world))
  double lower_bound_s = 0;        // lower bound with the tier bandwidths
  double predicted_s = 0;          // max link time + depth * chunk time
  bool relayed = false;            // true when any expert uses a relay
};

struct Schedule {
  BuildInput input;
  OpSchedule multicast;
  OpSchedule reduce;
  // 64-bit FNV-1a over all task and ref bytes of both ops: equal on every rank for the same plan.
  uint64_t digest = 0;
};

// Throws std::invalid_argument with a clear message on inconsistent input.
Schedule build_schedule(const BuildInput& in);

}  // namespace ultracomm
