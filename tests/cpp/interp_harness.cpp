// Interpreter harness: runs a real schedule (dumped by tests/transports/test_interp_harness.py) through
// run_host with the host or block mover, all ranks as threads of this process, for many
// epochs, and checks every byte: replicas equal the masters after multicast, master grads
// equal the Python reference's ordered fp32 sum after reduce.  Built by the test plainly and
// with -fsanitize=thread, and with the ULTRACOMM_MUTATE_* switches of interp.h / host_flags.h
// (each mutant must fail here: wrong bytes, a torn chunk, or a ThreadSanitizer race).
//
//   interp_harness FILE [--mover host|block] [--epochs N] [--workers W] [--threads T]
//                       [--jitter US] [--observe] [--ops mc|reduce|both] [--tile BYTES]
//                       [--delay-unit K --delay-us US]   (the worker claiming tile K waits US first)
//   interp_harness FILE --selftest     (layout checks with forged layouts)
// Exit 0 when every check passed; 1 with "MISMATCH ..." / "TORN ..." lines otherwise.
#include <atomic>
#include <cinttypes>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "ultracomm/impl/host_executor.h"

using namespace ultracomm;

namespace {

struct Reader {
  std::vector<char> buf;
  size_t pos = 0;
  template <class T>
  T get() {
    T v;
    if (pos + sizeof(T) > buf.size()) throw std::runtime_error("schedule file truncated");
    std::memcpy(&v, buf.data() + pos, sizeof(T));
    pos += sizeof(T);
    return v;
  }
  template <class T>
  std::vector<T> vec(size_t n) {
    std::vector<T> v(n);
    if (pos + n * sizeof(T) > buf.size()) throw std::runtime_error("schedule file truncated");
    if (n) std::memcpy(v.data(), buf.data() + pos, n * sizeof(T));
    pos += n * sizeof(T);
    return v;
  }
};

struct OpLists {
  std::vector<int32_t> parent;           // [world * slots]
  std::vector<std::vector<Task>> tasks;  // [world]
  std::vector<std::vector<Ref>> refs;    // [world]
};

struct Case {
  int32_t world = 0, slots = 0, experts = 0, grad_dtype = 0;
  uint64_t wsb = 0, gsb = 0, chunk = 0;
  std::vector<uint64_t> w_off, w_bytes, g_off, g_bytes;
  std::vector<int32_t> home_of, slot_src;
  OpLists op[2];
  std::vector<std::vector<uint8_t>> grad_init;     // [world * slots] slot images (empty if no expert)
  std::vector<std::vector<uint8_t>> master_grad0;  // [experts] members concatenated
  std::vector<std::vector<uint8_t>> master_grad_want;
};

Case load(const char* path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw std::runtime_error(std::string("cannot open ") + path);
  Reader r;
  r.buf.assign(std::istreambuf_iterator<char>(f), {});
  if (r.buf.size() < 8 || std::memcmp(r.buf.data(), "UCHARN01", 8)) throw std::runtime_error("bad magic");
  r.pos = 8;
  Case c;
  c.world = r.get<int32_t>();
  c.slots = r.get<int32_t>();
  c.experts = r.get<int32_t>();
  c.grad_dtype = r.get<int32_t>();
  c.wsb = r.get<uint64_t>();
  c.gsb = r.get<uint64_t>();
  c.chunk = r.get<uint64_t>();
  const int32_t nw = r.get<int32_t>();
  c.w_off = r.vec<uint64_t>(nw);
  c.w_bytes = r.vec<uint64_t>(nw);
  const int32_t ng = r.get<int32_t>();
  c.g_off = r.vec<uint64_t>(ng);
  c.g_bytes = r.vec<uint64_t>(ng);
  c.home_of = r.vec<int32_t>(c.experts);
  c.slot_src = r.vec<int32_t>(static_cast<size_t>(c.world) * c.slots);
  for (auto& o : c.op) {
    o.parent = r.vec<int32_t>(static_cast<size_t>(c.world) * c.slots);
    for (int32_t k = 0; k < c.world; ++k) {
      o.tasks.push_back(r.vec<Task>(static_cast<size_t>(r.get<int64_t>())));
      o.refs.push_back(r.vec<Ref>(static_cast<size_t>(r.get<int64_t>())));
    }
  }
  for (int32_t i = 0; i < c.world * c.slots; ++i)
    c.grad_init.push_back(c.slot_src[i] >= 0 ? r.vec<uint8_t>(c.gsb) : std::vector<uint8_t>());
  uint64_t gtotal = 0;
  for (uint64_t b : c.g_bytes) gtotal += b;
  for (int32_t e = 0; e < c.experts; ++e) c.master_grad0.push_back(r.vec<uint8_t>(gtotal));
  for (int32_t e = 0; e < c.experts; ++e) c.master_grad_want.push_back(r.vec<uint8_t>(gtotal));
  if (r.pos != r.buf.size()) throw std::runtime_error("trailing bytes in schedule file");
  return c;
}

struct Options {
  MoverKind mover = MoverKind::kHost;
  int epochs = 10, workers = 3, threads = 4;
  uint32_t jitter_us = 0;
  uint64_t tile_bytes = kDefaultTileBytes;  // ExecArgs::tile_bytes (0: whole chunks)
  int64_t delay_unit = -1;
  uint32_t delay_us = 0;
  bool observe = false, mc = true, reduce = true;
};

// Master weight byte i of expert e at epoch k: changes every epoch, so stale data shows.
uint8_t pattern(int e, int k, uint64_t i) { return static_cast<uint8_t>((i * 131u + e * 29u + k * 71u) ^ (i >> 9)); }

struct World {
  const Case& c;
  WindowLayout L;
  std::vector<uint8_t*> win;
  std::vector<std::vector<std::vector<uint8_t>>> w_master, g_master;  // [expert][member] bytes
  uint64_t epoch = 0;

