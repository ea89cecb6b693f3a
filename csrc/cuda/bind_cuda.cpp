// ultracomm._cuda: Python bindings of the CUDA executor (host compiler only; kernels are
// reached through launch.h / runner.h).  Pointers and streams cross as integers (tensor
// .data_ptr(), stream .cuda_stream); tasks and refs as buffers (records.TASK_DTYPE /
// REF_DTYPE arrays).  Importable without a GPU: nothing touches the driver until called.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "../bindings/py_errors.h"
#include "cuda_check.h"
#include "device_plan.h"
#include "launch.h"
#include "mover_limits.h"
#include "runner.h"
#include "k_build.h"
#include "pdl.h"

namespace py = pybind11;

namespace ultracomm::gpu {

void bind_loads(py::module_& m);  // bind_loads.cpp

namespace {

// The bytes of a C-contiguous buffer of sizeof(T)-byte records, copied (a plan copies them to
// the device anyway).
template <class T>
std::vector<T> records(const py::handle& obj, const char* what) {
  const py::buffer_info info = py::reinterpret_borrow<py::buffer>(obj).request();
  py::ssize_t expect = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expect)
      throw std::invalid_argument(std::string("ultracomm._cuda: ") + what + " must be C-contiguous");
    expect *= info.shape[d];
  }
  const size_t total = static_cast<size_t>(info.size * info.itemsize);
  if (total % sizeof(T))
    throw std::invalid_argument(std::string("ultracomm._cuda: ") + what + " has " + std::to_string(total) +
                                " bytes, not a multiple of its " + std::to_string(sizeof(T)) + "-byte records");
  std::vector<T> out(total / sizeof(T));
  if (total) std::memcpy(out.data(), info.ptr, total);
  return out;
}

template <class T>
T get(const py::dict& d, const char* key) {
  if (!d.contains(key))
    throw std::invalid_argument(std::string("ultracomm._cuda.DevicePlan: rank entry lacks '") + key + "'");
  return d[key].cast<T>();
}

// One rank's arguments (run_host's keyword names) -> ExecArgs; `keep` owns tasks/refs.
ExecArgs exec_args(const py::dict& d, std::vector<Task>& tasks, std::vector<Ref>& refs) {
  ExecArgs a;
  const int op = get<int>(d, "op"), dt = d.contains("grad_dtype") ? get<int>(d, "grad_dtype") : 0;
  if (op != 0 && op != 1) throw std::invalid_argument("ultracomm._cuda.DevicePlan: op must be 0 or 1");
  if (dt < 0 || dt > 2) throw std::invalid_argument("ultracomm._cuda.DevicePlan: grad_dtype must be 0, 1 or 2");
  const auto slots = get<int32_t>(d, "slots");
  const auto wsb = get<uint64_t>(d, "weight_slot_bytes"), gsb = get<uint64_t>(d, "grad_slot_bytes");
  const auto chunk = get<uint64_t>(d, "chunk_bytes");
  if (const char* e = window_layout_error(slots, wsb, gsb, chunk))
    throw std::invalid_argument(std::string("ultracomm._cuda.DevicePlan: ") + e);
  a.op = static_cast<Op>(op);
  a.rank = get<int32_t>(d, "rank");
  a.world = get<int32_t>(d, "world");
  a.epoch = 1;  // the launch supplies the epoch
  a.layout = WindowLayout::make(slots, wsb, gsb, chunk);
  a.window_bases = get<std::vector<uintptr_t>>(d, "window_bases");
  a.member_off = get<std::vector<uint64_t>>(d, "member_off");
  a.member_bytes = get<std::vector<uint64_t>>(d, "member_bytes");
  a.master_ptrs = get<std::vector<uintptr_t>>(d, "master_ptrs");
  a.local_index_of = get<std::vector<int32_t>>(d, "local_index_of");
  a.grad_dtype = static_cast<DType>(dt);
  a.my_slots = get<std::vector<int32_t>>(d, "my_slots");
  if (d.contains("slot_parent") && !d["slot_parent"].is_none())
    a.slot_parent = get<std::vector<int32_t>>(d, "slot_parent");
  tasks = records<Task>(d["tasks"], "tasks");
  refs = records<Ref>(d["refs"], "refs");
  a.tasks = tasks.data();
  a.num_tasks = static_cast<int64_t>(tasks.size());
  a.refs = refs.data();
  a.num_refs = static_cast<int64_t>(refs.size());
  a.timeout_s = get<double>(d, "timeout_s");
  a.digest = d.contains("digest") ? get<uint64_t>(d, "digest") : 0;
  return a;
}

