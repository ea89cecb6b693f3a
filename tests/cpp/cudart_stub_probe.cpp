// The host side of _cuda (csrc/cuda/device_plan.cpp, runner.cpp) linked against a stub CUDA
// runtime that logs every call, so its call sequence and checks run on a machine without a
// GPU.  The kernels' launchers (launch.h) are stubs too.  Usage: probe <scenario>; prints the
// log (one call a line) and "threw <what>" for an exception.
#include <cuda_runtime_api.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

#include "device_plan.h"
#include "k_build.h"
#include "launch.h"
#include "runner.h"

namespace {
std::vector<std::string> g_log;
cudaError_t g_fail_sync = cudaSuccess;  // what cudaStreamSynchronize returns
bool g_event_not_ready = false;         // what cudaEventQuery says
bool g_views = false;                   // log each launch's rank-0 view
int g_coresident_per_sm = 2;
int g_cc_major = 9;  // the stub device's compute capability (major)
unsigned char g_device_mem[1 << 20];
size_t g_device_used = 0;
void log(const std::string& s) { g_log.push_back(s); }
}  // namespace

extern "C" {
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
const char* cudaGetErrorName(cudaError_t e) { return e == cudaErrorLaunchFailure ? "cudaErrorLaunchFailure" : "err"; }
const char* cudaGetErrorString(cudaError_t) { return "stub error"; }
cudaError_t cudaDeviceGetAttribute(int* v, cudaDeviceAttr a, int) {
  *v = a == cudaDevAttrComputeCapabilityMajor ? g_cc_major : a == cudaDevAttrMultiProcessorCount ? 132 : 0;
  return cudaSuccess;
}
cudaError_t cudaMalloc(void** p, size_t n) {
  log("cudaMalloc " + std::to_string(n));
  *p = g_device_mem + g_device_used;
  g_device_used += (n + 255) / 256 * 256;
  return cudaSuccess;
}
cudaError_t cudaFree(void*) {
  log("cudaFree");
  return cudaSuccess;
}
cudaError_t cudaMemset(void* p, int v, size_t n) {
  std::memset(p, v, n);
  log("cudaMemset");
  return cudaSuccess;
}
cudaError_t cudaMemcpy(void* d, const void* s, size_t n, cudaMemcpyKind k) {
  std::memcpy(d, s, n);
  log("cudaMemcpy " + std::to_string(n) + (k == cudaMemcpyHostToDevice ? " H2D" : " other"));
  return cudaSuccess;
}
cudaError_t cudaStreamSynchronize(cudaStream_t s) {
  log(std::string("cudaStreamSynchronize ") + (s == cudaStreamLegacy ? "legacy" : "other"));
  return g_fail_sync;
}
cudaError_t cudaDeviceSynchronize() {
  log("cudaDeviceSynchronize");
  return cudaSuccess;
}
cudaError_t cudaHostAlloc(void** p, size_t n, unsigned int flags) {
  *p = std::calloc(1, n);
  log(std::string("cudaHostAlloc") + (flags & cudaHostAllocMapped ? " mapped" : ""));
  return cudaSuccess;
}
cudaError_t cudaHostGetDevicePointer(void** d, void* h, unsigned int) {
  *d = h;
  return cudaSuccess;
}
cudaError_t cudaFreeHost(void* p) {
  std::free(p);
  return cudaSuccess;
}
cudaError_t cudaStreamIsCapturing(cudaStream_t, cudaStreamCaptureStatus* st) {
  *st = cudaStreamCaptureStatusNone;
  return cudaSuccess;
}
// streams are named by their handle's value (1 = "s1"); handles >= 100 capture, id = handle / 100
std::string sname(cudaStream_t s) { return "s" + std::to_string(reinterpret_cast<uintptr_t>(s)); }
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t s, cudaStreamCaptureStatus* st, unsigned long long* id, cudaGraph_t*,
                                     const cudaGraphNode_t**, const cudaGraphEdgeData**, size_t*) {
  const uintptr_t h = reinterpret_cast<uintptr_t>(s);
  *st = h >= 100 ? cudaStreamCaptureStatusActive : cudaStreamCaptureStatusNone;
  if (id) *id = h / 100;
  return cudaSuccess;
}
cudaError_t cudaEventCreateWithFlags(cudaEvent_t* e, unsigned int) {
  static int n = 0;
  *e = reinterpret_cast<cudaEvent_t>(static_cast<uintptr_t>(++n));
  return cudaSuccess;
}
cudaError_t cudaEventDestroy(cudaEvent_t) { return cudaSuccess; }
cudaError_t cudaEventRecord(cudaEvent_t e, cudaStream_t s) {
  log("cudaEventRecord e" + std::to_string(reinterpret_cast<uintptr_t>(e)) + " " + sname(s));
  return cudaSuccess;
}
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode* mode) {
  static cudaStreamCaptureMode held = cudaStreamCaptureModeGlobal;
  const cudaStreamCaptureMode was = held;
  held = *mode;
  *mode = was;
  return cudaSuccess;
}
cudaError_t cudaEventQuery(cudaEvent_t e) {
  log("cudaEventQuery e" + std::to_string(reinterpret_cast<uintptr_t>(e)));
  return g_event_not_ready ? cudaErrorNotReady : cudaSuccess;
}
cudaError_t cudaEventSynchronize(cudaEvent_t e) {
  log("cudaEventSynchronize e" + std::to_string(reinterpret_cast<uintptr_t>(e)));
  return cudaSuccess;
}
cudaError_t cudaMemcpyAsync(void* d, const void* s, size_t n, cudaMemcpyKind k, cudaStream_t st) {
  std::memcpy(d, s, n);
  log("cudaMemcpyAsync " + std::to_string(n) + (k == cudaMemcpyHostToDevice ? " H2D " : " other ") + sname(st) + " +" +
      std::to_string(static_cast<unsigned char*>(d) - g_device_mem));
  return cudaSuccess;
}
cudaError_t cudaStreamWaitEvent(cudaStream_t s, cudaEvent_t e, unsigned int) {
  log("cudaStreamWaitEvent " + sname(s) + " e" + std::to_string(reinterpret_cast<uintptr_t>(e)));
  return cudaSuccess;
}
}

