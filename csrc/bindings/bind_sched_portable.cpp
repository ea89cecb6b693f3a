// _core.build_schedule_portable / build_into_views: the host build of the device control plane's
// schedule builder (include/ultracomm/impl/sched_build.h, slot_build.h), the same source k_build.cu
// runs on the GPU as one CTA.  One lane by default; `lanes` > 1 runs it on that many host threads
// in warps of `warp_lanes` (tests: the bytes must not depend on it).  Also bound for tests: the
// kernel's launch shape (schedule_build_launch), the digest of given trees
// (schedule_digest_portable) and the former one-thread builder (build_schedule_portable_serial_ref,
// csrc/schedule/sched_build_serial_ref.h).
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <stdexcept>
#include <string>
#include <utility>
#include <vector>

#include "schedule/sched_build_serial_ref.h"
#include "schedule/sched_lanes.h"
#include "ultracomm/impl/sched_build.h"
#include "ultracomm/impl/slot_build.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

const char* status_text(int32_t s) {
  switch (s) {
    case psched::kBadShape:
      return "world, slots or num_experts outside the builder's capacity";
    case psched::kBadPlan:
      return "slot_src/home_of invalid (expert out of range, replica on its home rank, or an expert twice on a rank)";
    case psched::kBadOption:
      return "chunk_bytes must be a positive multiple of 16, bytes <= 2**40, max_depth in [1, 64], rank in [0, world)";
    case psched::kBadNode:
      return "node_of has a node outside [0, world)";
    case psched::kOverflow:
      return "the task or ref output is too small";
    default:
      return "unknown status";
  }
}

py::array records(const std::vector<uint8_t>& raw, int64_t n, size_t size, const char* dtype_name) {
  py::object dt = py::module_::import("ultracomm.records").attr(dtype_name);
  py::array a(py::dtype::from_args(dt), std::vector<py::ssize_t>{py::ssize_t(n)});
  if (n) std::copy(raw.data(), raw.data() + n * size, static_cast<uint8_t*>(a.mutable_data()));
  return a;
}

// Host lanes of a build: `lanes` threads in warps of `warp_lanes` (0: lanes / 8, at least 1),
// at most `warps` candidate warps (0: all, at most 8).
struct Lanes {
  int32_t lanes, warp_lanes, warps;
};

Lanes lanes_of(int64_t lanes, int64_t warp_lanes, int64_t warps) {
  if (lanes < 1 || lanes > 256) throw std::invalid_argument("build_schedule_portable: lanes must be in [1, 256]");
  const int64_t wl = warp_lanes > 0 ? warp_lanes : std::max<int64_t>(1, lanes / psched::kMaxWarps);
  if (wl > lanes || lanes % wl != 0)
    throw std::invalid_argument("build_schedule_portable: warp_lanes must divide lanes");
  if (warps < 0 || warps > psched::kMaxWarps)
    throw std::invalid_argument("build_schedule_portable: warps must be in [0, 8]");
  return Lanes{int32_t(lanes), int32_t(wl), int32_t(warps)};
}

bool same(const psched::Result& a, const psched::Result& b) {
  bool eq =
      a.status == b.status && a.candidates == b.candidates && a.lower_bound == b.lower_bound && a.digest == b.digest;
  for (int op = 0; op < 2; ++op)
    eq = eq && a.cap[op] == b.cap[op] && a.busiest[op] == b.busiest[op] && a.depth[op] == b.depth[op] &&
         a.num_tasks[op] == b.num_tasks[op] && a.num_refs[op] == b.num_refs[op];
  return eq;
}

// Runs f(group) on one lane or on host threads; every lane must return the same Result.
template <class F>
psched::Result run_build(const Lanes& l, F&& f) {
  if (l.lanes == 1) return f(psched::SerialGroup{});
  const std::vector<psched::Result> out = psched::run_lanes(l.lanes, l.warp_lanes, f);
  for (const psched::Result& r : out)
    if (!same(r, out[0])) throw std::logic_error("build_schedule_portable: lanes disagree");
  return out[0];
}

