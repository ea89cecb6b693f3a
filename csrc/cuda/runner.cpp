// Runner: device state, mapped error slot, launch checks.
#include "runner.h"

#include "k_build.h"

#include <cstdint>
#include <cstring>
#include <functional>
#include <stdexcept>

#include "cuda_check.h"
#include "launch.h"

namespace ultracomm::gpu {

std::pair<bool, std::string> cuda_available(int device) {
  int n = 0;
  const cudaError_t e = cudaGetDeviceCount(&n);
  if (e != cudaSuccess) {
    cudaGetLastError();  // clear the sticky-free error so later calls report their own
    return {false, std::string("no usable CUDA driver or device (cudaGetDeviceCount: ") + cudaGetErrorName(e) + ": " +
                       cudaGetErrorString(e) + ")"};
  }
  if (n == 0) return {false, "no CUDA device"};
  if (device < 0 || device >= n)
    return {false, "CUDA device " + std::to_string(device) + " does not exist (" + std::to_string(n) + " devices)"};
  int major = 0, minor = 0;
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device));
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, device));
  if (major < 8)
    return {false, "CUDA device " + std::to_string(device) + " is sm_" + std::to_string(major) + std::to_string(minor) +
                       "; the tma transport needs sm_80 or newer"};
  return {true, ""};
}

DeviceGuard::DeviceGuard(int device) {
  UC_CUDA_CHECK(cudaGetDevice(&prev_));
  if (prev_ != device) UC_CUDA_CHECK(cudaSetDevice(device));
}
DeviceGuard::~DeviceGuard() {
  int cur = -1;
  if (cudaGetDevice(&cur) == cudaSuccess && cur != prev_) cudaSetDevice(prev_);
}

std::vector<int32_t> launch_ctas(const std::vector<int64_t>& rank_tasks, int ctas_per_rank) {
  if (ctas_per_rank < 1) throw std::invalid_argument("ultracomm._cuda.launch_ctas: ctas_per_rank must be >= 1");
  std::vector<int32_t> out;
  out.reserve(rank_tasks.size());
  for (const int64_t n : rank_tasks) {
    if (n < 0) throw std::invalid_argument("ultracomm._cuda.launch_ctas: a task count is negative");
    out.push_back(n > 0 ? ctas_per_rank : 1);
  }
  return out;
}

int max_ctas_per_rank(const std::vector<int64_t>& rank_tasks, int64_t max_grid) {
  const auto grid = [&](int c) {
    int64_t g = 0;
    for (const int32_t n : launch_ctas(rank_tasks, c)) g += n;
    return g;
  };
  const int64_t g1 = grid(1), per_cta = grid(2) - g1;  // grid(c) = g1 + per_cta * (c - 1)
  if (g1 > max_grid) return 0;
  const int64_t top = per_cta == 0 ? max_grid : 1 + (max_grid - g1) / per_cta;
  return static_cast<int>(top < INT32_MAX ? top : INT32_MAX);
}

Runner::Runner(int device) : device_(device) {
  const auto [ok, why] = cuda_available(device);
  if (!ok) throw std::runtime_error("ultracomm._cuda: " + why);
  DeviceGuard guard(device);
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&cc_major_, cudaDevAttrComputeCapabilityMajor, device));
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&cc_minor_, cudaDevAttrComputeCapabilityMinor, device));
  UC_CUDA_CHECK(cudaDeviceGetAttribute(&sm_count_, cudaDevAttrMultiProcessorCount, device));
  rings_ = setup_persistent(device, cc_major_);
  for (int d = 0; d < 3; ++d) coresident_[d] = persistent_max_coresident(rings_, d);
  void* p = nullptr;
  UC_CUDA_CHECK(cudaMalloc(&p, kNumOps * sizeof(DeviceState)));
  state_ = static_cast<DeviceState*>(p);
  UC_CUDA_CHECK(cudaMemset(state_, 0, kNumOps * sizeof(DeviceState)));
  UC_CUDA_CHECK(cudaHostAlloc(&p, kNumOps * sizeof(ErrorSlot), cudaHostAllocMapped));
  err_host_ = static_cast<ErrorSlot*>(p);
  std::memset(p, 0, kNumOps * sizeof(ErrorSlot));
  UC_CUDA_CHECK(cudaHostGetDevicePointer(&p, err_host_, 0));
  err_dev_ = static_cast<ErrorSlot*>(p);
  for (auto& ev : last_) UC_CUDA_CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
  UC_CUDA_CHECK(cudaDeviceSynchronize());  // the memset is done before any launch reads the state
}

