// DevicePlan: one operation's per-rank ExecViews and every array they point to (window
// bases, master pointers, slot tables, tasks, refs), uploaded once into ONE device allocation.
// A launch then only passes the views' device address: no per-launch upload or allocation
// (the Python layer caches plans by schedule digest).
#pragma once
#include <cstddef>
#include <cstdint>
#include <vector>

#include "ultracomm/exec_view.h"
#include "ultracomm/host_executor.h"

namespace ultracomm::gpu {

class DevicePlan {
 public:
  // ranks: the ranks one launch runs (1, or a loopback world), all of one op, world, layout
  // and grad dtype; each validated as run_host validates (std::invalid_argument before
  // anything is allocated).  Addresses in them are the device's (window bases as this device
  // addresses each rank's window).  Allocates on the current device and copies synchronously.
  explicit DevicePlan(const std::vector<ExecArgs>& ranks);
  ~DevicePlan();
  DevicePlan(const DevicePlan&) = delete;
  DevicePlan& operator=(const DevicePlan&) = delete;

  const ExecView* views() const { return views_; }  // device memory, [nranks]
  int nranks() const { return nranks_; }
  Op op() const { return op_; }
  int grad_dtype() const { return grad_dtype_; }
  int device() const { return device_; }
  size_t bytes() const { return bytes_; }

 private:
  void* blob_ = nullptr;
  const ExecView* views_ = nullptr;
  int nranks_ = 0;
  Op op_ = Op::kMulticast;
  int grad_dtype_ = 0;
  int device_ = 0;
  size_t bytes_ = 0;
};

}  // namespace ultracomm::gpu
