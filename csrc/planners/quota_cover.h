// Cover search for the quota planner's feasibility test: a depth-first search over which
// receivers (and which of the hot rank's experts) cover each hot rank's excess, with the
// spare the chosen pieces waste bounded by the total slack.  Complete with one slot per
// receiver (see quota_cover.cpp); a heuristic with more.
#pragma once
#include <cstdint>
#include <functional>
#include <vector>

namespace ultracomm::planners {

struct CoverProblem {
  int64_t min_tokens = 1;                     // smallest piece; a hot rank may keep min_tokens - 1 over
  std::vector<int64_t> need;                  // [hot] tokens each hot rank must shed
  std::vector<int64_t> hot_group;             // [hot] node (0: no restriction)
  std::vector<std::vector<int>> hot_experts;  // [hot] indices into cap
  std::vector<int64_t> cap;                   // [experts] tokens each expert can shed
  std::vector<int64_t> spare;                 // [receivers] tokens each can take
  std::vector<int64_t> slots;                 // [receivers] replica slots each has free
  std::vector<int64_t> recv_group;            // [receivers] node
};

struct CoverPiece {
  int expert, recv;
  int64_t tokens;
};

enum class CoverOutcome { kFound, kRefuted, kOutOfBudget };

// Searches for pieces (expert -> receiver, tokens) that cover every hot rank's need, at
// most one piece per (hot rank, receiver); `accept` may still reject a complete cover (the
// search then goes on).  Spends at most `budget` piece placements, subtracting them.
// kRefuted means the search space was exhausted: no cover of this form exists.
CoverOutcome cover_search(const CoverProblem& p, int64_t& budget,
                          const std::function<bool(const std::vector<CoverPiece>&)>& accept,
                          std::vector<CoverPiece>& pieces);

// One slot per receiver only: a local search over which hot rank each receiver serves
// (moves and swaps that lower the total uncovered need, random swaps on plateaus; a fixed
// seed, so deterministic), then experts by largest remaining cap.  Finds covers the
// depth-first search runs out of budget on; never refutes.  Spends at most `budget`
// units: each iteration costs one per (short expert, usable receiver) pair it scans.
bool cover_local(const CoverProblem& p, int64_t& budget,
                 const std::function<bool(const std::vector<CoverPiece>&)>& accept, std::vector<CoverPiece>& pieces);

}  // namespace ultracomm::planners