// Rank entries of one launch as ExecArgs; `tasks` / `refs` own their records.
std::vector<ExecArgs> rank_args(const py::list& ranks, std::vector<std::vector<Task>>& tasks,
                                std::vector<std::vector<Ref>>& refs) {
  tasks.resize(ranks.size());
  refs.resize(ranks.size());
  std::vector<ExecArgs> args;
  args.reserve(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) args.push_back(exec_args(ranks[i].cast<py::dict>(), tasks[i], refs[i]));
  return args;
}

PlanBounds bounds(int nranks, int world, int num_experts, int64_t masters, int slots, std::pair<int64_t, int64_t> tasks,
                  std::pair<int64_t, int64_t> refs) {
  PlanBounds b;
  b.nranks = nranks;
  b.world = world;
  b.num_experts = num_experts;
  b.masters = masters;
  b.slots = slots;
  b.tasks[0] = tasks.first;
  b.tasks[1] = tasks.second;
  b.refs[0] = refs.first;
  b.refs[1] = refs.second;
  return b;
}

std::unique_ptr<DevicePlan> make_plan(const py::list& ranks, int device) {
  std::vector<std::vector<Task>> tasks(ranks.size());
  std::vector<std::vector<Ref>> refs(ranks.size());
  std::vector<ExecArgs> args;
  args.reserve(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) args.push_back(exec_args(ranks[i].cast<py::dict>(), tasks[i], refs[i]));
  DeviceGuard guard(device);
  return std::make_unique<DevicePlan>(args);
}

cudaStream_t as_stream(uintptr_t s) { return reinterpret_cast<cudaStream_t>(s); }

// A launch's flags (persistent_args.h) from the bindings' arguments; reduce_path: "hunk" (the
// register hunks, default) or "tma" (the TMA-staged reduce, kReduceStaged; sm_90+).
uint32_t launch_flags(bool force_vector, const std::string& reduce_path) {
  if (reduce_path != "hunk" && reduce_path != "tma")
    throw std::invalid_argument("ultracomm._cuda.Runner: reduce_path must be 'hunk' or 'tma', got '" + reduce_path +
                                "'");
  return (force_vector ? kForceVector : 0u) | (reduce_path == "tma" ? kReduceStaged : 0u);
}

}  // namespace

