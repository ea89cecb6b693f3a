// Host-side declarations of the kernels' launchers (defined beside each kernel in k_*.cu) for
// the runner and the bindings.  Launchers only enqueue: no allocation, no synchronisation, so
// they can be captured in a CUDA graph.  Errors of the launch itself are thrown (CudaError).
#pragma once
#include <cuda_runtime_api.h>

#include <cstdint>

#include "mover_limits.h"
#include "persistent_args.h"
#include "ultracomm/window_layout.h"

namespace ultracomm::gpu {

// Per device, once: allow each persistent kernel the dynamic shared memory its mover needs.
void setup_persistent(int cc_major);

// Dynamic shared memory a launch on a device of compute capability cc_major needs
// (TmaMover's stages on sm_90+, none for VecMover).
uint32_t persistent_smem_bytes(int cc_major);

// CTAs of the persistent kernel for grad_dtype that can be resident at once on `device`
// (occupancy per SM x SMs): a loopback launch needs all its CTAs co-resident.
int persistent_max_coresident(int device, int cc_major, int grad_dtype);

// Enqueues one persistent launch: grid = a.nranks * a.ctas_per_rank.  grad_dtype selects the
// instantiation (multicast uses fp32's).  cooperative: launch with the cooperative attribute,
// which guarantees co-residency or fails (loopback).
void launch_persistent(const PersistentArgs& a, int grad_dtype, uint32_t smem_bytes, bool cooperative,
                       cudaStream_t stream);

// Enqueues interp.h's publish_rejection for op at epoch in the window at own_base (device
// address): kRejectedDigest beside ready[op] = epoch (k_reject.cu).
void launch_reject(Op op, uint64_t epoch, uintptr_t own_base, const WindowLayout& layout, cudaStream_t stream);

// Microbenchmarks (perf/bench_gpu.py).
void launch_empty(cudaStream_t stream);  // launch floor: one CTA, one thread, no work

// Two CTAs bounce a system-scope release/acquire flag pair `iters` times: CTA 0 writes
// ping = i and waits for pong >= i, CTA 1 the mirror.  out[0] = CTA 0's elapsed globaltimer
// ns, out[1] = 0 on success or the iteration at which a wait passed timeout_ns (+1).  ping/pong
// must be 8-byte aligned, zero before the first launch, and on different 128-byte lines;
// successive launches continue from the values left (base = first value to write).
void launch_flag_pingpong(uint64_t* ping, uint64_t* pong, uint64_t base, int64_t iters, uint64_t timeout_ns,
                          uint64_t* out, cudaStream_t stream);

}  // namespace ultracomm::gpu
