// Schedule builder: ReplicaPlan + expert byte sizes + domain topology + config -> per-rank
// task lists for multicast (weights) and reduction (grads).  Pure function of its inputs:
// the same inputs give a byte-identical Schedule on every rank.
#pragma once
#include <cstdint>
#include <string>
#include <vector>
#include "ultracomm/records/task.h"

namespace ultracomm {

struct BuildInput {
  int32_t world = 0;
  int32_t slots_per_rank = 0;
  int32_t num_experts = 0;
  std::vector<int32_t> slot_src;   // [world * slots_per_rank], logical expert or -1
  std::vector<int32_t> home_of;    // [num_experts]
  std::vector<int32_t> node_of;    // [world]; all zeros for one node
  uint64_t weight_bytes = 0;       // one expert's weights, slot layout
  uint64_t grad_bytes = 0;         // one expert's grads, slot layout
  uint64_t chunk_bytes = 1 << 20;  // multiple of 16
  // kAuto: per op, the candidate tree with the least predicted_s.  A relay tree is a
  // candidate only if, on one node, no rank sends (multicast) / pulls (reduce) more experts
  // than in the direct tree, so max egress / ingress never exceed direct's; on several nodes,
  // if its bottleneck per-tier time (max over ranks and tiers of bytes / tier bw) is no higher
  // than direct's -- its max egress bytes may exceed direct's, as crossing to each remote node
  // once (the topology rule, which takes precedence) shifts cheap intra-node sends onto relays.
  // There the direct tree is a candidate only if it crosses to each remote node at most once
  // per expert (else it is the fallback).  kOff: direct.  kForce: relay trees only.
  RelayMode relay_mode = RelayMode::kAuto;
  // Max tree depth (1 = direct); auto picks the depth by predicted time.  kForce raises 1 to 2
  // (a relay tree needs depth 2): it builds the trees of max_depth = 2 (input and digest keep 1).
  int32_t max_depth = 8;
  double intra_bw = 370e9;  // bytes/s per rank per direction within a node
  double inter_bw = 50e9;   // bytes/s per rank per direction across nodes
  // Per-hop latency of the cost model (seconds): a chunk is visible at the receiver (data +
  // flag, handled) this long after its last byte left; one per tree level on the critical path.
  double intra_latency_s = 2e-6;
  double inter_latency_s = 5e-6;
};

// Per operation: the tree (parent of every replica slot) and per-rank task lists.
struct OpSchedule {
  // parent of replica slot (r, s) in the tree, flattened [world * slots]:
  // the rank it receives from (multicast) / sends its (partial) grad to (reduce); -1 for empty slots.
  std::vector<int32_t> parent_rank;
  std::vector<int32_t> parent_slot;  // kMaster when the parent is the home's master
  std::vector<int32_t> depth;        // depth of the slot in its expert's tree (1 = child of home); 0 empty
  // Per rank, sorted by (chunk, level, expert, self.slot).  Empty for every rank but
  // Schedule::built_for when built for one rank.  A sender's refs block (its children, sorted
  // by (rank, slot)) is stored once and shared by the tasks of all its chunks.
  std::vector<std::vector<Task>> tasks;  // [world]
  std::vector<std::vector<Ref>> refs;    // [world]
  std::vector<int64_t> num_tasks;        // [world] task count per rank (always global)
  uint64_t bytes = 0;                    // one expert's bytes for this op (weights / grads)
  uint64_t chunks = 0;                   // ceil(bytes / chunk_bytes)
  // stats
  std::vector<uint64_t> egress;                       // [world] bytes sent (multicast) / read from it by peers (reduce)
  std::vector<uint64_t> ingress;                      // [world] bytes received / pulled
  std::vector<uint64_t> inter_egress, inter_ingress;  // [world] the cross-node part of the above
  int32_t max_depth = 0;
  // Multicast: max(max ingress, max over ranks of the bytes it must send at least once
  // (B per replicated expert it homes), ceil(total / world)).  Reduce: the mirror,
  // max(max egress, B per replicated expert a home must receive, ceil(total / world)).
  uint64_t lower_bound_bytes = 0;
  // One node: lower_bound_bytes / intra_bw.  Several nodes: max(lower_bound_bytes /
  // (intra_bw + inter_bw), max over nodes N of ceil(X_N / |N|) * B / inter_bw) where X_N is
  // the larger of the expert crossings that must enter N and that must leave N (one per
  // (expert, remote node holding a replica)).  Always <= the link part of predicted_s.
  double lower_bound_s = 0;
  // Link part: max over ranks and tiers (intra, inter) and directions of bytes / bw.  Plus the
  // pipeline fill: max over tree paths of the sum over its hops of (chunk_time + latency) of
  // the hop's tier, chunk_time = min(chunk_bytes, bytes) / bw.
  double predicted_s = 0;
  // Lower bound on predicted_s of any relay tree of this plan (same cost model): at least one
  // hop over lower_bound_s, and for the expert with the most replicas n, min over the largest
  // fan-out f of f*B/bw + (least depth at which fan-out f holds n replicas) * hop.  Where it
  // exceeds lower_bound_s + one hop, no tree reaches DESIGN.md's bound.
  double tree_lower_bound_s = 0;
  bool relayed = false;  // true when any expert uses a relay
};

struct Schedule {
  BuildInput input;
  OpSchedule multicast;
  OpSchedule reduce;
  // 64-bit FNV-1a over the inputs and both ops' trees (parent_rank, parent_slot), which
  // determine every task and ref; the symbols hashed are 32-bit little-endian words (one
  // FNV round per int32 / half of a 64-bit field) rather than single octets, for speed.
  // Equal on every rank for the same inputs, whether built for all ranks or one.
  uint64_t digest = 0;
  int32_t built_for = -1;  // -1: task lists for every rank; else the only rank with lists
};

// Throws std::invalid_argument with a clear message on inconsistent input.
// only_rank >= 0 generates task lists for that rank only (trees, stats, digest stay global).
Schedule build_schedule(const BuildInput& in, int32_t only_rank = -1);

}  // namespace ultracomm