  explicit World(const Case& cs) : c(cs), L(WindowLayout::make(cs.slots, cs.wsb, cs.gsb, cs.chunk)) {
    for (int32_t r = 0; r < c.world; ++r) {
      auto* p = static_cast<uint8_t*>(std::aligned_alloc(kWindowAlign, L.total_bytes));
      std::memset(p, 0, L.total_bytes);
      win.push_back(p);
    }
    w_master.resize(c.experts);
    g_master.resize(c.experts);
    for (int32_t e = 0; e < c.experts; ++e) {
      for (uint64_t b : c.w_bytes) w_master[e].emplace_back(b);
      for (uint64_t b : c.g_bytes) g_master[e].emplace_back(b);
    }
  }
  ~World() {
    for (auto* p : win) std::free(p);
  }

  ExecArgs args(int op, int32_t r, const Options& o) {
    ExecArgs a;
    a.op = static_cast<Op>(op);
    a.rank = r;
    a.world = c.world;
    a.epoch = epoch;
    a.layout = L;
    for (auto* p : win) a.window_bases.push_back(reinterpret_cast<uintptr_t>(p));
    a.member_off = op == 0 ? c.w_off : c.g_off;
    a.member_bytes = op == 0 ? c.w_bytes : c.g_bytes;
    a.local_index_of.assign(c.experts, -1);
    int32_t li = 0;
    for (int32_t e = 0; e < c.experts; ++e) {
      if (c.home_of[e] != r) continue;
      a.local_index_of[e] = li++;
      for (auto& m : (op == 0 ? w_master : g_master)[e]) a.master_ptrs.push_back(reinterpret_cast<uintptr_t>(m.data()));
    }
    a.grad_dtype = static_cast<DType>(c.grad_dtype);
    a.my_slots.assign(c.slot_src.begin() + r * c.slots, c.slot_src.begin() + (r + 1) * c.slots);
    a.slot_parent.assign(c.op[op].parent.begin() + r * c.slots, c.op[op].parent.begin() + (r + 1) * c.slots);
    a.tasks = c.op[op].tasks[r].data();
    a.num_tasks = static_cast<int64_t>(c.op[op].tasks[r].size());
    a.refs = c.op[op].refs[r].data();
    a.num_refs = static_cast<int64_t>(c.op[op].refs[r].size());
    a.num_workers = o.workers;
    a.timeout_s = 60;
    a.jitter_us = o.jitter_us;
    a.tile_bytes = o.tile_bytes;
    a.delay_unit = o.delay_unit;
    a.delay_us = o.delay_us;
    a.jitter_seed = epoch * 1000 + r * 10;
    a.digest = 0x5eed0000u + op;
    a.mover = o.mover;
    a.threads_per_worker = o.threads;
    return a;
  }