// The candidate warps of such a build (where its chosen trees are in the scratch).
int32_t warps_of(const Lanes& l) {
  if (l.lanes == 1) return psched::candidate_warps(psched::SerialGroup{}, l.warps);
  return psched::candidate_warps(psched::LaneBlock{nullptr, 0, l.lanes, l.warp_lanes}, l.warps);
}

// The problem of build / build_into_views (numpy inputs kept alive by the caller).
psched::Problem problem_of(const I32& slot_src, const I32& home_of, const py::object& node_of, I32& node,
                           uint64_t weight_bytes, uint64_t grad_bytes, uint64_t chunk_bytes, int64_t rank,
                           int64_t max_depth, uint64_t hop_bytes) {
  if (slot_src.ndim() != 2)
    throw std::invalid_argument("build_schedule_portable: slot_src must be int32 [world, slots]");
  if (home_of.ndim() != 1) throw std::invalid_argument("build_schedule_portable: home_of must be int32 [num_experts]");
  const int64_t W = slot_src.shape(0), S = slot_src.shape(1), E = home_of.shape(0);
  if (W < 1 || W > psched::kMaxWorld || S > psched::kMaxSlots || E > psched::kMaxExperts)
    throw std::invalid_argument("build_schedule_portable: " + std::string(status_text(psched::kBadShape)) +
                                " (world <= " + std::to_string(psched::kMaxWorld) +
                                ", slots <= " + std::to_string(psched::kMaxSlots) +
                                ", experts <= " + std::to_string(psched::kMaxExperts) + ")");
  psched::Problem p{};
  p.world = int32_t(W);
  p.slots = int32_t(S);
  p.num_experts = int32_t(E);
  p.max_depth = int32_t(std::clamp<int64_t>(max_depth, -1, 1 << 20));
  p.rank = int32_t(std::clamp<int64_t>(rank, -1, 1 << 20));
  p.slot_src = slot_src.data();
  p.home_of = home_of.data();
  if (!node_of.is_none()) {
    node = node_of.cast<I32>();
    if (node.ndim() != 1 || node.shape(0) != W)
      throw std::invalid_argument("build_schedule_portable: node_of must be int32 [world]");
    p.node_of = node.data();
  }
  p.weight_bytes = weight_bytes;
  p.grad_bytes = grad_bytes;
  p.chunk_bytes = chunk_bytes;
  p.hop_bytes = hop_bytes;
  return p;
}

