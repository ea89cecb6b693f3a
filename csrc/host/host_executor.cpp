// Host executor: drives the interpreter (interp.h) for one rank's operation with host worker
// groups: HostMover (one thread per worker; the reference) or BlockMover (T threads per
// worker imitating a CUDA block).  Protocol logic lives in interp.h only.
#include "ultracomm/impl/host_executor.h"

#include <algorithm>
#include <exception>
#include <limits>
#include <memory>
#include <thread>
#include <vector>

#include "movers/block_mover.h"
#include "movers/host_mover.h"
#include "ultracomm/impl/interp.h"

namespace ultracomm {
namespace {

uint64_t timeout_ns(double timeout_s) {
  // timeouts beyond ~30 years (inf included) never expire rather than overflow
  if (timeout_s >= 1e9) return std::numeric_limits<uint64_t>::max();
  return static_cast<uint64_t>(timeout_s * 1e9);
}

const char* op_name_of(const ExecArgs& a) { return a.op_name.c_str(); }

[[noreturn]] void throw_aborted(const ExecArgs& a) {
  const std::string name = !a.op_name.empty() ? a.op_name : a.op == Op::kMulticast ? "weight_sync" : "grad_reduce";
  throw AbortedError("ultracomm: rank " + std::to_string(a.rank) + " " + name + " (epoch " + std::to_string(a.epoch) +
                     ") stopped: its abort word was raised by the caller");
}

// The first failure, else the caller's abort (a run stopped by abort_word records none).
[[noreturn]] void throw_stopped(const host::RunState& run, const ExecArgs& a) {
  if (run.failed) throw_error(run.first, op_name_of(a), a.timeout_s);
  throw_aborted(a);
}

// Workers that run tasks: no more than there are work units (tiles).
int num_groups(const ExecArgs& a, const ExecView& v) {
  return static_cast<int>(std::min<uint64_t>(static_cast<uint64_t>(a.num_workers), interp::num_units(v)));
}

// One thread per worker: the caller joins, runs worker 0 and drains; nw - 1 threads help.
void run_host_movers(const ExecArgs& a, const ExecView& v) {
  host::RunState run(static_cast<int64_t>(interp::num_units(v)));
  run.external = reinterpret_cast<const uint64_t*>(a.abort_word);
  run.delay_unit = a.delay_unit;
  run.delay_us = a.delay_us;
  const auto mover = [&](int w) { return host::HostMover(run, a.jitter_us, a.jitter_seed + w, a.portable_f16); };
  host::HostMover m0 = mover(0);
  interp::join(v, m0);
  const int nw = num_groups(a, v);
  if (nw > 0) {
    std::exception_ptr spawn_error;
    std::vector<std::thread> threads;
    threads.reserve(nw - 1);
    try {
      for (int w = 1; w < nw; ++w)
        threads.emplace_back([&v, &mover, w] {
          host::HostMover m = mover(w);
          interp::run_tasks(v, m);
        });
    } catch (...) {
      spawn_error = std::current_exception();
      run.abort.store(true);
    }
    interp::run_tasks(v, m0);
    for (auto& t : threads) t.join();
    if (spawn_error) std::rethrow_exception(spawn_error);
    if (run.stopped()) throw_stopped(run, a);
  }
  if (!interp::drain(v, m0)) throw_stopped(run, a);
}

// G groups of T threads.  Group 0 joins, every group claims tasks, all meet at a barrier,
// then group 0 drains unless a group failed.  Threads start only once all exist (a failed
// spawn must not leave the others waiting at a barrier).  Barriers: group_barrier.h.
void run_block_movers(const ExecArgs& a, const ExecView& v) {
  host::RunState run(static_cast<int64_t>(interp::num_units(v)));
  run.external = reinterpret_cast<const uint64_t*>(a.abort_word);
  run.delay_unit = a.delay_unit;
  run.delay_us = a.delay_us;
  const int G = std::max(1, num_groups(a, v));
  const int T = a.threads_per_worker;
  std::vector<std::unique_ptr<host::BlockGroup>> groups;
  for (int g = 0; g < G; ++g) groups.push_back(std::make_unique<host::BlockGroup>(T));
  host::GroupBarrier all_done(G * T);
  host::StartGate start;
  bool completed = false;  // written by group 0's thread 0 only, read after the joins
  const auto body = [&](int g, int t) {
    if (!start.wait()) return;
    host::BlockMover m(run, *groups[g], t, T, a.jitter_us, a.jitter_seed + g, a.portable_f16);
    if (g == 0) interp::join(v, m);
    interp::run_tasks(v, m);
    all_done.arrive_and_wait();
    if (g != 0) return;
    // the leader's reading, shared: a thread reading abort itself could see the drain's own failure
    if (!m.broadcast(run.stopped()) && interp::drain(v, m) && t == 0) completed = true;
  };
  std::vector<std::thread> threads;
  threads.reserve(G * T);
  std::exception_ptr spawn_error;
  try {
    for (int g = 0; g < G; ++g)
      for (int t = 0; t < T; ++t) threads.emplace_back(body, g, t);
  } catch (...) {
    spawn_error = std::current_exception();
  }
  start.open(!spawn_error);
  for (auto& t : threads) t.join();
  if (spawn_error) std::rethrow_exception(spawn_error);
  if (!completed) throw_stopped(run, a);
}

}  // namespace

ExecView make_view(const ExecArgs& a) {
  ExecView v{};
  v.op = a.op;
  v.rank = a.rank;
  v.world = a.world;
  v.epoch = a.epoch;
  v.layout = a.layout;
  v.window_bases = a.window_bases.data();
  v.num_members = static_cast<int32_t>(a.member_off.size());
  for (size_t m = 0; m < a.member_off.size() && m < static_cast<size_t>(kMaxMembers); ++m) {
    v.member_off[m] = a.member_off[m];
    v.member_bytes[m] = a.member_bytes[m];
  }
  v.master_ptrs = a.master_ptrs.data();
  v.local_index_of = a.local_index_of.data();
  v.num_experts = static_cast<int32_t>(a.local_index_of.size());
  v.grad_dtype = static_cast<int32_t>(a.grad_dtype);
  v.my_slots = a.my_slots.data();
  v.slot_parent = a.slot_parent.empty() ? nullptr : a.slot_parent.data();
  v.tasks = a.tasks;
  v.num_tasks = a.num_tasks;
  v.refs = a.refs;
  v.num_refs = a.num_refs;
  v.timeout_ns = timeout_ns(a.timeout_s);
  v.digest = a.digest;
  v.tile_bytes = a.tile_bytes;
  v.tile_done = nullptr;  // the executor's: run_host's vector, a device plan's array
  return v;
}

void run_host(const ExecArgs& args) {
  validate(args);
  ExecView v = make_view(args);
  std::vector<uint32_t> tile_done;  // per task, zero: tiles retired (interp.h)
  if (args.tile_bytes != 0 && args.tile_bytes < args.layout.chunk_bytes) {
    tile_done.assign(static_cast<size_t>(args.num_tasks), 0);
    v.tile_done = tile_done.data();
  }
  if (args.mover == MoverKind::kBlock)
    run_block_movers(args, v);
  else
    run_host_movers(args, v);
}

void publish_rejection(const ExecArgs& a) {
  if (a.op != Op::kMulticast && a.op != Op::kReduce) throw std::invalid_argument("ultracomm: op must be 0 or 1");
  if (a.rank < 0 || static_cast<size_t>(a.rank) >= a.window_bases.size() || a.window_bases[a.rank] == 0 ||
      a.window_bases[a.rank] % 8)
    throw std::invalid_argument("ultracomm: publish_rejection needs this rank's 8-byte aligned window base");
  if (a.epoch < 1) throw std::invalid_argument("ultracomm: epoch must be >= 1");
  ExecView v{};
  v.op = a.op;
  v.rank = a.rank;
  v.epoch = a.epoch;
  v.layout = a.layout;
  v.window_bases = a.window_bases.data();
  host::RunState run(0);
  host::HostMover m(run, 0, 0, false);
  interp::publish_rejection(v, m);
}

}  // namespace ultracomm
