// PlanArena: one device allocation and its pinned staging, written per slot with async copies.
#include "plan_arena.h"

#include <algorithm>
#include <cstring>
#include <stdexcept>
#include <string>

#include "cuda_check.h"
#include "persistent_args.h"

namespace ultracomm::gpu {
namespace {

constexpr size_t kAreaAlign = 256;
constexpr int64_t kMaxCount = int64_t(1) << 40;  // keeps every size below in 64-bit arithmetic
constexpr size_t kMaxArenaBytes = size_t(1) << 44;

[[noreturn]] void bad(const std::string& msg) { throw std::invalid_argument("ultracomm._cuda.PlanArena: " + msg); }

const char* op_name(Op op) { return op == Op::kMulticast ? "multicast" : "reduce"; }

void check_bounds(int num_slots, const PlanBounds& b) {
  if (num_slots < 1) bad("num_slots must be >= 1");
  if (b.nranks < 1 || b.nranks > kMaxLoopbackRanks)
    bad("nranks must be 1.." + std::to_string(kMaxLoopbackRanks) + ", got " + std::to_string(b.nranks));
  if (b.world < 1 || b.num_experts < 1 || b.slots < 0 || b.masters < 0)
    bad("world and num_experts must be >= 1, slots and masters >= 0");
  for (int op = 0; op < kNumOps; ++op)
    if (b.tasks[op] < 0 || b.refs[op] < 0 || b.tasks[op] > kMaxCount || b.refs[op] > kMaxCount)
      bad("task and ref bounds must be in 0..2^40");
  if (b.masters > kMaxCount || b.slots > (1 << 20)) bad("masters must be <= 2^40 and slots <= 2^20");
}

// This thread's stream-capture mode is relaxed while the guard lives: an event query or
// synchronize for an eager copy stays legal while another stream is being captured in global
// mode (torch.cuda.graph's default, also from another thread), where it would fail and
// invalidate that capture.
class RelaxedCaptureMode {
 public:
  RelaxedCaptureMode() { UC_CUDA_CHECK(cudaThreadExchangeStreamCaptureMode(&mode_)); }
  ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
  RelaxedCaptureMode(const RelaxedCaptureMode&) = delete;
  RelaxedCaptureMode& operator=(const RelaxedCaptureMode&) = delete;