namespace ultracomm::gpu {
PersistentRings setup_persistent(int, int cc_major) {
  log("setup_persistent " + std::to_string(cc_major));
  const uint32_t ring = cc_major >= 9 ? 65568 : 0;
  return {ring, ring, 132};
}
int persistent_max_coresident(const PersistentRings& r, int) { return g_coresident_per_sm * r.sms; }
void launch_persistent(const PersistentArgs& a, int, uint32_t smem, bool cooperative, cudaStream_t s) {
  // a loopback launch's layout: the CTAs of each rank as the kernel's cta_rank sees them, from
  // the arguments it would get (rank of every block, counted per rank; -1 if a block maps to a
  // rank whose count disagrees with cta_rank's)
  std::string layout;
  if (a.nranks > 1) {
    std::vector<int> seen(static_cast<size_t>(a.nranks), 0), said(static_cast<size_t>(a.nranks), 0);
    for (int32_t b = 0; b < launch_grid(a); ++b) {
      const CtaRank cr = cta_rank(a, b);
      if (cr.rank < 0 || cr.rank >= a.nranks) return log("launch: block " + std::to_string(b) + " maps nowhere");
      seen[static_cast<size_t>(cr.rank)]++;
      said[static_cast<size_t>(cr.rank)] = cr.ctas;
    }
    layout = " ctas";
    for (int r = 0; r < a.nranks; ++r) layout += (r ? "," : " ") + std::to_string(seen[r] == said[r] ? seen[r] : -1);
    layout += a.ctas_per_rank > 0 ? " uniform" : "";
  }
  log("launch grid " + std::to_string(launch_grid(a)) + " smem " + std::to_string(smem) +
      (cooperative ? " cooperative" : " plain") + " " + sname(s) + ((a.flags & kReduceStaged) ? " staged" : "") +
      layout);
  if (g_views) {
    // the kernel's view of rank 0: what the launch would run
    ExecView v;
    std::memcpy(&v, a.views, sizeof v);
    log("  views +" + std::to_string(reinterpret_cast<const unsigned char*>(a.views) - g_device_mem) + " op " +
        std::to_string(static_cast<int>(v.op)) + " tasks " + std::to_string(v.num_tasks) + " at +" +
        std::to_string(reinterpret_cast<const unsigned char*>(v.tasks) - g_device_mem));
  }
}
void launch_reject(Op, uint64_t, uintptr_t, const WindowLayout&, cudaStream_t) {}
// The stub's device memory is host memory: run the build the kernel runs (slot_build.h) in place.
void launch_build_slot(const SlotBuildArgs& a, cudaStream_t s) {
  log("launch build_slot views +" + std::to_string(reinterpret_cast<unsigned char*>(a.views[0]) - g_device_mem) + " +" +
      std::to_string(reinterpret_cast<unsigned char*>(a.views[1]) - g_device_mem) + " caps " +
      std::to_string(a.caps.task_cap[0]) + "/" + std::to_string(a.caps.task_cap[1]) + " " + sname(s));
  const int32_t upstream = psched::upstream_status(a.exchange_status, a.plan_result);
  a.report->result = psched::build_into_views(a.problem, a.scratch, a.views, a.caps, upstream);
  if (a.report->result.status != psched::kOk) {
    a.report->failed = a.report->result;
    a.report->failed_seq += 2;
  }
  a.report->generation++;
}
}  // namespace ultracomm::gpu

