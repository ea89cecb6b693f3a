// Python bindings of the planner loops: _core.taot_matching, _core.taot_auction,
// _core.taot_consolidate, _core.taot_finish, _core.taot_run, _core.split_slots,
// _core.quota_search, _core.quota_feasible, _core.balance_quotas, _core.lpt_plan.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <tuple>
#include <vector>

#include "planners/balance.h"
#include "planners/lpt.h"
#include "planners/quota_search.h"
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

py::tuple matching(I64 sp_e, I64 grp, I64 exc, I64 sp_r, F64 stat, U8 allowed, int64_t K, int64_t n_inner,
                   int64_t min_gain, bool mutual, bool two_pass) {
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
    planners::taot_matching(ne, nr, se.mutable_data(), grp.data(), ex.mutable_data(), sr.mutable_data(), stat.data(),
                            allowed.data(), K, n_inner, min_gain, mutual, two_pass, g.mutable_data(),
                            rnd.mutable_data());
  }
  return py::make_tuple(g, rnd);
}

py::tuple auction(I64 supply, I64 inv, I64 demand, F64 bonus, double price_step, int64_t cap) {
  need(supply.ndim() == 2, "supply [R, U]");
  const int64_t R = supply.shape(0), U = supply.shape(1), S = inv.size();
  need(demand.size() == S, "demand [S]");
  need(bonus.ndim() == 2 && bonus.shape(0) == R && bonus.shape(1) == S, "bonus [R, S]");
  for (int64_t s = 0; s < S; ++s) need(inv.data()[s] >= 0 && inv.data()[s] < U, "inv in [0, U)");
  I64 sup({R, U});
  std::copy(supply.data(), supply.data() + R * U, sup.mutable_data());
  I64 A(S);
  std::copy(demand.data(), demand.data() + S, A.mutable_data());
  I64 X({R, S});
  std::fill(X.mutable_data(), X.mutable_data() + R * S, 0);
  int64_t rounds;
  {
    py::gil_scoped_release rel;
    rounds = planners::taot_auction(R, U, S, sup.mutable_data(), inv.data(), A.mutable_data(), bonus.data(), price_step,
                                    cap, X.mutable_data());
  }
  return py::make_tuple(X, rounds);
}

U8 consolidate(I64 home, I64 rank, I64 expert, U8 inter, py::array_t<int64_t> amt, py::array_t<int64_t> left,
               py::array_t<int64_t> room) {
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
    planners::taot_consolidate(n, home.data(), rank.data(), expert.data(), inter.data(), amt.mutable_data(),
                               left.mutable_data(), room.mutable_data(), keep.mutable_data());
  }
  return keep;
}

// A plan without replicas: slot_src [W, K] int32 -1, slot quotas [W, K] and moves [W, W, K] 0.
std::tuple<py::array_t<int32_t>, I64, I64> empty_slots(int64_t W, int64_t K) {
  py::array_t<int32_t> src({W, K});
  I64 quota({W, K}), rep({W, W, K});
  std::fill(src.mutable_data(), src.mutable_data() + W * K, -1);
  std::fill(quota.mutable_data(), quota.mutable_data() + W * K, 0);
  std::fill(rep.mutable_data(), rep.mutable_data() + W * W * K, 0);
  return {src, quota, rep};
}

py::tuple finish(I64 g, I64 rnd, I64 ei, I64 ri, I64 home, I64 el, I64 L, U8 same, I64 load, F64 bid, int64_t tgt,
                 int64_t K, bool consolidate, double price_step, py::object auction_cap) {
  need(load.ndim() == 2, "load [W, E]");
  const int64_t W = load.shape(0), E = load.shape(1), ne = ei.size(), nr = ri.size();
  need(g.ndim() == 2 && g.shape(0) == ne && g.shape(1) == nr, "g [ne, nr]");
  need(rnd.ndim() == 2 && rnd.shape(0) == ne && rnd.shape(1) == nr, "rnd [ne, nr]");
  need(home.size() == E && el.size() == E && L.size() == W, "home / el [E], L [W]");
  need(same.size() == W * W && bid.size() == W * W, "same / bid [W, W]");
  need(K >= 0, "K >= 0");
  for (int64_t e = 0; e < E; ++e) need(home.data()[e] >= 0 && home.data()[e] < W, "home in [0, W)");
  for (int64_t e = 0; e < ne; ++e) need(ei.data()[e] >= 0 && ei.data()[e] < E, "ei in [0, E)");
  for (int64_t r = 0; r < nr; ++r) need(ri.data()[r] >= 0 && ri.data()[r] < W, "ri in [0, W)");
  std::vector<int64_t> per_rank(static_cast<size_t>(W), 0);  // slots are written at [rank, k < K]
  for (int64_t i = 0; i < ne * nr; ++i)
    if (g.data()[i] != 0) ++per_rank[ri.data()[i % nr]];
  for (int64_t w = 0; w < W; ++w) need(per_rank[w] <= K, "at most K matches per rank");
  const bool has_cap = !auction_cap.is_none();
  planners::TaotFinishIn in{W,           E,           K,          ne,
                            nr,          g.data(),    rnd.data(), ei.data(),
                            ri.data(),   home.data(), el.data(),  L.data(),
                            same.data(), load.data(), bid.data(), tgt,
                            consolidate, price_step,  has_cap,    has_cap ? auction_cap.cast<int64_t>() : 0};
  auto [src, quota, rep] = empty_slots(W, K);
  planners::TaotFinish f;
  {
    py::gil_scoped_release rel;
    f = planners::taot_finish(in, src.mutable_data(), quota.mutable_data(), rep.mutable_data());
  }
  return py::make_tuple(f.n_matches, src, quota, rep, f.consolidated, f.rounds, f.worst);
}

