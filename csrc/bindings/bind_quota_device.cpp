// _core.quota_device: the host build of the device control plane's quota planner
// (include/ultracomm/impl/quota_plan.h), the same plan() the GPU kernel runs: by default one thread
// (SerialCta: one probe group of one lane, a round's thresholds in turn); with lanes > 1 or
// groups > 1, groups x lanes host threads standing in for the kernel's warps and their lanes
// (csrc/planners/quota_lanes.h; tests compare every shape byte for byte).
// _core.quota_device_smem_bytes: the kernel's dynamic shared memory for a shape (k_quota.cu
// launches with it, or falls back to global scratch above the device's limit).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "planners/quota_lanes.h"
#include "ultracomm/impl/quota_plan.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

const char* status_text(int32_t s) {
  switch (s) {
    case quota::kBadShape:
      return "world, experts_per_rank or slots outside the planner's capacity";
    case quota::kBadLoad:
      return "an expert load is negative, or the total is above 2**48 tokens";
    case quota::kBadOption:
      return "min_tokens must be in [1, 2**48], tol in [0, 2**48]";
    case quota::kBadNode:
      return "node_of has a negative node";
    default:
      return "unknown status";
  }
}

py::tuple quota_device(I64 expert_load, py::object node_of, int64_t world, int64_t experts_per_rank, int64_t slots,
                       int64_t min_tokens, int64_t tol, int64_t eps_bp, int64_t lanes, int64_t groups) {
  if (world < 1 || world > quota::kMaxWorld || experts_per_rank < 1 || slots < 0 || slots > quota::kMaxSlots ||
      world * experts_per_rank > quota::kMaxExperts)
    throw std::invalid_argument("quota_device: " + std::string(status_text(quota::kBadShape)) + " (world <= " +
                                std::to_string(quota::kMaxWorld) + ", slots <= " + std::to_string(quota::kMaxSlots) +
                                ", experts <= " + std::to_string(quota::kMaxExperts) + ")");
  if (expert_load.ndim() != 1 || expert_load.shape(0) != world * experts_per_rank)
    throw std::invalid_argument("quota_device: expert_load must be int64 [world * experts_per_rank]");
  if (eps_bp < 0 || eps_bp > 10000) throw std::invalid_argument("quota_device: eps_bp must be in [0, 10000]");
  if (lanes < 1 || lanes > 64) throw std::invalid_argument("quota_device: lanes must be in [1, 64]");
  if (groups < 1 || groups > quota::kProbes)
    throw std::invalid_argument("quota_device: groups must be in [1, " + std::to_string(quota::kProbes) + "]");
  I32 node;
  quota::Problem p{static_cast<int32_t>(world),
                   static_cast<int32_t>(experts_per_rank),
                   static_cast<int32_t>(slots),
                   min_tokens,
                   tol,
                   static_cast<int32_t>(eps_bp),
                   expert_load.data(),
                   nullptr};
  if (!node_of.is_none()) {
    node = node_of.cast<I32>();
    if (node.ndim() != 1 || node.shape(0) != world)
      throw std::invalid_argument("quota_device: node_of must be int32 [world]");
    p.node_of = node.data();
  }
  const int32_t W = p.world, E = p.experts(), K = p.slots, G = static_cast<int32_t>(groups);
  std::vector<int64_t> scratch(quota::scratch_words(W, E, K, G));
  I32 src({world, slots});
  I64 q({world, slots});
  const quota::Plan out{src.mutable_data(), q.mutable_data()};
  quota::Result res{};
  {
    py::gil_scoped_release rel;
    quota::Round rd{};
    if (lanes == 1 && G == 1) {
      res = quota::plan(p, scratch.data(), out, rd, quota::SerialCta{});
    } else {
      const int32_t n = static_cast<int32_t>(lanes) * G;
      quota::ThreadCtaShared shared(G, static_cast<int32_t>(lanes));
      std::vector<quota::Result> got(n);
      std::vector<std::thread> threads;
      for (int32_t i = 0; i < n; ++i)
        threads.emplace_back([&, i] {
          got[i] =
              quota::plan(p, scratch.data(), out, rd, quota::ThreadCta{&shared, i, G, static_cast<int32_t>(lanes)});
        });
      for (auto& t : threads) t.join();
      res = got[0];
      for (int32_t i = 1; i < n; ++i)  // every thread must reach the same answer
        if (got[i].status != res.status || got[i].threshold != res.threshold || got[i].probes != res.probes ||
            got[i].rounds != res.rounds || got[i].replicas != res.replicas)
          throw std::logic_error("quota_device: lanes disagree");
    }
  }
  if (res.status != quota::kOk) throw std::invalid_argument(std::string("quota_device: ") + status_text(res.status));
  py::dict info;
  info["threshold"] = res.threshold;
  info["probes"] = res.probes;
  info["rounds"] = res.rounds;
  info["replicas"] = res.replicas;
  return py::make_tuple(src, q, info);
}

}  // namespace

void bind_quota_device(py::module_& m) {
  m.def("quota_device", &quota_device, py::arg("expert_load"), py::arg("node_of"), py::arg("world"),
        py::arg("experts_per_rank"), py::arg("slots"), py::arg("min_tokens"), py::arg("tol"), py::arg("eps_bp"),
        py::arg("lanes") = 1, py::arg("groups") = 1,
        "Device quota planner, host build: (slot_src [W, K] int32, slot_quota [W, K] int64, info); lanes x "
        "groups host threads stand in for the kernel's warps (any shape gives the same plan).");
  m.def(
      "quota_device_smem_bytes",
      [](int64_t world, int64_t experts, int64_t slots) {
        if (world < 1 || world > quota::kMaxWorld || experts < 1 || experts > quota::kMaxExperts || slots < 0 ||
            slots > quota::kMaxSlots)
          throw std::invalid_argument("quota_device_smem_bytes: shape outside the planner's capacity");
        return 8 * quota::smem_words(static_cast<int32_t>(world), static_cast<int32_t>(experts),
                                     static_cast<int32_t>(slots));
      },
      py::arg("world"), py::arg("experts"), py::arg("slots"),
      "Dynamic shared memory (bytes) of the GPU quota kernel with its whole state in shared memory "
      "(csrc/cuda/k_quota.cu; above the device's per-block limit it runs on global scratch).");
  m.attr("QUOTA_DEVICE_PROBES") = quota::kProbes;
  m.attr("QUOTA_DEVICE_MAX_WORLD") = quota::kMaxWorld;
  m.attr("QUOTA_DEVICE_MAX_EXPERTS") = quota::kMaxExperts;
  m.attr("QUOTA_DEVICE_MAX_SLOTS") = quota::kMaxSlots;
}

}  // namespace ultracomm
