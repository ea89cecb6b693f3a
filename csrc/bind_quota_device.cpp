// _core.quota_device: the host build of the device control plane's quota planner
// (include/ultracomm/quota_plan.h), with one lane or with `lanes` host threads standing in
// for a warp (tests compare the two).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "planners/quota_lanes.h"
#include "ultracomm/quota_plan.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

const char* status_text(int32_t s) {
  switch (s) {
    case quota::kBadShape: return "world, experts_per_rank or slots outside the planner's capacity";
    case quota::kBadLoad: return "an expert load is negative, or the total is above 2**48 tokens";
    case quota::kBadOption: return "min_tokens must be in [1, 2**48], tol in [0, 2**48]";
    case quota::kBadNode: return "node_of has a negative node";
    default: return "unknown status";
  }
}

py::tuple quota_device(I64 expert_load, py::object node_of, int64_t world, int64_t experts_per_rank,
                       int64_t slots, int64_t min_tokens, int64_t tol, int64_t eps_bp, int64_t lanes) {
  if (world < 1 || world > quota::kMaxWorld || experts_per_rank < 1 || slots < 0 ||
      slots > quota::kMaxSlots || world * experts_per_rank > quota::kMaxExperts)
    throw std::invalid_argument("quota_device: " + std::string(status_text(quota::kBadShape)) +
                                " (world <= " + std::to_string(quota::kMaxWorld) + ", slots <= " +
                                std::to_string(quota::kMaxSlots) + ", experts <= " +
                                std::to_string(quota::kMaxExperts) + ")");
  if (expert_load.ndim() != 1 || expert_load.shape(0) != world * experts_per_rank)
    throw std::invalid_argument("quota_device: expert_load must be int64 [world * experts_per_rank]");
  if (eps_bp < 0 || eps_bp > 10000) throw std::invalid_argument("quota_device: eps_bp must be in [0, 10000]");
  if (lanes < 1 || lanes > 64) throw std::invalid_argument("quota_device: lanes must be in [1, 64]");
  I32 node;
  quota::Problem p{static_cast<int32_t>(world), static_cast<int32_t>(experts_per_rank),
                   static_cast<int32_t>(slots), min_tokens, tol, static_cast<int32_t>(eps_bp),
                   expert_load.data(), nullptr};
  if (!node_of.is_none()) {
    node = node_of.cast<I32>();
    if (node.ndim() != 1 || node.shape(0) != world)
      throw std::invalid_argument("quota_device: node_of must be int32 [world]");
    p.node_of = node.data();
  }
  const int32_t W = p.world, E = p.experts(), K = p.slots;
  std::vector<int64_t> scratch(quota::scratch_words(W, E, K, 1));
  quota::Result res{};
  {
    py::gil_scoped_release rel;
    if (lanes == 1) {
      res = quota::plan(p, scratch.data(), quota::SerialGroup{});
    } else {
      const int32_t n = static_cast<int32_t>(lanes);
      quota::ThreadShared shared(n);
      std::vector<quota::Result> out(n);
      std::vector<std::thread> threads;
      for (int32_t i = 0; i < n; ++i)
        threads.emplace_back([&, i] { out[i] = quota::plan(p, scratch.data(), quota::ThreadGroup{&shared, i, n}); });
      for (auto& t : threads) t.join();
      res = out[0];
      for (int32_t i = 1; i < n; ++i)  // every lane must reach the same answer
        if (out[i].status != res.status || out[i].threshold != res.threshold || out[i].probes != res.probes)
          throw std::logic_error("quota_device: lanes disagree");
    }
  }
  if (res.status != quota::kOk) throw std::invalid_argument(std::string("quota_device: ") + status_text(res.status));
  const quota::ProbeState st = quota::probe_view(scratch.data(), W, E, K, 0);
  I32 src({world, slots});
  I64 q({world, slots});
  std::copy(st.src, st.src + int64_t(W) * K, src.mutable_data());
  std::copy(st.quota, st.quota + int64_t(W) * K, q.mutable_data());
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
        py::arg("experts_per_rank"), py::arg("slots"), py::arg("min_tokens"), py::arg("tol"),
        py::arg("eps_bp"), py::arg("lanes") = 1,
        "Device quota planner, host build: (slot_src [W, K] int32, slot_quota [W, K] int64, info).");
  m.attr("QUOTA_DEVICE_MAX_WORLD") = quota::kMaxWorld;
  m.attr("QUOTA_DEVICE_MAX_EXPERTS") = quota::kMaxExperts;
  m.attr("QUOTA_DEVICE_MAX_SLOTS") = quota::kMaxSlots;
}

}  // namespace ultracomm
