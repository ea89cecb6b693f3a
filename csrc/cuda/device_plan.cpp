// DevicePlan: host image of the views and their arrays, pointers rebased onto one device
// allocation, one synchronous copy (tests and benchmarks; the transports use PlanArena).
#include "device_plan.h"

#include <cuda_runtime_api.h>

#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "persistent_args.h"

namespace ultracomm::gpu {
namespace {

[[noreturn]] void bad(const std::string& who, const std::string& msg) {
  throw std::invalid_argument("ultracomm._cuda." + who + ": " + msg);
}

// Host image of the allocation: arrays appended at 16-byte aligned offsets.
struct Image {
  std::vector<unsigned char> bytes;
  // n bytes of p, then zeros up to `room` bytes (room >= n)
  size_t add(const void* p, size_t n, size_t room = 0) {
    const size_t off = (bytes.size() + 15) / 16 * 16;
    bytes.resize(off + (room > n ? room : n));
    if (n) std::memcpy(bytes.data() + off, p, n);
    return off;
  }
};

size_t align16(size_t x) { return (x + 15) / 16 * 16; }

// The device address of `off` in the allocation at `base`, or null for an empty array.
template <class T>
const T* at(uintptr_t base, size_t off, size_t n) {
  return n ? reinterpret_cast<const T*>(base + off) : nullptr;
}

void check_same(const ExecArgs& a, const ExecArgs& r0, size_t i, const std::string& who) {
  const std::string entry = "rank entry " + std::to_string(i);
  if (a.op != r0.op || a.world != r0.world || a.grad_dtype != r0.grad_dtype)
    bad(who, entry + ": op, world and grad_dtype must be the same for every rank of a launch");
  if (a.layout.total_bytes != r0.layout.total_bytes || a.layout.slots != r0.layout.slots ||
      a.layout.chunk_bytes != r0.layout.chunk_bytes)
    bad(who, entry + ": every rank of a launch must have the same window layout");
}

}  // namespace

void check_launch_ranks(const std::vector<ExecArgs>& ranks, const char* who) {
  if (ranks.empty()) bad(who, "no ranks");
  if (ranks.size() > static_cast<size_t>(kMaxLoopbackRanks))
    bad(who, std::to_string(ranks.size()) + " ranks; one launch runs at most " + std::to_string(kMaxLoopbackRanks));
  for (size_t i = 0; i < ranks.size(); ++i) {
    validate(ranks[i]);
    if (ranks[i].member_off.size() > static_cast<size_t>(kMaxMembers))
      bad(who, "an expert has at most " + std::to_string(kMaxMembers) + " members on the device");
    check_same(ranks[i], ranks[0], i, who);
  }
}

std::vector<unsigned char> plan_image(const std::vector<ExecArgs>& ranks, uintptr_t base, const ImageCapacity* cap) {
  // views first (patched below), then each rank's arrays
  Image img;
  img.bytes.resize(sizeof(ExecView) * ranks.size());
  struct Offsets {
    size_t bases, masters, lidx, slots, parent, tasks, refs, done;
  };
  std::vector<Offsets> off(ranks.size());
  for (size_t i = 0; i < ranks.size(); ++i) {
    const ExecArgs& a = ranks[i];
    off[i].bases = img.add(a.window_bases.data(), a.window_bases.size() * sizeof(uintptr_t));
    off[i].masters = img.add(a.master_ptrs.data(), a.master_ptrs.size() * sizeof(uintptr_t));
    off[i].lidx = img.add(a.local_index_of.data(), a.local_index_of.size() * sizeof(int32_t));
    const size_t room_slots = cap ? static_cast<size_t>(cap->slots) * sizeof(int32_t) : 0;
    off[i].slots = img.add(a.my_slots.data(), a.my_slots.size() * sizeof(int32_t), room_slots);
    off[i].parent = img.add(a.slot_parent.data(), a.slot_parent.size() * sizeof(int32_t), room_slots);
    off[i].tasks = img.add(a.tasks, static_cast<size_t>(a.num_tasks) * sizeof(Task),
                           cap ? static_cast<size_t>(cap->tasks) * sizeof(Task) : 0);
    off[i].refs = img.add(a.refs, static_cast<size_t>(a.num_refs) * sizeof(Ref),
                          cap ? static_cast<size_t>(cap->refs) * sizeof(Ref) : 0);
    // the tiles' retire counters (interp.h), one per task, zero
    const int64_t ntasks = cap && cap->tasks > 0 ? cap->tasks : a.num_tasks;
    off[i].done = img.add(nullptr, 0, static_cast<size_t>(ntasks) * sizeof(uint32_t));
  }
  // a template's arrays exist even when empty now: the device step writes into them
  const auto n_or_cap = [&](size_t n, int64_t c) { return cap && c > 0 ? static_cast<size_t>(c) : n; };
  for (size_t i = 0; i < ranks.size(); ++i) {
    const ExecArgs& a = ranks[i];
    ExecView v = make_view(a);
    v.window_bases = at<uintptr_t>(base, off[i].bases, a.window_bases.size());
    v.master_ptrs = at<uintptr_t>(base, off[i].masters, a.master_ptrs.size());
    v.local_index_of = at<int32_t>(base, off[i].lidx, a.local_index_of.size());
    v.my_slots = at<int32_t>(base, off[i].slots, n_or_cap(a.my_slots.size(), cap ? cap->slots : 0));
    // an entry without parents keeps none (null: timeouts then name no parent), also at capacity
    v.slot_parent = a.slot_parent.empty()
                        ? nullptr
                        : at<int32_t>(base, off[i].parent, n_or_cap(a.slot_parent.size(), cap ? cap->slots : 0));
    v.tasks = at<Task>(base, off[i].tasks, n_or_cap(static_cast<size_t>(a.num_tasks), cap ? cap->tasks : 0));
    v.refs = at<Ref>(base, off[i].refs, n_or_cap(static_cast<size_t>(a.num_refs), cap ? cap->refs : 0));
    v.tile_done = const_cast<uint32_t*>(
        at<uint32_t>(base, off[i].done, n_or_cap(static_cast<size_t>(a.num_tasks), cap ? cap->tasks : 0)));
    std::memcpy(img.bytes.data() + i * sizeof(ExecView), &v, sizeof v);
  }
  return std::move(img.bytes);
}

size_t plan_image_bytes(int64_t nranks, int64_t world, int64_t num_experts, int64_t masters, int64_t slots,
                        int64_t tasks, int64_t refs) {
  const size_t per_rank = align16(world * sizeof(uintptr_t)) + align16(masters * sizeof(uintptr_t)) +
                          align16(num_experts * sizeof(int32_t)) + 2 * align16(slots * sizeof(int32_t)) +
                          align16(tasks * sizeof(Task)) + align16(refs * sizeof(Ref)) +
                          align16(tasks * sizeof(uint32_t));
  return align16(nranks * sizeof(ExecView)) + nranks * per_rank;
}

DevicePlan::DevicePlan(const std::vector<ExecArgs>& ranks) {
  check_launch_ranks(ranks, "DevicePlan");
  nranks_ = static_cast<int>(ranks.size());
  op_ = ranks[0].op;
  grad_dtype_ = static_cast<int>(ranks[0].grad_dtype);
  for (const ExecArgs& a : ranks) rank_tasks_.push_back(a.num_tasks);
  UC_CUDA_CHECK(cudaGetDevice(&device_));
  bytes_ = plan_image(ranks, 0).size();
  UC_CUDA_CHECK(cudaMalloc(&blob_, bytes_));
  const std::vector<unsigned char> img = plan_image(ranks, reinterpret_cast<uintptr_t>(blob_));
  // A pageable-memory cudaMemcpy returns once the bytes are staged, "but the DMA to final
  // destination may not have completed" (CUDA runtime API, memcpy synchronization behavior);
  // the DMA rides the legacy stream, which does not order torch's non-blocking streams, so a
  // launch enqueued there next could read a half-written plan.  Wait for the legacy stream.
  cudaError_t e = cudaMemcpy(blob_, img.data(), bytes_, cudaMemcpyHostToDevice);
  const char* call = "cudaMemcpy(plan upload)";
  if (e == cudaSuccess) {
    e = cudaStreamSynchronize(cudaStreamLegacy);
    call = "cudaStreamSynchronize(cudaStreamLegacy) after the plan upload";
  }
  if (e != cudaSuccess) {
    cudaFree(blob_);
    blob_ = nullptr;
    throw_cuda(e, call, __FILE__, __LINE__);
  }
  views_ = static_cast<const ExecView*>(blob_);
}

DevicePlan::~DevicePlan() {
  if (blob_) cudaFree(blob_);  // no throw from a destructor; a dead context frees nothing anyway
}

}  // namespace ultracomm::gpu
