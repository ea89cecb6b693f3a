// DevicePlan: one operation's per-rank ExecViews and every array they point to (window
// bases, master pointers, slot tables, tasks, refs), uploaded once into ONE device allocation
// (tests and benchmarks: ultracomm.cuda.loopback).  The transports write their plans into the
// slots of a PlanArena allocated at setup instead (plan_arena.h).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ultracomm/records/exec_view.h"
#include "ultracomm/impl/host_executor.h"

namespace ultracomm::gpu {

// Checks the rank entries of one launch as run_host does (validate), plus the device's limits
// and that every entry has the same op, world, layout and grad dtype (std::invalid_argument,
// prefixed with `who`), before anything is allocated or written.
void check_launch_ranks(const std::vector<ExecArgs>& ranks, const char* who);

// Array sizes of a template image (PlanArena::write_template): my_slots and slot_parent hold
// `slots`, tasks `tasks` and refs `refs` entries whatever the rank entries carry (zero-filled
// beyond), so the device step can build into them (include/ultracomm/impl/slot_build.h).
struct ImageCapacity {
  int64_t slots;
  int64_t tasks;
  int64_t refs;
};

// Host image of one launch's views and arrays ([ExecView x nranks], then per rank: window
// bases, masters, local_index_of, my_slots, slot_parent, tasks, refs, the tasks' tile counters
// (zero), each 16-byte aligned),
// with every pointer rebased onto `base`, the device address the image will be copied to.
// cap: the template layout above (nullptr: each array as long as the entry's).
std::vector<unsigned char> plan_image(const std::vector<ExecArgs>& ranks, uintptr_t base,
                                      const ImageCapacity* cap = nullptr);

// Bytes plan_image takes for nranks entries of these sizes (it grows with each of them).
size_t plan_image_bytes(int64_t nranks, int64_t world, int64_t num_experts, int64_t masters, int64_t slots,
                        int64_t tasks, int64_t refs);

class DevicePlan {
 public:
  // ranks: the ranks one launch runs (1, or a loopback world), all of one op, world, layout
  // and grad dtype; each validated as run_host validates (std::invalid_argument before
  // anything is allocated).  Addresses in them are the device's (window bases as this device
  // addresses each rank's window).  Allocates on the current device and copies synchronously.
  explicit DevicePlan(const std::vector<ExecArgs>& ranks);
  ~DevicePlan();
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;

  const ExecView* views() const { return views_; }  // device memory, [nranks]
  int nranks() const { return nranks_; }
  Op op() const { return op_; }
  int grad_dtype() const { return grad_dtype_; }
  int device() const { return device_; }
  size_t bytes() const { return bytes_; }
  // Each rank entry's task count (host-known: a launch sizes each rank's CTAs by it, runner.h
  // launch_ctas).
  const std::vector<int64_t>& rank_tasks() const { return rank_tasks_; }

 private:
  void* blob_ = nullptr;
  const ExecView* views_ = nullptr;
  int nranks_ = 0;
  Op op_ = Op::kMulticast;
  int grad_dtype_ = 0;
  int device_ = 0;
  size_t bytes_ = 0;
  std::vector<int64_t> rank_tasks_;
};

}  // namespace ultracomm::gpu