py::tuple run(I64 load, I64 el, I64 L, I64 home, I64 excess, I64 spare, F64 flow, F64 Brr, F64 bid, U8 same,
              int64_t epr, int64_t K, int64_t tgt, int64_t mg, double alpha, bool dynamic_spill, bool mutual,
              bool two_pass, bool consolidate, double price_step, py::object auction_cap) {
  need(load.ndim() == 2, "load [W, E]");
  const int64_t W = load.shape(0), E = load.shape(1);
  need(epr >= 1 && W * epr == E, "E = W * experts_per_rank");
  need(el.size() == E && home.size() == E, "el / home [E]");
  need(L.size() == W && excess.size() == W && spare.size() == W, "L / excess / spare [W]");
  for (const F64* a : {&flow, &Brr, &bid}) need(a->size() == W * W, "flow / Brr / bid [W, W]");
  need(same.size() == W * W, "same [W, W]");
  need(K >= 0 && mg >= 1, "K >= 0, min_gain >= 1");
  for (int64_t e = 0; e < E; ++e) need(home.data()[e] >= 0 && home.data()[e] < W, "home in [0, W)");
  const bool has_cap = !auction_cap.is_none();
  const planners::TaotRunIn in{W,
                               E,
                               epr,
                               K,
                               load.data(),
                               el.data(),
                               L.data(),
                               home.data(),
                               excess.data(),
                               spare.data(),
                               flow.data(),
                               Brr.data(),
                               bid.data(),
                               same.data(),
                               tgt,
                               mg,
                               alpha,
                               dynamic_spill,
                               mutual,
                               two_pass,
                               consolidate,
                               price_step,
                               has_cap,
                               has_cap ? auction_cap.cast<int64_t>() : 0};
  auto [src, squota, rep] = empty_slots(W, K);
  std::vector<int64_t> q;
  planners::TaotRun r;
  {
    py::gil_scoped_release rel;
    r = planners::taot_run(in, src.mutable_data(), squota.mutable_data(), rep.mutable_data(), q);
  }
  const int64_t I = r.fin.n_matches ? r.instances : 1;
  I64 quota({E, I});
  if (r.fin.n_matches) std::copy(q.begin(), q.end(), quota.mutable_data());
  return py::make_tuple(r.fin.n_matches, src, quota, rep, r.fin.consolidated, r.fin.rounds, r.fin.worst);
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
    planners::split_slots(W, E, I, WK, load.data(), inst_rank.data(), quota.data(), inst_slot.data(),
                          rep.mutable_data());
  }
  return rep;
}

// Checks the arrays and fills a QuotaInput that points into them.
planners::QuotaInput quota_input(const I64& rank_load, const I64& expert_load, const I64& order, const py::object& node,
                                 I64& node_arr, int64_t slots, int64_t min_tokens, int64_t tol, int64_t budget,
                                 int64_t cover_budget) {
  const int64_t W = rank_load.size(), E = expert_load.size();
  if (W < 1 || E % W || order.size() != E)
    throw std::invalid_argument("quota: rank_load [W], expert_load / order [W * experts_per_rank]");
  const int64_t epr = E / W;
  for (int64_t r = 0; r < W; ++r) {
    int64_t sum = 0;
    for (int64_t i = 0; i < epr; ++i) {
      const int64_t e = order.data()[r * epr + i];
      if (e < r * epr || e >= (r + 1) * epr)
        throw std::invalid_argument("quota: order must list each rank's own experts");
      sum += expert_load.data()[e];
    }
    if (sum != rank_load.data()[r]) throw std::invalid_argument("quota: rank_load != sum of its experts");
  }
  planners::QuotaInput in;
  in.world = W;
  in.experts_per_rank = epr;
  in.slots = slots;
  in.min_tokens = min_tokens;
  in.tol = tol;
  in.budget = budget;
  in.cover_budget = cover_budget;
  in.rank_load = rank_load.data();
  in.expert_load = expert_load.data();
  in.order = order.data();
  if (!node.is_none()) {
    node_arr = node.cast<I64>();
    if (node_arr.size() != W) throw std::invalid_argument("quota: node must be [W]");
    in.node = node_arr.data();
  }
  return in;
}

