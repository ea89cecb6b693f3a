// The REAL kernel launchers of _cuda (the host side of csrc/cuda/*.cu as nvcc compiled it, linked
// from the objects tests/cuda_build.py builds) and the runner / plan arena, against a stub CUDA
// runtime that models the launch rules a device enforces and logs every violation:
//   * dynamic shared memory above 48 KB without a MaxDynamicSharedMemorySize attribute that
//     covers it (set on this device), or static + dynamic above the opt-in limit;
//   * threads x registers above the register file, more than 1024 threads;
//   * a cooperative launch whose grid the device cannot hold at once (occupancy x SMs, computed
//     from the kernel's registers and shared memory as ptxas reported them);
//   * a runtime call that is illegal while a stream capture is under way in global mode (torch's
//     default): allocation, synchronous copies, synchronisation, event / stream queries.
// The kernel table (mangled name, registers, static shared memory) comes from the file named
// by UC_KERNEL_TABLE.  Usage: probe <scenario> [cc_major]; prints the log, one call a line;
// "VIOLATION ..." lines are what a device would refuse (or a capture would be invalidated by).
#include <cuda_runtime_api.h>
#include <cxxabi.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <sstream>
#include <string>
#include <utility>
#include <vector>

#include "device_plan.h"
#include "plan_arena.h"
#include "k_build.h"
#include "launch.h"
#include "load_exchange.h"
#include "pdl.h"
#include "runner.h"