  // Runs `op` on every rank (one thread each); false (after printing) if a rank raised.
  bool run(int op, const Options& o) {
    ++epoch;
    std::vector<std::string> err(c.world);
    std::vector<std::thread> th;
    for (int32_t r = 0; r < c.world; ++r)
      th.emplace_back([&, r] {
        try {
          run_host(args(op, r, o));
        } catch (const std::exception& e) {
          err[r] = e.what();
        }
      });
    for (auto& t : th) t.join();
    bool ok = true;
    for (int32_t r = 0; r < c.world; ++r)
      if (!err[r].empty()) {
        std::printf("ERROR rank %d: %s\n", r, err[r].c_str());
        ok = false;
      }
    return ok;
  }
};

// The first replica slot that has a parent: the chunk an observer watches.
bool first_replica(const Case& c, int32_t& rank, int32_t& slot) {
  for (int32_t i = 0; i < c.world * c.slots; ++i)
    if (c.slot_src[i] >= 0) {
      rank = i / c.slots;
      slot = i % c.slots;
      return true;
    }
  return false;
}

// Observer: spins on arrival[slot][chunk 0] of `rank`; the instant it reads the epoch it
// snapshots the chunk, last bytes first (a forward copy writes them last), then compares the
// member bytes with the masters'.  Returns the number of stale bytes.  (memcpy snapshots: one
// ranged access each under TSan, not a million byte checks.)
int observe(const World& w, int32_t rank, int32_t slot, int k, uint64_t epoch, std::atomic<bool>& stop) {
  const Case& c = w.c;
  const int32_t e = c.slot_src[rank * c.slots + slot];
  const uintptr_t flag = reinterpret_cast<uintptr_t>(w.win[rank]) + w.L.arrival_flag(slot, 0);
  const uint64_t end = std::min(c.chunk, c.wsb), tail = std::min<uint64_t>(end, 4096);
  std::vector<uint8_t> snap(end);
  while (__atomic_load_n(reinterpret_cast<const uint64_t*>(flag), __ATOMIC_ACQUIRE) < epoch)
    if (stop.load(std::memory_order_relaxed)) return 0;
  const uint8_t* s = w.win[rank] + w.L.weight_slot(slot);
  std::memcpy(snap.data() + end - tail, s + end - tail, tail);
  std::memcpy(snap.data(), s, end - tail);
  int bad = 0;
  for (size_t m = 0; m < c.w_off.size(); ++m)
    for (uint64_t i = c.w_off[m]; i < std::min(end, c.w_off[m] + c.w_bytes[m]); ++i)
      bad += snap[i] != pattern(e, k, i - c.w_off[m]);
  return bad;
}

int check_multicast(World& w, int k) {
  const Case& c = w.c;
  int bad = 0;
  for (int32_t r = 0; r < c.world; ++r)
    for (int32_t s = 0; s < c.slots; ++s) {
      const int32_t e = c.slot_src[r * c.slots + s];
      if (e < 0) continue;
      const uint8_t* p = w.win[r] + w.L.weight_slot(s);
      for (size_t m = 0; m < c.w_off.size(); ++m)
        if (std::memcmp(p + c.w_off[m], w.w_master[e][m].data(), c.w_bytes[m]) != 0) {
          if (bad++ < 5) std::printf("MISMATCH multicast epoch %d rank %d slot %d member %zu\n", k, r, s, m);
        }
    }
  return bad;
}

int check_reduce(World& w, int k) {
  const Case& c = w.c;
  int bad = 0;
  for (int32_t e = 0; e < c.experts; ++e) {
    uint64_t off = 0;
    for (size_t m = 0; m < c.g_bytes.size(); ++m) {
      if (std::memcmp(w.g_master[e][m].data(), c.master_grad_want[e].data() + off, c.g_bytes[m]) != 0) {
        if (bad++ < 5) std::printf("MISMATCH reduce epoch %d expert %d member %zu\n", k, e, m);
      }
      off += c.g_bytes[m];
    }
  }
  return bad;
}

int run_all(const Case& c, const Options& o) {
  World w(c);
  int32_t obs_rank = -1, obs_slot = -1;
  if (o.observe && !first_replica(c, obs_rank, obs_slot)) return std::printf("no replica to observe\n"), 1;
  int failures = 0;
  for (int k = 1; k <= o.epochs; ++k) {
    if (o.mc) {
      for (int32_t e = 0; e < c.experts; ++e)
        for (auto& m : w.w_master[e])
          for (uint64_t i = 0; i < m.size(); ++i) m[i] = pattern(e, k, i);
      std::atomic<bool> stop{false};
      int torn = 0;
      std::thread obs;
      if (o.observe) {
        const uint64_t next = w.epoch + 1;  // the epoch run() is about to use
        obs = std::thread([&, next] { torn = observe(w, obs_rank, obs_slot, k, next, stop); });
      }
      const bool ran = w.run(0, o);
      stop = true;
      if (obs.joinable()) obs.join();
      if (torn) std::printf("TORN epoch %d: the observer saw %d stale bytes of a chunk whose flag was up\n", k, torn);
      failures += !ran + (torn != 0) + (ran && check_multicast(w, k) != 0);
    }
    if (o.reduce) {
      for (int32_t i = 0; i < c.world * c.slots; ++i)
        if (!c.grad_init[i].empty())
          std::memcpy(w.win[i / c.slots] + w.L.grad_slot(i % c.slots), c.grad_init[i].data(), c.gsb);
      for (int32_t e = 0; e < c.experts; ++e) {
        uint64_t off = 0;
        for (size_t m = 0; m < c.g_bytes.size(); ++m) {
          std::memcpy(w.g_master[e][m].data(), c.master_grad0[e].data() + off, c.g_bytes[m]);
          off += c.g_bytes[m];
        }
      }
      const bool ran = w.run(1, o);
      failures += !ran + (ran && check_reduce(w, k) != 0);
    }
  }
  std::printf("%s: %d epochs, %d failures\n", failures ? "FAIL" : "OK", o.epochs, failures);
  return failures ? 1 : 0;
}

// Checks that need a forged layout (the bindings always build a consistent one): the executor
// asserts that the chunk count covers the slot before anything moves, and sizes whose
// arithmetic once overflowed (chunk_bytes 2^64 - 32768 gave 0 chunks) are rejected.
int selftest(const Case& c) {
  int bad = 0;
  const auto expect_reject = [&](const char* name, ExecArgs a, const char* what) {
    World w(c);
    a.window_bases.clear();
    for (auto* p : w.win) a.window_bases.push_back(reinterpret_cast<uintptr_t>(p));
    std::vector<uint8_t> before(w.win[0], w.win[0] + w.L.total_bytes);
    try {
      run_host(a);
      std::printf("MISMATCH selftest %s: accepted\n", name);
      ++bad;
    } catch (const std::invalid_argument& e) {
      if (!std::strstr(e.what(), what)) std::printf("MISMATCH selftest %s: %s\n", name, e.what()), ++bad;
    }
    if (std::memcmp(before.data(), w.win[0], before.size()) != 0)
      std::printf("MISMATCH selftest %s: wrote\n", name), ++bad;
  };
  World w(c);
  w.epoch = 1;
  Options o;
  ExecArgs a = w.args(0, 0, o);
  a.layout.weight_chunks -= 1;  // one chunk short of the slot
  expect_reject("short chunk count", a, "do not cover the slot");
  a = w.args(0, 0, o);
  a.layout.weight_chunks = 0;
  expect_reject("zero chunks", a, "do not cover the slot");
  a = w.args(0, 0, o);
  a.layout = WindowLayout::make(c.slots, c.wsb, c.gsb, ~uint64_t(0) - 32767);
  expect_reject("chunk bytes near 2^64", a, "chunk_bytes must be <= 2^48");
  if (!WindowLayout::make(1, 1000, 1000, ~uint64_t(0) - 32767).chunks_cover(Op::kMulticast))
    std::printf("MISMATCH selftest: ceil_div overflowed\n"), ++bad;
  std::printf("%s: selftest, %d failures\n", bad ? "FAIL" : "OK", bad);
  return bad ? 1 : 0;
}

}  // namespace

