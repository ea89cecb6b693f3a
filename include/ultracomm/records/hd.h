// Host/device qualifiers for headers compiled by both g++ (host executor) and nvcc (kernel).
// No CUDA include: under g++ every macro is empty (or plain `inline`).
#pragma once

#if defined(__CUDACC__)
#define UC_HD __host__ __device__
#define UC_INLINE __host__ __device__ __forceinline__
#else
#define UC_HD
#define UC_INLINE inline
#endif

// Unroll a loop over a constant bound: a small array indexed by it stays in registers on the
// device (a runtime-bounded loop puts it in local memory, which the CUDA build refuses).
// Device pass only: the host compilers warn about an unknown pragma.
#if defined(__CUDA_ARCH__)
#define UC_UNROLL _Pragma("unroll")
#else
#define UC_UNROLL
#endif

// Debug-only invariant check; compiled out unless ULTRACOMM_DEBUG_ASSERT is defined (never
// in release: a device trap would kill the context).
#if defined(ULTRACOMM_DEBUG_ASSERT) && !defined(__CUDA_ARCH__)
#include <cassert>
#define UC_ASSERT(x) assert(x)
#else
#define UC_ASSERT(x) ((void)0)
#endif