namespace {
std::vector<std::string> g_log;
int g_cc_major = 9;
int g_sms = 132;
bool g_capturing = false;  // a global-mode capture is under way (streams >= 100 are the captured ones)
void log(const std::string& s) { g_log.push_back(s); }

struct Kernel {
  std::string name;  // demangled, arguments dropped
  std::string mangled;
  int regs = 32;
  int static_smem = 0;
  int max_dyn = 48 * 1024;  // cudaFuncAttributeMaxDynamicSharedMemorySize, this device
};
std::map<const void*, Kernel> g_kernels;
std::map<std::string, std::pair<int, int>> g_table;  // mangled -> (registers, static smem)

std::string demangle(const char* m) {
  int st = 0;
  char* d = abi::__cxa_demangle(m, nullptr, nullptr, &st);
  std::string s = st == 0 && d ? d : m;
  std::free(d);
  // keep "ns::k_name<targs>": drop the argument list and the anonymous namespace
  const size_t paren = s.rfind('(');
  if (paren != std::string::npos && s.back() == ')') s = s.substr(0, paren);
  for (const std::string anon : {"(anonymous namespace)::"})
    for (size_t p; (p = s.find(anon)) != std::string::npos;) s.erase(p, anon.size());
  const size_t sp = s.find(' ');  // "void ultracomm::k<...>"
  if (sp != std::string::npos && s.compare(0, 5, "void ") == 0) s = s.substr(sp + 1);
  return s;
}

Kernel& kernel(const void* f) {
  auto it = g_kernels.find(f);
  if (it == g_kernels.end()) {
    log("VIOLATION launch of an unregistered function");
    static Kernel none;
    return none;
  }
  Kernel& k = it->second;
  if (k.regs < 0) {
    const auto t = g_table.find(k.mangled);
    if (t == g_table.end()) {
      log("VIOLATION " + k.name + " is not in the kernel table");
      k.regs = 255;
    } else {
      k.regs = t->second.first;
      k.static_smem = t->second.second;
    }
  }
  return k;
}

bool captured(cudaStream_t s) { return reinterpret_cast<uintptr_t>(s) >= 100; }
std::string sname(cudaStream_t s) { return "s" + std::to_string(reinterpret_cast<uintptr_t>(s)); }

// A call that is illegal while a global-mode capture is under way (cudaStreamCaptureModeGlobal:
// "potentially unsafe API calls"; torch.cuda.graph captures in that mode by default).
// This thread's capture mode (cudaThreadExchangeStreamCaptureMode): relaxed lifts the rule.
cudaStreamCaptureMode g_mode = cudaStreamCaptureModeGlobal;
void unsafe(const char* call) {
  if (g_capturing && g_mode != cudaStreamCaptureModeRelaxed)
    log(std::string("VIOLATION ") + call + " during a stream capture");
}

int optin_smem() { return g_cc_major >= 12 ? 101376 : g_cc_major >= 9 ? 232448 : g_cc_major == 8 ? 166912 : 49152; }
int smem_per_sm() { return g_cc_major >= 12 ? 102400 : g_cc_major >= 9 ? 233472 : 167936; }

// Blocks of k an SM holds with `threads` threads and `dyn` bytes of dynamic shared memory.
int occupancy(const Kernel& k, int threads, size_t dyn) {
  const int warps = (threads + 31) / 32;
  const int regs_per_warp = (k.regs * 32 + 255) / 256 * 256;
  int by_regs = 65536 / (regs_per_warp * warps);
  const int smem = static_cast<int>(dyn) + k.static_smem + 1024;  // + the 1 KB the system reserves per block
  int by_smem = smem_per_sm() / smem;
  int by_threads = 2048 / (warps * 32);
  int n = by_regs < by_smem ? by_regs : by_smem;
  n = n < by_threads ? n : by_threads;
  return n < 32 ? n : 32;
}

cudaError_t check_launch(const void* f, dim3 grid, dim3 block, size_t dyn, cudaStream_t s, bool coop, bool pdl,
                         const char* how) {
  Kernel& k = kernel(f);
  const int threads = static_cast<int>(block.x * block.y * block.z);
  std::ostringstream o;
  o << how << " " << k.name << " grid " << grid.x * grid.y * grid.z << " block " << threads << " smem " << dyn
    << (coop ? " cooperative" : "") << (pdl ? " pdl" : "") << " " << sname(s);
  log(o.str());
  cudaError_t err = cudaSuccess;
  const auto bad = [&](const std::string& why) {
    log("VIOLATION " + k.name + ": " + why);
    err = cudaErrorInvalidValue;
  };
  if (threads > 1024) bad("more than 1024 threads");
  if (static_cast<int64_t>((k.regs * 32 + 255) / 256 * 256) * ((threads + 31) / 32) > 65536)
    bad(std::to_string(threads) + " threads x " + std::to_string(k.regs) + " registers exceed the register file");
  if (dyn > 48 * 1024 && static_cast<int64_t>(dyn) > k.max_dyn)
    bad(std::to_string(dyn) + " bytes of dynamic shared memory, MaxDynamicSharedMemorySize " +
        std::to_string(k.max_dyn));
  if (static_cast<int64_t>(dyn) + k.static_smem > optin_smem())
    bad(std::to_string(dyn + k.static_smem) + " bytes of shared memory, the device allows " +
        std::to_string(optin_smem()));
  if (coop) {
    const int64_t fit = static_cast<int64_t>(occupancy(k, threads, dyn)) * g_sms;
    if (static_cast<int64_t>(grid.x) * grid.y * grid.z > fit)
      bad("a cooperative grid of " + std::to_string(grid.x) + " CTAs, the device holds " + std::to_string(fit));
  }
  if (pdl && g_cc_major < 9) bad("programmatic stream serialization before sm_90");
  return err;
}

struct CallConfig {
  dim3 grid, block;
  size_t smem = 0;
  cudaStream_t stream = nullptr;
};
CallConfig g_config;
}  // namespace