py::dict build(const I32& slot_src, const I32& home_of, py::object node_of, uint64_t weight_bytes, uint64_t grad_bytes,
               uint64_t chunk_bytes, int64_t rank, int64_t max_depth, uint64_t hop_bytes, int64_t lanes,
               int64_t warp_lanes, int64_t warps) {
  const Lanes ln = lanes_of(lanes, warp_lanes, warps);
  I32 node;
  const psched::Problem p =
      problem_of(slot_src, home_of, node_of, node, weight_bytes, grad_bytes, chunk_bytes, rank, max_depth, hop_bytes);
  const int64_t W = p.world, S = p.slots, E = p.num_experts;
  const int32_t st = psched::check_problem(p);
  if (st != psched::kOk) throw std::invalid_argument(std::string("build_schedule_portable: ") + status_text(st));
  std::vector<int64_t> scratch(psched::scratch_words(p.world, p.slots, p.num_experts));
  // output bounds: every sender node of the rank with every chunk; every replica as a ref
  int64_t homed = 0;
  for (int64_t e = 0; e < E; ++e) homed += p.home_of[e] == p.rank;
  const uint64_t cb = std::max<uint64_t>(chunk_bytes, 1);
  const int64_t tcap[2] = {(homed + S) * psched::chunks_of(weight_bytes, cb),
                           (homed + S) * psched::chunks_of(grad_bytes, cb)};
  std::vector<uint8_t> traw[2], rraw[2];
  psched::OpOut out[2];
  for (int op = 0; op < 2; ++op) {
    traw[op].resize(std::max<int64_t>(tcap[op], 1) * sizeof(Task));
    rraw[op].resize(std::max<int64_t>(W * S, 1) * sizeof(Ref));
    out[op] = psched::OpOut{reinterpret_cast<Task*>(traw[op].data()), tcap[op], reinterpret_cast<Ref*>(rraw[op].data()),
                            W * S};
  }
  psched::Result res{};
  {
    py::gil_scoped_release rel;
    res = run_build(ln, [&](const auto& g) { return psched::build(p, scratch.data(), out[0], out[1], g, ln.warps); });
  }
  if (res.status != psched::kOk)
    throw std::invalid_argument(std::string("build_schedule_portable: ") + status_text(res.status));
  const psched::View v = psched::view(scratch.data(), p.world, p.slots, p.num_experts, warps_of(ln));
  py::dict d;
  const char* names[2] = {"multicast", "reduce"};
  for (int op = 0; op < 2; ++op) {
    py::dict o;
    o["tasks"] = records(traw[op], res.num_tasks[op], sizeof(Task), "TASK_DTYPE");
    o["refs"] = records(rraw[op], res.num_refs[op], sizeof(Ref), "REF_DTYPE");
    const char* fields[3] = {"parent_rank", "parent_slot", "depth"};
    for (int f = 0; f < 3; ++f) {
      py::array_t<int32_t> a({W, S});
      const int32_t* tb = psched::chosen(v, op) + f * W * S;
      std::copy(tb, tb + W * S, a.mutable_data());
      o[fields[f]] = a;
    }
    o["cap"] = res.cap[op];
    o["busiest"] = res.busiest[op];
    o["depth_max"] = res.depth[op];
    d[names[op]] = o;
  }
  d["digest"] = res.digest;
  d["lower_bound"] = res.lower_bound;
  d["candidates"] = res.candidates;
  return d;
}

// The host build of the device step's write into a plan-arena slot (slot_build.h): two
// ExecViews in host memory whose arrays are at capacity, as PlanArena::write_template leaves
// them (my_slots and slot_parent first filled with 7, an expert id no test uses, so a missing
// write shows), built into; returns per op what the views hold afterwards.
py::dict build_views(const I32& slot_src, const I32& home_of, py::object node_of, uint64_t weight_bytes,
                     uint64_t grad_bytes, uint64_t chunk_bytes, int64_t rank, int64_t max_depth, uint64_t hop_bytes,
                     std::vector<int64_t> task_cap, std::vector<int64_t> ref_cap, int64_t view_rank, int32_t upstream,
                     int64_t lanes, int64_t warp_lanes, int64_t warps) {
  const Lanes ln = lanes_of(lanes, warp_lanes, warps);
  I32 node;
  const psched::Problem p =
      problem_of(slot_src, home_of, node_of, node, weight_bytes, grad_bytes, chunk_bytes, rank, max_depth, hop_bytes);
  if (task_cap.size() != 2 || ref_cap.size() != 2 || task_cap[0] < 0 || task_cap[1] < 0 || ref_cap[0] < 0 ||
      ref_cap[1] < 0)
    throw std::invalid_argument("build_into_views: task_cap and ref_cap must be two counts >= 0 (multicast, reduce)");
  const int64_t S = p.slots;
  std::vector<int64_t> scratch(
      psched::scratch_words(std::max(p.world, 1), std::max(p.slots, 0), std::max(p.num_experts, 1)));
  std::vector<Task> tasks[2];
  std::vector<Ref> refs[2];
  std::vector<int32_t> mine[2], parent[2];
  ExecView views[2]{};
  ExecView* vp[2] = {&views[0], &views[1]};
  psched::SlotCaps caps{};
  for (int op = 0; op < 2; ++op) {
    tasks[op].resize(std::max<int64_t>(task_cap[op], 1));
    refs[op].resize(std::max<int64_t>(ref_cap[op], 1));
    mine[op].assign(std::max<int64_t>(S, 1), 7);
    parent[op].assign(std::max<int64_t>(S, 1), 7);
    views[op].op = op == 0 ? Op::kMulticast : Op::kReduce;
    views[op].rank = int32_t(view_rank < 0 ? p.rank : view_rank);
    views[op].world = p.world;
    views[op].layout.slots = p.slots;
    views[op].tasks = tasks[op].data();
    views[op].refs = refs[op].data();
    views[op].my_slots = mine[op].data();
    views[op].slot_parent = parent[op].data();
    views[op].num_tasks = -1;
    views[op].num_refs = -1;
    caps.task_cap[op] = task_cap[op];
    caps.ref_cap[op] = ref_cap[op];
  }
  psched::Result res{};
  {
    py::gil_scoped_release rel;
    res = run_build(ln, [&](const auto& g) {
      return psched::build_into_views(p, scratch.data(), vp, caps, upstream, g, ln.warps);
    });
  }
  py::dict d;
  const char* names[2] = {"multicast", "reduce"};
  for (int op = 0; op < 2; ++op) {
    py::dict o;
    const int64_t nt = std::max<int64_t>(views[op].num_tasks, 0), nr = std::max<int64_t>(views[op].num_refs, 0);
    std::vector<uint8_t> traw(reinterpret_cast<uint8_t*>(tasks[op].data()),
                              reinterpret_cast<uint8_t*>(tasks[op].data()) + nt * sizeof(Task));
    std::vector<uint8_t> rraw(reinterpret_cast<uint8_t*>(refs[op].data()),
                              reinterpret_cast<uint8_t*>(refs[op].data()) + nr * sizeof(Ref));
    o["tasks"] = records(traw, nt, sizeof(Task), "TASK_DTYPE");
    o["refs"] = records(rraw, nr, sizeof(Ref), "REF_DTYPE");
    o["num_tasks"] = views[op].num_tasks;
    o["num_refs"] = views[op].num_refs;
    o["my_slots"] = std::vector<int32_t>(mine[op].begin(), mine[op].begin() + S);
    o["slot_parent"] = std::vector<int32_t>(parent[op].begin(), parent[op].begin() + S);
    o["digest"] = views[op].digest;
    d[names[op]] = o;
  }
  d["status"] = res.status;
  d["digest"] = res.digest;
  return d;
}