I64 replica_array(const std::vector<planners::QuotaReplica>& reps) {
  I64 out({static_cast<int64_t>(reps.size()), int64_t{3}});
  int64_t* p = out.mutable_data();
  for (const auto& r : reps) {
    *p++ = r.expert;
    *p++ = r.rank;
    *p++ = r.tokens;
  }
  return out;
}

py::dict quota_stats(const planners::QuotaResult& r) {
  py::dict d;
  d["probes"] = r.probes;
  d["steps"] = r.steps;
  d["pruned"] = r.pruned;
  d["searched"] = r.searched;
  d["rescued"] = r.rescued;
  d["budget_left"] = r.budget_left;
  d["covered"] = r.covered;
  d["cover_met"] = r.cover_met;
  d["refuted"] = r.refuted;
  d["cover_budget_left"] = r.cover_budget_left;
  return d;
}

py::tuple quota_search(I64 rank_load, I64 expert_load, I64 order, py::object node, int64_t slots, int64_t min_tokens,
                       int64_t tol, int64_t budget, int64_t cover_budget) {
  I64 node_arr;
  auto in = quota_input(rank_load, expert_load, order, node, node_arr, slots, min_tokens, tol, budget, cover_budget);
  planners::QuotaResult res;
  {
    py::gil_scoped_release rel;
    res = planners::quota_search(in);
  }
  return py::make_tuple(res.threshold, replica_array(res.replicas), quota_stats(res));
}

py::tuple quota_feasible(I64 rank_load, I64 expert_load, I64 order, py::object node, int64_t slots, int64_t min_tokens,
                         int64_t budget, int64_t cover_budget, int64_t T) {
  I64 node_arr;
  auto in = quota_input(rank_load, expert_load, order, node, node_arr, slots, min_tokens, 1, budget, cover_budget);
  planners::QuotaResult res;
  res.budget_left = budget;
  res.cover_budget_left = cover_budget;
  std::vector<planners::QuotaReplica> reps;
  bool ok;
  {
    py::gil_scoped_release rel;
    ok = planners::quota_feasible(in, T, reps, res);
  }
  return py::make_tuple(ok ? py::object(replica_array(reps)) : py::none(), quota_stats(res));
}

py::tuple balance(I64 el, I64 off, I64 inst, I64 base) {
  const int64_t n = el.size(), W = base.size();
  if (off.size() != n + 1 || off.data()[0] != 0 || off.data()[n] != inst.size())
    throw std::invalid_argument("balance_quotas: off must be [n + 1] from 0 to len(inst)");
  for (int64_t e = 0; e < n; ++e)
    if (off.data()[e + 1] <= off.data()[e] || el.data()[e] < 0)
      throw std::invalid_argument("balance_quotas: every expert needs an instance and el >= 0");
  for (int64_t i = 0; i < inst.size(); ++i)
    if (inst.data()[i] < 0 || inst.data()[i] >= W)
      throw std::invalid_argument("balance_quotas: instance rank out of range");
  I64 quota(inst.size());
  int64_t T;
  {
    py::gil_scoped_release rel;
    T = planners::balance_quotas(W, n, el.data(), off.data(), inst.data(), base.data(), quota.mutable_data());
  }
  return py::make_tuple(T, quota);
}

py::tuple lpt(I64 expert_load, py::object group, int64_t world, int64_t slots, int64_t min_tokens, int64_t budget,
              int64_t count_rule) {
  const int64_t E = expert_load.size();
  if (world < 1 || E % world || slots < 0)
    throw std::invalid_argument("lpt_plan: expert_load [world * experts_per_rank], slots >= 0");
  planners::LptInput in;
  in.world = world;
  in.experts_per_rank = E / world;
  in.slots = slots;
  in.min_tokens = min_tokens;
  in.budget = std::max<int64_t>(budget, 0);
  if (count_rule < 0 || count_rule > 2) throw std::invalid_argument("lpt_plan: count_rule 0..2");
  in.count_rule = static_cast<planners::LptCountRule>(count_rule);
  in.expert_load = expert_load.data();
  I64 group_arr;
  if (!group.is_none()) {
    group_arr = group.cast<I64>();
    if (group_arr.size() != world) throw std::invalid_argument("lpt_plan: group must be [world]");
    in.group = group_arr.data();
  }
  planners::LptResult res;
  {
    py::gil_scoped_release rel;
    res = planners::lpt_plan(in);
  }
  I64 src({world, slots}), quota({world, slots});
  std::copy(res.slot_src.begin(), res.slot_src.end(), src.mutable_data());
  std::copy(res.slot_quota.begin(), res.slot_quota.end(), quota.mutable_data());
  py::dict d;
  d["replicas"] = res.replicas;
  d["dropped"] = res.dropped;
  d["idle"] = res.idle;
  d["max_load"] = res.max_load;
  return py::make_tuple(src, quota, d);
}

}  // namespace