Runner::~Runner() {
  for (auto ev : last_)
    if (ev) cudaEventDestroy(ev);
  if (state_) cudaFree(state_);
  if (err_host_) cudaFreeHost(err_host_);
}

// Two launches of one op kind on two streams would run at once on one DeviceState: the second
// would claim the first one's tasks and its last CTA reset the counters under it.  Wait on the
// event recorded after the previous launch of the kind.  Only where both sides are in the same
// world: both eager, or both in one capture (then the wait is a graph edge).  An event last
// recorded in a capture cannot be waited on outside it (cudaErrorCapturedEvent), nor an eager
// one from inside a capture without making it an external node whose meaning changes at
// replay; across that boundary the order is the stream the user launches the graph on.
unsigned long long Runner::order_after_last(int op, cudaStream_t stream) {
  cudaStreamCaptureStatus st = cudaStreamCaptureStatusNone;
  unsigned long long id = 0;
  UC_CUDA_CHECK(cudaStreamGetCaptureInfo(stream, &st, &id));
  const unsigned long long capture = st == cudaStreamCaptureStatusActive ? id : 0;
  if (launched_[op] && last_stream_[op] != stream && last_capture_[op] == capture)
    UC_CUDA_CHECK(cudaStreamWaitEvent(stream, last_[op], 0));
  return capture;
}

int Runner::max_coresident(int grad_dtype) const {
  return coresident_[grad_dtype >= 0 && grad_dtype < 3 ? grad_dtype : 0];
}

void Runner::launch(const DevicePlan& plan, uint64_t epoch, int ctas_per_rank, cudaStream_t stream, uint32_t flags) {
  const std::string where = "ultracomm._cuda.Runner.launch: ";
  if (plan.device() != device_)
    throw std::invalid_argument(where + "the plan lives on device " + std::to_string(plan.device()) +
                                ", this runner on device " + std::to_string(device_));
  if (ctas_per_rank < 1) throw std::invalid_argument(where + "ctas_per_rank must be >= 1");
  const Shape shape{plan.views(), plan.nranks(), plan.op(), plan.grad_dtype()};
  launch_views(shape, epoch, launch_ctas(plan.rank_tasks(), ctas_per_rank), stream, flags, where,
               [](unsigned long long) {});
}

void Runner::launch(PlanArena& arena, int slot, Op op, const std::vector<ExecArgs>* upload, uint64_t epoch,
                    int ctas_per_rank, cudaStream_t stream, uint32_t flags) {
  const std::string where = "ultracomm._cuda.Runner.launch: ";
  if (arena.device() != device_)
    throw std::invalid_argument(where + "the plan arena lives on device " + std::to_string(arena.device()) +
                                ", this runner on device " + std::to_string(device_));
  Shape shape{arena.views(slot, op), 0, op, 0};
  if (upload != nullptr) {
    arena.check(*upload);  // before anything moves
    if ((*upload)[0].op != op) throw std::invalid_argument(where + "the plan's op differs from the launch's");
    shape.nranks = static_cast<int>(upload->size());
    shape.grad_dtype = static_cast<int>((*upload)[0].grad_dtype);
  } else {
    const PlanArena::Area& a = arena.area(slot, op);
    if (!a.written)
      throw std::invalid_argument(where + "plan arena slot " + std::to_string(slot) +
                                  " holds no plan for this op; "
                                  "pass the plan's rank entries");
    shape.nranks = a.nranks;
    shape.grad_dtype = a.grad_dtype;
  }
  if (ctas_per_rank < 1) throw std::invalid_argument(where + "ctas_per_rank must be >= 1");
  // uniform: the host does not know a device-built plan's task counts
  const std::vector<int32_t> ctas(static_cast<size_t>(shape.nranks), ctas_per_rank);
  // the upload goes after the wait for the previous launch of this op kind: that launch (or one
  // before it) may still read this area
  launch_views(shape, epoch, ctas, stream, flags, where, [&](unsigned long long capture) {
    if (capture == 0) arena.retire();  // copies that finished no longer keep a capture from the slot
    if (upload != nullptr) arena.write(slot, *upload, stream, capture != 0);
  });
}

