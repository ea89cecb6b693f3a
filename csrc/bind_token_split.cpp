// _core.reroute_table: the host build of the device reroute (include/ultracomm/token_split.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "ultracomm/token_split.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

py::tuple reroute_table(I32 loads, I32 slot_src, I64 slot_quota, int64_t experts_per_rank, int64_t rank,
                        int64_t layout) {
  if (slot_src.ndim() != 2 || slot_quota.ndim() != 2 || slot_quota.shape(0) != slot_src.shape(0) ||
      slot_quota.shape(1) != slot_src.shape(1))
    throw std::invalid_argument("reroute_table: slot_src and slot_quota must both be [world, slots]");
  const int64_t W = slot_src.shape(0), K = slot_src.shape(1), E = W * experts_per_rank;
  if (experts_per_rank < 1 || loads.ndim() != 2 || loads.shape(0) != W || loads.shape(1) != E)
    throw std::invalid_argument("reroute_table: loads must be int32 [world, world * experts_per_rank]");
  if (rank < 0 || rank >= W) throw std::invalid_argument("reroute_table: rank out of range");
  if (layout != split::kEcho && layout != split::kPhysical)
    throw std::invalid_argument("reroute_table: layout must be 0 (echo) or 1 (physical)");
  for (int64_t s = 0; s < W * K; ++s)
    if (slot_src.data()[s] < -1 || slot_src.data()[s] >= E)
      throw std::invalid_argument("reroute_table: slot_src entry out of range");
  const split::Plan p{static_cast<int32_t>(W), static_cast<int32_t>(experts_per_rank), static_cast<int32_t>(K),
                      loads.data(), slot_src.data(), slot_quota.data()};
  I64 bounds({E, W}), columns({E, W});
  std::vector<int64_t> scratch(split::scratch_words(p.world));
  for (int32_t e = 0; e < p.experts(); ++e)
    split::expert_table(p, e, static_cast<int32_t>(rank), static_cast<int32_t>(layout),
                        bounds.mutable_data() + int64_t(e) * W, columns.mutable_data() + int64_t(e) * W,
                        scratch.data());
  return py::make_tuple(bounds, columns);
}

}  // namespace

void bind_token_split(py::module_& m) {
  m.def("reroute_table", &reroute_table, py::arg("loads"), py::arg("slot_src"), py::arg("slot_quota"),
        py::arg("experts_per_rank"), py::arg("rank"), py::arg("layout"),
        "Device reroute, host build: (bounds [E, world], columns [E, world]) of one source rank.");
}

}  // namespace ultracomm
