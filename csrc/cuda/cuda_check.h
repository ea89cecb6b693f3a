// CUDA runtime error checks for the host side of _cuda: a failed call throws with the call,
// the runtime's message and where, so the Python layer raises it as a RuntimeError.
#pragma once
#include <cuda_runtime_api.h>

#include <stdexcept>
#include <string>

namespace ultracomm::gpu {

struct CudaError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

[[noreturn]] inline void throw_cuda(cudaError_t e, const char* call, const char* file, int line) {
  throw CudaError(std::string("ultracomm._cuda: ") + call + " failed: " + cudaGetErrorName(e) + " (" +
                  cudaGetErrorString(e) + ") at " + file + ":" + std::to_string(line));
}

}  // namespace ultracomm::gpu

#define UC_CUDA_CHECK(call)                                                                       \
  do {                                                                                            \
    const cudaError_t uc_err_ = (call);                                                           \
    if (uc_err_ != cudaSuccess) ::ultracomm::gpu::throw_cuda(uc_err_, #call, __FILE__, __LINE__); \
  } while (0)