// The former one-thread builder (test oracle): the same dict as build().
py::dict build_serial_ref(const I32& slot_src, const I32& home_of, py::object node_of, uint64_t weight_bytes,
                          uint64_t grad_bytes, uint64_t chunk_bytes, int64_t rank, int64_t max_depth,
                          uint64_t hop_bytes) {
  I32 node;
  const psched::Problem q =
      problem_of(slot_src, home_of, node_of, node, weight_bytes, grad_bytes, chunk_bytes, rank, max_depth, hop_bytes);
  psched_ref::Problem p{q.world,   q.slots,   q.num_experts,  q.max_depth,  q.rank,        0,          q.slot_src,
                        q.home_of, q.node_of, q.weight_bytes, q.grad_bytes, q.chunk_bytes, q.hop_bytes};
  const int64_t W = p.world, S = p.slots, E = p.num_experts;
  if (psched_ref::check_problem(p) != psched::kOk) throw std::invalid_argument("build_schedule_portable_serial_ref");
  std::vector<int64_t> scratch(psched_ref::scratch_words(p.world, p.slots, p.num_experts));
  int64_t homed = 0;
  for (int64_t e = 0; e < E; ++e) homed += p.home_of[e] == p.rank;
  const uint64_t cb = std::max<uint64_t>(chunk_bytes, 1);
  const int64_t tcap[2] = {(homed + S) * psched::chunks_of(weight_bytes, cb),
                           (homed + S) * psched::chunks_of(grad_bytes, cb)};
  std::vector<uint8_t> traw[2], rraw[2];
  psched_ref::OpOut out[2];
  for (int op = 0; op < 2; ++op) {
    traw[op].resize(std::max<int64_t>(tcap[op], 1) * sizeof(Task));
    rraw[op].resize(std::max<int64_t>(W * S, 1) * sizeof(Ref));
    out[op] = psched_ref::OpOut{reinterpret_cast<Task*>(traw[op].data()), tcap[op],
                                reinterpret_cast<Ref*>(rraw[op].data()), W * S};
  }
  const psched_ref::Result res = psched_ref::build(p, scratch.data(), out[0], out[1]);
  if (res.status != psched::kOk)
    throw std::invalid_argument("build_schedule_portable_serial_ref: " + std::string(status_text(res.status)));
  const psched_ref::View v = psched_ref::view(scratch.data(), p.world, p.slots, p.num_experts);
  py::dict d;
  const char* names[2] = {"multicast", "reduce"};
  for (int op = 0; op < 2; ++op) {
    py::dict o;
    o["tasks"] = records(traw[op], res.num_tasks[op], sizeof(Task), "TASK_DTYPE");
    o["refs"] = records(rraw[op], res.num_refs[op], sizeof(Ref), "REF_DTYPE");
    const char* fields[3] = {"parent_rank", "parent_slot", "depth"};
    for (int f = 0; f < 3; ++f) {
      py::array_t<int32_t> a({W, S});
      const int32_t* tb = psched_ref::tree_of(v.trees, W * S, 1 + op) + f * W * S;
      std::copy(tb, tb + W * S, a.mutable_data());
      o[fields[f]] = a;
    }
    o["cap"] = res.cap[op];
    o["busiest"] = res.busiest[op];
    o["depth_max"] = res.depth[op];
    d[names[op]] = o;
  }
  d["digest"] = res.digest;
  d["lower_bound"] = res.lower_bound;
  d["candidates"] = res.candidates;
  return d;
}

