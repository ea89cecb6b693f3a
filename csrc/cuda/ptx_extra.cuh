// The PTX the device movers issue, under names that say what they do.  Everything here is a
// thin wrapper over libcu++'s `cuda::ptx` (one function per PTX instruction, CCCL ships with
// nvcc) or an intrinsic; this is also the ONLY file allowed to hold inline asm (a test greps
// for `asm`): no instruction used so far lacks a wrapper, so there is none.  If one is added,
// it goes here with the PTX it emits and why no `cuda::ptx` wrapper serves.
//
// Bulk copies (sm_90+, the TMA engine's 1D form): addresses 16-byte aligned, sizes multiples
// of 16 (nothing checks this at compile time; the movers route the rest through vector ld/st).
#pragma once
#include <cuda/ptx>
#include <nv/target>

#include <cstdint>

namespace ultracomm::dev {

// cp.async.bulk.shared::cta.global.mbarrier::complete_tx::bytes [smem], [gmem], bytes, [bar]
// global -> shared; completion is counted on `bar` (see bar_expect_tx).
__device__ __forceinline__ void bulk_load(void* smem, const void* gmem, uint32_t bytes, uint64_t* bar) {
  NV_IF_TARGET(NV_PROVIDES_SM_90,
               (cuda::ptx::cp_async_bulk(cuda::ptx::space_shared, cuda::ptx::space_global, smem, gmem, bytes, bar);))
}

// cp.async.bulk.global.shared::cta.bulk_group [gmem], [smem], bytes: shared -> global (the
// destination may be an NVLink-mapped peer address); tracked by bulk_commit's groups.
__device__ __forceinline__ void bulk_store(void* gmem, const void* smem, uint32_t bytes) {
  NV_IF_TARGET(NV_PROVIDES_SM_90,
               (cuda::ptx::cp_async_bulk(cuda::ptx::space_global, cuda::ptx::space_shared, gmem, smem, bytes);))
}

// cp.async.bulk.commit_group: the stores issued since the last commit form one group.
__device__ __forceinline__ void bulk_commit() {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (cuda::ptx::cp_async_bulk_commit_group();))
}

// cp.async.bulk.wait_group.read N: all but the newest N groups have finished READING shared
// memory (their stage may be refilled); their global writes may still be in flight.
template <int N>
__device__ __forceinline__ void bulk_wait_read() {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (cuda::ptx::cp_async_bulk_wait_group_read(cuda::ptx::n32_t<N>{});))
}

// The same with N known at run time (0 <= n <= Max): one wait_group.read per case, N being an
// immediate of the instruction.
template <int Max>
__device__ __forceinline__ void bulk_wait_read_newer(uint32_t n) {
  if constexpr (Max > 0) {
    if (n < static_cast<uint32_t>(Max)) return bulk_wait_read_newer<Max - 1>(n);
  }
  bulk_wait_read<Max>();
}

// cp.async.bulk.wait_group 0 (not .read): every committed store is complete, i.e. its writes
// are performed; completion also orders them before this thread's later generic operations
// (GPU_NOTES: publish = this, then st.release.sys of the flag).
__device__ __forceinline__ void bulk_wait_all() {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (cuda::ptx::cp_async_bulk_wait_group(cuda::ptx::n32_t<0>{});))
}

// mbarrier.init.shared.b64 [bar], count; then fence.mbarrier_init.release.cluster so the
// async proxy (the bulk loads' complete_tx) sees the initialised barrier.
__device__ __forceinline__ void bar_init(uint64_t* bar, uint32_t count) {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (cuda::ptx::mbarrier_init(bar, count);
                                   cuda::ptx::fence_mbarrier_init(cuda::ptx::sem_release, cuda::ptx::scope_cluster);))
}

// mbarrier.arrive.expect_tx.release.cta.shared::cta.b64: this thread's arrival (count 1) plus
// `bytes` of transactions the phase must also see before it completes.
__device__ __forceinline__ void bar_expect_tx(uint64_t* bar, uint32_t bytes) {
  NV_IF_TARGET(NV_PROVIDES_SM_90,
               ((void)cuda::ptx::mbarrier_arrive_expect_tx(cuda::ptx::sem_release, cuda::ptx::scope_cta,
                                                           cuda::ptx::space_shared, bar, bytes);))
}

// mbarrier.try_wait.parity.shared::cta.b64: true once the phase with this parity completed
// (the hardware suspends the thread for a while before returning false).
__device__ __forceinline__ bool bar_try_wait(uint64_t* bar, uint32_t parity) {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (return cuda::ptx::mbarrier_try_wait_parity(bar, parity);), (return true;))
}

// fence.proxy.async.global: generic-proxy writes this thread has observed (a peer's data,
// published by the flag it just acquired) become visible to its later async-proxy (bulk)
// reads of global memory.
__device__ __forceinline__ void fence_async_global() {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (cuda::ptx::fence_proxy_async(cuda::ptx::space_global);))
}

// fence.proxy.async.shared::cta: this thread's generic-proxy accesses of shared memory (and,
// after a barrier, those of the threads it synchronised with) are ordered before its later
// async-proxy ones -- the staged reduce's ld.shared reads of a stage before the bulk load that
// refills it.
__device__ __forceinline__ void fence_async_shared() {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (cuda::ptx::fence_proxy_async(cuda::ptx::space_shared);))
}

// mov.u32 %dynamic_smem_size: the dynamic shared memory this launch gave the CTA (the TMA
// ring sizes itself from it).
__device__ __forceinline__ uint32_t dynamic_smem_bytes() { return cuda::ptx::get_sreg_dynamic_smem_size(); }

// mov.u64 %globaltimer: nanoseconds, the clock device waits time out against.
__device__ __forceinline__ uint64_t globaltimer_ns() { return cuda::ptx::get_sreg_globaltimer(); }

// Programmatic dependent launch (csrc/cuda/pdl.h).  No cuda::ptx wrapper exists for these; the
// CUDA runtime's device functions (cuda_device_runtime_api.h) are the wrappers.  sm_90+ only:
// older targets compile to nothing (and their launches never carry the PDL attribute).
//
// griddepcontrol.wait: this thread waits until the grids this launch depends on programmatically
// have completed and their memory operations are visible; returns at once when there are none
// (a launch without the attribute, or a predecessor that already completed).
__device__ __forceinline__ void grid_dependency_wait() {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (cudaGridDependencySynchronize();))
}

// griddepcontrol.launch_dependents: the stream's next kernel, if launched with the PDL attribute,
// may be scheduled once every CTA of this grid issued it or exited (no memory visibility: the
// dependent's grid_dependency_wait gives that).  Later calls by the CTA do nothing more.
__device__ __forceinline__ void launch_dependents() {
  NV_IF_TARGET(NV_PROVIDES_SM_90, (cudaTriggerProgrammaticLaunchCompletion();))
}

}  // namespace ultracomm::dev
