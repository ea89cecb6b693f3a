// Runner: what persists between launches on one device for one executor (a TmaTransport, or
// a one-GPU loopback domain): the DeviceState (abort word, claim counters, epochs), the
// mapped ErrorSlot, and the device's properties.  launch() only enqueues.
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include "device_plan.h"
#include "launch.h"
#include "plan_arena.h"
#include "persistent_args.h"
#include "ultracomm/impl/sched_build.h"

namespace ultracomm::gpu {

// (true, "") when a CUDA device usable by _cuda (sm_80+) is present; else (false, why).
std::pair<bool, std::string> cuda_available(int device);

// Makes `device` current for a scope and restores the previous one (no synchronisation).
class DeviceGuard {
 public:
  explicit DeviceGuard(int device);
  ~DeviceGuard();
  DeviceGuard(const DeviceGuard&) = delete;
  DeviceGuard& operator=(const DeviceGuard&) = delete;

 private:
  int prev_ = -1;
};

// The CTAs a launch of a plan whose task counts the host knows gives each rank (a DevicePlan's;
// rank_tasks[r]: rank entry r's tasks in the op): ctas_per_rank to a rank with at least one task,
// ONE to a rank with none (it only publishes its ready flag and drains its incoming chunks; tasks
// are claimed dynamically, so more CTAs would only spin).  A one-GPU loopback launch whose op has
// tasks on few ranks then fits many more CTAs on those (the co-residency limit counts the whole
// grid).  std::invalid_argument for ctas_per_rank < 1 or a negative count.
std::vector<int32_t> launch_ctas(const std::vector<int64_t>& rank_tasks, int ctas_per_rank);

// The largest ctas_per_rank whose launch_ctas sum to at most max_grid CTAs (e.g. max_coresident
// for a loopback plan), from launch_ctas itself (the grid is affine in ctas_per_rank); 0 when not
// even 1 fits; min(max_grid, INT_MAX) when it fits and no rank has a task (the grid then does not
// depend on ctas_per_rank).
int max_ctas_per_rank(const std::vector<int64_t>& rank_tasks, int64_t max_grid);

class Runner {
 public:
  explicit Runner(int device);  // allocates and zeroes the state; sets kernel attributes
  ~Runner();
  Runner(const Runner&) = delete;
  Runner& operator=(const Runner&) = delete;

  // Enqueues plan's operation on `stream` at `epoch` (the kernel runs max(epoch, last + 1) of
  // this runner's previous launches of that op).  Each rank entry gets
  // launch_ctas(plan.rank_tasks(), ctas_per_rank)[r] CTAs.  Loopback plans
  // (nranks > 1) need every CTA of the grid co-resident: std::invalid_argument naming the grid's
  // make-up and the limit otherwise.
  // flags: persistent_args.h kForceVector, kReduceStaged (std::invalid_argument before sm_90: no
  // bulk copies there).  A launch on another stream than the previous one of
  // its op waits for it (cudaStreamWaitEvent: a graph edge while both are in one capture); an
  // eager launch and a captured one are not ordered here (the graph's launch stream orders them).
  void launch(const DevicePlan& plan, uint64_t epoch, int ctas_per_rank, cudaStream_t stream, uint32_t flags);

  // The same for the plan in arena slot `slot`, area `op`, with ctas_per_rank CTAs for EVERY rank
  // (uniform: a device-built plan's task counts are not known on the host).  upload: the plan's
  // rank entries to write there first (checked against the arena's bounds before anything moves;
  // the async copy is enqueued after the wait for the previous launch of this op kind, which may
  // still read the area), or null to run what the slot holds (std::invalid_argument if it holds
  // nothing).
  void launch(PlanArena& arena, int slot, Op op, const std::vector<ExecArgs>* upload, uint64_t epoch, int ctas_per_rank,
              cudaStream_t stream, uint32_t flags);

  // A device-built plan (include/ultracomm/impl/slot_build.h).  write_template: the rank entries'
  // static part into arena slot `slot` (PlanArena::write_template), after the previous launch
  // of the op kind (it may read the area).  build_slot: enqueues k_build_slot for rank entry
  // `entry` of both op areas of `slot` (both templates written: std::invalid_argument
  // otherwise), after the previous launches of both kinds; then launch(arena, slot, op, nullptr,
  // ...) runs what it built.  problem's arrays are device memory.
  void write_template(PlanArena& arena, int slot, const std::vector<ExecArgs>& ranks, cudaStream_t stream);
  // The build uses the slot's scratch and reports into the entry's BuildReport
  // (PlanArena::build_report).  exchange_status / plan_result (device memory, or null): the
  // loads' exchange status word and the planner's result words; when either says it failed
  // the build rejects instead of building from them.  Launches of either kind after it on
  // another stream wait for it (it writes both areas).
  void build_slot(PlanArena& arena, int slot, int entry, const psched::Problem& problem, const int32_t* exchange_status,
                  const int64_t* plan_result, cudaStream_t stream);

  // A failure a launch recorded since the last call, if any (call after the stream reached
  // the launch, e.g. after an event or stream synchronisation); multicast's first.
  std::optional<ErrorRecord> take_error();

  int max_coresident(int grad_dtype) const;  // CTAs of one launch that fit at once
  int device() const { return device_; }
  int cc_major() const { return cc_major_; }
  int cc_minor() const { return cc_minor_; }
  int sm_count() const { return sm_count_; }
  bool tma() const { return cc_major_ >= 9; }  // the mover k_persistent runs on this device

 private:
  struct Shape {
    const ExecView* views;
    int nranks;
    Op op;
    int grad_dtype;
  };
  // checks, ordering, before(capture id) (the plan upload), launch, event; ctas: per rank, p.nranks
  void launch_views(const Shape& p, uint64_t epoch, const std::vector<int32_t>& ctas, cudaStream_t stream,
                    uint32_t flags, const std::string& where, const std::function<void(unsigned long long)>& before);
  int device_;
  int cc_major_ = 0, cc_minor_ = 0, sm_count_ = 0;
  int coresident_[3] = {0, 0, 0};  // per grad dtype
  PersistentRings rings_;          // the TMA rings this device holds (launch.h)
  // One state and one error slot per op kind: a multicast and a reduction may overlap on two
  // streams (disjoint flags and slots); launches of one kind must be stream-ordered.
  DeviceState* state_ = nullptr;   // device memory, [kNumOps]
  ErrorSlot* err_host_ = nullptr;  // mapped host memory, [kNumOps]
  ErrorSlot* err_dev_ = nullptr;   // its device address
  uint64_t seen_error_epoch_[kNumOps] = {0, 0};
  // Launches of one op kind share state_[op] (claim counters, join ticket, epochs): each one
  // waits for the previous one of its kind when that went to another stream (order_after_last).
  unsigned long long order_after_last(int op, cudaStream_t stream);         // the stream's capture id, 0 = eager
  void mark_last(int op, cudaStream_t stream, unsigned long long capture);  // records last_[op] on stream
  cudaEvent_t last_[kNumOps] = {nullptr, nullptr};                          // recorded after each launch of the kind
  cudaStream_t last_stream_[kNumOps] = {nullptr, nullptr};
  unsigned long long last_capture_[kNumOps] = {0, 0};  // capture id of that launch, 0 = eager
  bool launched_[kNumOps] = {false, false};
};

}  // namespace ultracomm::gpu