using namespace ultracomm;

// Each rank's tasks (valid copies of its own expert, rank r homes expert r, to the next rank's
// slot 0), kept alive for the plans that point at them.
std::vector<std::vector<Task>> g_tasks(64);
std::vector<Ref> g_refs[64];

static ExecArgs one_rank(int rank, int world);

// rank `rank` of a world in which expert e lives on rank e, with `n` tasks copying its expert
static ExecArgs busy_rank(int rank, int world, int n) {
  ExecArgs a = one_rank(rank, world);
  for (int e = 0; e < world; ++e) a.local_index_of.push_back(e == rank ? 0 : -1);
  a.master_ptrs = {0x9000u + 0x1000u * static_cast<unsigned>(rank)};
  g_refs[rank] = {Ref{(rank + 1) % world, 0}};
  g_tasks[rank].assign(static_cast<size_t>(n), Task{1, 0, 0, rank, 0, 0, 1, 0, 0, 256, Ref{rank, kMaster}});
  a.tasks = g_tasks[rank].data();
  a.num_tasks = n;
  a.refs = g_refs[rank].data();
  a.num_refs = 1;
  return a;
}

static ExecArgs one_rank(int rank, int world) {
  ExecArgs a;
  a.op = Op::kMulticast;
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

int main(int argc, char** argv) {
  const std::string sc = argc > 1 ? argv[1] : "";
  try {
    if (sc == "plan_upload" || sc == "plan_upload_sync_fails") {
      if (sc == "plan_upload_sync_fails") g_fail_sync = cudaErrorLaunchFailure;
      gpu::DevicePlan plan({one_rank(0, 2), one_rank(1, 2)});
      log("plan ready " + std::to_string(plan.bytes()));
    } else if (sc.rfind("launch_", 0) == 0) {  // launch_<nranks>_<ctas_per_rank> [tasks of rank 0, 1, ...]
      int nranks = 0, ctas = 0;
      std::sscanf(sc.c_str(), "launch_%d_%d", &nranks, &ctas);
      std::vector<ExecArgs> ranks;
      for (int r = 0; r < nranks; ++r) {
        const int n = r + 2 < argc ? std::atoi(argv[r + 2]) : 1;  // every rank busy unless told
        ranks.push_back(n > 0 ? busy_rank(r, nranks, n) : one_rank(r, nranks));
      }
      gpu::DevicePlan plan(ranks);
      gpu::Runner runner(0);
      g_log.clear();
      runner.launch(plan, 1, ctas, nullptr, 0);
    } else if (sc == "ctas") {  // ctas <ctas_per_rank> <max_grid> <tasks of rank 0, 1, ...>: the rule alone
      const int ctas = std::atoi(argv[2]);
      const int64_t max_grid = std::atoll(argv[3]);
      std::vector<int64_t> tasks;
      for (int i = 4; i < argc; ++i) tasks.push_back(std::atoll(argv[i]));
      std::string line = "launch_ctas";
      for (const int32_t c : gpu::launch_ctas(tasks, ctas)) line += " " + std::to_string(c);
      log(line);
      log("max_ctas_per_rank " + std::to_string(gpu::max_ctas_per_rank(tasks, max_grid)));
    } else if (sc.rfind("arena_uniform_", 0) == 0) {  // arena_uniform_<ctas>: 3 entries, tasks on rank 0 only
      gpu::PlanBounds b;
      b.nranks = 3;
      b.world = 3;
      b.num_experts = 3;
      b.masters = 1;
      b.slots = 1;
      b.tasks[0] = b.tasks[1] = 2;
      b.refs[0] = b.refs[1] = 2;
      gpu::Runner runner(0);
      gpu::PlanArena arena(0, 1, b);
      std::vector<ExecArgs> plan{busy_rank(0, 3, 1), one_rank(1, 3), one_rank(2, 3)};
      for (int r = 1; r < 3; ++r) {
        plan[r].local_index_of = {-1, -1, -1};
        plan[r].local_index_of[r] = 0;
        plan[r].master_ptrs = {0x9000u + 0x1000u * r};
      }
      g_log.clear();
      runner.launch(arena, 0, Op::kMulticast, &plan, 1, std::atoi(sc.c_str() + 14), nullptr, 0);
    } else if (sc == "arena" || sc == "arena_capture" || sc == "arena_behind" || sc == "arena_over") {
      g_views = true;
      gpu::PlanBounds b;
      b.world = 2;
      b.num_experts = 2;
      b.masters = 1;
      b.slots = 1;
      b.tasks[0] = b.tasks[1] = 2;
      b.refs[0] = b.refs[1] = 2;
      gpu::Runner runner(0);
      gpu::PlanArena arena(0, 3, b);
      log("arena " + std::to_string(arena.bytes()) + " area " +
          std::to_string(gpu::PlanArena::area_bytes(b, Op::kMulticast)));
      std::vector<Task> tasks(sc == "arena_over" ? 3 : 1);
      std::vector<Ref> refs(1, Ref{1, 0});
      ExecArgs a = one_rank(0, 2);
      a.local_index_of = {0, -1};
      a.master_ptrs = {0x9000};
      a.my_slots = {-1};
      a.tasks = tasks.data();
      a.num_tasks = static_cast<int64_t>(tasks.size());
      for (auto& t : tasks) t = Task{1, 0, 0, 0, 0, 0, 1, 0, 0, 256, Ref{0, -1}};
      a.refs = refs.data();
      a.num_refs = 1;
      std::vector<ExecArgs> plan{a};
      if (sc == "arena_behind") g_event_not_ready = true;
      cudaStream_t s = reinterpret_cast<cudaStream_t>(static_cast<uintptr_t>(sc == "arena_capture" ? 100 : 1));
      log("-- write slot 1");
      runner.launch(arena, 1, Op::kMulticast, &plan, 1, 1, s, 0);
      log("-- rerun slot 1");
      runner.launch(arena, 1, Op::kMulticast, nullptr, 2, 1, s, 0);
      log("-- rewrite slot 1");
      runner.launch(arena, 1, Op::kMulticast, &plan, 3, 1, s, 0);
      log("-- slot 2 empty");
      runner.launch(arena, 2, Op::kMulticast, nullptr, 4, 1, s, 0);
    } else if (sc == "device_step") {  // templates, the device build, launches of what it built
      g_views = true;
      const int W = 4, S = 2, epr = 4, rank = 1;
      gpu::PlanBounds b;
      b.world = W;
      b.num_experts = W * epr;
      b.masters = epr;
      b.slots = S;
      b.tasks[0] = (epr + S) * 1;  // 256-byte weights, 512-byte grads in 256-byte chunks
      b.tasks[1] = (epr + S) * 2;
      b.refs[0] = b.refs[1] = W * S;
      gpu::Runner runner(0);
      gpu::PlanArena arena(0, 3, b);
      std::vector<ExecArgs> tmpl[2];
      for (int op = 0; op < 2; ++op) {
        ExecArgs a = one_rank(rank, W);
        a.op = op == 0 ? Op::kMulticast : Op::kReduce;
        a.layout = WindowLayout::make(S, 256, 512, 256);
        a.member_bytes = {op == 0 ? 256u : 512u};
        for (int e = 0; e < W * epr; ++e) a.local_index_of.push_back(e / epr == rank ? e % epr : -1);
        for (int i = 0; i < epr; ++i) a.master_ptrs.push_back(0x9000 + 0x1000 * i);
        a.my_slots = {-1, -1};
        a.slot_parent = {-1, -1};
        a.digest = 1;
        tmpl[op].push_back(a);
      }
      // the plan, read from argv: W x S expert ids (what the device planner left in device memory)
      std::vector<int32_t> slot_src, home_of;
      for (int i = 2; i < argc; ++i) slot_src.push_back(std::atoi(argv[i]));
      slot_src.resize(W * S, -1);
      for (int e = 0; e < W * epr; ++e) home_of.push_back(e / epr);
      psched::Problem p{};
      p.world = W;
      p.slots = S;
      p.num_experts = W * epr;
      p.max_depth = 8;
      p.rank = rank;
      p.slot_src = slot_src.data();
      p.home_of = home_of.data();
      p.weight_bytes = 256;
      p.grad_bytes = 512;
      p.chunk_bytes = 256;
      p.hop_bytes = 64;
      cudaStream_t s1 = reinterpret_cast<cudaStream_t>(uintptr_t(1)), s2 = reinterpret_cast<cudaStream_t>(uintptr_t(2));
      const auto show = [&](int slot) {
        for (int op = 0; op < 2; ++op) {
          ExecView v;
          std::memcpy(&v, arena.views(slot, static_cast<Op>(op)), sizeof v);
          log("  view " + std::to_string(op) + " tasks " + std::to_string(v.num_tasks) + " refs " +
              std::to_string(v.num_refs) + " digest " + std::to_string(v.digest) + " my_slots " +
              std::to_string(v.my_slots[0]) + "," + std::to_string(v.my_slots[1]) + " parent " +
              std::to_string(v.slot_parent[0]) + "," + std::to_string(v.slot_parent[1]) + " first_task_expert " +
              std::to_string(v.num_tasks ? v.tasks[0].expert : -1));
        }
        const psched::BuildReport r = arena.build_report(slot, 0);
        log("  result generation " + std::to_string(r.generation) + " status " + std::to_string(r.result.status) +
            " digest " + std::to_string(r.result.digest) + " failures " + std::to_string(r.failed_seq / 2));
      };
      log("-- reduce on s2");
      runner.launch(arena, 0, Op::kReduce, &tmpl[1], 1, 1, s2, 0);
      log("-- templates slot 1");
      runner.write_template(arena, 1, tmpl[0], s1);
      runner.write_template(arena, 1, tmpl[1], s1);
      log("-- build slot 1");
      runner.build_slot(arena, 1, 0, p, nullptr, nullptr, s1);
      show(1);
      log("-- run slot 1");
      runner.launch(arena, 1, Op::kMulticast, nullptr, 2, 1, s1, 0);
      runner.launch(arena, 1, Op::kReduce, nullptr, 3, 1, s1, 0);
      log("-- build as rank 2 into rank 1's template");
      p.rank = 2;
      runner.build_slot(arena, 1, 0, p, nullptr, nullptr, s1);
      show(1);
      log("-- build after a failed exchange");
      p.rank = 1;
      const int32_t exchange_failed = 1;
      runner.build_slot(arena, 1, 0, p, &exchange_failed, nullptr, s2);
      show(1);
      log("-- reduce on s1 after the build on s2");
      runner.launch(arena, 1, Op::kReduce, nullptr, 4, 1, s1, 0);
      log("-- build slot 2 without a template");
      runner.build_slot(arena, 2, 0, p, nullptr, nullptr, s1);
    } else if (sc.rfind("staged_", 0) == 0) {  // staged_<cc major>: a reduce launch with kReduceStaged
      g_cc_major = std::atoi(sc.c_str() + 7);
      ExecArgs r = one_rank(0, 1);  // no task: one CTA whatever is asked (runner.h launch_ctas)
      r.op = Op::kReduce;
      gpu::DevicePlan red({r});
      gpu::Runner runner(0);
      g_log.clear();
      runner.launch(red, 1, 2, nullptr, kReduceStaged);
    } else if (sc.rfind("streams", 0) == 0) {  // streams <op><handle> ...: one launch each
      gpu::DevicePlan mc({one_rank(0, 1)});
      ExecArgs r = one_rank(0, 1);
      r.op = Op::kReduce;
      gpu::DevicePlan red({r});
      gpu::Runner runner(0);
      g_log.clear();
      for (int i = 2; i < argc; ++i) {
        const uintptr_t h = std::strtoull(argv[i] + 1, nullptr, 10);
        runner.launch(argv[i][0] == 'm' ? mc : red, 1, 1, reinterpret_cast<cudaStream_t>(h), 0);
      }
    }
  } catch (const std::exception& e) {
    log(std::string("threw ") + e.what());
  }
  for (const auto& l : g_log) std::printf("%s\n", l.c_str());
  return 0;
}
