// The persistent kernel's argument struct and the state a launch shares with the next one:
// plain structs, identical for nvcc and g++ (the launcher and the bindings fill them).
//
// Epochs.  A launch runs epoch e = max(args.epoch, last epoch its ranks ran + 1): eager
// launches get the Context's epoch, and a CUDA graph replay (whose arguments are frozen at
// capture) still runs a fresh, larger epoch on every rank (all ranks replay the same
// sequence).  The launch's last CTA records e for its ranks and resets the claim counters, so
// nothing is reset from the host (no memset node, no allocation, graph-capturable).
#pragma once
#include <cstdint>
#include <type_traits>

#include "ultracomm/records/error_record.h"
#include "ultracomm/records/exec_view.h"
#include "ultracomm/records/hd.h"

namespace ultracomm {

constexpr int kMaxLoopbackRanks = 64;  // ranks one launch can run (one-GPU loopback domains)

// Per rank, own 64-byte line (claim counters are hot atomics).
struct alignas(64) RankState {
  uint64_t next_task;     // claim counter of this launch; 0 between launches
  uint64_t last_epoch;    // epoch of the last launch that ran this rank
  uint32_t done_workers;  // CTAs of this rank past run_tasks; the last one drains.  0 between
  uint32_t join_ticket;   // CTAs of this rank that started; ticket 0 joins.  0 between launches
  uint64_t pad[5];
};

// Device memory, zeroed once when the runner is created.
struct DeviceState {
  uint64_t abort_epoch;  // >= the running epoch: a group of this launch failed, all stop
  uint32_t done_ctas;    // CTAs of this launch that finished; the last one resets
  uint32_t pad0;
  uint64_t pad[6];
  RankState ranks[kMaxLoopbackRanks];
};

// Mapped host memory (cudaHostAlloc mapped): written only by the first failing group of a
// launch, read by the host after the stream reached the launch.
struct ErrorSlot {
  ErrorRecord rec;
  uint64_t epoch;  // written last: != 0 and new means "rec holds a failure of that epoch"
};

// Flags of PersistentArgs::flags.
constexpr uint32_t kForceVector = 1u;   // sm_90+: move every byte through the vector path (bench)
constexpr uint32_t kReduceStaged = 2u;  // sm_90+: reductions TMA-staged (run option reduce_path="tma"; the
                                        // launcher refuses it before sm_90), else register hunks

struct PersistentArgs {
  const ExecView* views;  // device memory, [nranks]: rank r's view (its epoch is replaced)
  DeviceState* state;     // device memory
  ErrorSlot* err;         // device pointer of mapped host memory
  uint64_t epoch;         // requested epoch (>= 1)
  int32_t nranks;         // ranks run by this launch: 1 (one process per GPU) or the loopback world
  int32_t ctas_per_rank;  // grid = nranks * ctas_per_rank; blockIdx.x = rank * ctas_per_rank + worker
  uint32_t flags;
  uint32_t pad;
};

// The epoch one launch runs, the same for every rank it runs: max(requested, each of its ranks'
// last epoch + 1).  One value per launch: loopback ranks wait on each other's flags for
// >= their own epoch (a rank one epoch ahead would wait forever on the others), and the abort
// word stops only groups whose epoch it reached.  Read before any CTA of the launch finished,
// recorded by the launch's last CTA, so every CTA computes the same value.
UC_INLINE uint64_t launch_epoch(const DeviceState& s, uint64_t requested, int32_t nranks) {
  uint64_t e = requested;
  for (int32_t r = 0; r < nranks && r < kMaxLoopbackRanks; ++r)
    if (s.ranks[r].last_epoch + 1 > e) e = s.ranks[r].last_epoch + 1;
  return e;
}

static_assert(std::is_trivially_copyable_v<PersistentArgs> && sizeof(PersistentArgs) <= 4096,
              "kernel arguments must be a small POD");
static_assert(std::is_trivially_copyable_v<ErrorSlot> && std::is_trivially_copyable_v<DeviceState>);
static_assert(sizeof(RankState) == 64 && alignof(DeviceState) == 64);

}  // namespace ultracomm