 private:
  cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

}  // namespace

size_t PlanArena::area_bytes(const PlanBounds& b, Op op) {
  const int i = static_cast<int>(op);
  const size_t n = plan_image_bytes(b.nranks, b.world, b.num_experts, b.masters, b.slots, b.tasks[i], b.refs[i]);
  return (n + kAreaAlign - 1) / kAreaAlign * kAreaAlign;
}

size_t PlanArena::scratch_bytes(const PlanBounds& b) {
  if (b.world > psched::kMaxWorld || b.slots > psched::kMaxSlots || b.num_experts > psched::kMaxExperts) return 0;
  const size_t n =
      8 * static_cast<size_t>(psched::scratch_words(b.world, static_cast<int32_t>(b.slots), b.num_experts));
  return (n + kAreaAlign - 1) / kAreaAlign * kAreaAlign;
}

size_t PlanArena::bytes_for(int num_slots, const PlanBounds& b) {
  check_bounds(num_slots, b);
  const unsigned __int128 total =
      (unsigned __int128)(area_bytes(b, Op::kMulticast) + area_bytes(b, Op::kReduce) + scratch_bytes(b)) *
      static_cast<unsigned>(num_slots);
  if (total > kMaxArenaBytes) bad("the arena would exceed 2^44 bytes; lower num_layers x max_microbatches");
  return static_cast<size_t>(total);
}

PlanArena::PlanArena(int device, int num_slots, const PlanBounds& bounds)
    : device_(device), num_slots_(num_slots), bounds_(bounds) {
  bytes_ = bytes_for(num_slots, bounds);
  area_[0] = area_bytes(bounds, Op::kMulticast);
  area_[1] = area_bytes(bounds, Op::kReduce);
  scratch_ = scratch_bytes(bounds);
  areas_.resize(static_cast<size_t>(num_slots) * kNumOps);
  copied_.assign(areas_.size(), nullptr);
  in_flight_.assign(areas_.size(), false);
  try {
    void* p = nullptr;
    UC_CUDA_CHECK(cudaMalloc(&p, bytes_));
    dev_ = static_cast<unsigned char*>(p);
    UC_CUDA_CHECK(cudaHostAlloc(&p, bytes_, cudaHostAllocDefault));
    staging_ = static_cast<unsigned char*>(p);
    const size_t reports = sizeof(psched::BuildReport) * static_cast<size_t>(num_slots) * bounds.nranks;
    UC_CUDA_CHECK(cudaHostAlloc(&p, reports, cudaHostAllocMapped));
    reports_ = static_cast<psched::BuildReport*>(p);
    std::memset(static_cast<void*>(reports_), 0, reports);
    UC_CUDA_CHECK(cudaHostGetDevicePointer(&p, reports_, 0));
    reports_dev_ = static_cast<psched::BuildReport*>(p);
    for (auto& ev : copied_) UC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  } catch (...) {
    release();
    throw;
  }
}

PlanArena::~PlanArena() { release(); }

// No throw (destructor); the caller synchronised the device first (a kernel may read dev_).
void PlanArena::release() {
  for (auto& ev : copied_)
    if (ev) cudaEventDestroy(ev), ev = nullptr;
  if (staging_) cudaFreeHost(staging_), staging_ = nullptr;
  if (reports_) cudaFreeHost(reports_), reports_ = nullptr, reports_dev_ = nullptr;
  if (dev_) cudaFree(dev_), dev_ = nullptr;
}

size_t PlanArena::index(int slot, Op op) const {
  if (slot < 0 || slot >= num_slots_)
    bad("slot " + std::to_string(slot) + " is out of range 0.." + std::to_string(num_slots_ - 1));
  return static_cast<size_t>(slot) * kNumOps + static_cast<size_t>(op);
}

size_t PlanArena::offset(int slot, Op op) const {
  return static_cast<size_t>(slot) * (area_[0] + area_[1]) + (op == Op::kReduce ? area_[0] : 0);
}

const ExecView* PlanArena::views(int slot, Op op) const {
  (void)index(slot, op);
  return reinterpret_cast<const ExecView*>(dev_ + offset(slot, op));
}

int64_t* PlanArena::build_scratch(int slot) const {
  (void)index(slot, Op::kMulticast);
  if (scratch_ == 0) return nullptr;
  const size_t areas = static_cast<size_t>(num_slots_) * (area_[0] + area_[1]);
  return reinterpret_cast<int64_t*>(dev_ + areas + static_cast<size_t>(slot) * scratch_);
}

size_t PlanArena::report_index(int slot, int entry) const {
  (void)index(slot, Op::kMulticast);
  if (entry < 0 || entry >= bounds_.nranks)
    bad("rank entry " + std::to_string(entry) + " is out of range 0.." + std::to_string(bounds_.nranks - 1));
  return static_cast<size_t>(slot) * bounds_.nranks + entry;
}

psched::BuildReport* PlanArena::build_report_dev(int slot, int entry) const {
  return reports_dev_ + report_index(slot, entry);
}

psched::BuildReport PlanArena::build_report(int slot, int entry) const {
  const psched::BuildReport* r = reports_ + report_index(slot, entry);
  psched::BuildReport out{};
  // the last build: written by the device with the generation last, so read it first (the
  // result may already be the next build's: informational only)
  out.generation = __atomic_load_n(&r->generation, __ATOMIC_ACQUIRE);
  std::memcpy(&out.result, const_cast<const psched::Result*>(&r->result), sizeof out.result);
  // the last failure, behind its sequence lock: retry while the device writes it
  for (int tries = 0; tries < 1000; ++tries) {
    const uint64_t s1 = __atomic_load_n(&r->failed_seq, __ATOMIC_ACQUIRE);
    if (s1 & 1) continue;
    std::memcpy(&out.failed, const_cast<const psched::Result*>(&r->failed), sizeof out.failed);
    __atomic_thread_fence(__ATOMIC_ACQUIRE);
    if (__atomic_load_n(&r->failed_seq, __ATOMIC_ACQUIRE) == s1) {
      out.failed_seq = s1;
      return out;
    }
  }
  out.failed_seq = 1;  // still being written after 1000 reads: say "unknown" (odd), the caller retries later
  return out;
}

void PlanArena::retire() {
  const RelaxedCaptureMode relaxed;
  for (size_t i = 0; i < in_flight_.size(); ++i) {
    if (!in_flight_[i]) continue;
    const cudaError_t q = cudaEventQuery(copied_[i]);
    if (q == cudaSuccess)
      in_flight_[i] = false;
    else if (q != cudaErrorNotReady)
      throw_cuda(q, "cudaEventQuery(plan staging)", __FILE__, __LINE__);
  }
}

void PlanArena::check(const std::vector<ExecArgs>& ranks) const {
  check_launch_ranks(ranks, "PlanArena");
  const PlanBounds& b = bounds_;
  const int op = static_cast<int>(ranks[0].op);
  const auto over = [&](const std::string& who, const char* name, int64_t n, int64_t limit) {
    if (n > limit)
      bad(who + std::to_string(n) + " " + name + " exceed the plan arena's bound of " + std::to_string(limit) +
          " for " + op_name(ranks[0].op) +
          " (set at setup from the Context's experts, slots, world, window chunks and "
          "loopback ranks)");
  };
  over("", "rank entries", static_cast<int64_t>(ranks.size()), b.nranks);
  for (size_t i = 0; i < ranks.size(); ++i) {
    const ExecArgs& a = ranks[i];
    const std::string who = "rank entry " + std::to_string(i) + ": ";
    over(who, "window bases", static_cast<int64_t>(a.window_bases.size()), b.world);
    over(who, "experts", static_cast<int64_t>(a.local_index_of.size()), b.num_experts);
    over(who, "master pointers", static_cast<int64_t>(a.master_ptrs.size()), b.masters);
    over(who, "slots", static_cast<int64_t>(std::max(a.my_slots.size(), a.slot_parent.size())), b.slots);
    over(who, "tasks", a.num_tasks, b.tasks[op]);
    over(who, "refs", a.num_refs, b.refs[op]);
  }
}

void PlanArena::write(int slot, const std::vector<ExecArgs>& ranks, cudaStream_t stream, bool capturing) {
  check(ranks);
  write_image(slot, ranks, stream, capturing);
}

void PlanArena::write_template(int slot, const std::vector<ExecArgs>& ranks, cudaStream_t stream, bool capturing) {
  check(ranks);
  for (const ExecArgs& a : ranks)
    if (a.num_tasks != 0 || a.num_refs != 0) bad("a template entry carries no task or ref (the device builds them)");
  write_image(slot, ranks, stream, capturing);
}

// Every image at the bounds: a device build may follow any plan in its area (checked entries).
void PlanArena::write_image(int slot, const std::vector<ExecArgs>& ranks, cudaStream_t stream, bool capturing) {
  const Op op = ranks[0].op;
  const ImageCapacity cap{bounds_.slots, bounds_.tasks[static_cast<int>(op)], bounds_.refs[static_cast<int>(op)]};
  const size_t i = index(slot, op), off = offset(slot, op);
  const std::vector<unsigned char> img = plan_image(ranks, reinterpret_cast<uintptr_t>(dev_ + off), &cap);
  if (img.size() > area_[static_cast<int>(op)])  // unreachable after check(): the image grows with each bound
    bad("a plan image of " + std::to_string(img.size()) + " bytes does not fit its area");
  // The previous copy out of this staging area may still be queued (the host is ahead of the
  // device by a whole cycle of this slot): it must read the old bytes before they change.
  if (in_flight_[i] && capturing)  // no event query inside a capture
    bad("plan slot " + std::to_string(slot) +
        ": a new plan or template inside a CUDA graph capture while an "
        "eager copy into the same slot may still be in flight; synchronize() before capturing (or capture a "
        "step whose plans the slots already hold)");
  if (in_flight_[i]) {
    const RelaxedCaptureMode relaxed;
    const cudaError_t q = cudaEventQuery(copied_[i]);
    if (q == cudaErrorNotReady)
      UC_CUDA_CHECK(cudaEventSynchronize(copied_[i]));
    else if (q != cudaSuccess)
      throw_cuda(q, "cudaEventQuery(plan staging)", __FILE__, __LINE__);
    in_flight_[i] = false;
  }
  std::memcpy(staging_ + off, img.data(), img.size());
  UC_CUDA_CHECK(cudaMemcpyAsync(dev_ + off, staging_ + off, img.size(), cudaMemcpyHostToDevice, stream));
  if (!capturing) {
    UC_CUDA_CHECK(cudaEventRecord(copied_[i], stream));
    in_flight_[i] = true;
  }
  Area& a = areas_[i];
  a.nranks = static_cast<int>(ranks.size());
  a.grad_dtype = static_cast<int>(ranks[0].grad_dtype);
  a.written = true;
}

}  // namespace ultracomm::gpu
