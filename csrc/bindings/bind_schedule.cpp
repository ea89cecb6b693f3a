// Python bindings of the schedule builder: _core.build_schedule, _core.time_build, _core.Schedule.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <chrono>
#include <memory>
#include <stdexcept>
#include <string>

#include "ultracomm/records/schedule.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

using I32 = py::array_t<int32_t, py::array::c_style | py::array::forcecast>;

struct PySchedule {
  std::shared_ptr<const Schedule> s;
};

RelayMode parse_mode(const py::object& m) {
  if (py::isinstance<py::str>(m)) {
    const std::string v = m.cast<std::string>();
    if (v == "auto") return RelayMode::kAuto;
    if (v == "off") return RelayMode::kOff;
    if (v == "force") return RelayMode::kForce;
    throw std::invalid_argument("relay_mode must be 'auto', 'off' or 'force', got '" + v + "'");
  }
  const int v = m.cast<int>();
  if (v < 0 || v > 2)
    throw std::invalid_argument("relay_mode must be 0 (auto), 1 (off) or 2 (force), got " + std::to_string(v));
  return static_cast<RelayMode>(v);
}

Op parse_op(const py::object& o) {
  if (py::isinstance<py::str>(o)) {
    const std::string v = o.cast<std::string>();
    if (v == "multicast") return Op::kMulticast;
    if (v == "reduce") return Op::kReduce;
    throw std::invalid_argument("op must be 'multicast' or 'reduce', got '" + v + "'");
  }
  const int v = o.cast<int>();
  if (v < 0 || v >= kNumOps)
    throw std::invalid_argument("op must be 0 (multicast) or 1 (reduce), got " + std::to_string(v));
  return static_cast<Op>(v);
}

const OpSchedule& op_of(const Schedule& s, Op op) { return op == Op::kMulticast ? s.multicast : s.reduce; }

BuildInput make_input(int32_t world, int32_t slots, int32_t experts, const I32& slot_src, const I32& home_of,
                      const py::object& node_of, uint64_t weight_bytes, uint64_t grad_bytes, uint64_t chunk_bytes,
                      const py::object& relay_mode, int32_t max_depth, double intra_bw, double inter_bw,
                      double intra_lat, double inter_lat) {
  BuildInput in;
  in.world = world;
  in.slots_per_rank = slots;
  in.num_experts = experts;
  in.slot_src.assign(slot_src.data(), slot_src.data() + slot_src.size());
  in.home_of.assign(home_of.data(), home_of.data() + home_of.size());
  if (!node_of.is_none()) {
    I32 n = node_of.cast<I32>();
    in.node_of.assign(n.data(), n.data() + n.size());
  }
  in.weight_bytes = weight_bytes;
  in.grad_bytes = grad_bytes;
  in.chunk_bytes = chunk_bytes;
  in.relay_mode = parse_mode(relay_mode);
  in.max_depth = max_depth;
  in.intra_bw = intra_bw;
  in.inter_bw = inter_bw;
  in.intra_latency_s = intra_lat;
  in.inter_latency_s = inter_lat;
  return in;
}

template <class T>
py::array view(const py::object& self, const std::vector<T>& v, const py::object& dtype) {
  py::dtype dt = py::dtype::from_args(dtype);
  if (v.empty()) return py::array(dt, std::vector<py::ssize_t>{0});
  py::array a(dt, std::vector<py::ssize_t>{py::ssize_t(v.size())}, std::vector<py::ssize_t>{py::ssize_t(sizeof(T))},
              v.data(), self);
  a.attr("setflags")(py::arg("write") = false);
  return a;
}

py::array_t<int32_t> grid(const Schedule& s, const std::vector<int32_t>& v) {
  py::array_t<int32_t> a({s.input.world, s.input.slots_per_rank});
  std::copy(v.begin(), v.end(), a.mutable_data());
  return a;
}

