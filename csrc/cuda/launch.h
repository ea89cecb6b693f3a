// Host-side declarations of the kernels' launchers (defined beside each kernel in k_*.cu) for
// the runner and the bindings.  Launchers only enqueue: no allocation, no synchronisation, so
// they can be captured in a CUDA graph.  Errors of the launch itself are thrown (CudaError).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "load_exchange.h"
#include "mover_limits.h"
#include "persistent_args.h"
#include "ultracomm/impl/quota_plan.h"
#include "ultracomm/records/window_layout.h"

namespace ultracomm::gpu {

// The TMA rings of the persistent kernel on one device, as dynamic shared memory bytes (0: no
// ring, the vector path; always 0 before sm_90): `deep` for one CTA per SM, `shared` for two
// (loopback grids larger than the SM count), each the most stages (<= kTmaStages /
// kTmaStagesShared) the device's shared memory holds beside the kernels' static shared memory.
struct PersistentRings {
  uint32_t deep = 0;
  uint32_t shared = 0;
  int sms = 0;  // the device's SM count
  // The ring a launch runs: the shared one when its grid, every rank's CTAs, is a loopback grid
  // larger than the SM count (persistent_args.h shared_ring), else the deep one.
  uint32_t pick(const PersistentArgs& a) const { return shared_ring(a, sms) ? shared : deep; }
};

// Per device, once: size the rings to the device and allow each persistent kernel the deep one.
PersistentRings setup_persistent(int device, int cc_major);

// CTAs of the persistent kernel for grad_dtype that can be resident at once on the device of
// `rings` (occupancy per SM with the shared ring x SMs): a loopback launch needs all its CTAs
// co-resident.
int persistent_max_coresident(const PersistentRings& rings, int grad_dtype);

// Enqueues one persistent launch: grid = launch_grid(a), every rank's CTAs (persistent_args.h
// set_cta_layout), with `smem_bytes` of dynamic shared memory (PersistentRings::pick; the mover
// sizes its ring from it).  grad_dtype selects the instantiation (multicast uses fp32's).
// cooperative: launch with the cooperative attribute, which guarantees co-residency or fails
// (loopback).
void launch_persistent(const PersistentArgs& a, int grad_dtype, uint32_t smem_bytes, bool cooperative,
                       cudaStream_t stream);

// Enqueues interp.h's publish_rejection for op at epoch in the window at own_base (device
// address): kRejectedDigest beside ready[op] = epoch (k_reject.cu).
void launch_reject(Op op, uint64_t epoch, uintptr_t own_base, const WindowLayout& layout, cudaStream_t stream);

// Enqueues one expert-load exchange (k_loads.cu; protocol in load_exchange.h): grid = a.nranks
// CTAs, one per rank entry.  The caller validated the arguments (bind_cuda.cpp).
void launch_load_exchange(const LoadExchangeArgs& a, cudaStream_t stream);

// Microbenchmarks (perf/bench_gpu.py).
void launch_empty(cudaStream_t stream);  // launch floor: one CTA, one thread, no work

// Two CTAs bounce a system-scope release/acquire flag pair `iters` times: CTA 0 writes
// ping = i and waits for pong >= i, CTA 1 the mirror.  out[0] = CTA 0's elapsed globaltimer
// ns, out[1] = 0 on success or the iteration at which a wait passed timeout_ns (+1).  ping/pong
// must be 8-byte aligned, zero before the first launch, and on different 128-byte lines;
// successive launches continue from the values left (base = first value to write).
void launch_flag_pingpong(uint64_t* ping, uint64_t* pong, uint64_t base, int64_t iters, uint64_t timeout_ns,
                          uint64_t* out, cudaStream_t stream);

// The device quota planner (k_quota.cu, include/ultracomm/impl/quota_plan.h): every pointer is
// device memory.  loads: int32 [world, E] gathered token counts; expert_load: int64 [E]
// written (per-expert totals); node_of: int32 [world] or nullptr; scratch:
// quota_scratch_bytes(); slot_src int32 / slot_quota int64 [world, slots] and result written.
struct QuotaArgs {
  const int32_t* loads;
  int64_t* expert_load;
  const int32_t* node_of;
  int64_t* scratch;
  int32_t* slot_src;
  int64_t* slot_quota;
  quota::Result* result;
  int32_t world, experts_per_rank, slots;
  int64_t min_tokens, tol;
  int32_t eps_bp;
};
int64_t quota_scratch_bytes(int32_t world, int32_t experts, int32_t slots);

// Device reroute (k_reroute.cu, include/ultracomm/impl/token_split.h): source rank `rank`'s
// RerouteTable, bounds / columns int64 [E, world], from loads int32 [world, E] and the plan
// (slot_src int32, slot_quota int64 [world, slots]); scratch: reroute_scratch_bytes().
struct RerouteArgs {
  const int32_t* loads;
  const int32_t* slot_src;
  const int64_t* slot_quota;
  int64_t* scratch;
  int64_t* bounds;
  int64_t* columns;
  int32_t world, experts_per_rank, slots, rank, layout;
};
int64_t reroute_scratch_bytes(int32_t world, int32_t experts);
void launch_reroute_table(const RerouteArgs& a, cudaStream_t stream);
void launch_quota_plan(const QuotaArgs& a, cudaStream_t stream);

}  // namespace ultracomm::gpu