extern "C" {
// ---- what nvcc's host stubs call
void** __cudaRegisterFatBinary(void*) {
  static void* handle = nullptr;
  return &handle;
}
void __cudaRegisterFatBinaryEnd(void**) {}
void __cudaUnregisterFatBinary(void**) {}
void __cudaRegisterFunction(void**, const char* host_fun, char*, const char* device_name, int, uint3*, uint3*, dim3*,
                            dim3*, int*) {
  Kernel k;  // registers and static shared memory: from the table, once main() read it
  k.mangled = device_name;
  k.name = demangle(device_name);
  k.regs = -1;
  g_kernels[host_fun] = k;
}
cudaError_t __cudaGetKernel(cudaKernel_t* out, const void* fun) {
  *out = reinterpret_cast<cudaKernel_t>(const_cast<void*>(fun));
  return cudaSuccess;
}
unsigned __cudaPushCallConfiguration(dim3 grid, dim3 block, size_t smem, struct CUstream_st* stream) {
  g_config = CallConfig{grid, block, smem, stream};
  return 0;
}
cudaError_t __cudaPopCallConfiguration(dim3* grid, dim3* block, size_t* smem, void* stream) {
  *grid = g_config.grid;
  *block = g_config.block;
  *smem = g_config.smem;
  *static_cast<cudaStream_t*>(stream) = g_config.stream;
  return cudaSuccess;
}
cudaError_t __cudaLaunchKernel(cudaKernel_t k, dim3 grid, dim3 block, void**, size_t smem, cudaStream_t s) {
  return check_launch(reinterpret_cast<const void*>(k), grid, block, smem, s, false, false, "launch<<<>>>");
}
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t* cfg, const void* f, void**) {
  bool coop = false, pdl = false;
  for (unsigned i = 0; i < cfg->numAttrs; ++i) {
    if (cfg->attrs[i].id == cudaLaunchAttributeCooperative && cfg->attrs[i].val.cooperative) coop = true;
    if (cfg->attrs[i].id == cudaLaunchAttributeProgrammaticStreamSerialization &&
        cfg->attrs[i].val.programmaticStreamSerializationAllowed)
      pdl = true;
  }
  return check_launch(f, cfg->gridDim, cfg->blockDim, cfg->dynamicSmemBytes, cfg->stream, coop, pdl, "launchEx");
}
cudaError_t cudaFuncSetAttribute(const void* f, cudaFuncAttribute attr, int value) {
  Kernel& k = kernel(f);
  if (attr == cudaFuncAttributeMaxDynamicSharedMemorySize) {
    log("cudaFuncSetAttribute " + k.name + " MaxDynamicSharedMemorySize " + std::to_string(value));
    if (value + k.static_smem > optin_smem()) {
      log("VIOLATION cudaFuncSetAttribute " + k.name + ": " + std::to_string(value) +
          " + static shared memory exceed the device's " + std::to_string(optin_smem()));
      return cudaErrorInvalidValue;
    }
    k.max_dyn = value;
  }
  return cudaSuccess;
}
cudaError_t cudaFuncGetAttributes(cudaFuncAttributes* a, const void* f) {
  const Kernel& k = kernel(f);
  std::memset(a, 0, sizeof *a);
  a->sharedSizeBytes = static_cast<size_t>(k.static_smem);
  a->numRegs = k.regs;
  a->maxDynamicSharedSizeBytes = k.max_dyn;
  a->maxThreadsPerBlock = 1024;
  return cudaSuccess;
}
cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessorWithFlags(int* n, const void* f, int threads, size_t dyn,
                                                                   unsigned int) {
  const Kernel& k = kernel(f);
  *n = static_cast<int64_t>(dyn) > k.max_dyn && dyn > 48 * 1024 ? 0 : occupancy(k, threads, dyn);
  log("cudaOccupancy " + k.name + " threads " + std::to_string(threads) + " smem " + std::to_string(dyn) + " -> " +
      std::to_string(*n));
  return cudaSuccess;
}