py::dict op_stats(const OpSchedule& o) {
  py::dict d;
  d["egress"] = o.egress;
  d["ingress"] = o.ingress;
  d["inter_egress"] = o.inter_egress;
  d["inter_ingress"] = o.inter_ingress;
  const uint64_t me = o.egress.empty() ? 0 : *std::max_element(o.egress.begin(), o.egress.end());
  const uint64_t mi = o.ingress.empty() ? 0 : *std::max_element(o.ingress.begin(), o.ingress.end());
  d["max_egress"] = me;
  d["max_ingress"] = mi;
  d["max_link_bytes"] = std::max(me, mi);
  d["depth"] = o.max_depth;
  d["num_tasks"] = o.num_tasks;
  d["lower_bound_bytes"] = o.lower_bound_bytes;
  d["lower_bound_s"] = o.lower_bound_s;
  d["tree_lower_bound_s"] = o.tree_lower_bound_s;
  d["predicted_s"] = o.predicted_s;
  d["relayed"] = o.relayed;
  d["bytes"] = o.bytes;
  d["chunks"] = o.chunks;
  return d;
}

}  // namespace

void bind_schedule(py::module_& m) {
  py::class_<PySchedule>(m, "Schedule",
                         "Per-rank task lists of both operations (see include/ultracomm/records/schedule.h)")
      .def_property_readonly("digest", [](const PySchedule& p) { return p.s->digest; })
      .def_property_readonly("built_for", [](const PySchedule& p) { return p.s->built_for; })
      .def_property_readonly("world", [](const PySchedule& p) { return p.s->input.world; })
      .def_property_readonly("slots_per_rank", [](const PySchedule& p) { return p.s->input.slots_per_rank; })
      .def_property_readonly("num_experts", [](const PySchedule& p) { return p.s->input.num_experts; })
      .def_property_readonly("weight_chunks", [](const PySchedule& p) { return p.s->multicast.chunks; })
      .def_property_readonly("grad_chunks", [](const PySchedule& p) { return p.s->reduce.chunks; })
      .def_property_readonly("chunk_bytes", [](const PySchedule& p) { return p.s->input.chunk_bytes; })
      .def(
          "tasks",
          [](py::object self, py::object op, int32_t rank) {
            const Schedule& s = *self.cast<const PySchedule&>().s;
            if (rank < 0 || rank >= s.input.world) throw py::index_error("rank out of range");
            return view(self, op_of(s, parse_op(op)).tasks[rank],
                        py::module_::import("ultracomm.records").attr("TASK_DTYPE"));
          },
          py::arg("op"), py::arg("rank"),
          "Read-only numpy view (records.TASK_DTYPE) of a rank's task list; keeps the schedule alive")
      .def(
          "refs",
          [](py::object self, py::object op, int32_t rank) {
            const Schedule& s = *self.cast<const PySchedule&>().s;
            if (rank < 0 || rank >= s.input.world) throw py::index_error("rank out of range");
            return view(self, op_of(s, parse_op(op)).refs[rank],
                        py::module_::import("ultracomm.records").attr("REF_DTYPE"));
          },
          py::arg("op"), py::arg("rank"))
      .def("parent_rank",
           [](const PySchedule& p, py::object op) { return grid(*p.s, op_of(*p.s, parse_op(op)).parent_rank); })
      .def("parent_slot",
           [](const PySchedule& p, py::object op) { return grid(*p.s, op_of(*p.s, parse_op(op)).parent_slot); })
      .def("depth", [](const PySchedule& p, py::object op) { return grid(*p.s, op_of(*p.s, parse_op(op)).depth); })
      .def("stats", [](const PySchedule& p, py::object op) { return op_stats(op_of(*p.s, parse_op(op))); })
      .def("input", [](const PySchedule& p) {
        const BuildInput& in = p.s->input;
        py::dict d;
        d["world"] = in.world;
        d["slots_per_rank"] = in.slots_per_rank;
        d["num_experts"] = in.num_experts;
        d["slot_src"] = in.slot_src;
        d["home_of"] = in.home_of;
        d["node_of"] = in.node_of;
        d["weight_bytes"] = in.weight_bytes;
        d["grad_bytes"] = in.grad_bytes;
        d["chunk_bytes"] = in.chunk_bytes;
        d["relay_mode"] = static_cast<int>(in.relay_mode);
        d["max_depth"] = in.max_depth;
        d["intra_bw"] = in.intra_bw;
        d["inter_bw"] = in.inter_bw;
        d["intra_latency_s"] = in.intra_latency_s;
        d["inter_latency_s"] = in.inter_latency_s;
        return d;
      });

  m.def(
      "build_schedule",
      [](int32_t world, int32_t slots, int32_t experts, const I32& slot_src, const I32& home_of, py::object node_of,
         uint64_t weight_bytes, uint64_t grad_bytes, uint64_t chunk_bytes, py::object relay_mode, int32_t max_depth,
         double intra_bw, double inter_bw, int32_t only_rank, double intra_lat, double inter_lat) {
        BuildInput in = make_input(world, slots, experts, slot_src, home_of, node_of, weight_bytes, grad_bytes,
                                   chunk_bytes, relay_mode, max_depth, intra_bw, inter_bw, intra_lat, inter_lat);
        std::shared_ptr<Schedule> s;
        {
          py::gil_scoped_release nogil;
          s = std::make_shared<Schedule>(build_schedule(in, only_rank));
        }
        return PySchedule{std::move(s)};
      },
      py::arg("world"), py::arg("slots_per_rank"), py::arg("num_experts"), py::arg("slot_src"), py::arg("home_of"),
      py::arg("node_of"), py::arg("weight_bytes"), py::arg("grad_bytes"), py::arg("chunk_bytes"), py::arg("relay_mode"),
      py::arg("max_depth"), py::arg("intra_bw"), py::arg("inter_bw"), py::arg("only_rank") = -1,
      py::arg("intra_latency_s") = BuildInput{}.intra_latency_s,
      py::arg("inter_latency_s") = BuildInput{}.inter_latency_s,
      "Build both operations' trees and task lists; raises ValueError on invalid input.");

  m.def(
      "time_build",
      [](int32_t world, int32_t slots, int32_t experts, const I32& slot_src, const I32& home_of, py::object node_of,
         uint64_t weight_bytes, uint64_t grad_bytes, uint64_t chunk_bytes, py::object relay_mode, int32_t max_depth,
         double intra_bw, double inter_bw, int32_t only_rank, int32_t iters, double intra_lat, double inter_lat) {
        BuildInput in = make_input(world, slots, experts, slot_src, home_of, node_of, weight_bytes, grad_bytes,
                                   chunk_bytes, relay_mode, max_depth, intra_bw, inter_bw, intra_lat, inter_lat);
        py::array_t<double> out(std::max(iters, 0));
        double* o = out.mutable_data();
        {
          py::gil_scoped_release nogil;
          uint64_t sink = 0;
          for (int32_t i = 0; i < iters; ++i) {
            const auto t0 = std::chrono::steady_clock::now();
            Schedule s = build_schedule(in, only_rank);
            const auto t1 = std::chrono::steady_clock::now();
            sink ^= s.digest;
            o[i] = std::chrono::duration<double, std::nano>(t1 - t0).count();
          }
          (void)sink;
        }
        return out;
      },
      py::arg("world"), py::arg("slots_per_rank"), py::arg("num_experts"), py::arg("slot_src"), py::arg("home_of"),
      py::arg("node_of"), py::arg("weight_bytes"), py::arg("grad_bytes"), py::arg("chunk_bytes"), py::arg("relay_mode"),
      py::arg("max_depth"), py::arg("intra_bw"), py::arg("inter_bw"), py::arg("only_rank") = -1, py::arg("iters") = 100,
      py::arg("intra_latency_s") = BuildInput{}.intra_latency_s,
      py::arg("inter_latency_s") = BuildInput{}.inter_latency_s,
      "Run build_schedule `iters` times in C++ (GIL released); returns the nanoseconds of each build.");
}

}  // namespace ultracomm