// The digest of given inputs and trees (sched_write.h digest) on one lane or host lanes: what a
// build publishes, for tests that change one field at a time.  trees: multicast and reduce
// (parent_rank, parent_slot), int32 [world, slots] each.
uint64_t digest_of(const I32& slot_src, const I32& home_of, py::object node_of, uint64_t weight_bytes,
                   uint64_t grad_bytes, uint64_t chunk_bytes, int64_t max_depth, uint64_t hop_bytes,
                   const std::vector<std::pair<I32, I32>>& trees, int64_t lanes, int64_t warp_lanes) {
  const Lanes ln = lanes_of(lanes, warp_lanes, 0);
  I32 node;
  const psched::Problem p =
      problem_of(slot_src, home_of, node_of, node, weight_bytes, grad_bytes, chunk_bytes, 0, max_depth, hop_bytes);
  const int64_t WS = int64_t(p.world) * p.slots;
  if (trees.size() != 2)
    throw std::invalid_argument("schedule_digest_portable: trees must be two (parent_rank, parent_slot) pairs");
  std::vector<int32_t> tb[2];
  for (int op = 0; op < 2; ++op) {
    const I32* parts[2] = {&trees[op].first, &trees[op].second};
    for (const I32* a : parts) {
      if (a->size() != WS) throw std::invalid_argument("schedule_digest_portable: a tree array is not [world, slots]");
      tb[op].insert(tb[op].end(), a->data(), a->data() + WS);
    }
  }
  const int32_t* const tp[2] = {tb[0].data(), tb[1].data()};
  py::gil_scoped_release rel;
  if (ln.lanes == 1) return psched::digest(p, tp, psched::SerialGroup{});
  const std::vector<uint64_t> out =
      psched::run_lanes(ln.lanes, ln.warp_lanes, [&](const auto& g) { return psched::digest(p, tp, g); });
  for (uint64_t d : out)
    if (d != out[0]) throw std::logic_error("schedule_digest_portable: lanes disagree");
  return out[0];
}

}  // namespace

