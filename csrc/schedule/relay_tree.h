// Internal: per-expert distribution trees shared by both operations.
//
// A tree node is the home's master copy of an expert or one replica slot of it.  Every
// replica slot gets exactly one parent.  The "parent side" of an edge carries the load
// that the builder balances: the sender's egress for multicast (push) and the puller's
// ingress for reduce (pull).  With homogeneous experts that load is (number of children)
// x bytes, so the trees are computed once in units of "one expert" and each operation
// scales them by its own byte count (weights or grads) when it picks a candidate.
#pragma once
#include <cstdint>
#include <vector>

namespace ultracomm::detail {

// The plan, preprocessed once per build.
struct TreeInput {
  int32_t world = 0, slots = 0, num_experts = 0, num_nodes = 1;
  bool multi_node = false;
  double intra_bw = 1, inter_bw = 1;
  std::vector<int32_t> node_of;    // [world]
  std::vector<int32_t> node_size;  // [num_nodes]
  std::vector<int32_t> home_of;    // [E]
  // Replicas of expert e: rep[rep_begin[e] .. rep_begin[e+1]) as slot ids (rank*slots+slot).
  // Single node: rank ascending.  Multi node: the home node's replicas first, then one group
  // per remote node ordered by (size desc, node asc); rank ascending inside a group.
  std::vector<int32_t> rep_begin, rep;
  // Groups of expert e: grp[grp_begin[e] .. grp_begin[e+1]); each is [begin, end) into rep.
  // The first group is the home node's (possibly empty).
  std::vector<int32_t> grp_begin, grp_lo, grp_hi;
  std::vector<uint8_t> force_ok;  // [E] force mode can keep the home below nrep-1 children
  std::vector<int32_t> multi;     // experts with >= 2 replicas, by (replicas desc, expert asc)
  std::vector<int32_t> single;    // experts with exactly 1 replica
  int64_t total_reps = 0;
  std::vector<int32_t> rank_of_id, slot_of_id;  // [world*slots] slot id -> rank / slot
  std::vector<int32_t> empty_parent;            // [world*slots] -1 everywhere (template)
  std::vector<int32_t> empty_depth;             // [world*slots] 0 everywhere
};

struct Tree {
  std::vector<int32_t> parent_rank, parent_slot, depth;  // [world*slots]
  std::vector<int32_t> load_intra, load_inter;           // [world] children counts by tier
  int32_t max_depth = 0;
  double t = 0;          // max over ranks of max(load_intra/intra_bw, load_inter/inter_bw)
  int64_t max_load = 0;  // max over ranks of load_intra + load_inter
  bool relayed = false;
};

// Validated BuildInput fields -> TreeInput.
void prepare(int32_t world, int32_t slots, int32_t num_experts, const int32_t* slot_src, const int32_t* home_of,
             const int32_t* node_of, double intra_bw, double inter_bw, TreeInput& out);

// Home -> every replica, depth 1 (no topology rule).
void direct_tree(const TreeInput& in, Tree& out);

// Recomputes t.t and t.max_load from the tree's per-rank loads.
void finish(const TreeInput& in, Tree& t);

// Local search (relay_repair.cpp): lowers t's bottleneck (max over ranks of the parent side's
// tier time) by re-parenting subtrees along short ejection chains, never deeper than dlim, in
// force mode never giving the home nrep children; stops at floor_t.  True if t changed (then
// t is consistent: loads, depth, finish()).  Deterministic.
bool repair_tree(const TreeInput& in, Tree& t, int32_t dlim, bool force, double floor_t);

// One node: the caller's cost model (schedule_builder's predicted()), per op: a tree whose
// busiest rank sends k experts and whose depth is d costs max(k, fixed) * unit + d * hop.
// relay_candidates() skips the searches whose trees cannot cost less than a candidate it
// already has, for every op.
struct Pick {
  int32_t ops = 0;
  double unit[2] = {0, 0};  // bytes / intra_bw
  double hop[2] = {0, 0};   // min(chunk, bytes) / intra_bw + intra latency
  int64_t fixed = 0;        // the most filled slots on one rank (the fed side's load)
};

// Relay trees for depth limits 2..max_depth (deduplicated, shallowest first): per limit, the
// minimal bottleneck time t found by a galloping search over per-rank capacities with a
// deterministic greedy, skipping limits and levels that cannot improve on the trees found
// (see relay_tree.cpp), then a local search on the lowest bottleneck.  Without `force`, trees
// are searched up to the direct tree's t and, on one node, no rank sends more experts in total
// than direct's busiest rank (a relay tree never exceeds direct's max egress; with several
// nodes: its max per-tier egress time); with `force`, every expert with >= 2 replicas keeps at
// most nrep-1 direct children of the home where the topology allows it.  May return nothing
// (caller falls back to direct).  `pick` (one node only; may be null) prunes searches that
// cannot beat the candidates found so far.
std::vector<Tree> relay_candidates(const TreeInput& in, int32_t max_depth, bool force, const Tree& direct,
                                   const Pick* pick = nullptr);

}  // namespace ultracomm::detail
