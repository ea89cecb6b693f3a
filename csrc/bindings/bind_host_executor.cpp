// Python bindings of the host executor: _core.run_host, _core.window_layout, _core.TimeoutError,
// _core.PlanMismatchError, _core.format_error / raise_error_record, _core.publish_rejection.
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <cstring>
#include <optional>
#include <string>
#include <vector>

#include "ultracomm/impl/host_executor.h"

namespace py = pybind11;

namespace ultracomm {
namespace {

// ultracomm.errors.PlanMismatchError (a reference held for the process's life: the translator
// below is a plain function, so it reads the class from here)
PyObject* plan_mismatch_type = nullptr;

// A C-contiguous buffer of `sizeof(T)`-byte records (a structured numpy array such as
// Schedule.tasks(), or raw bytes / uint8 of a multiple of sizeof(T)), read in place: `info`
// holds the buffer (and a reference to its exporter) until the view is destroyed, after the
// call.  Only a buffer not aligned for T (e.g. a uint8 slice at an odd offset) is copied.
template <class T>
struct RecordView {
  py::buffer_info info;
  std::vector<T> copy;  // used only for a misaligned buffer
  const T* ptr = nullptr;
  int64_t count = 0;
};

template <class T>
RecordView<T> records_view(const py::buffer& b, const char* what) {
  RecordView<T> v;
  v.info = b.request();  // read-only request
  const py::buffer_info& info = v.info;
  const size_t item = static_cast<size_t>(info.itemsize);
  // C-contiguity: strides must be the packed ones.
  py::ssize_t expect = info.itemsize;
  for (py::ssize_t d = info.ndim - 1; d >= 0; --d) {
    if (info.shape[d] > 1 && info.strides[d] != expect)
      throw std::invalid_argument(std::string("ultracomm.run_host: ") + what + " must be C-contiguous");
    expect *= info.shape[d];
  }
  const size_t total = static_cast<size_t>(info.size) * item;
  if (item != sizeof(T) && item != 1)
    throw std::invalid_argument(std::string("ultracomm.run_host: ") + what + " must hold " + std::to_string(sizeof(T)) +
                                "-byte records, got itemsize " + std::to_string(item));
  if (total % sizeof(T))
    throw std::invalid_argument(std::string("ultracomm.run_host: ") + what + " byte size " + std::to_string(total) +
                                " is not a multiple of " + std::to_string(sizeof(T)));
  v.count = static_cast<int64_t>(total / sizeof(T));
  if (total == 0) return v;
  if (reinterpret_cast<uintptr_t>(info.ptr) % alignof(T) == 0) {
    v.ptr = static_cast<const T*>(info.ptr);
  } else {
    v.copy.resize(total / sizeof(T));
    std::memcpy(v.copy.data(), info.ptr, total);
    v.ptr = v.copy.data();
  }
  return v;
}

}  // namespace

WindowLayout checked_layout(const char* fn, int32_t slots, uint64_t weight_slot_bytes, uint64_t grad_slot_bytes,
                            uint64_t chunk_bytes) {
  if (const char* e = window_layout_error(slots, weight_slot_bytes, grad_slot_bytes, chunk_bytes))
    throw std::invalid_argument(std::string("ultracomm.") + fn + ": " + e);
  return WindowLayout::make(slots, weight_slot_bytes, grad_slot_bytes, chunk_bytes);
}

ErrorRecord record_from(const py::bytes& b) {
  const std::string s = b;
  if (s.size() != sizeof(ErrorRecord))
    throw std::invalid_argument("ultracomm: an error record is " + std::to_string(sizeof(ErrorRecord)) +
                                " bytes, got " + std::to_string(s.size()));
  ErrorRecord r;
  std::memcpy(&r, s.data(), sizeof r);
  return r;
}

MoverKind mover_kind(const std::string& name) {
  if (name == "host") return MoverKind::kHost;
  if (name == "block") return MoverKind::kBlock;
  throw std::invalid_argument("ultracomm.run_host: mover must be 'host' or 'block', got '" + name + "'");
}

void bind_host_executor(py::module_& m) {
  // a subclass of ultracomm.errors.UltracommTimeout (itself a TimeoutError), so that one
  // `except UltracommTimeout` catches executor and control-plane timeouts alike
  py::register_exception<TimeoutError>(m, "TimeoutError",
                                       py::module_::import("ultracomm.errors").attr("UltracommTimeout"));
  // a peer runs another plan: ultracomm.errors.PlanMismatchError itself (a PlanError: UltracommError
  // and ValueError), the class Python raises for ranks out of step, so one except catches both
  plan_mismatch_type = py::object(py::module_::import("ultracomm.errors").attr("PlanMismatchError")).release().ptr();
  m.attr("PlanMismatchError") = py::handle(plan_mismatch_type);
  py::register_exception_translator([](std::exception_ptr p) {
    try {
      if (p) std::rethrow_exception(p);
    } catch (const PlanMismatchError& e) {
      PyErr_SetString(plan_mismatch_type, e.what());
    }
  });
  // the caller raised the abort word (run_host's abort_word): an ultracomm.errors.UltracommError
  py::register_exception<AbortedError>(m, "AbortedError",
                                       py::module_::import("ultracomm.errors").attr("UltracommError"));
  m.attr("MAX_MEMBERS") = kMaxMembers;
  m.attr("ERROR_RECORD_BYTES") = sizeof(ErrorRecord);
  m.attr("REJECTED_DIGEST") = kRejectedDigest;

  m.def(
      "window_layout",
      [](int32_t slots, uint64_t weight_slot_bytes, uint64_t grad_slot_bytes, uint64_t chunk_bytes) {
        const WindowLayout L = checked_layout("window_layout", slots, weight_slot_bytes, grad_slot_bytes, chunk_bytes);
        py::dict d;
        d["slots"] = L.slots;
        d["weight_slot_bytes"] = L.weight_slot_bytes;
        d["grad_slot_bytes"] = L.grad_slot_bytes;
        d["chunk_bytes"] = L.chunk_bytes;
        d["weight_stride"] = L.weight_stride;
        d["grad_stride"] = L.grad_stride;
        d["weight_chunks"] = L.weight_chunks;
        d["grad_chunks"] = L.grad_chunks;
        d["weights_off"] = L.weights_off;
        d["grads_off"] = L.grads_off;
        d["ready_off"] = L.ready_off;
        d["digest_off"] = L.digest_off;
        d["arrival_off"] = L.arrival_off;
        d["grad_ready_off"] = L.grad_ready_off;
        d["consumed_off"] = L.consumed_off;
        d["total_bytes"] = L.total_bytes;
        return d;
      },
      py::arg("slots"), py::arg("weight_slot_bytes"), py::arg("grad_slot_bytes"), py::arg("chunk_bytes"),
      "Byte layout of one rank's window (every WindowLayout field), identical on all ranks.");

  m.def(
      "run_host",
      [](int op, int32_t rank, int32_t world, uint64_t epoch, int32_t slots, uint64_t weight_slot_bytes,
         uint64_t grad_slot_bytes, uint64_t chunk_bytes, std::vector<uintptr_t> window_bases,
         std::vector<uint64_t> member_off, std::vector<uint64_t> member_bytes, std::vector<uintptr_t> master_ptrs,
         std::vector<int32_t> local_index_of, int grad_dtype, std::vector<int32_t> my_slots, py::buffer tasks,
         py::buffer refs, int32_t num_workers, double timeout_s, uint32_t jitter_us, uint64_t jitter_seed,
         std::optional<std::vector<int32_t>> slot_parent, bool portable_f16, std::optional<std::string> op_name,
         uint64_t digest, const std::string& mover, int32_t threads_per_worker, uintptr_t abort_word,
         uint64_t tile_bytes) {
        if (op != 0 && op != 1)
          throw std::invalid_argument("ultracomm.run_host: op must be 0 (multicast) or 1 (reduce)");
        if (grad_dtype < 0 || grad_dtype > 2)
          throw std::invalid_argument("ultracomm.run_host: grad_dtype must be 0 (fp32), 1 (bf16) or 2 (fp16)");
        // zero-copy: the views hold the buffers until the call returns (after the GIL is back)
        const RecordView<Task> task_view = records_view<Task>(tasks, "tasks");
        const RecordView<Ref> ref_view = records_view<Ref>(refs, "refs");
        ExecArgs a;
        a.op = static_cast<Op>(op);
        a.rank = rank;
        a.world = world;
        a.epoch = epoch;
        a.layout = checked_layout("run_host", slots, weight_slot_bytes, grad_slot_bytes, chunk_bytes);
        a.window_bases = std::move(window_bases);
        a.member_off = std::move(member_off);
        a.member_bytes = std::move(member_bytes);
        a.master_ptrs = std::move(master_ptrs);
        a.local_index_of = std::move(local_index_of);
        a.grad_dtype = static_cast<DType>(grad_dtype);
        a.my_slots = std::move(my_slots);
        if (slot_parent) a.slot_parent = std::move(*slot_parent);
        if (op_name) a.op_name = std::move(*op_name);
        a.tasks = task_view.ptr;
        a.num_tasks = task_view.count;
        a.refs = ref_view.ptr;
        a.num_refs = ref_view.count;
        a.num_workers = num_workers;
        a.timeout_s = timeout_s;
        a.jitter_us = jitter_us;
        a.jitter_seed = jitter_seed;
        a.portable_f16 = portable_f16;
        a.digest = digest;
        a.mover = mover_kind(mover);
        a.threads_per_worker = threads_per_worker;
        a.abort_word = abort_word;
        a.tile_bytes = tile_bytes;
        py::gil_scoped_release nogil;
        run_host(a);
      },
      py::arg("op"), py::arg("rank"), py::arg("world"), py::arg("epoch"), py::arg("slots"),
      py::arg("weight_slot_bytes"), py::arg("grad_slot_bytes"), py::arg("chunk_bytes"), py::arg("window_bases"),
      py::arg("member_off"), py::arg("member_bytes"), py::arg("master_ptrs"), py::arg("local_index_of"),
      py::arg("grad_dtype"), py::arg("my_slots"), py::arg("tasks"), py::arg("refs"), py::arg("num_workers"),
      py::arg("timeout_s"), py::arg("jitter_us") = 0, py::arg("jitter_seed") = 0, py::arg("slot_parent") = py::none(),
      py::arg("portable_f16") = false, py::arg("op_name") = py::none(), py::arg("digest") = 0,
      py::arg("mover") = "host", py::arg("threads_per_worker") = 4, py::arg("abort_word") = 0,
      py::arg("tile_bytes") = kDefaultTileBytes,
      R"doc(Run one rank's task list of one operation (op 0 multicast, 1 reduce) on the host.

Windows are raw addresses (window_bases[world]); master_ptrs[local_index*M + m] are this
rank's master members; tasks/refs are records.TASK_DTYPE / REF_DTYPE arrays (or any
C-contiguous buffer of 48- / 8-byte records).  grad_dtype: 0 fp32, 1 bf16, 2 fp16.
slot_parent (optional, [slots]) only names peers in timeout messages; op_name (optional)
names the operation in them (default "weight_sync" for op 0, "grad_reduce" for op 1; e.g.
"restore"); portable_f16 (testing) uses the portable fp16 conversion instead of F16C (same
bits).  digest: this op's schedule digest (uint64, not 2^64-1), published beside ready[op];
a peer this rank touches that published another one raises PlanMismatchError.  mover:
"host" (one thread per worker, the reference) or "block" (threads_per_worker threads per
worker imitating a CUDA block; same bytes).  abort_word (optional): address of a uint64
the caller owns; once it is nonzero every worker stops and AbortedError is raised (the
split transport's bridge stops the interpreter this way).  tile_bytes: the work unit a worker
claims (a multiple of 16; 0 = whole chunks; default 64 KiB): a chunk's tiles go to any
workers and the one retiring its last tile releases it (same bytes for every value).  tasks and refs are read in place, not copied: they must not be modified until the call
returns.  Releases the GIL.
Raises _core.TimeoutError (an ultracomm.UltracommTimeout, a TimeoutError) on a wait past timeout_s (naming the peer awaited
and, if its ready flag shows it never started this op, that it is likely the stalled or dead
rank), _core.PlanMismatchError (an ultracomm.PlanError, a ValueError) when a peer runs another plan or rejected its
plan, ValueError on bad arguments (nothing is written then).)doc");

  m.def(
      "publish_rejection",
      [](int op, int32_t rank, uint64_t epoch, uintptr_t window_base, int32_t slots, uint64_t weight_slot_bytes,
         uint64_t grad_slot_bytes, uint64_t chunk_bytes) {
        if (op != 0 && op != 1) throw std::invalid_argument("ultracomm.publish_rejection: op must be 0 or 1");
        if (rank < 0) throw std::invalid_argument("ultracomm.publish_rejection: rank must be >= 0");
        ExecArgs a;
        a.op = static_cast<Op>(op);
        a.rank = rank;
        a.epoch = epoch;
        a.layout = checked_layout("publish_rejection", slots, weight_slot_bytes, grad_slot_bytes, chunk_bytes);
        a.window_bases.assign(static_cast<size_t>(rank) + 1, 0);
        a.window_bases[rank] = window_base;
        publish_rejection(a);
      },
      py::arg("op"), py::arg("rank"), py::arg("epoch"), py::arg("window_base"), py::arg("slots"),
      py::arg("weight_slot_bytes"), py::arg("grad_slot_bytes"), py::arg("chunk_bytes"),
      R"doc(Mark this rank's plan for `op` at `epoch` as rejected, in its own window (window_base):
every peer that touches this rank in that operation raises PlanMismatchError "rank r rejected
its plan" at once instead of waiting for the timeout.  Call it instead of run_host.)doc");

  m.def(
      "format_error",
      [](py::bytes record, std::optional<std::string> op_name, double timeout_s) {
        const ErrorRecord r = record_from(record);
        return format_error(r, op_name ? op_name->c_str() : nullptr, timeout_s);
      },
      py::arg("record"), py::arg("op_name") = py::none(), py::arg("timeout_s") = 0.0,
      "Text of a raw ErrorRecord (ERROR_RECORD_BYTES bytes, e.g. copied from a kernel's error "
      "record): exactly what run_host raises for it.");
  m.def(
      "raise_error_record",
      [](py::bytes record, std::optional<std::string> op_name, double timeout_s) {
        const ErrorRecord r = record_from(record);
        if (r.code == kOk) return;
        throw_error(r, op_name ? op_name->c_str() : nullptr, timeout_s);
      },
      py::arg("record"), py::arg("op_name") = py::none(), py::arg("timeout_s") = 0.0,
      "Raise what run_host raises for a raw ErrorRecord (TimeoutError, PlanMismatchError or "
      "RuntimeError); returns None for code 0 (no error).");
}

}  // namespace ultracomm
