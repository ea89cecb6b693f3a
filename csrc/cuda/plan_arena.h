// PlanArena: every plan one executor (a TmaTransport, or a one-GPU loopback domain) will run,
// in ONE device allocation made at setup, plus pinned host staging of the same shape.  One
// slot per micro-batch slot (vid) of the Context and one for calls without a vid; a slot has
// one area per op kind (multicast, reduce), each sized for the largest plan the bounds allow.
// A new plan is written into its area with cudaMemcpyAsync from the staging on the launch
// stream: no cudaMalloc, cudaFree, pageable copy or host wait after setup, and the kernel reads
// its views at a fixed address, so a captured CUDA graph replays whatever was written last.
//
// Device / staging layout: area(slot, op) at slot * (area[0] + area[1]) + (op ? area[0] : 0);
// an area holds plan_image (device_plan.h) of its plan, rebased onto the area's address.
// Every image is laid out at the bounds (ImageCapacity), so a device build may follow a host
// plan in any slot (also at a graph replay).  After the areas, per slot, the device step's
// builder scratch (Runner::build_slot; none when the bounds exceed the builder's capacities);
// and per slot and rank entry one psched::BuildReport in mapped host memory, where each build
// reports its status (read by the host without a copy or a wait).
#pragma once
#include <cuda_runtime_api.h>

#include <cstddef>
#include <cstdint>
#include <vector>

#include "device_plan.h"
#include "ultracomm/impl/slot_build.h"

namespace ultracomm::gpu {

// What one plan may hold, per rank entry of a launch (the Context's shape; the schedule
// builder emits at most (local experts + slots) x chunks tasks and world x slots refs).
struct PlanBounds {
  int32_t nranks = 1;  // rank entries of one launch (1, or a loopback world)
  int32_t world = 0;
  int32_t num_experts = 0;
  int64_t masters = 0;  // master pointers per rank (local experts x members)
  int32_t slots = 0;    // replica slots per rank
  int64_t tasks[kNumOps] = {0, 0};
  int64_t refs[kNumOps] = {0, 0};
};

class PlanArena {
 public:
  // Allocates num_slots slots on `device` (std::invalid_argument for bounds that are not
  // positive or overflow, CudaError if the allocation fails).
  PlanArena(int device, int num_slots, const PlanBounds& bounds);
  ~PlanArena();
  PlanArena(const PlanArena&) = delete;
  PlanArena& operator=(const PlanArena&) = delete;

  // Device bytes (the pinned staging takes as many) of an arena with these bounds.
  static size_t bytes_for(int num_slots, const PlanBounds& b);
  static size_t area_bytes(const PlanBounds& b, Op op);
  static size_t scratch_bytes(const PlanBounds& b);  // per slot, 0 beyond the builder's capacities

  // Checks `ranks` as DevicePlan does, then that each entry fits the bounds (each count named
  // with its limit), before anything is written: std::invalid_argument.
  void check(const std::vector<ExecArgs>& ranks) const;

  // Writes `ranks` (checked) into area(slot, ranks[0].op): the staging first (waiting for the
  // previous copy out of that area's staging only if it is still in flight, i.e. the device is a
  // whole cycle of this slot behind), then cudaMemcpyAsync on `stream`.  capturing: the copy
  // becomes a graph node reading the staging at each replay; no event is recorded for it (and a
  // capture that would have to wait for an eager copy is refused: std::invalid_argument).
  void write(int slot, const std::vector<ExecArgs>& ranks, cudaStream_t stream, bool capturing);

  // The same for a device-built plan's template (include/ultracomm/impl/slot_build.h): the entries'
  // static part, with my_slots / slot_parent / tasks / refs at the arena's bounds (ImageCapacity),
  // for the device step to build into (Runner::build_slot).  The entries carry no task.
  void write_template(int slot, const std::vector<ExecArgs>& ranks, cudaStream_t stream, bool capturing);

  struct Area {
    int nranks = 0;
    int grad_dtype = 0;
    bool written = false;
  };
  const Area& area(int slot, Op op) const { return areas_[index(slot, op)]; }
  const ExecView* views(int slot, Op op) const;  // device address of the area
  // The device step's build of `slot`: its scratch (device memory; null when the bounds exceed
  // the builder's capacities), the device address of rank entry `entry`'s report, and what the
  // last build of that entry reported (generation 0: none yet).
  int64_t* build_scratch(int slot) const;
  // Forgets the eager copies out of the staging that have finished (an event query each; never
  // inside a capture): a capture may then write those areas.
  void retire();
  psched::BuildReport* build_report_dev(int slot, int entry) const;
  psched::BuildReport build_report(int slot, int entry) const;
  int num_slots() const { return num_slots_; }
  int device() const { return device_; }
  size_t bytes() const { return bytes_; }
  const PlanBounds& bounds() const { return bounds_; }

 private:
  void release();
  void write_image(int slot, const std::vector<ExecArgs>& ranks, cudaStream_t stream, bool capturing);
  size_t index(int slot, Op op) const;
  size_t offset(int slot, Op op) const;
  int device_ = 0;
  int num_slots_ = 0;
  PlanBounds bounds_;
  size_t area_[kNumOps] = {0, 0};
  size_t bytes_ = 0;
  unsigned char* dev_ = nullptr;                // device memory
  unsigned char* staging_ = nullptr;            // pinned host memory, same layout
  size_t scratch_ = 0;                          // builder scratch bytes per slot, after the areas
  psched::BuildReport* reports_ = nullptr;      // mapped host memory, [num_slots][nranks]
  psched::BuildReport* reports_dev_ = nullptr;  // its device address
  size_t report_index(int slot, int entry) const;
  std::vector<Area> areas_;
  std::vector<cudaEvent_t> copied_;  // per area: recorded after its last eager copy
  std::vector<bool> in_flight_;      // copied_ was recorded and not yet seen complete
};

}  // namespace ultracomm::gpu