void Runner::write_template(PlanArena& arena, int slot, const std::vector<ExecArgs>& ranks, cudaStream_t stream) {
  if (arena.device() != device_)
    throw std::invalid_argument("ultracomm._cuda.Runner.write_template: the plan arena lives on another device");
  arena.check(ranks);  // before anything moves
  DeviceGuard guard(device_);
  const int op = static_cast<int>(ranks[0].op);
  const unsigned long long capture = order_after_last(op, stream);
  arena.write_template(slot, ranks, stream, capture != 0);
  mark_last(op, stream, capture);  // the next launch of the kind on another stream waits for the copy
}

void Runner::mark_last(int op, cudaStream_t stream, unsigned long long capture) {
  UC_CUDA_CHECK(cudaEventRecord(last_[op], stream));
  launched_[op] = true;
  last_stream_[op] = stream;
  last_capture_[op] = capture;
}

void Runner::build_slot(PlanArena& arena, int slot, int entry, const psched::Problem& problem,
                        const int32_t* exchange_status, const int64_t* plan_result, cudaStream_t stream) {
  const std::string where = "ultracomm._cuda.Runner.build_slot: ";
  if (arena.device() != device_) throw std::invalid_argument(where + "the plan arena lives on another device");
  SlotBuildArgs a{};
  for (int op = 0; op < kNumOps; ++op) {
    const PlanArena::Area& area = arena.area(slot, static_cast<Op>(op));
    if (!area.written)
      throw std::invalid_argument(where + "plan arena slot " + std::to_string(slot) + " has no template for " +
                                  (op == 0 ? "multicast" : "reduce") + "; write_template first");
    if (entry < 0 || entry >= area.nranks)
      throw std::invalid_argument(where + "rank entry " + std::to_string(entry) + " is not in the slot's " +
                                  std::to_string(area.nranks) + " entries");
    a.views[op] = const_cast<ExecView*>(arena.views(slot, static_cast<Op>(op))) + entry;
    a.caps.task_cap[op] = arena.bounds().tasks[op];
    a.caps.ref_cap[op] = arena.bounds().refs[op];
  }
  const PlanBounds& b = arena.bounds();
  if (problem.world != b.world || problem.slots != b.slots || problem.num_experts > b.num_experts)
    throw std::invalid_argument(where + "the problem (world " + std::to_string(problem.world) + ", slots " +
                                std::to_string(problem.slots) + ", experts " + std::to_string(problem.num_experts) +
                                ") is not the arena's (world " + std::to_string(b.world) + ", slots " +
                                std::to_string(b.slots) + ", experts <= " + std::to_string(b.num_experts) + ")");
  a.scratch = arena.build_scratch(slot);
  if (a.scratch == nullptr)
    throw std::invalid_argument(where + "world " + std::to_string(b.world) + ", slots " + std::to_string(b.slots) +
                                ", experts " + std::to_string(b.num_experts) +
                                " exceed the device schedule builder's "
                                "capacities (world <= 1024, slots <= 8, experts <= 65536); use a host-built plan");
  a.problem = problem;
  a.report = arena.build_report_dev(slot, entry);
  a.exchange_status = exchange_status;
  a.plan_result = plan_result;
  DeviceGuard guard(device_);
  // both areas may still be read by the previous launch of their kind
  unsigned long long capture = 0;
  for (int op = 0; op < kNumOps; ++op) capture = order_after_last(op, stream);
  launch_build_slot(a, stream);
  for (int op = 0; op < kNumOps; ++op) mark_last(op, stream, capture);
}