void bind_sched_portable(py::module_& m) {
  m.def("build_schedule_portable", &build, py::arg("slot_src"), py::arg("home_of"), py::arg("node_of"),
        py::arg("weight_bytes"), py::arg("grad_bytes"), py::arg("chunk_bytes"), py::arg("rank"), py::arg("max_depth"),
        py::arg("hop_bytes"), py::arg("lanes") = 1, py::arg("warp_lanes") = 0, py::arg("warps") = 0,
        "Portable schedule builder, host build: {multicast: {tasks, refs, parent_rank, parent_slot, depth, ...}, "
        "reduce: {...}, digest, lower_bound, candidates} for one rank.  lanes: host threads standing in for the "
        "CTA's lanes (1: one lane), in warps of warp_lanes (0: lanes / 8, at least 1), at most `warps` candidate "
        "trees at once (0: one per warp, at most 8); the result does not depend on them (tests).");
  m.def("build_schedule_portable_serial_ref", &build_serial_ref, py::arg("slot_src"), py::arg("home_of"),
        py::arg("node_of"), py::arg("weight_bytes"), py::arg("grad_bytes"), py::arg("chunk_bytes"), py::arg("rank"),
        py::arg("max_depth"), py::arg("hop_bytes"),
        "Test oracle: the former one-thread builder (csrc/schedule/sched_build_serial_ref.h); the same dict as "
        "build_schedule_portable.");
  m.def("schedule_digest_portable", &digest_of, py::arg("slot_src"), py::arg("home_of"), py::arg("node_of"),
        py::arg("weight_bytes"), py::arg("grad_bytes"), py::arg("chunk_bytes"), py::arg("max_depth"),
        py::arg("hop_bytes"), py::arg("trees"), py::arg("lanes") = 1, py::arg("warp_lanes") = 0,
        "The portable builder's digest (sched_write.h digest) of these inputs and trees -- [(parent_rank, "
        "parent_slot) of multicast, of reduce], int32 [world, slots] each -- on `lanes` host lanes (tests).");
  m.def(
      "schedule_build_launch",
      [](int32_t W, int32_t S, int32_t E) {
        const psched::LaunchShape ls = psched::launch_shape(W, S, E);
        py::dict d;
        d["threads"] = ls.threads;
        d["warps"] = ls.warps;
        d["smem_bytes"] = ls.smem_bytes;
        d["scratch_bytes"] = 8 * psched::scratch_words(W, S, E, ls.warps);
        return d;
      },
      py::arg("world"), py::arg("slots"), py::arg("num_experts"),
      "k_build_slot's launch (sched_build.h launch_shape): one CTA of `threads`, `warps` candidate trees at once, "
      "`smem_bytes` of dynamic shared memory holding the scratch (0: the scratch stays in global memory).");
  m.attr("SCHEDULE_BUILD_BLOCK_THREADS") = psched::kBlockThreads;
  m.attr("SCHEDULE_BUILD_SMEM_BUDGET") = psched::kSmemBudget;
  m.def("build_into_views", &build_views, py::arg("slot_src"), py::arg("home_of"), py::arg("node_of"),
        py::arg("weight_bytes"), py::arg("grad_bytes"), py::arg("chunk_bytes"), py::arg("rank"), py::arg("max_depth"),
        py::arg("hop_bytes"), py::arg("task_cap"), py::arg("ref_cap"), py::arg("view_rank") = -1,
        py::arg("upstream") = 0, py::arg("lanes") = 1, py::arg("warp_lanes") = 0, py::arg("warps") = 0,
        "Host build of slot_build.h (the device step's write into a plan-arena slot): {multicast: {tasks, refs, "
        "num_tasks, num_refs, my_slots, slot_parent, digest}, reduce: {...}, status, digest}.  view_rank: the "
        "views' rank if not `rank` (tests a template of another rank); upstream: 6 (the loads' exchange failed) or 7 "
        "(the planner failed): nothing is built.  lanes / warp_lanes / warps as build_schedule_portable.");
  m.def(
      "schedule_portable_scratch_bytes",
      [](int32_t W, int32_t S, int32_t E) { return 8 * psched::scratch_words(W, S, E); }, py::arg("world"),
      py::arg("slots"), py::arg("num_experts"));
  m.attr("SCHEDULE_PORTABLE_MAX_WORLD") = psched::kMaxWorld;
  m.attr("SCHEDULE_PORTABLE_MAX_SLOTS") = psched::kMaxSlots;
  m.attr("SCHEDULE_PORTABLE_MAX_EXPERTS") = psched::kMaxExperts;
}

}  // namespace ultracomm
