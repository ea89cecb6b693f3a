// ExecView: everything the interpreter (interp.h) reads about one rank's operation, as a
// flat POD of pointers and scalars, identical on host and device (a kernel takes it by value).
// The host builds it from ExecArgs (host_executor.h) after validate(); pointers point into
// memory the executing side can read (host memory for the host movers, device memory or
// mapped host memory for the kernel).
#pragma once
#include <cstdint>
#include <type_traits>
#include "ultracomm/records/hd.h"
#include "ultracomm/records/task.h"
#include "ultracomm/records/window_layout.h"

namespace ultracomm {

constexpr int kMaxMembers = 8;                     // members of one expert (fc1, fc2, biases, scales ...)
constexpr uint64_t kDefaultTileBytes = 64 * 1024;  // ExecView::tile_bytes unless a caller sets another

struct ExecView {
  Op op;
  int32_t rank;
  int32_t world;
  uint64_t epoch;
  WindowLayout layout;
  const uintptr_t* window_bases;  // [world]: each rank's window base, as this side addresses it
  // Members of one expert in slot layout: [member_off[m], +member_bytes[m]), sorted, disjoint.
  int32_t num_members;
  uint64_t member_off[kMaxMembers];
  uint64_t member_bytes[kMaxMembers];
  const uintptr_t* master_ptrs;   // [n_local * num_members]: member m of local expert i at [i * M + m]
  const int32_t* local_index_of;  // [num_experts]: local index on its home, -1 if not here
  int32_t num_experts;
  int32_t grad_dtype;          // DType: 0 fp32, 1 bf16, 2 fp16 (reduce only)
  const int32_t* my_slots;     // [layout.slots]: expert held by each own slot, -1 empty
  const int32_t* slot_parent;  // [layout.slots] or null: rank each own slot receives from /
                               //   is consumed by (names peers in errors, watched for digests)
  const Task* tasks;
  int64_t num_tasks;
  const Ref* refs;
  int64_t num_refs;
  uint64_t timeout_ns;  // per wait; UINT64_MAX = never
  uint64_t digest;      // this op's schedule digest, published beside ready[op]
  // Tiles (interp.h run_tasks): a task's chunk is moved as tiles of tile_bytes (a multiple of 16),
  // claimed by any worker; the worker retiring a task's last tile on tile_done[task] releases the
  // chunk.  tile_bytes 0 or >= layout.chunk_bytes, or tile_done null: one tile per task (a task
  // whole, as one worker's).  tile_done: [num_tasks] uint32, zero before a run and after every
  // run that completed (the last tile's worker resets its counter); writable by the executor.
  uint64_t tile_bytes;
  uint32_t* tile_done;
};
static_assert(std::is_trivially_copyable_v<ExecView>, "ExecView is passed to kernels by value");
static_assert(sizeof(ExecView) <= 512, "ExecView must stay small (kernel parameter space)");

}  // namespace ultracomm
