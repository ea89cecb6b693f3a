// Host executor: runs one rank's task list of one operation with C++ worker threads over
// the windows (memcpy for tiles, acquire/release atomics for epoch flags).  The reference
// executor: every GPU executor follows the same protocol (see task.h).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>
#include "ultracomm/task.h"
#include "ultracomm/window_layout.h"

namespace ultracomm {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// Raised when a wait exceeds the timeout; the message names rank, op, expert, chunk, peer.
struct TimeoutError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

struct ExecArgs {
  Op op = Op::kMulticast;
  int32_t rank = 0;
  int32_t world = 0;
  uint64_t epoch = 0;
  WindowLayout layout;  // must be WindowLayout::make(...) (not re-derived by run_host)
  std::vector<uintptr_t> window_bases;  // [world]: each rank's window base in this process
  // Members of one expert, slot layout: member m occupies [member_off[m], +member_bytes[m]).
  // For multicast these are the weight members; for reduce the grad members.
  std::vector<uint64_t> member_off;
  std::vector<uint64_t> member_bytes;
  // Master copies on this rank: master_ptrs[local_index * M + m] = address of member m.
  std::vector<uintptr_t> master_ptrs;
  std::vector<int32_t> local_index_of;  // [num_experts]: local index on its home, -1 if not here
  DType grad_dtype = DType::kF32;       // reduce only
  // This rank's replica slots: expert held by slot s (or -1), from the plan.
  std::vector<int32_t> my_slots;
  // Optional, [slots] or empty: the rank each own slot receives from (multicast) / is
  // consumed by (reduce), e.g. OpSchedule::parent_rank.  Only used in timeout messages.
  std::vector<int32_t> slot_parent;
  // Optional: the operation's name in timeout messages (e.g. "restore"); empty means
  // "weight_sync" for multicast, "grad_reduce" for reduce.
  std::string op_name;
  const Task* tasks = nullptr;
  int64_t num_tasks = 0;
  const Ref* refs = nullptr;
  int64_t num_refs = 0;
  int32_t num_workers = 4;
  double timeout_s = 100.0;  // > 0; >= 1e9 (or inf) never times out
  uint32_t jitter_us = 0;  // testing: random sleep up to this before each task
  uint64_t jitter_seed = 0;  // worker w draws from a PRNG seeded with jitter_seed + w
  bool portable_f16 = false;  // testing: portable fp16 conversions instead of F16C (same bits)
};

// Runs the operation to completion on this rank:
//  1. raise own ready[op] = epoch; for reduce, raise grad_ready of every own replica slot
//     that is not a relay (not the `self` of any own reduce task), all chunks;
//  2. workers claim tasks in list order and run them;
//  3. wait until every own non-empty slot has all chunks arrived (multicast) or consumed
//     by its parent (reduce).
// Every wait gives up after timeout_s (TimeoutError naming rank, op_name, epoch, expert,
// chunk, peer and flag); a worker's error aborts the others and is rethrown after all joined.
// Before any flag or byte is written, every argument that can be checked here is
// (std::invalid_argument): scalars, sizes, member ranges, and each task and ref (kind, ranks,
// slots, expert vs. my_slots / local_index_of, chunk index and that offset/bytes are exactly
// that chunk's range, ref range, grad element alignment).  Not checkable, the caller's
// contract: layout is WindowLayout::make(...); window_bases[r] maps layout.total_bytes of
// rank r's window and master_ptrs map the members' bytes (only null / alignment are checked);
// the tasks and refs stay unmodified until run_host returns; and the peers run the same
// schedule (a wrong peer shows up as a timeout, not as an argument error).
void run_host(const ExecArgs& args);

}  // namespace ultracomm