// ---- the rest of the runtime the host side calls
cudaError_t cudaGetDeviceCount(int* n) {
  *n = 1;
  return cudaSuccess;
}
cudaError_t cudaGetDevice(int* d) {
  *d = 0;
  return cudaSuccess;
}
cudaError_t cudaSetDevice(int) { return cudaSuccess; }
cudaError_t cudaGetLastError() { return cudaSuccess; }
const char* cudaGetErrorName(cudaError_t e) { return e == cudaErrorInvalidValue ? "cudaErrorInvalidValue" : "err"; }
const char* cudaGetErrorString(cudaError_t) { return "stub error"; }
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  switch (a) {
    case cudaDevAttrComputeCapabilityMajor:
      *v = g_cc_major;
      break;
    case cudaDevAttrMultiProcessorCount:
      *v = g_sms;
      break;
    case cudaDevAttrMaxSharedMemoryPerBlockOptin:
      *v = optin_smem();
      break;
    case cudaDevAttrMaxSharedMemoryPerMultiprocessor:
      *v = smem_per_sm();
      break;
    case cudaDevAttrReservedSharedMemoryPerBlock:
      *v = 1024;
      break;
    default:
      *v = 0;
  }
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t n) {
  unsafe("cudaMalloc");
  *p = std::calloc(1, n + 256);  // host memory (DevicePlan writes its image; kernels never run)
  return *p ? cudaSuccess : cudaErrorMemoryAllocation;
}
cudaError_t cudaFree(void*) {
  unsafe("cudaFree");
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  unsafe("cudaMemset");
  std::memset(p, v, n);
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind) {
  unsafe("cudaMemcpy");
  std::memcpy(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t) {
  unsafe("cudaStreamSynchronize");
  return cudaSuccess;
}
cudaError_t cudaDeviceSynchronize() {
  unsafe("cudaDeviceSynchronize");
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int) {
  unsafe("cudaHostAlloc");
  *p = std::calloc(1, n);
  return cudaSuccess;
}
cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned int) {
  *d = h;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  unsafe("cudaFreeHost");
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t s, cudaStreamCaptureStatus* st) {
  *st = captured(s) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, cudaStreamCaptureStatus* st, unsigned long long* id, cudaGraph_t*,
                                     const cudaGraphNode_t**, const cudaGraphEdgeData**, size_t*) {
  const uintptr_t h = reinterpret_cast<uintptr_t>(s);
  *st = captured(s) ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  if (id) *id = h / 100;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  static int n = 0;
  *e = reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(++n));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t) { return cudaSuccess; }
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  std::swap(*mode, g_mode);
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t) {
  unsafe("cudaEventQuery");
  return cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t) {
  unsafe("cudaEventSynchronize");
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind, cudaStream_t) {
  std::memcpy(d, s, n);
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned int) { return cudaSuccess; }
}

using namespace ultracomm;

