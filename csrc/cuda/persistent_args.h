// The persistent kernel's argument struct and the state a launch shares with the next one:
// plain structs, identical for nvcc and g++ (the launcher and the bindings fill them).
//
// Epochs.  A launch runs epoch e = max(args.epoch, last epoch its ranks ran + 1): eager
// launches get the Context's epoch, and a CUDA graph replay (whose arguments are frozen at
// capture) still runs a fresh, larger epoch on every rank (all ranks replay the same
// sequence).  The launch's last CTA records e for its ranks and resets the claim counters, so
// nothing is reset from the host (no memset node, no allocation, graph-capturable).
#pragma once
#include <cstddef>
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

// The CTA layout.  Rank r runs blocks [cta_end[r - 1], cta_end[r]) (cta_end[-1] = 0), at least one
// each: the grid is cta_end[nranks - 1].  Ranks claim their tasks dynamically (interp.h run_tasks),
// so a rank's CTA count only sizes how many workers claim them and how many must pass run_tasks
// before its last one drains; a rank with no task in the op gets one CTA (it joins and drains)
// where the host knows the counts (runner.h launch_ctas).  Inline in the arguments, not in device
// memory: a graph-captured launch needs no buffer and no copy.  ctas_per_rank > 0: every rank has
// that many (the uniform fast path: rank = block / ctas_per_rank); 0: cta_end alone says.
struct PersistentArgs {
  const ExecView* views;  // device memory, [nranks]: rank r's view (its epoch is replaced)
  DeviceState* state;     // device memory
  ErrorSlot* err;         // device pointer of mapped host memory
  uint64_t epoch;         // requested epoch (>= 1)
  int32_t nranks;         // ranks run by this launch: 1 (one process per GPU) or the loopback world
  int32_t ctas_per_rank;  // > 0: uniform layout, that many CTAs per rank; 0: see cta_end
  uint32_t flags;
  uint32_t pad;
  int32_t cta_end[kMaxLoopbackRanks];  // exclusive prefix end of each rank's CTAs, [nranks] used
};

// The rank a block of the launch works for and that rank's CTA count.
struct CtaRank {
  int32_t rank;
  int32_t ctas;
};

// Kernel prologue: block -> (rank, its CTAs).  Uniform: one division; else a binary search for
// the first rank whose end is past the block (<= 6 reads of the argument array, which the
// kernel's __grid_constant__ parameter serves from the parameter space).
UC_INLINE CtaRank cta_rank(const PersistentArgs& a, int32_t block) {
  if (a.ctas_per_rank > 0) return {block / a.ctas_per_rank, a.ctas_per_rank};
  int32_t lo = 0, hi = a.nranks - 1;
  while (lo < hi) {
    const int32_t mid = (lo + hi) / 2;
    if (a.cta_end[mid] > block)
      hi = mid;
    else
      lo = mid + 1;
  }
  return {lo, a.cta_end[lo] - (lo > 0 ? a.cta_end[lo - 1] : 0)};
}

// The launch's grid: every rank's CTAs.
UC_INLINE int64_t launch_grid(const PersistentArgs& a) { return a.nranks > 0 ? a.cta_end[a.nranks - 1] : 0; }

// Whether a launch runs the shared (shallower) TMA ring, two CTAs an SM: a loopback launch
// (nranks > 1, every CTA co-resident) whose grid exceeds the device's SMs (launch.h
// PersistentRings::pick).
UC_INLINE bool shared_ring(const PersistentArgs& a, int32_t sms) { return a.nranks > 1 && launch_grid(a) > sms; }

// Host: a's layout from rank r's CTA count ctas[r], r < nranks (the caller checked 1 <= nranks <=
// kMaxLoopbackRanks, every count >= 1 and the sum < 2^31).  Sets nranks, cta_end and
// ctas_per_rank (the count when all are equal, else 0); returns the grid.
inline int64_t set_cta_layout(PersistentArgs& a, const int32_t* ctas, int32_t nranks) {
  a.nranks = nranks;
  a.ctas_per_rank = ctas[0];
  int32_t end = 0;
  for (int32_t r = 0; r < nranks; ++r) {
    end += ctas[r];
    a.cta_end[r] = end;
    if (ctas[r] != ctas[0]) a.ctas_per_rank = 0;
  }
  for (int32_t r = nranks; r < kMaxLoopbackRanks; ++r) a.cta_end[r] = end;
  return end;
}

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
static_assert(offsetof(PersistentArgs, cta_end) == 48 && sizeof(PersistentArgs) == 48 + 4 * kMaxLoopbackRanks,
              "tests/cuda/test_cuda_build.py looks for the layout reads at these parameter offsets");
static_assert(std::is_trivially_copyable_v<ErrorSlot> && std::is_trivially_copyable_v<DeviceState>);
static_assert(sizeof(RankState) == 64 && alignof(DeviceState) == 64);

}  // namespace ultracomm