namespace {

// What a grid is made of, for the messages: "4 ranks x 100 CTAs" when uniform, else each distinct
// count with its ranks, e.g. "4 ranks (1 with tasks x 100 CTAs, 3 without x 1 CTA)".
std::string grid_makeup(const std::vector<int32_t>& ctas) {
  const size_t n = ctas.size();
  const std::string ranks = std::to_string(n) + (n == 1 ? " rank" : " ranks");
  bool uniform = true;
  for (const int32_t c : ctas) uniform = uniform && c == ctas[0];
  if (uniform) return ranks + " x " + std::to_string(ctas[0]) + (ctas[0] == 1 ? " CTA" : " CTAs");
  int32_t top = 0;
  size_t idle = 0;
  for (const int32_t c : ctas) {
    top = c > top ? c : top;
    idle += c == 1;
  }
  return ranks + " (" + std::to_string(n - idle) + " with tasks x " + std::to_string(top) + " CTAs, " +
         std::to_string(idle) + " without x 1 CTA)";
}

}  // namespace

void Runner::launch_views(const Shape& p, uint64_t epoch, const std::vector<int32_t>& ctas, cudaStream_t stream,
                          uint32_t flags, const std::string& where,
                          const std::function<void(unsigned long long)>& before) {
  if (epoch < 1) throw std::invalid_argument(where + "epoch must be >= 1 (flags start at 0)");
  if (p.nranks < 1 || p.nranks > kMaxLoopbackRanks || ctas.size() != static_cast<size_t>(p.nranks))
    throw std::invalid_argument(where + "a launch runs 1 to " + std::to_string(kMaxLoopbackRanks) +
                                " rank entries, not " + std::to_string(p.nranks));
  int64_t grid = 0;
  for (const int32_t c : ctas) {
    if (c < 1) throw std::invalid_argument(where + "ctas_per_rank must be >= 1");
    grid += c;
  }
  if ((flags & kReduceStaged) != 0 && cc_major_ < 9)
    throw std::invalid_argument(where +
                                "reduce_path='tma' (the TMA-staged reduce) needs bulk copies, sm_90 or newer; " +
                                "device " + std::to_string(device_) + " is sm_" + std::to_string(cc_major_) +
                                std::to_string(cc_minor_) + ": use reduce_path='hunk'");
  if (grid > (int64_t(1) << 31) - 1) throw std::invalid_argument(where + "grid too large");
  const bool loopback = p.nranks > 1;
  if (loopback && grid > max_coresident(p.grad_dtype))
    throw std::invalid_argument(where + "a loopback launch of " + grid_makeup(ctas) + " = " + std::to_string(grid) +
                                " CTAs cannot be co-resident on device " + std::to_string(device_) + " (at most " +
                                std::to_string(max_coresident(p.grad_dtype)) + " on its " + std::to_string(sm_count_) +
                                " SMs); every rank's CTAs must run at once, lower ctas_per_rank");
  const int op = static_cast<int>(p.op);
  PersistentArgs a{};
  a.views = p.views;
  a.state = state_ + op;
  a.err = err_dev_ + op;
  a.epoch = epoch;
  set_cta_layout(a, ctas.data(), p.nranks);
  a.flags = flags;
  DeviceGuard guard(device_);
  const unsigned long long capture = order_after_last(op, stream);
  before(capture);
  // Cooperative (co-residency guaranteed or the launch fails) for loopback grids, except while
  // the stream is captured into a graph: the occupancy check above is what holds there.
  launch_persistent(a, p.grad_dtype, rings_.pick(a), loopback && capture == 0, stream);
  mark_last(op, stream, capture);
}

std::optional<ErrorRecord> Runner::take_error() {
  for (int op = 0; op < kNumOps; ++op) {
    // written by the device last, after a system fence (mover_common.cuh fail)
    const uint64_t e = __atomic_load_n(&err_host_[op].epoch, __ATOMIC_ACQUIRE);
    if (e == 0 || e == seen_error_epoch_[op]) continue;
    seen_error_epoch_[op] = e;
    ErrorRecord r;
    std::memcpy(&r, &err_host_[op].rec, sizeof r);
    return r;
  }
  return std::nullopt;
}

}  // namespace ultracomm::gpu