void bind(py::module_& m) {
  ultracomm::register_input_error(m);
  // a CUDA failure ultracomm detected: an ultracomm.errors.UltracommError (also a RuntimeError)
  py::register_exception<CudaError>(m, "CudaError", py::module_::import("ultracomm.errors").attr("UltracommError"));
  m.attr("THREADS_PER_CTA") = kThreadsPerCta;
  m.attr("TMA_TILE_BYTES") = kTmaTileBytes;
  m.attr("TMA_STAGES") = kTmaStages;
  m.attr("MAX_LOOPBACK_RANKS") = kMaxLoopbackRanks;
  m.attr("ERROR_RECORD_BYTES") = sizeof(ErrorRecord);
  m.attr("FORCE_VECTOR") = kForceVector;
  m.attr("REDUCE_STAGED") = kReduceStaged;
  m.attr("REDUCE_PATHS") = py::make_tuple("hunk", "tma");

  m.def(
      "available", [](int device) { return cuda_available(device); }, py::arg("device") = 0,
      "(True, '') if CUDA device `device` can run the tma transport (sm_80+), else (False, why).  "
      "Never raises for a missing driver or device.");

  m.def(
      "set_programmatic_launch", [](bool on) { set_programmatic_launch(on); }, py::arg("on"),
      "Process-wide: launch the control-plane kernels (k_quota_plan, k_build_slot, k_reroute_table) with "
      "programmatic dependent launch on sm_90+ devices (pdl.h).  ultracomm.cuda.support sets it from "
      "ULTRACOMM_PDL when it loads this module; on by default.");
  m.def(
      "programmatic_launch",
      [](std::optional<int> device) {
        return device ? programmatic_launch_on(*device) : programmatic_launch_enabled();
      },
      py::arg("device") = py::none(),
      "Whether control-plane launches on CUDA device `device` use programmatic dependent launch now (the "
      "switch on and compute capability >= 9.0); without a device: the switch alone (needs no driver).");

  m.def("launch_ctas", &launch_ctas, py::arg("rank_tasks"), py::arg("ctas_per_rank"),
        "The rule Runner.launch applies to a DevicePlan, from each rank entry's task count: ctas_per_rank CTAs for "
        "a rank with at least one task, 1 for a rank with none (it joins and drains).  Needs no device.");
  m.def("max_ctas_per_rank", &max_ctas_per_rank, py::arg("rank_tasks"), py::arg("max_grid"),
        "The largest ctas_per_rank whose launch_ctas(rank_tasks, ctas_per_rank) sum to at most max_grid; 0 when "
        "not even 1 fits; max_grid when it fits and no rank has a task.  Needs no device.");

  py::class_<DevicePlan>(m, "DevicePlan", R"doc(One operation's task lists and views on a device.

DevicePlan(ranks, device): ranks is a list of dicts, one per rank a launch runs (one, or every
rank of a one-GPU loopback domain), with _core.run_host's argument names: op, rank, world,
slots, weight_slot_bytes, grad_slot_bytes, chunk_bytes, window_bases (device addresses),
member_off, member_bytes, master_ptrs, local_index_of, grad_dtype, my_slots, tasks, refs,
timeout_s, and optional slot_parent, digest.  Validated as run_host validates (ValueError),
then uploaded once (allocates and copies synchronously: build plans before graph capture).
rank_tasks: each rank entry's task count, which sizes its CTAs (Runner.launch_ctas).)doc")
      .def(py::init(&make_plan), py::arg("ranks"), py::arg("device"))
      .def_property_readonly("nranks", &DevicePlan::nranks)
      .def_property_readonly("rank_tasks", &DevicePlan::rank_tasks)
      .def_property_readonly("op", [](const DevicePlan& p) { return static_cast<int>(p.op()); })
      .def_property_readonly("grad_dtype", &DevicePlan::grad_dtype)
      .def_property_readonly("device", &DevicePlan::device)
      .def_property_readonly("nbytes", &DevicePlan::bytes);

  m.def(
      "plan_arena_bytes",
      [](int num_slots, int nranks, int world, int num_experts, int64_t masters, int slots,
         std::pair<int64_t, int64_t> tasks, std::pair<int64_t, int64_t> refs) {
        return PlanArena::bytes_for(num_slots, bounds(nranks, world, num_experts, masters, slots, tasks, refs));
      },
      py::arg("num_slots"), py::arg("nranks"), py::arg("world"), py::arg("num_experts"), py::arg("masters"),
      py::arg("slots"), py::arg("tasks"), py::arg("refs"),
      "Device bytes (and as many pinned host bytes) of a PlanArena with these bounds; allocates nothing.");
  py::class_<PlanArena>(m, "PlanArena", R"doc(Every plan slot of one executor in one device allocation.

PlanArena(device, num_slots, nranks, world, num_experts, masters, slots, tasks, refs): tasks and
refs are (multicast, reduce) bounds per rank entry.  Allocated once (device memory + pinned
staging); Runner.launch_slot writes a plan into a slot with an async copy on the launch stream.)doc")
      .def(py::init([](int device, int num_slots, int nranks, int world, int num_experts, int64_t masters, int slots,
                       std::pair<int64_t, int64_t> tasks, std::pair<int64_t, int64_t> refs) {
             const PlanBounds b = bounds(nranks, world, num_experts, masters, slots, tasks, refs);
             PlanArena::bytes_for(num_slots, b);  // bounds checked before the device is touched
             DeviceGuard guard(device);
             return std::make_unique<PlanArena>(device, num_slots, b);
           }),
           py::arg("device"), py::arg("num_slots"), py::arg("nranks"), py::arg("world"), py::arg("num_experts"),
           py::arg("masters"), py::arg("slots"), py::arg("tasks"), py::arg("refs"))
      .def_property_readonly("nbytes", &PlanArena::bytes)
      .def_property_readonly("num_slots", &PlanArena::num_slots)
      .def_property_readonly("device", &PlanArena::device)
      .def(
          "build_result",
          [](const PlanArena& a, int slot, int entry) {
            const psched::BuildReport rep = a.build_report(slot, entry);
            const psched::Result& r = rep.result;
            py::dict d;
            d["generation"] = rep.generation;
            d["status"] = r.status;
            d["num_tasks"] = py::make_tuple(r.num_tasks[0], r.num_tasks[1]);
            d["num_refs"] = py::make_tuple(r.num_refs[0], r.num_refs[1]);
            d["depth"] = py::make_tuple(r.depth[0], r.depth[1]);
            d["digest"] = r.digest;
            d["failures"] = rep.failed_seq & 1 ? -1 : static_cast<int64_t>(rep.failed_seq / 2);
            d["failed_status"] = rep.failed.status;
            return d;
          },
          py::arg("slot"), py::arg("entry") = 0,
          "What the device builds of rank entry `entry` of `slot` reported: generation (builds so far, 0: none), "
          "status (0 = ok), counts, depths and digest of the last one; failures (failed builds so far; -1 while the "
          "device writes one: ask again) and failed_status (the last failure's).  Mapped host memory: no copy, no "
          "wait.")
      .def("retire", &PlanArena::retire,
           "Forget the finished eager copies into the arena (a capture may then write those slots).");

  py::class_<Runner>(m, "Runner", R"doc(Launch state of one executor on one device.

Runner(device) allocates the device state and a mapped error record.  launch(plan, epoch,
ctas_per_rank, stream, force_vector=False, reduce_path="hunk") enqueues one persistent kernel on
the stream (no allocation, no synchronisation: capturable in a CUDA graph); the kernel runs epoch
max(epoch, last epoch + 1).  ctas_per_rank: the CTAs of each rank with at least one task in the
plan; a rank with none gets ONE (it joins and drains): launch_ctas(plan, ctas_per_rank) lists them,
and a loopback launch (plan.nranks > 1) needs their sum co-resident (max_coresident; ValueError
otherwise).  launch_slot's arena plans are built on the device: every rank gets ctas_per_rank.  reduce_path: how reductions run, "hunk" (register hunks) or "tma"
(TMA-staged through shared memory, sm_90+: ValueError before sm_90); force_vector: no bulk copy
at all (sm_90+ devices through the vector path, reductions by register hunks).  take_error() returns the raw ErrorRecord bytes of a failure
recorded since the last call (read it after the stream reached the launch), or None; turn it
into text/exception with _core.format_error / _core.raise_error_record.)doc")
      .def(py::init<int>(), py::arg("device"))
      .def(
          "launch",
          [](Runner& r, const DevicePlan& plan, uint64_t epoch, int ctas_per_rank, uintptr_t stream, bool force_vector,
             const std::string& reduce_path) {
            r.launch(plan, epoch, ctas_per_rank, as_stream(stream), launch_flags(force_vector, reduce_path));
          },
          py::arg("plan"), py::arg("epoch"), py::arg("ctas_per_rank"), py::arg("stream"),
          py::arg("force_vector") = false, py::arg("reduce_path") = "hunk")
      .def_static(
          "launch_ctas",
          [](const DevicePlan& plan, int ctas_per_rank) { return launch_ctas(plan.rank_tasks(), ctas_per_rank); },
          py::arg("plan"), py::arg("ctas_per_rank"),
          "The CTAs launch(plan, ..., ctas_per_rank) gives each rank entry, in order: ctas_per_rank for a rank "
          "with at least one task in the plan, 1 for a rank with none; their sum is the grid (a loopback launch "
          "needs it <= max_coresident(plan.grad_dtype)).  Static: needs no device.")
      .def_static(
          "max_ctas_per_rank",
          [](const DevicePlan& plan, int64_t max_grid) { return max_ctas_per_rank(plan.rank_tasks(), max_grid); },
          py::arg("plan"), py::arg("max_grid"),
          "The largest ctas_per_rank whose launch of `plan` has a grid of at most max_grid CTAs (the sum of "
          "launch_ctas(plan, c)), e.g. max_grid = max_coresident(plan.grad_dtype) for a loopback plan; 0 when "
          "not even 1 fits.  When no rank has a task every ctas_per_rank gives the same grid (one CTA a rank): "
          "then max_grid if that fits.  Static: needs no device.")
      .def(
          "launch_slot",
          [](Runner& r, PlanArena& arena, int slot, int op, const py::object& ranks, uint64_t epoch, int ctas_per_rank,
             uintptr_t stream, bool force_vector, const std::string& reduce_path) {
            if (op != 0 && op != 1)
              throw std::invalid_argument("ultracomm._cuda.Runner.launch_slot: op must be 0 or 1");
            std::vector<std::vector<Task>> tasks;
            std::vector<std::vector<Ref>> refs;
            std::vector<ExecArgs> args;
            if (!ranks.is_none()) args = rank_args(ranks.cast<py::list>(), tasks, refs);
            r.launch(arena, slot, static_cast<Op>(op), ranks.is_none() ? nullptr : &args, epoch, ctas_per_rank,
                     as_stream(stream), launch_flags(force_vector, reduce_path));
          },
          py::arg("arena"), py::arg("slot"), py::arg("op"), py::arg("ranks"), py::arg("epoch"),
          py::arg("ctas_per_rank"), py::arg("stream"), py::arg("force_vector") = false, py::arg("reduce_path") = "hunk",
          "Enqueue the plan of arena slot `slot` for `op` (ranks: the plan's rank entries, as DevicePlan takes "
          "them, to write into the slot first; None: run what the slot holds).  No allocation, no host wait "
          "(the upload is an async copy from pinned staging on `stream`).  force_vector and reduce_path as "
          "launch's.")
      .def(
          "write_template",
          [](Runner& r, PlanArena& arena, int slot, const py::list& ranks, uintptr_t stream) {
            std::vector<std::vector<Task>> tasks;
            std::vector<std::vector<Ref>> refs;
            const std::vector<ExecArgs> args = rank_args(ranks, tasks, refs);
            r.write_template(arena, slot, args, as_stream(stream));
          },
          py::arg("arena"), py::arg("slot"), py::arg("ranks"), py::arg("stream"),
          "Write the static part of a device-built plan (rank entries without tasks, as DevicePlan takes them) "
          "into arena slot `slot`, its lists at the arena's bounds, for build_slot to fill (async copy on `stream`).")
      .def(
          "build_slot",
          [](Runner& r, PlanArena& arena, int slot, int entry, uintptr_t slot_src, uintptr_t home_of, uintptr_t node_of,
             int32_t world, int32_t slots, int32_t num_experts, int32_t rank, int32_t max_depth, uint64_t weight_bytes,
             uint64_t grad_bytes, uint64_t chunk_bytes, uint64_t hop_bytes, uintptr_t stream, uintptr_t exchange_status,
             uintptr_t plan_result) {
            if (!slot_src || slot_src % 4 || !home_of || home_of % 4 || node_of % 4 || exchange_status % 4 ||
                plan_result % 8)
              throw std::invalid_argument(
                  "ultracomm._cuda.Runner.build_slot: slot_src and home_of must be non-null "
                  "int32 device arrays, node_of and exchange_status int32 ones or 0, "
                  "plan_result int64 words or 0");
            psched::Problem p{};
            p.world = world;
            p.slots = slots;
            p.num_experts = num_experts;
            p.max_depth = max_depth;
            p.rank = rank;
            p.slot_src = reinterpret_cast<const int32_t*>(slot_src);
            p.home_of = reinterpret_cast<const int32_t*>(home_of);
            p.node_of = reinterpret_cast<const int32_t*>(node_of);
            p.weight_bytes = weight_bytes;
            p.grad_bytes = grad_bytes;
            p.chunk_bytes = chunk_bytes;
            p.hop_bytes = hop_bytes;
            r.build_slot(arena, slot, entry, p, reinterpret_cast<const int32_t*>(exchange_status),
                         reinterpret_cast<const int64_t*>(plan_result), as_stream(stream));
          },
          py::arg("arena"), py::arg("slot"), py::arg("entry"), py::arg("slot_src"), py::arg("home_of"),
          py::arg("node_of"), py::arg("world"), py::arg("slots"), py::arg("num_experts"), py::arg("rank"),
          py::arg("max_depth"), py::arg("weight_bytes"), py::arg("grad_bytes"), py::arg("chunk_bytes"),
          py::arg("hop_bytes"), py::arg("stream"), py::arg("exchange_status") = 0, py::arg("plan_result") = 0,
          "Enqueue the device step's schedule build (include/ultracomm/impl/slot_build.h) of rank entry `entry` into "
          "both op areas of arena slot `slot` (its scratch and report are the arena's: PlanArena.build_result). "
          "exchange_status / plan_result: device addresses of the loads' exchange status word and the planner's "
          "result words, or 0; when either says it failed the build publishes a rejection instead.")
      .def("take_error",
           [](Runner& r) -> py::object {
             const auto e = r.take_error();
             if (!e) return py::none();
             return py::bytes(reinterpret_cast<const char*>(&*e), sizeof(ErrorRecord));
           })
      .def("max_coresident", &Runner::max_coresident, py::arg("grad_dtype") = 0,
           "CTAs of one launch that can be resident at once (a loopback launch needs all).")
      .def_property_readonly("device", &Runner::device)
      .def_property_readonly("compute_capability",
                             [](const Runner& r) { return py::make_tuple(r.cc_major(), r.cc_minor()); })
      .def_property_readonly("sm_count", &Runner::sm_count)
      .def_property_readonly("mover", [](const Runner& r) { return r.tma() ? "tma" : "vector"; });

  m.def(
      "publish_rejection",
      [](int op, uint64_t epoch, uintptr_t window_base, int32_t slots, uint64_t weight_slot_bytes,
         uint64_t grad_slot_bytes, uint64_t chunk_bytes, uintptr_t stream) {
        if (op != 0 && op != 1) throw std::invalid_argument("ultracomm._cuda.publish_rejection: op must be 0 or 1");
        if (epoch < 1) throw std::invalid_argument("ultracomm._cuda.publish_rejection: epoch must be >= 1");
        if (!window_base || window_base % 8)
          throw std::invalid_argument(
              "ultracomm._cuda.publish_rejection: window_base must be an 8-byte aligned address");
        if (const char* e = window_layout_error(slots, weight_slot_bytes, grad_slot_bytes, chunk_bytes))
          throw std::invalid_argument(std::string("ultracomm._cuda.publish_rejection: ") + e);
        launch_reject(static_cast<Op>(op), epoch, window_base,
                      WindowLayout::make(slots, weight_slot_bytes, grad_slot_bytes, chunk_bytes), as_stream(stream));
      },
      py::arg("op"), py::arg("epoch"), py::arg("window_base"), py::arg("slots"), py::arg("weight_slot_bytes"),
      py::arg("grad_slot_bytes"), py::arg("chunk_bytes"), py::arg("stream"),
      "Enqueue on `stream`: this rank rejected its plan for `op` at `epoch` (its window at device address "
      "window_base): peers touching it raise PlanError \"rank r rejected its plan\" instead of timing out.");
  bind_loads(m);
  m.def("quota_scratch_bytes", &quota_scratch_bytes, py::arg("world"), py::arg("experts"), py::arg("slots"),
        "Device scratch bytes of one quota_plan launch (8-byte aligned buffer).");
  m.def(
      "quota_plan",
      [](uintptr_t loads, uintptr_t expert_load, uintptr_t node_of, uintptr_t scratch, uintptr_t slot_src,
         uintptr_t slot_quota, uintptr_t result, int32_t world, int32_t experts_per_rank, int32_t slots,
         int64_t min_tokens, int64_t tol, int32_t eps_bp, uintptr_t stream) {
        if (!loads || loads % 4 || !slot_src || slot_src % 4 || node_of % 4 || !expert_load || expert_load % 8 ||
            !scratch || scratch % 8 || !slot_quota || slot_quota % 8 || !result || result % 8)
          throw std::invalid_argument(
              "ultracomm._cuda.quota_plan: device pointers must be non-null and aligned "
              "to their element (int32: 4, int64/scratch/result: 8)");
        QuotaArgs a{reinterpret_cast<const int32_t*>(loads),
                    reinterpret_cast<int64_t*>(expert_load),
                    reinterpret_cast<const int32_t*>(node_of),
                    reinterpret_cast<int64_t*>(scratch),
                    reinterpret_cast<int32_t*>(slot_src),
                    reinterpret_cast<int64_t*>(slot_quota),
                    reinterpret_cast<quota::Result*>(result),
                    world,
                    experts_per_rank,
                    slots,
                    min_tokens,
                    tol,
                    eps_bp};
        launch_quota_plan(a, as_stream(stream));
      },
      py::arg("loads"), py::arg("expert_load"), py::arg("node_of"), py::arg("scratch"), py::arg("slot_src"),
      py::arg("slot_quota"), py::arg("result"), py::arg("world"), py::arg("experts_per_rank"), py::arg("slots"),
      py::arg("min_tokens"), py::arg("tol"), py::arg("eps_bp"), py::arg("stream"),
      "Enqueue the device quota planner (launch.h launch_quota_plan) on `stream`; result: 3 int64 words "
      "(status | probes << 32, rounds | replicas << 32, threshold).");
  m.def("reroute_scratch_bytes", &reroute_scratch_bytes, py::arg("world"), py::arg("experts"),
        "Device scratch bytes of one reroute_table launch.");
  m.def(
      "reroute_table",
      [](uintptr_t loads, uintptr_t slot_src, uintptr_t slot_quota, uintptr_t scratch, uintptr_t bounds,
         uintptr_t columns, int32_t world, int32_t experts_per_rank, int32_t slots, int32_t rank, int32_t layout,
         uintptr_t stream) {
        if (!loads || loads % 4 || !slot_src || slot_src % 4 || !slot_quota || slot_quota % 8 || !scratch ||
            scratch % 8 || !bounds || bounds % 8 || !columns || columns % 8)
          throw std::invalid_argument(
              "ultracomm._cuda.reroute_table: device pointers must be non-null and aligned "
              "to their element (int32: 4, int64: 8)");
        if (world < 1 || experts_per_rank < 1 || slots < 0 || rank < 0 || rank >= world || (layout != 0 && layout != 1))
          throw std::invalid_argument(
              "ultracomm._cuda.reroute_table: world, experts_per_rank >= 1, slots >= 0, "
              "rank in [0, world), layout 0 (echo) or 1 (physical)");
        RerouteArgs a{reinterpret_cast<const int32_t*>(loads),
                      reinterpret_cast<const int32_t*>(slot_src),
                      reinterpret_cast<const int64_t*>(slot_quota),
                      reinterpret_cast<int64_t*>(scratch),
                      reinterpret_cast<int64_t*>(bounds),
                      reinterpret_cast<int64_t*>(columns),
                      world,
                      experts_per_rank,
                      slots,
                      rank,
                      layout};
        launch_reroute_table(a, as_stream(stream));
      },
      py::arg("loads"), py::arg("slot_src"), py::arg("slot_quota"), py::arg("scratch"), py::arg("bounds"),
      py::arg("columns"), py::arg("world"), py::arg("experts_per_rank"), py::arg("slots"), py::arg("rank"),
      py::arg("layout"), py::arg("stream"), "Enqueue the device reroute (launch.h launch_reroute_table) on `stream`.");
  m.def(
      "launch_empty", [](uintptr_t stream) { launch_empty(as_stream(stream)); }, py::arg("stream"),
      "Enqueue an empty kernel (launch floor).");
  m.def(
      "flag_pingpong",
      [](uintptr_t ping, uintptr_t pong, uint64_t base, int64_t iters, uint64_t timeout_ns, uintptr_t out,
         uintptr_t stream) {
        if (ping % 8 || pong % 8 || out % 8 || !ping || !pong || !out)
          throw std::invalid_argument("ultracomm._cuda.flag_pingpong: ping, pong and out must be 8-byte aligned");
        if (iters < 1) throw std::invalid_argument("ultracomm._cuda.flag_pingpong: iters must be >= 1");
        launch_flag_pingpong(reinterpret_cast<uint64_t*>(ping), reinterpret_cast<uint64_t*>(pong), base, iters,
                             timeout_ns, reinterpret_cast<uint64_t*>(out), as_stream(stream));
      },
      py::arg("ping"), py::arg("pong"), py::arg("base"), py::arg("iters"), py::arg("timeout_ns"), py::arg("out"),
      py::arg("stream"),
      "Enqueue the flag round trip between two CTAs (launch.h launch_flag_pingpong): out[0] = elapsed ns of "
      "`iters` round trips, out[1] = 0 or the iteration whose wait timed out.  ping/pong: uint64 device words "
      "on different 128-byte lines, equal to `base` before the launch (they are base + iters after).");
}

}  // namespace ultracomm::gpu

PYBIND11_MODULE(_cuda, m) {
  m.doc() = "ultracomm CUDA executor: persistent TMA / vector tile-mover kernel (see ultracomm.transports.tma)";
  ultracomm::gpu::bind(m);
}
