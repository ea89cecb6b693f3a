// Programmatic dependent launch (PDL, sm_90+) of the device control plane's kernels (issue 33):
// k_load_exchange -> k_quota_plan -> k_build_slot -> k_reroute_table, enqueued back to back on one
// stream (and captured so into a CUDA graph), may overlap each kernel's launch and preamble with
// its predecessor's tail.  The dependents (k_quota_plan, k_build_slot, k_reroute_table) are
// launched with cudaLaunchAttributeProgrammaticStreamSerialization; each one's threads first run
// griddepcontrol.wait (dev::grid_dependency_wait, ptx_extra.cuh), which returns once the
// stream's previous kernel has COMPLETED and its memory is visible, before they read or write
// anything -- so whatever precedes them on the stream (the previous kernel of the chain, or any
// other kernel) is safe, and the chain is transitive (a kernel completes only after its own wait,
// so k_reroute's wait also covers the exchange's gathered loads).  Each kernel of the chain then
// runs griddepcontrol.launch_dependents (dev::launch_dependents), letting the next one be
// scheduled while it works; its CTAs wait in griddepcontrol.wait.  k_load_exchange itself is
// launched without the attribute (its predecessor is the caller's work; a loopback exchange is a
// cooperative launch) but waits and triggers the same way.
//
// Where: devices of compute capability 9.0 or newer (older ones launch as before; their builds
// hold no griddepcontrol instruction), and only while the process-wide switch is on -- set from
// ULTRACOMM_PDL (python/ultracomm/env.py) when ultracomm._cuda is first loaded
// (ultracomm.cuda.support), default on; _cuda.set_programmatic_launch changes it (the bench
// times the control graph both ways).  Host side only: no stream work, so a capture may call it.
#pragma once
#include <cuda_runtime_api.h>
#if defined(__CUDACC__)
#include <cuda_runtime.h>
#endif

#include <atomic>

#include "cuda_check.h"

namespace ultracomm::gpu {

inline std::atomic<bool> g_programmatic_launch{true};
constexpr int kPdlMaxDevices = 64;
inline std::atomic<int> g_cc_major[kPdlMaxDevices];  // 0: not queried yet

inline void set_programmatic_launch(bool on) { g_programmatic_launch.store(on, std::memory_order_relaxed); }
inline bool programmatic_launch_enabled() { return g_programmatic_launch.load(std::memory_order_relaxed); }

// Compute capability major of `device`, cached.
inline int cc_major_of(int device) {
  if (device < 0 || device >= kPdlMaxDevices) {
    int major = 0;
    UC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
    return major;
  }
  int major = g_cc_major[device].load(std::memory_order_relaxed);
  if (major > 0) return major;
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  g_cc_major[device].store(major, std::memory_order_relaxed);
  return major;
}

// Whether control-plane launches on `device` use PDL now: the switch, and sm_90 or newer.
inline bool programmatic_launch_on(int device) { return programmatic_launch_enabled() && cc_major_of(device) >= 9; }

// The same for the current device (what the launchers ask).
inline bool programmatic_launch_here() {
  if (!programmatic_launch_enabled()) return false;
  int device = 0;
  UC_CUDA_CHECK(cudaGetDevice(&device));
  return cc_major_of(device) >= 9;
}

#if defined(__CUDACC__)
// Enqueues kernel<<<grid, block, smem, stream>>>(args...) -- with the PDL attribute when `pdl`
// (programmatic_launch_here() at the launcher: the kernel must begin with grid_dependency_wait).
template <class... KArgs, class... Args>
void launch_programmatic(bool pdl, void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t stream,
                         Args&&... args) {
  cudaLaunchConfig_t cfg{};
  cfg.gridDim = grid;
  cfg.blockDim = block;
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = pdl ? 1 : 0;
  UC_CUDA_CHECK(cudaLaunchKernelEx(&cfg, kernel, static_cast<Args&&>(args)...));
}
#endif

}  // namespace ultracomm::gpu
