// Python bindings of the planner loops: _core.taot_matching, _core.taot_auction,
// _core.split_slots.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>

#include "planners/split.h"
#include "planners/taot.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;
using U8 = py::array_t<uint8_t, py::array::c_style | py::array::forcecast>;

void need(bool ok, const char* what) {
  if (!ok) throw std::invalid_argument(std::string("taot: bad shape: ") + what);
}

py::tuple matching(I64 sp_e, I64 grp, I64 exc, I64 sp_r, F64 stat, U8 allowed, int64_t K,
                   int64_t n_inner, int64_t min_gain, bool mutual, bool two_pass) {
  const int64_t ne = sp_e.size(), nr = sp_r.size(), ng = exc.size();
  need(grp.size() == ne, "grp [ne]");
  for (int64_t e = 0; e < ne; ++e) need(grp.data()[e] >= 0 && grp.data()[e] < ng, "grp in [0, ng)");
  need(stat.ndim() == 2 && stat.shape(0) == ne && stat.shape(1) == nr, "static [ne, nr]");
  need(allowed.ndim() == 2 && allowed.shape(0) == ne && allowed.shape(1) == nr, "allowed [ne, nr]");
  I64 se(ne), sr(nr), ex(ng);
  std::copy(sp_e.data(), sp_e.data() + ne, se.mutable_data());
  std::copy(sp_r.data(), sp_r.data() + nr, sr.mutable_data());
  std::copy(exc.data(), exc.data() + ng, ex.mutable_data());
  I64 g({ne, nr}), rnd({ne, nr});
  std::fill(g.mutable_data(), g.mutable_data() + ne * nr, 0);
  std::fill(rnd.mutable_data(), rnd.mutable_data() + ne * nr, -1);
  {
    py::gil_scoped_release rel;
    planners::taot_matching(ne, nr, se.mutable_data(), grp.data(), ex.mutable_data(),
                            sr.mutable_data(), stat.data(), allowed.data(), K, n_inner, min_gain,
                            mutual, two_pass, g.mutable_data(), rnd.mutable_data());
  }
  return py::make_tuple(g, rnd);
}

py::tuple auction(I64 supply, I64 inv, I64 demand, F64 bonus, double price_step, int64_t cap) {
  need(supply.ndim() == 2, "supply [R, U]");
  const int64_t R = supply.shape(0), U = supply.shape(1), S = inv.size();
  need(demand.size() == S, "demand [S]");
  need(bonus.ndim() == 2 && bonus.shape(0) == R && bonus.shape(1) == S, "bonus [R, S]");
  for (int64_t s = 0; s < S; ++s)
    need(inv.data()[s] >= 0 && inv.data()[s] < U, "inv in [0, U)");
  I64 sup({R, U});
  std::copy(supply.data(), supply.data() + R * U, sup.mutable_data());
  I64 A(S);
  std::copy(demand.data(), demand.data() + S, A.mutable_data());
  I64 X({R, S});
  std::fill(X.mutable_data(), X.mutable_data() + R * S, 0);
  int64_t rounds;
  {
    py::gil_scoped_release rel;
    rounds = planners::taot_auction(R, U, S, sup.mutable_data(), inv.data(), A.mutable_data(),
                                    bonus.data(), price_step, cap, X.mutable_data());
  }
  return py::make_tuple(X, rounds);
}

U8 consolidate(I64 home, I64 rank, I64 expert, U8 inter, py::array_t<int64_t> amt,
               py::array_t<int64_t> left, py::array_t<int64_t> room) {
  const int64_t n = home.size();
  need(rank.size() == n && expert.size() == n && inter.size() == n && amt.size() == n,
       "home / rank / expert / inter / amt [n]");
  for (auto* a : {&amt, &left, &room})
    need(a->ndim() == 1 && (a->flags() & py::array::c_style) && a->writeable(),
         "amt / left / room: writeable contiguous int64 [.]");
  for (int64_t q = 0; q < n; ++q) {
    need(expert.data()[q] >= 0 && expert.data()[q] < left.size(), "expert in [0, U)");
    need(home.data()[q] >= 0 && home.data()[q] < room.size(), "home in [0, W)");
    need(rank.data()[q] >= 0 && rank.data()[q] < room.size(), "rank in [0, W)");
  }
  U8 keep(n);
  {
    py::gil_scoped_release rel;
    planners::taot_consolidate(n, home.data(), rank.data(), expert.data(), inter.data(),
                               amt.mutable_data(), left.mutable_data(), room.mutable_data(),
                               keep.mutable_data());
  }
  return keep;
}

I64 split(I64 load, I64 inst_rank, I64 quota, I64 inst_slot, int64_t K) {
  if (load.ndim() != 2 || inst_rank.ndim() != 2 || quota.ndim() != 2 || inst_slot.ndim() != 2)
    throw std::invalid_argument("split_slots: load [W, E], inst_rank / quota / inst_slot [E, I]");
  const int64_t W = load.shape(0), E = load.shape(1), I = quota.shape(1), WK = W * K;
  for (const auto* a : {&inst_rank, &inst_slot})
    if (a->shape(0) != E || a->shape(1) != I)
      throw std::invalid_argument("split_slots: shapes of inst_rank / inst_slot do not match quota");
  if (quota.shape(0) != E) throw std::invalid_argument("split_slots: quota must be [E, I]");
  for (int64_t e = 0; e < E; ++e)
    for (int64_t i = 0; i < I; ++i) {
      const int64_t r = inst_rank.data()[e * I + i], sl = inst_slot.data()[e * I + i];
      if (r >= W) throw std::invalid_argument("split_slots: rank out of range");
      if (i > 0 && r >= 0 && (sl < 0 || sl >= WK))
        throw std::invalid_argument("split_slots: replica instance without a slot");
    }
  I64 rep({W, WK});
  {
    py::gil_scoped_release rel;
    planners::split_slots(W, E, I, WK, load.data(), inst_rank.data(), quota.data(),
                          inst_slot.data(), rep.mutable_data());
  }
  return rep;
}

}  // namespace

void bind_planners(py::module_& m) {
  m.def("taot_matching", &matching, py::arg("spill"), py::arg("group"), py::arg("group_cap"),
        py::arg("spare"), py::arg("static"), py::arg("allowed"), py::arg("K"),
        py::arg("inner_iters"), py::arg("min_gain"), py::arg("mutual"), py::arg("two_pass"),
        "TAOT phase 2 on the compacted problem: (g [ne, nr], round [ne, nr]).");
  m.def("taot_auction", &auction, py::arg("supply"), py::arg("inv"), py::arg("demand"),
        py::arg("bonus"), py::arg("price_step"), py::arg("cap"),
        "TAOT phase 3: (X [R, S], rounds).");
  m.def("taot_consolidate", &consolidate, py::arg("home"), py::arg("rank"), py::arg("expert"),
        py::arg("inter"), py::arg("amt"), py::arg("left"), py::arg("room"),
        "TAOT refinement: drop replicas whose tokens fit elsewhere; updates amt / left / room "
        "in place, returns keep [n].");
  m.def("split_slots", &split, py::arg("load"), py::arg("inst_rank"), py::arg("quota"),
        py::arg("inst_slot"), py::arg("K"),
        "Exact token split over expert instances, per replica slot: rep [W, W*K].");
}

}  // namespace ultracomm