void bind_planners(py::module_& m) {
  m.def("taot_matching", &matching, py::arg("spill"), py::arg("group"), py::arg("group_cap"), py::arg("spare"),
        py::arg("static"), py::arg("allowed"), py::arg("K"), py::arg("inner_iters"), py::arg("min_gain"),
        py::arg("mutual"), py::arg("two_pass"), "TAOT phase 2 on the compacted problem: (g [ne, nr], round [ne, nr]).");
  m.def("taot_auction", &auction, py::arg("supply"), py::arg("inv"), py::arg("demand"), py::arg("bonus"),
        py::arg("price_step"), py::arg("cap"), "TAOT phase 3: (X [R, S], rounds).");
  m.def("taot_consolidate", &consolidate, py::arg("home"), py::arg("rank"), py::arg("expert"), py::arg("inter"),
        py::arg("amt"), py::arg("left"), py::arg("room"),
        "TAOT refinement: drop replicas whose tokens fit elsewhere; updates amt / left / room "
        "in place, returns keep [n].");
  m.def("taot_finish", &finish, py::arg("g"), py::arg("rnd"), py::arg("ei"), py::arg("ri"), py::arg("home"),
        py::arg("el"), py::arg("L"), py::arg("same"), py::arg("load"), py::arg("bid"), py::arg("target"), py::arg("K"),
        py::arg("consolidate"), py::arg("price_step"), py::arg("auction_cap"),
        "TAOT after phase 2: (matches, slot_src [W, K] int32, slot_quota [W, K], "
        "rep [W, W, K], consolidated (-1: not run), auction rounds, most loaded rank).");
  m.def("taot_run", &run, py::arg("load"), py::arg("el"), py::arg("L"), py::arg("home"), py::arg("excess"),
        py::arg("spare"), py::arg("flow"), py::arg("Brr"), py::arg("bid"), py::arg("same"), py::arg("experts_per_rank"),
        py::arg("K"), py::arg("target"), py::arg("min_gain"), py::arg("alpha"), py::arg("dynamic_spill"),
        py::arg("mutual"), py::arg("two_pass"), py::arg("consolidate"), py::arg("price_step"), py::arg("auction_cap"),
        "TAOT after phase 1: (matches, slot_src [W, K] int32, quota [E, I], rep [W, W, K], "
        "consolidated (-1: not run), auction rounds, most loaded rank).");
  m.def("split_slots", &split, py::arg("load"), py::arg("inst_rank"), py::arg("quota"), py::arg("inst_slot"),
        py::arg("K"), "Exact token split over expert instances, per replica slot: rep [W, W*K].");
  m.def("quota_search", &quota_search, py::arg("rank_load"), py::arg("expert_load"), py::arg("order"), py::arg("node"),
        py::arg("slots"), py::arg("min_tokens"), py::arg("tol"), py::arg("budget"), py::arg("cover_budget"),
        "Quota planner threshold search: (threshold, replicas [n, 3] (expert, rank, tokens), "
        "stats dict).");
  m.def("quota_feasible", &quota_feasible, py::arg("rank_load"), py::arg("expert_load"), py::arg("order"),
        py::arg("node"), py::arg("slots"), py::arg("min_tokens"), py::arg("budget"), py::arg("cover_budget"),
        py::arg("T"), "One quota feasibility test at T: (replicas [n, 3] or None, stats dict).");
  m.def("balance_quotas", &balance, py::arg("el"), py::arg("off"), py::arg("inst"), py::arg("base"),
        "Min-max quotas on a fixed placement: (max rank load, quota per instance).");
  m.def("lpt_plan", &lpt, py::arg("expert_load"), py::arg("group"), py::arg("world"), py::arg("slots"),
        py::arg("min_tokens"), py::arg("budget"), py::arg("count_rule"),
        "EPLB within the fixed-home model: (slot_src [W, K], slot_quota [W, K], stats).");
}

}  // namespace ultracomm