namespace {

void load_table() {
  const char* path = std::getenv("UC_KERNEL_TABLE");
  if (!path) return;
  std::ifstream in(path);
  std::string name;
  int regs = 0, smem = 0;
  while (in >> name >> regs >> smem) g_table[name] = {regs, smem};
}

ExecArgs one_rank(int rank, int world, Op op) {
  ExecArgs a;
  a.op = op;
  a.rank = rank;
  a.world = world;
  a.epoch = 1;
  a.layout = WindowLayout::make(1, 256, 256, 256);
  for (int r = 0; r < world; ++r) a.window_bases.push_back(0x100000u * (r + 1));
  a.member_off = {0};
  a.member_bytes = {256};
  a.my_slots = {-1};
  return a;
}

template <class T>
T* dev(size_t n) {
  void* p = nullptr;
  cudaMalloc(&p, n * sizeof(T));
  return static_cast<T*>(p);
}

cudaStream_t stream_of(bool capture) { return reinterpret_cast<cudaStream_t>(uintptr_t(capture ? 100 : 1)); }

// Every persistent launch shape a Context makes: one rank, loopback grids below and above the
// SM count, each dtype, both reduce paths; plans in a plan arena (a slot per plan, written
// eagerly first: a capture replays what the slots hold).
void persistent(bool capture) {
  gpu::Runner runner(0);
  std::vector<std::pair<Op, std::vector<ExecArgs>>> plans;
  for (int nranks : {1, 2, 8, 64})
    for (Op op : {Op::kMulticast, Op::kReduce})
      for (int dt = 0; dt < (op == Op::kReduce ? 3 : 1); ++dt) {
        std::vector<ExecArgs> ranks;
        for (int r = 0; r < nranks; ++r) {
          ranks.push_back(one_rank(r, nranks, op));
          ranks.back().grad_dtype = static_cast<DType>(dt);
        }
        plans.emplace_back(op, ranks);
      }
  gpu::PlanBounds b;
  b.nranks = kMaxLoopbackRanks;
  b.world = kMaxLoopbackRanks;
  b.num_experts = 1;
  b.slots = 1;
  gpu::PlanArena arena(0, static_cast<int>(plans.size()), b);
  for (size_t i = 0; i < plans.size(); ++i)
    runner.launch(arena, static_cast<int>(i), plans[i].first, &plans[i].second, 1, 1, stream_of(false), 0);
  arena.retire();
  log("-- launches" + std::string(capture ? " (captured)" : ""));
  g_capturing = capture;
  uint64_t epoch = 2;
  for (size_t i = 0; i < plans.size(); ++i) {
    const auto& [op, ranks] = plans[i];
    const int nranks = static_cast<int>(ranks.size()), dt = static_cast<int>(ranks[0].grad_dtype);
    for (int ctas : {1, 2, 4})
      for (uint32_t flags : {0u, kReduceStaged, kForceVector}) {
        if ((flags & kReduceStaged) && (op != Op::kReduce || g_cc_major < 9)) continue;
        if (static_cast<int64_t>(nranks) * ctas > runner.max_coresident(dt)) continue;
        log("- nranks " + std::to_string(nranks) + " ctas " + std::to_string(ctas) + " dtype " + std::to_string(dt) +
            " flags " + std::to_string(flags));
        runner.launch(arena, static_cast<int>(i), op, nullptr, epoch++, ctas, stream_of(capture), flags);
      }
  }
  g_capturing = false;
}

// Eager launches with new plans (the plan arena's staging copies still in flight: it queries
// their events) while another stream of the process is being captured in global mode.
void beside_capture() {
  gpu::Runner runner(0);
  std::vector<ExecArgs> ranks{one_rank(0, 1, Op::kMulticast)};
  gpu::PlanBounds b;
  b.nranks = 1;
  b.world = 1;
  b.num_experts = 1;
  b.slots = 1;
  gpu::PlanArena arena(0, 1, b);
  runner.launch(arena, 0, Op::kMulticast, &ranks, 1, 1, stream_of(false), 0);
  log("-- another stream is being captured");
  g_capturing = true;
  runner.launch(arena, 0, Op::kMulticast, &ranks, 2, 1, stream_of(false), 0);   // waits for the first copy
  runner.launch(arena, 0, Op::kMulticast, nullptr, 3, 1, stream_of(false), 0);  // retires it
  g_capturing = false;
  log(g_mode == cudaStreamCaptureModeGlobal ? "mode restored" : "VIOLATION capture mode left relaxed");
}

// The device control plane of one step: exchange, quota plan, build, reroute.
void control(int world, int epr, int slots, int nranks, bool capture) {
  const int E = world * epr;
  LoadExchangeArgs* ex = new LoadExchangeArgs{};
  ex->s = LoadExchangeShape{nranks, world, E, 2, static_cast<uint64_t>((16 + 4 * E + 63) / 64 * 64), ~uint64_t(0)};
  for (int i = 0; i < nranks; ++i) {
    LoadRankArgs& r = ex->ranks[i];
    r.counts = dev<int32_t>(E);
    r.out = dev<int32_t>(int64_t(world) * E);
    r.status = dev<int32_t>(4);
    r.bases = dev<uintptr_t>(world);
    r.seq = dev<uint64_t>(1);
    r.rank = i;
  }
  gpu::QuotaArgs q{};
  q.loads = dev<int32_t>(int64_t(world) * E);
  q.expert_load = dev<int64_t>(E);
  q.scratch = dev<int64_t>(gpu::quota_scratch_bytes(world, E, slots) / 8 + 1);
  q.slot_src = dev<int32_t>(int64_t(world) * slots);
  q.slot_quota = dev<int64_t>(int64_t(world) * slots);
  q.result = dev<quota::Result>(1);
  q.world = world;
  q.experts_per_rank = epr;
  q.slots = slots;
  q.min_tokens = 1;
  q.eps_bp = 100;
  gpu::SlotBuildArgs b{};
  b.problem.world = world;
  b.problem.slots = slots;
  b.problem.num_experts = E;
  b.problem.max_depth = 8;
  b.problem.chunk_bytes = 1 << 20;
  b.scratch = dev<int64_t>(gpu::build_scratch_bytes(world, slots, E) / 8 + 1);
  gpu::RerouteArgs rr{};
  rr.loads = q.loads;
  rr.slot_src = q.slot_src;
  rr.slot_quota = q.slot_quota;
  rr.scratch = dev<int64_t>(gpu::reroute_scratch_bytes(world, E) / 8 + 1);
  rr.bounds = dev<int64_t>(int64_t(E) * world);
  rr.columns = dev<int64_t>(int64_t(E) * world);
  rr.world = world;
  rr.experts_per_rank = epr;
  rr.slots = slots;
  log("-- control world " + std::to_string(world) + " E " + std::to_string(E) + " slots " + std::to_string(slots) +
      " nranks " + std::to_string(nranks) + (capture ? " (captured)" : ""));
  g_capturing = capture;
  const cudaStream_t s = stream_of(capture);
  gpu::launch_load_exchange(*ex, s);
  gpu::launch_quota_plan(q, s);
  gpu::launch_build_slot(b, s);
  gpu::launch_reroute_table(rr, s);
  g_capturing = false;
  delete ex;
}

void misc(bool capture) {
  uint64_t* words = dev<uint64_t>(4);
  log(std::string("-- misc") + (capture ? " (captured)" : ""));
  g_capturing = capture;
  const cudaStream_t s = stream_of(capture);
  gpu::launch_reject(Op::kReduce, 1, 0x1000, WindowLayout::make(1, 256, 256, 256), s);
  gpu::launch_empty(s);
  gpu::launch_flag_pingpong(words, words + 1, 0, 1, 1000, words + 2, s);
  g_capturing = false;
}

}  // namespace

