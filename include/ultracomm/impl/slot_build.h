// The device step's schedule, written where the persistent kernel reads it: the portable builder
// (sched_build.h) run into this rank's ExecViews of one plan-arena slot (both op kinds), so a
// plan made on the GPU never visits the host.  Compiled by g++ (`_core.build_into_views`, what
// the CPU tests run) and by nvcc (csrc/cuda/k_build.cu `k_build_slot`), like sched_build.h.
//
// The views' static part -- op, rank, world, layout, window bases, members, master pointers,
// local_index_of, grad dtype, timeout -- is the host's, written once per slot at setup
// (PlanArena::write_template).  Its arrays are at capacity: `tasks` holds task_cap Tasks,
// `refs` ref_cap Refs, `my_slots` and `slot_parent` the layout's slots.  This file writes the
// rest, per op: the task and ref lists, my_slots (the plan's row of this rank), slot_parent
// (each own slot's parent rank in that op's tree), num_tasks, num_refs and the digest.  Like the
// builder it runs on a lane group (sched_group.h): the kernel's CTA, one host lane, or host
// threads in tests; every lane calls it and gets the same Result.
//
// A build that fails (a plan the builder refuses, lists beyond the capacities) writes no task
// and the rejected digest: the rank publishes a rejection at its join, so peers raise PlanError
// "rank r rejected its plan" instead of timing out; the Result says why (status).  So does a
// build whose inputs failed upstream (`upstream`: the loads' exchange timed out, the planner
// refused the loads): nothing is built from partial or stale inputs.
#pragma once
#include <cstdint>

#include "ultracomm/records/error_record.h"
#include "ultracomm/records/exec_view.h"
#include "ultracomm/impl/sched_build.h"

namespace ultracomm::psched {

// Statuses beyond sched_build.h's: the build's inputs failed before it ran.
constexpr int32_t kExchangeFailed = 6;  // the loads' all-gather timed out (a rank never posted)
constexpr int32_t kPlanFailed = 7;      // the planner refused the loads
constexpr int32_t kRanksOutOfStep = 8;  // the loads' exchange found a rank on another layer or micro-batch

// The build's `upstream` from its inputs' status words (either may be null): the loads' exchange
// status (nonzero: it failed), the planner's result words (low 32 bits of [0]: its status).
UC_INLINE int32_t upstream_status(const int32_t* exchange_status, const int64_t* plan_result) {
  // the exchange's status word: 1 a rank never posted, 2 a rank posted another exchange's tag
  if (exchange_status != nullptr && *exchange_status != 0)
    return *exchange_status == 2 ? kRanksOutOfStep : kExchangeFailed;
  if (plan_result != nullptr && (*plan_result & 0xffffffff) != 0) return kPlanFailed;
  return 0;
}

struct SlotCaps {
  int64_t task_cap[2];  // per op: Tasks the view's task array holds
  int64_t ref_cap[2];   // per op: Refs its ref array holds
};

// What builds report to the host (in mapped host memory).  `result` / `generation`: the last
// build (the generation incremented after its result).  `failed` / `failed_seq`: the last FAILED
// build, behind a sequence lock -- failed_seq is odd while `failed` is written and even after,
// failed_seq / 2 failures so far -- so a failure stays visible however many builds (graph
// replays, steps) run before the host looks, and the host never takes a half-written record.
struct BuildReport {
  Result result;
  uint64_t generation;
  Result failed;
  uint64_t failed_seq;
};

// On block g (every lane).  views[0]: the multicast view, views[1]: the reduce view (this rank's
// entry of each area).  Scratch: scratch_words(world, slots, experts, warps) int64 words (warps as
// build()).  upstream: 0, or kExchangeFailed / kPlanFailed / kRanksOutOfStep (then nothing is built).
template <class G>
UC_INLINE Result build_into_views(const Problem& p, int64_t* scratch, ExecView* const views[2], const SlotCaps& caps,
                                  int32_t upstream, const G& g, int32_t warps = 0) {
  // the view's shape must be the problem's: a template of another Context never gets a list
  bool fits = true;
  UC_UNROLL
  for (int op = 0; op < 2; ++op)
    fits = fits && views[op]->rank == p.rank && views[op]->world == p.world && views[op]->layout.slots == p.slots;
  Result res{};
  if (upstream != 0) {
    res.status = upstream;
  } else if (!fits) {
    res.status = kBadShape;
  } else {
    const OpOut mc{const_cast<Task*>(views[0]->tasks), caps.task_cap[0], const_cast<Ref*>(views[0]->refs),
                   caps.ref_cap[0]};
    const OpOut rd{const_cast<Task*>(views[1]->tasks), caps.task_cap[1], const_cast<Ref*>(views[1]->refs),
                   caps.ref_cap[1]};
    res = build(p, scratch, mc, rd, g, warps);
  }
  const int64_t S = p.slots;
  UC_UNROLL
  for (int op = 0; op < 2; ++op) {
    ExecView* v = views[op];
    int32_t* my = const_cast<int32_t*>(v->my_slots);
    int32_t* parent = const_cast<int32_t*>(v->slot_parent);
    const int32_t* pr = res.status == kOk
                            ? chosen(view(scratch, p.world, p.slots, p.num_experts, candidate_warps(g, warps)), op)
                            : nullptr;
    // the view's own slots (a failed build clears them: the rank's drain then waits on nothing)
    const int64_t n = v->layout.slots < S ? v->layout.slots : S;
    for (int64_t s = g.lane(); s < n; s += g.width()) {
      my[s] = res.status == kOk ? p.slot_src[int64_t(p.rank) * S + s] : -1;
      if (parent != nullptr) parent[s] = pr != nullptr ? pr[int64_t(p.rank) * S + s] : -1;
    }
    if (g.lane() == 0) {
      v->num_tasks = res.status == kOk ? res.num_tasks[op] : 0;
      v->num_refs = res.status == kOk ? res.num_refs[op] : 0;
      v->digest = res.status == kOk ? res.digest : kRejectedDigest;
    }
  }
  g.sync();  // every view write is done before the caller reports the build
  return res;
}

// The one-lane build (the host's default).
UC_INLINE Result build_into_views(const Problem& p, int64_t* scratch, ExecView* const views[2], const SlotCaps& caps,
                                  int32_t upstream = 0) {
  return build_into_views(p, scratch, views, caps, upstream, SerialGroup{});
}

}  // namespace ultracomm::psched