int main(int argc, char** argv) {
  if (argc < 2) return std::fprintf(stderr, "usage: %s FILE [options]\n", argv[0]), 2;
  if (argc == 3 && std::string(argv[2]) == "--selftest") return selftest(load(argv[1]));
  Options o;
  for (int i = 2; i < argc; ++i) {
    const std::string a = argv[i];
    const auto next = [&] {
      if (i + 1 >= argc) throw std::runtime_error("missing value after " + a);
      return std::string(argv[++i]);
    };
    if (a == "--mover")
      o.mover = next() == "block" ? MoverKind::kBlock : MoverKind::kHost;
    else if (a == "--epochs")
      o.epochs = std::stoi(next());
    else if (a == "--workers")
      o.workers = std::stoi(next());
    else if (a == "--threads")
      o.threads = std::stoi(next());
    else if (a == "--jitter")
      o.jitter_us = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--observe")
      o.observe = true;
    else if (a == "--tile")
      o.tile_bytes = std::stoull(next());
    else if (a == "--delay-unit")
      o.delay_unit = std::stoll(next());
    else if (a == "--delay-us")
      o.delay_us = static_cast<uint32_t>(std::stoul(next()));
    else if (a == "--ops") {
      const std::string v = next();
      o.mc = v != "reduce";
      o.reduce = v != "mc";
    } else
      return std::fprintf(stderr, "unknown option %s\n", a.c_str()), 2;
  }
  try {
    return run_all(load(argv[1]), o);
  } catch (const std::exception& e) {
    std::printf("ERROR %s\n", e.what());
    return 1;
  }
}