int main(int argc, char** argv) {
  load_table();
  const std::string sc = argc > 1 ? argv[1] : "";
  if (argc > 2) g_cc_major = std::atoi(argv[2]);
  try {
    if (sc == "persistent") {
      persistent(false);
    } else if (sc == "persistent_captured") {
      persistent(true);
    } else if (sc == "persistent_beside_capture") {
      beside_capture();
    } else if (sc.rfind("control", 0) == 0) {  // control[_captured] world epr slots nranks
      const bool capture = sc == "control_captured";
      control(std::atoi(argv[3]), std::atoi(argv[4]), std::atoi(argv[5]), std::atoi(argv[6]), capture);
    } else if (sc == "control_first_in_capture") {  // the planner's first launch on a device is captured
      control(64, 4, 2, 1, true);
    } else if (sc == "misc") {
      misc(false);
      misc(true);
    } else if (sc == "kernels") {
      for (const auto& [f, k] : g_kernels) {
        const Kernel& x = kernel(f);
        log(x.name + " regs " + std::to_string(x.regs) + " static " + std::to_string(x.static_smem));
      }
    }
  } catch (const std::exception& e) {
    log(std::string("threw ") + e.what());
  }
  for (const auto& l : g_log) std::printf("%s\n", l.c_str());
  return 0;
}
