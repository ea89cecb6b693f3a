// _core.reroute_table: the host build of the device reroute (include/ultracomm/impl/token_split.h):
// expert_table per expert (lanes = 0, the reference), or the kernel's expert_table_lanes with
// one lane or with `lanes` host threads standing in for a warp (tests compare them).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <barrier>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ultracomm/impl/token_split.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

// split::expert_table_lanes's group on host threads (test support: real concurrency, the
// barriers where the warp has its shuffles).
struct ThreadLanesShared {
  explicit ThreadLanesShared(int32_t n) : bar(n), vals(static_cast<size_t>(n)) {}
  std::barrier<> bar;
  std::vector<int64_t> vals;
};

struct ThreadLanes {
  ThreadLanesShared* sh;
  int32_t id, n;
  int32_t lane() const { return id; }
  int32_t width() const { return n; }
  void sync() const { sh->bar.arrive_and_wait(); }
  int64_t scan(int64_t v, int64_t* total) const {
    sh->vals[static_cast<size_t>(id)] = v;
    sync();
    int64_t before = 0, all = 0;
    for (int32_t i = 0; i < n; ++i) {
      before += i < id ? sh->vals[static_cast<size_t>(i)] : 0;
      all += sh->vals[static_cast<size_t>(i)];
    }
    sync();  // nobody overwrites vals before every lane has read them
    *total = all;
    return before;
  }
  int64_t sum(int64_t v) const {
    int64_t t = 0;
    scan(v, &t);
    return t;
  }
};

py::tuple reroute_table(I32 loads, I32 slot_src, I64 slot_quota, int64_t experts_per_rank, int64_t rank, int64_t layout,
                        int64_t lanes) {
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
  const split::Plan p{static_cast<int32_t>(W), static_cast<int32_t>(experts_per_rank),
                      static_cast<int32_t>(K), loads.data(),
                      slot_src.data(),         slot_quota.data()};
  if (lanes < 0 || lanes > 64) throw std::invalid_argument("reroute_table: lanes must be in [0, 64]");
  I64 bounds({E, W}), columns({E, W});
  int64_t* b = bounds.mutable_data();
  int64_t* c = columns.mutable_data();
  const auto me = static_cast<int32_t>(rank), lay = static_cast<int32_t>(layout);
  std::vector<int64_t> scratch(split::scratch_words(p.world));
  std::vector<int32_t> inst(static_cast<size_t>(W));
  {
    py::gil_scoped_release rel;  // host threads, no Python
    if (lanes == 0) {
      for (int32_t e = 0; e < p.experts(); ++e)
        split::expert_table(p, e, me, lay, b + int64_t(e) * W, c + int64_t(e) * W, scratch.data());
    } else if (lanes == 1) {
      for (int32_t e = 0; e < p.experts(); ++e)
        split::expert_table_lanes(p, e, me, lay, b + int64_t(e) * W, c + int64_t(e) * W, inst.data(), scratch.data(),
                                  split::SerialLanes{});
    } else {
      ThreadLanesShared shared(static_cast<int32_t>(lanes));
      std::vector<std::thread> threads;
      for (int32_t i = 0; i < lanes; ++i)
        threads.emplace_back([&, i] {
          const ThreadLanes g{&shared, i, static_cast<int32_t>(lanes)};
          for (int32_t e = 0; e < p.experts(); ++e) {
            split::expert_table_lanes(p, e, me, lay, b + int64_t(e) * W, c + int64_t(e) * W, inst.data(),
                                      scratch.data(), g);
            g.sync();  // the next expert reuses inst
          }
        });
      for (auto& t : threads) t.join();
    }
  }
  return py::make_tuple(bounds, columns);
}

}  // namespace

void bind_token_split(py::module_& m) {
  m.def("reroute_table", &reroute_table, py::arg("loads"), py::arg("slot_src"), py::arg("slot_quota"),
        py::arg("experts_per_rank"), py::arg("rank"), py::arg("layout"), py::arg("lanes") = 0,
        "Device reroute, host build: (bounds [E, world], columns [E, world]) of one source rank; lanes 0: "
        "token_split.h's expert_table, lanes >= 1: the kernel's expert_table_lanes on that many host threads.");
}

}  // namespace ultracomm
