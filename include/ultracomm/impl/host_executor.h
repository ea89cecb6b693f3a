// Host executor: runs one rank's task list of one operation with C++ worker threads over
// the windows (memcpy for tiles, acquire/release atomics for epoch flags).  The reference
// executor: every GPU executor follows the same protocol (see task.h).
#pragma once
#include <cstdint>
#include <stdexcept>
#include <string>
#include <vector>
#include "ultracomm/impl/error_text.h"
#include "ultracomm/records/exec_view.h"
#include "ultracomm/records/task.h"
#include "ultracomm/records/window_layout.h"

namespace ultracomm {

enum class DType : int32_t { kF32 = 0, kBF16 = 1, kF16 = 2 };

// How worker groups move bytes (both run interp.h):
//  kHost  one thread per worker (memcpy, acquire/release atomics): the reference executor;
//  kBlock threads_per_worker threads per worker with a std::barrier, imitating a CUDA block
//         (leader waits and releases, copies/reductions split by thread): tests the device's
//         control flow on the CPU.  Bit-identical results.
enum class MoverKind : int32_t { kHost = 0, kBlock = 1 };

struct ExecArgs {
  Op op = Op::kMulticast;
  int32_t rank = 0;
  int32_t world = 0;
  uint64_t epoch = 0;
  WindowLayout layout;                  // must be WindowLayout::make(...) (not re-derived by run_host)
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
  double timeout_s = 100.0;   // > 0; >= 1e9 (or inf) never times out
  uint32_t jitter_us = 0;     // testing: random sleep up to this before each task
  uint64_t jitter_seed = 0;   // worker w draws from a PRNG seeded with jitter_seed + w
  int64_t delay_unit = -1;    // testing: the worker that claims this work unit (tile) sleeps
  uint32_t delay_us = 0;      //   delay_us before moving it (holds one tile of a chunk back)
  bool portable_f16 = false;  // testing: portable fp16 conversions instead of F16C (same bits)
  // This op's schedule digest, published beside ready[op]; a peer touching this rank with
  // another digest (or kRejectedDigest) raises PlanMismatchError.  Must not be kRejectedDigest.
  uint64_t digest = 0;
  MoverKind mover = MoverKind::kHost;
  // Optional address of a uint64 owned by the caller: once nonzero, every worker stops at its
  // next claim or wait and run_host throws AbortedError (no ErrorRecord: the caller knows why,
  // e.g. the split transport's bridge failed).  0 = none.
  uintptr_t abort_word = 0;
  int32_t threads_per_worker = 4;  // kBlock only, 1..64
  // Bytes of the work unit a worker claims (interp.h tiles): a multiple of 16, or 0 for whole
  // chunks; a chunk no longer than it is one tile.  Results are the same bytes for every value.
  uint64_t tile_bytes = kDefaultTileBytes;
};

// ExecArgs checked by validate() as the interpreter sees them (pointers into `a`).
ExecView make_view(const ExecArgs& a);

// Runs the operation to completion on this rank:
//  1. raise own ready[op] = epoch; for reduce, raise grad_ready of every own replica slot
//     that is not a relay (not the `self` of any own reduce task), all chunks;
//  2. workers claim tiles of tasks (tile_bytes each, a chunk's last one shorter) in list order
//     and move them; the worker retiring a chunk's last tile releases the chunk's flags;
//  3. wait until every own non-empty slot has all chunks arrived (multicast) or consumed
//     by its parent (reduce).
// Every wait gives up after timeout_s (TimeoutError naming rank, op_name, epoch, expert,
// chunk, peer and flag, and whether that peer ever started this op); a peer whose published
// digest differs raises PlanMismatchError; a worker's error aborts the others and is rethrown
// after all joined (format_error in error_text.h gives the text).
// Before any flag or byte is written, every argument that can be checked here is
// (std::invalid_argument): scalars, sizes, member ranges, and each task and ref (kind, ranks,
// slots, expert vs. my_slots / local_index_of, chunk index and that offset/bytes are exactly
// that chunk's range, ref range, grad element alignment).  Not checkable, the caller's
// contract: layout is WindowLayout::make(...); window_bases[r] maps layout.total_bytes of
// rank r's window and master_ptrs map the members' bytes (only null / alignment are checked);
// the tasks and refs stay unmodified until run_host returns; and the peers run the same
// schedule (a wrong peer shows up as a timeout, not as an argument error).
void run_host(const ExecArgs& args);

// Thrown by run_host when args.abort_word was raised before the operation finished.
struct AbortedError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// For a rank that rejected its plan for args.op at args.epoch: publishes kRejectedDigest with
// ready[op] = epoch in its own window, so every peer that touches it raises PlanMismatchError
// ("rank r rejected its plan") at once.  Only window_bases[rank], layout, op, rank, epoch used.
void publish_rejection(const ExecArgs& args);

// Checks every argument (std::invalid_argument "ultracomm.run_host: ..."); run_host calls it.
void validate(const ExecArgs& args);

}  // namespace ultracomm
